"""The API process's side of engine core processes (:mod:`tianxia.engine.core_proc`).

:class:`EngineCoreClient` is an :class:`EngineClient`, so the server cannot tell it from the
in-process :class:`AsyncLLMEngine`. It starts ``data_parallel_size`` core processes (each with its
own device, or on CPU its own cores), reads their messages on the event loop (the sockets' file
descriptors are watched by the loop: no thread of ours polls), and routes each request to one
core: the one that already served the longest prefix of its prompt in blocks (its prefix cache
likely holds them, as the SGLang router does), unless that core is busier than the least loaded by
more than ``balance_threshold`` requests; otherwise the least loaded.

A core that exits or reports a crashed loop ends every request in flight with
:class:`EngineDeadError` and calls ``on_dead`` (the server then exits 1 for a supervisor).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from tianxia.config import EngineConfig
from tianxia.engine import async_engine as ae
from tianxia.engine import core_messages as msgs
from tianxia.engine.async_engine import EngineClient, EngineDeadError
from tianxia.engine.engine_info import EngineInfo
from tianxia.engine.llm_engine import PromptType

logger = logging.getLogger(__name__)
# plain ints: pyzmq's enum members cost an enum operation on every test of the socket
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

# the errors a core reports for a request, by class name
_ERRORS = {cls.__name__: cls for cls in (
    ae.EngineDeadError, ae.EngineStepError, ae.RequestAbortedError, ae.RequestFailedError,
    ae.RequestUnsatisfiableError, ae.RequestTimeoutError)}
_PREFIX_KEYS_PER_CORE = 1 << 16
# statistics that are not summed over cores
_MEAN_STATS = ("kv_cache_usage",)
_SAME_STATS = ("kv_cache_bytes_per_token", "max_lora")
# libgomp's default wait after a parallel region is 300,000 spins (milliseconds): a core's compute
# threads spin through its Python work between steps, on the CPUs its API process needs right then
# to stream the step's tokens. 1,000 spins still bridge the microseconds between a step's kernels.
# Measured on 2 cores (SmolLM2, 2 threads, 8 rounds each against its offline step): 0.7-4.2 ms
# less of the core's CPU a streamed token, served TPOT at concurrency 1 at 1.09x the offline
# step in the median against 1.11x; offline steps unchanged. The user's own OMP_WAIT_POLICY or
# GOMP_SPINCOUNT wins.
_CORE_OMP_WAIT = {"GOMP_SPINCOUNT": "1000"}


@dataclasses.dataclass(frozen=True)
class CoreEndpoints:
    """Where API processes find started engine cores: plain data, handed to each API process
    (``--api-server-count``)."""

    inputs: list[str]  # per core: its request socket (the core binds it)
    outputs: list[list[str]]  # per core, per API process: where its outputs go (the API binds it)
    pids: list[int]
    facts: dict[str, Any]  # what the first core said when ready (EngineInfo.facts)


class EngineCores:
    """The engine core processes, started (from the main thread: a core's ``PR_SET_PDEATHSIG``
    follows the thread that made it) and loaded; owned by the process that started them, which
    stops them with :meth:`shutdown` once no API process needs them."""

    def __init__(self, config: EngineConfig, *, data_parallel_size: int = 1, num_clients: int = 1,
                 request_timeout: float | None = None, log_stats_interval: float | None = 10.0,
                 log_level: str = "INFO") -> None:
        if data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be at least 1")
        options = {"request_timeout": request_timeout, "log_stats_interval": log_stats_interval}
        spawn = multiprocessing.get_context("spawn")  # a forked torch process is not safe
        self._ctx = zmq.Context()
        self._ready = self._ctx.socket(zmq.PULL)
        self._ready.setsockopt(zmq.LINGER, 0)
        tag = f"ipc://@tianxia-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._ready.bind(f"{tag}-ready")
        self._control: list[zmq.Socket] = []
        self.procs: list[Any] = []
        inputs, outputs = [], []
        try:
            with _core_environment():
                for i, cpus in enumerate(_cpu_sets(data_parallel_size, config.threads)):
                    inputs.append(f"{tag}-{i}-in")
                    outputs.append([f"{tag}-{i}-out-{j}" for j in range(num_clients)])
                    proc = spawn.Process(
                        target=_pinned_core, name=f"tianxia-engine-core-{i}", daemon=True,
                        args=(cpus, _core_config(config, i, data_parallel_size), inputs[-1],
                              outputs[-1], f"{tag}-ready", os.getpid(), log_level, options))
                    proc.start()
                    self.procs.append(proc)
            facts = self._wait_ready()
        except BaseException:
            self.kill(grace=5.0)  # a core that failed to load is exiting on its own
            raise
        self.endpoints = CoreEndpoints(inputs, outputs, [p.pid for p in self.procs], facts)
        for i, proc in enumerate(self.procs):
            logger.info("engine core %d: process %d", i, proc.pid)

    def _wait_ready(self) -> dict[str, Any]:
        """Block until every core has loaded its model; a load error is raised here."""
        facts: dict[str, Any] = {}
        for _ in self.procs:
            while not self._ready.poll(1000):
                for i, proc in enumerate(self.procs):
                    if not proc.is_alive():
                        raise RuntimeError(f"engine core {i} exited during start-up (exit code "
                                           f"{proc.exitcode}); see its log above")
            message = msgs.from_core.decode(self._ready.recv())
            if isinstance(message, msgs.StartupFailed):
                try:
                    error = pickle.loads(message.error)
                except Exception:  # noqa: BLE001 - the text says it all
                    error = RuntimeError(message.text)
                raise error
            if not isinstance(message, msgs.Ready):
                # a broken handshake between our own processes, not a caller's wrong argument
                raise RuntimeError(  # noqa: TRY004
                    f"an engine core said {type(message).__name__} before Ready")
            facts = facts or message.facts
        return facts

    def exitcode(self, index: int) -> int | None:
        return self.procs[index].exitcode

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask every core to stop (their API processes are done with them) and wait for them."""
        for addr, proc in zip(self.endpoints.inputs, self.procs):
            if proc.is_alive():
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(addr)
                sock.send(msgs.encoder.encode(("shutdown",)))
                self._control.append(sock)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            await loop.run_in_executor(None, proc.join, max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self, grace: float = 0.0) -> None:
        deadline = time.monotonic() + grace
        for i, proc in enumerate(self.procs):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                if not grace:
                    logger.warning("engine core %d did not stop; killing it", i)
                proc.kill()
                proc.join(5.0)
        for sock in (self._ready, *self._control):
            sock.close(linger=0)
        self._ctx.term()


