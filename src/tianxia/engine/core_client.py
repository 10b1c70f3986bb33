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
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import time
import uuid
from collections import OrderedDict
from typing import Any, Callable

import zmq

from tianxia.config import EngineConfig
from tianxia.engine import async_engine as ae
from tianxia.engine import core_messages as msgs
from tianxia.engine.async_engine import EngineClient, EngineDeadError
from tianxia.engine.engine_info import EngineInfo
from tianxia.engine.llm_engine import PromptType
from tianxia.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# the errors a core reports for a request, by class name
_ERRORS = {cls.__name__: cls for cls in (
    ae.EngineDeadError, ae.EngineStepError, ae.RequestAbortedError, ae.RequestFailedError,
    ae.RequestUnsatisfiableError, ae.RequestTimeoutError)}
_PREFIX_KEYS_PER_CORE = 1 << 16
# statistics that are not summed over cores
_MEAN_STATS = ("kv_cache_usage",)
_SAME_STATS = ("kv_cache_bytes_per_token", "max_lora")


@dataclasses.dataclass
class CoreState:
    """One engine core process, its sockets and what the API side knows of its load."""

    index: int
    proc: Any  # multiprocessing.Process
    inp: zmq.Socket  # to the core
    out: zmq.Socket  # from the core
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


def _pinned_core(cpus: set[int] | None, *args: Any) -> None:
    from tianxia.engine.core_proc import run_engine_core

    if cpus:
        os.sched_setaffinity(0, cpus)
    run_engine_core(*args)


class EngineCoreClient(EngineClient):
    def __init__(
        self,
        config: EngineConfig,
        *,
        data_parallel_size: int = 1,
        max_waiting_requests: int | None = None,
        request_timeout: float | None = None,
        log_stats_interval: float | None = 10.0,
        on_dead: Callable[[BaseException], None] | None = None,
        log_level: str = "INFO",
        balance_threshold: int = 32,
    ) -> None:
        if data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be at least 1")
        super().__init__(max_waiting_requests=max_waiting_requests)
        self.on_dead = on_dead
        self.balance_threshold = balance_threshold
        self._block_size = config.cache.block_size
        self._ctx = zmq.Context()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._adds: dict[str, tuple[CoreState, concurrent.futures.Future]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._owner: dict[str, CoreState] = {}
        options = {"request_timeout": request_timeout, "log_stats_interval": log_stats_interval}
        spawn = multiprocessing.get_context("spawn")  # a forked torch process is not safe
        self.cores: list[CoreState] = []
        try:
            for i, cpus in enumerate(_cpu_sets(data_parallel_size, config.threads)):
                name = f"ipc://@tianxia-{os.getpid()}-{uuid.uuid4().hex[:12]}-{i}"
                inp = self._ctx.socket(zmq.PUSH)
                inp.setsockopt(zmq.SNDHWM, 0)
                inp.setsockopt(zmq.LINGER, 0)
                inp.bind(name + "-in")
                out = self._ctx.socket(zmq.PULL)
                out.setsockopt(zmq.LINGER, 0)
                out.bind(name + "-out")
                proc = spawn.Process(
                    target=_pinned_core, name=f"tianxia-engine-core-{i}", daemon=True,
                    args=(cpus, _core_config(config, i, data_parallel_size), name + "-in",
                          name + "-out", os.getpid(), log_level, options))
                proc.start()
                self.cores.append(CoreState(i, proc, inp, out))
            facts = [self._wait_ready(core) for core in self.cores]
        except BaseException:
            self._kill_all(grace=5.0)  # a core that failed to load is exiting on its own
            raise
        self.info = EngineInfo.from_facts(facts[0], config)
        for core in self.cores:
            logger.info("engine core %d: process %d", core.index, core.proc.pid)

    # --- start-up and shutdown ----------------------------------------------------------------

    def _wait_ready(self, core: CoreState) -> dict[str, Any]:
        """Block until ``core`` has loaded its model; its load error is raised here."""
        while not core.out.poll(1000):
            if not core.proc.is_alive():
                raise RuntimeError(f"the engine core process exited during start-up "
                                   f"(exit code {core.proc.exitcode}); see its log above")
        message = msgs.from_core.decode(core.out.recv())
        if isinstance(message, msgs.StartupFailed):
            try:
                error = pickle.loads(message.error)
            except Exception:  # noqa: BLE001 - the text says it all
                error = RuntimeError(message.text)
            raise error
        if not isinstance(message, msgs.Ready):
            raise RuntimeError(f"the engine core said {type(message).__name__} before Ready")
        return message.facts

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._loop is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        for core in self.cores:
            self._loop.add_reader(core.out.getsockopt(zmq.FD), self._on_readable, core)
            self._loop.add_reader(core.proc.sentinel, self._on_exit, core)
            self._on_readable(core)  # anything that came before the loop watched

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is still running, ask every core to stop, and wait for them."""
        self.abort_all("the engine is shutting down")
        self._stopping = True
        for core in self.cores:
            if core.proc.is_alive():
                core.inp.send(msgs.encoder.encode(("shutdown",)))
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        for core in self.cores:
            await loop.run_in_executor(None, core.proc.join, max(0.0, deadline - time.monotonic()))
        self._kill_all()

    def _kill_all(self, grace: float = 0.0) -> None:
        deadline = time.monotonic() + grace
        for core in self.cores:
            core.proc.join(max(0.0, deadline - time.monotonic()))
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(core.proc.sentinel)
                if not core.out.closed:
                    self._loop.remove_reader(core.out.getsockopt(zmq.FD))
            if core.proc.is_alive():
                if not grace:
                    logger.warning("engine core %d did not stop; killing it", core.index)
                core.proc.kill()
                core.proc.join(5.0)
            core.inp.close(linger=0)
            core.out.close(linger=0)
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
            core.inp.send(msgs.encoder.encode(
                ("add", rid, prompt, msgs.params_fields(params), arrival,
                 None if lora_request is None else [lora_request.lora_name, lora_request.lora_path])),
                copy=False)
        elif command[0] == "abort":
            core = self._owner.pop(command[1], None)
            if core is not None:
                core.requests.discard(command[1])
                core.inp.send(msgs.encoder.encode(command))

    async def utility(self, name: str, *args: Any) -> Any:
        """Run on every core (each has its own cache); core 0's result is returned."""
        self._check_running()
        futures = []
        for core in self.cores:
            call_id = next(self._call_ids)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._calls[call_id] = fut
            core.inp.send(msgs.encoder.encode(("utility", call_id, name, list(args))))
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
        while not core.out.closed and core.out.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            message = msgs.from_core.decode(core.out.recv(zmq.NOBLOCK))
            if isinstance(message, msgs.Outputs):
                self._on_outputs(core, message)
            elif isinstance(message, msgs.Dead):
                self._core_died(core, f"the engine loop crashed ({message.reason})")
                return

    def _on_outputs(self, core: CoreState, m: msgs.Outputs) -> None:
        for rid, error, is_value_error in m.acks:
            _, fut = self._adds.pop(rid, (None, None))
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
        core.pending_adds -= m.adds_taken
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
        for latency, n in m.inter_tokens:
            listener.on_inter_token(latency, n)
        for done in m.done:
            listener.on_request_done(done)

    def _forget(self, rid: str) -> None:
        core = self._owner.pop(rid, None)
        if core is not None:
            core.requests.discard(rid)

    def _on_exit(self, core: CoreState) -> None:
        if self._loop is not None:
            self._loop.remove_reader(core.proc.sentinel)
        self._on_readable(core)  # what it said before it went
        if not self._stopping:
            self._core_died(core, f"engine core {core.index} exited (exit code "
                                  f"{core.proc.exitcode})")

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