@dataclasses.dataclass
class CoreState:
    """One engine core process, its sockets and what the API side knows of its load."""

    index: int
    pid: int
    inp: zmq.Socket  # to the core
    out: zmq.Socket  # from the core
    exit_fd: int  # readable once the core process has exited (a pidfd)
    snapshot: dict[str, float] = dataclasses.field(default_factory=dict)
    pending_adds: int = 0
    max_step_seqs: int = 0
    requests: set[str] = dataclasses.field(default_factory=set)
    prefixes: OrderedDict = dataclasses.field(default_factory=OrderedDict)  # block key -> None
    routed: int = 0  # requests sent here
    routed_by_prefix: int = 0  # ... because this core held their prefix


def _core_config(config: EngineConfig, index: int, size: int) -> EngineConfig:
    """Core ``index``'s config: its own GPU when the engine runs on CUDA."""
    if size == 1 or config.device not in ("auto", "", "cuda"):
        return config
    import torch

    if not torch.cuda.is_available():
        return config
    return dataclasses.replace(config, device=f"cuda:{index}")


def _cpu_sets(size: int, threads: int | None) -> list[set[int] | None]:
    """Disjoint CPU sets for ``size`` cores of ``threads`` threads each, when the machine has
    room for them (else none: the OS places them)."""
    if size == 1 or not threads or not hasattr(os, "sched_getaffinity"):
        return [None] * size
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < size * threads:
        logger.warning("data parallel: %d cores x %d threads exceed the %d CPUs here; not pinning",
                       size, threads, len(cpus))
        return [None] * size
    return [set(cpus[i * threads:(i + 1) * threads]) for i in range(size)]


@contextlib.contextmanager
def _core_environment() -> Iterator[None]:
    """The environment a core process starts with (a spawned process takes this one's): the
    OpenMP wait of :data:`_CORE_OMP_WAIT` unless the user chose one."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        yield
        return
    os.environ.update(_CORE_OMP_WAIT)
    try:
        yield
    finally:
        for key in _CORE_OMP_WAIT:
            os.environ.pop(key, None)


def _pinned_core(cpus: set[int] | None, *args: Any) -> None:
    from tianxia.engine.core_proc import run_engine_core

    if cpus:
        os.sched_setaffinity(0, cpus)
    run_engine_core(*args)


class EngineCoreClient(EngineClient):
    """One API process's connection to the engine cores. Without ``endpoints`` it starts the
    cores itself (and stops them at :meth:`shutdown`); with them it is API process ``client``
    of several that share cores another process started and stops."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        data_parallel_size: int = 1,
        endpoints: CoreEndpoints | None = None,
        client: int = 0,
        max_waiting_requests: int | None = None,
        request_timeout: float | None = None,
        log_stats_interval: float | None = 10.0,
        on_dead: Callable[[BaseException], None] | None = None,
        log_level: str = "INFO",
        balance_threshold: int = 32,
    ) -> None:
        super().__init__(max_waiting_requests=max_waiting_requests)
        self.on_dead = on_dead
        self.balance_threshold = balance_threshold
        self._block_size = config.cache.block_size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._adds: dict[str, tuple[CoreState, concurrent.futures.Future]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._owner: dict[str, CoreState] = {}
        self._client = client
        self._owned: EngineCores | None = None
        if endpoints is None:
            self._owned = EngineCores(
                config, data_parallel_size=data_parallel_size, request_timeout=request_timeout,
                log_stats_interval=log_stats_interval, log_level=log_level)
            endpoints = self._owned.endpoints
        self._ctx = zmq.Context()
        self.cores: list[CoreState] = []
        for i, (in_addr, outs, pid) in enumerate(zip(endpoints.inputs, endpoints.outputs,
                                                    endpoints.pids)):
            inp = self._ctx.socket(zmq.PUSH)
            inp.setsockopt(zmq.SNDHWM, 0)
            inp.setsockopt(zmq.LINGER, 0)
            inp.connect(in_addr)
            out = self._ctx.socket(zmq.PULL)
            out.setsockopt(zmq.LINGER, 0)
            out.bind(outs[client])
            # a pidfd: the loop learns of the core's exit even where it is not our child
            self.cores.append(CoreState(i, pid, inp, out, os.pidfd_open(pid)))
        self.info = EngineInfo.from_facts(endpoints.facts, config)

    # --- start-up and shutdown ----------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._loop is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        for core in self.cores:
            self._loop.add_reader(core.out.getsockopt(zmq.FD), self._on_readable, core)
            self._loop.add_reader(core.exit_fd, self._on_exit, core)
            self._on_readable(core)  # anything that came before the loop watched

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is still running; the process that started the cores stops them."""
        self.abort_all("the engine is shutting down")
        self._stopping = True
        if self._owned is not None:
            await self._owned.shutdown(timeout)
        self._close()

    def _close(self) -> None:
        for core in self.cores:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(core.exit_fd)
                if not core.out.closed:
                    self._loop.remove_reader(core.out.getsockopt(zmq.FD))
            core.inp.close(linger=0)
            core.out.close(linger=0)
            os.close(core.exit_fd)
        self._ctx.term()

    @property
    def is_running(self) -> bool:
        return self._loop is not None and self._dead is None and not self._stopping

    @property
    def errored(self) -> BaseException | None:
        return self._dead

    # --- requests -----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """The cores' statistics combined (sums; the mean KV cache usage)."""
        per_core = [self.core_stats(core) for core in self.cores]
        total: dict[str, float] = {}
        for snap in per_core:
            for key, value in snap.items():
                if key in _SAME_STATS or key not in total:
                    total[key] = value
                elif isinstance(value, list):  # per position: summed position by position
                    mine = total[key]
                    total[key] = [a + b for a, b in itertools.zip_longest(mine, value, fillvalue=0)]
                elif isinstance(value, dict):  # per adapter: summed adapter by adapter
                    mine = total[key]
                    total[key] = {k: mine.get(k, 0) + value.get(k, 0) for k in {*mine, *value}}
                elif isinstance(value, str):  # the adapters in use, comma-separated
                    total[key] = ",".join(sorted({*total[key].split(","), *value.split(",")} - {""}))
                else:
                    total[key] += value
        for key in _MEAN_STATS:
            if key in total:
                total[key] /= len(per_core)
        return total

    def core_stats(self, core: CoreState) -> dict[str, float]:
        """One core's statistics (``/metrics`` labels them with its index)."""
        snap = dict(core.snapshot)
        snap["num_waiting"] = snap.get("num_waiting", 0) + core.pending_adds
        return snap

    def per_core(self) -> list[dict[str, float]]:
        """Each core's statistics and routing counts, by index."""
        return [{**self.core_stats(core), "routed": core.routed,
                 "routed_by_prefix": core.routed_by_prefix} for core in self.cores]

    @property
    def max_step_seqs(self) -> int:
        return max((core.max_step_seqs for core in self.cores), default=0)

    @max_step_seqs.setter
    def max_step_seqs(self, value: int) -> None:  # the base class's initial 0
        pass

    def _check_running(self) -> None:
        if self._dead is not None or self._stopping or self._loop is None:
            raise EngineDeadError(
                "the engine is not running" + (f": {self._dead}" if self._dead else ""))

    def _send(self, command: tuple) -> None:
        self._check_running()
        if command[0] == "add":
            _, rid, prompt, params, arrival, lora_request, fut = command
            with self._count_lock:  # the base class counted it in _pending_adds
                self._pending_adds -= 1
            core = self._route(rid, prompt)
            core.pending_adds += 1
            self._adds[rid] = (core, fut)
            self._owner[rid] = core
            core.requests.add(rid)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("request %s to core %d at %.4f", rid, core.index, time.monotonic())
            core.inp.send(msgs.encoder.encode(
                ("add", rid, prompt, msgs.params_fields(params), arrival,
                 None if lora_request is None else [lora_request.lora_name, lora_request.lora_path],
                 self._client)),
                copy=False)
        elif command[0] == "abort":
            core = self._owner.pop(command[1], None)
            if core is not None:
                core.requests.discard(command[1])
                core.inp.send(msgs.encoder.encode(command))
        elif command[0] == "stop_choice":
            core = self._owner.get(command[1])
            if core is not None:
                core.inp.send(msgs.encoder.encode(command))

    async def utility(self, name: str, *args: Any) -> Any:
        """Run on every core (each has its own cache); core 0's result is returned."""
        self._check_running()
        futures = []
        for core in self.cores:
            call_id = next(self._call_ids)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._calls[call_id] = fut
            core.inp.send(msgs.encoder.encode(("utility", call_id, name, list(args), self._client)))
            futures.append(asyncio.wrap_future(fut))
            if name == "embed":  # a pure function of its input: one core answers
                break
        results = await asyncio.gather(*futures)
        if name == "reset_prefix_cache":
            if all(results):
                for core in self.cores:
                    core.prefixes.clear()
            return all(results)
        return results[0]

    def _route(self, rid: str, prompt: PromptType) -> CoreState:
        if len(self.cores) == 1:
            core = self.cores[0]
            core.routed += 1
            return core
        keys = self._block_keys(prompt)
        least = min(self.cores, key=lambda c: len(c.requests))
        best, best_len = least, 0
        for core in self.cores:
            n = 0
            for key in keys:
                if key not in core.prefixes:
                    break
                n += 1
            if n > best_len:
                best, best_len = core, n
        if best_len and len(best.requests) - len(least.requests) <= self.balance_threshold:
            core = best
            core.routed_by_prefix += 1
        else:
            core = least
        core.routed += 1
        for key in keys:
            core.prefixes[key] = None
            core.prefixes.move_to_end(key)
        while len(core.prefixes) > _PREFIX_KEYS_PER_CORE:
            core.prefixes.popitem(last=False)
        return core

    def _block_keys(self, prompt: PromptType) -> list[int]:
        """Chained keys of the prompt's full blocks of token ids (none for a text prompt)."""
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        if not isinstance(ids, list):
            return []
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        keys, key, bs = [], hash(salt), self._block_size
        for start in range(0, len(ids) - bs + 1, bs):
            key = hash((key, *ids[start:start + bs]))
            keys.append(key)
        return keys

    # --- from the cores (event loop) ----------------------------------------------------------

    def _on_readable(self, core: CoreState) -> None:
        # the socket's descriptor is edge-triggered: read until ZeroMQ says nothing is left
        while not core.out.closed and core.out.getsockopt(_EVENTS) & _POLLIN:
            message = msgs.from_core.decode(core.out.recv(zmq.NOBLOCK))
            if isinstance(message, msgs.Outputs):
                self._on_outputs(core, message)
            elif isinstance(message, msgs.Dead):
                self._core_died(core, f"the engine loop crashed ({message.reason})")
                return

    def _on_outputs(self, core: CoreState, m: msgs.Outputs) -> None:
        for rid, error, is_value_error in m.acks:
            owner, fut = self._adds.pop(rid, (None, None))
            if owner is not None:
                # the message's statistics already count it (the core publishes, then acks)
                owner.pending_adds -= 1
            if fut is None or not fut.set_running_or_notify_cancel():
                continue
            if error is None:
                fut.set_result(None)
            else:
                self._forget(rid)
                fut.set_exception(ValueError(error) if is_value_error else RuntimeError(error))
        for call_id, result, error, is_value_error in m.replies:
            fut = self._calls.pop(call_id, None)
            if fut is not None and fut.set_running_or_notify_cancel():
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(ValueError(error) if is_value_error else RuntimeError(error))
        if m.stats is not None:
            core.snapshot = m.stats
        core.max_step_seqs = m.max_step_seqs
        batch: list[tuple[str, Any]] = [(out.request_id, out) for out in m.outputs]
        batch += [(rid, _ERRORS.get(name, EngineDeadError)(text)) for rid, name, text in m.errors]
        for rid, item in batch:
            if isinstance(item, BaseException) or item.finished:
                self._forget(rid)
        self._deliver(batch)
        listener = self.listener
        for step in m.steps:
            listener.on_step(step)
        for ttft in m.first_tokens:
            listener.on_first_token(ttft)
        if m.inter_tokens:
            listener.on_inter_tokens(m.inter_tokens)
        for done in m.done:
            listener.on_request_done(done)

    def _forget(self, rid: str) -> None:
        core = self._owner.pop(rid, None)
        if core is not None:
            core.requests.discard(rid)

    def _on_exit(self, core: CoreState) -> None:
        if self._loop is not None:
            self._loop.remove_reader(core.exit_fd)
        self._on_readable(core)  # what it said before it went
        if not self._stopping:
            code = self._owned.exitcode(core.index) if self._owned is not None else None
            self._core_died(core, f"engine core {core.index} exited"
                                  + (f" (exit code {code})" if code is not None else ""))

    def _core_died(self, core: CoreState, reason: str) -> None:
        if self._dead is not None:
            return
        logger.error("%s; failing %d request(s) in flight", reason, len(self._streams))
        self._dead = EngineDeadError(reason)
        for _, fut in self._adds.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(self._dead)
        for fut in self._calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(self._dead)
        self._adds.clear()
        self._calls.clear()
        self._deliver([(rid, EngineDeadError(reason)) for rid, s in self._streams.items()
                       if not s.finished])
        if self.on_dead is not None:
            self.on_dead(self._dead)
