"""The engine core process: the scheduler, KV cache and model runner, away from the HTTP side.

Two threads. The engine thread runs :class:`AsyncLLMEngine`'s loop (step while there is work,
sleep on an event when there is none), and sends what each turn produced (new tokens, errors,
statistics) to each API process as one message: a request's outputs go to the API process that
sent it (``--api-server-count``: several share a core), the statistics to every one of them, so
that each can answer ``/metrics`` for the whole server. The main thread blocks on the input socket and
turns each message into a command for that loop, so a request arriving at an idle core wakes it
at once and an idle core uses no CPU. Neither thread holds the GIL while the other works for
long: the C++ kernels release it, and ZeroMQ does its I/O on its own threads.

The core never outlives the API process: it asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``) and checks its parent id while it waits. It ignores SIGINT and SIGTERM:
the API process drains its requests and then sends ``shutdown``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import logging
import os
import pickle
import signal
import threading
from typing import Any

import zmq

from tianxia.engine import core_messages as msgs
from tianxia.engine.async_engine import (
    UTILITIES,
    AsyncLLMEngine,
    RequestStats,
    StatsListener,
    StepStats,
    build_off_main_thread,
)
from tianxia.engine.engine_info import EngineInfo
from tianxia.engine.heap import freeze_startup_heap
from tianxia.engine.lora_manager import LoRARequest
from tianxia.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PARENT_CHECK_S = 1.0


class _Forwarder(StatsListener):
    """Collects the engine thread's statistics events until the next message carries them."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.first_tokens: list[float] = []
        self.inter_tokens: list[tuple[float, int]] = []
        self.done: list[RequestStats] = []

    def on_step(self, step: StepStats) -> None:
        self.steps.append(step)

    def on_first_token(self, ttft_s: float) -> None:
        self.first_tokens.append(ttft_s)

    def on_inter_token(self, latency_s: float, num_tokens: int) -> None:
        self.inter_tokens.append((latency_s, num_tokens))

    def on_request_done(self, stats: RequestStats) -> None:
        self.done.append(stats)

    def pending(self) -> bool:
        return bool(self.steps or self.first_tokens or self.inter_tokens or self.done)

    def take(self) -> dict[str, list]:
        out = {"steps": self.steps, "first_tokens": self.first_tokens,
               "inter_tokens": self.inter_tokens, "done": self.done}
        self.steps, self.first_tokens, self.inter_tokens, self.done = [], [], [], []
        return out


class EngineCore(AsyncLLMEngine):
    """:class:`AsyncLLMEngine`'s engine thread, delivering to ZeroMQ sockets (one per API process)
    instead of an event loop. Only the engine thread sends on them; other threads queue
    acknowledgements and replies for it (``deque.append`` is atomic)."""

    def __init__(self, engine, outs: list[zmq.Socket], **kwargs: Any) -> None:
        self._outs = outs
        self._client_of: dict[str, int] = {}  # request id -> the API process that sent it
        self._acks: collections.deque = collections.deque()
        self._replies: collections.deque = collections.deque()
        self._sent_stats: dict | None = None  # the snapshot the last message carried
        self._forwarder = _Forwarder()
        super().__init__(engine, stats_listener=self._forwarder, on_dead=self._send_dead, **kwargs)

    def run_thread(self) -> threading.Thread:
        self._thread = threading.Thread(target=self._run, name="tianxia-engine", daemon=True)
        self._thread.start()
        return self._thread

    # --- from the input socket (main thread) --------------------------------------------------

    def handle(self, message: list) -> bool:
        """One message from the API process; False once it says ``shutdown``."""
        kind = message[0]
        if kind == "add":
            _, rid, prompt, fields, arrival, lora, client = message
            self._client_of[rid] = client
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.add_done_callback(lambda f, rid=rid, client=client: self._ack(client, rid, f))
            try:
                params = SamplingParams(**fields)
            except (TypeError, ValueError) as e:
                fut.set_exception(ValueError(str(e)))
                self._wakeup.set()  # the engine thread sends the refusal
                return True
            with self._count_lock:
                self._pending_adds += 1
            lora_request = None if lora is None else LoRARequest(lora[0], lora_path=lora[1])
            self._commands.put(("add", rid, prompt, params, arrival, lora_request, fut))
        elif kind == "abort":  # ("abort", rid[, finish reason, generated tokens])
            self._client_of.pop(message[1], None)  # whatever it still produces goes nowhere
            self._commands.put(tuple(message))
        elif kind == "stop_choice":  # ("stop_choice", rid, index): one choice of n > 1
            self._commands.put(tuple(message))
        elif kind == "utility":
            _, call_id, name, args, client = message
            fut = concurrent.futures.Future()
            fut.add_done_callback(lambda f, call_id=call_id, client=client:
                                  self._reply(client, call_id, f))
            if name not in UTILITIES:
                fut.set_exception(ValueError(f"unknown engine utility {name!r}"))
            else:
                self._commands.put(("call", lambda e: getattr(e, name)(*args), fut))
        elif kind == "shutdown":
            self._stopping = True
        self._wakeup.set()
        return kind != "shutdown"

    def _ack(self, client: int, rid: str, fut: concurrent.futures.Future) -> None:
        e = fut.exception()
        if e is not None:
            self._client_of.pop(rid, None)
        self._acks.append((client, (rid, None if e is None else str(e), isinstance(e, ValueError))))

    def _reply(self, client: int, call_id: int, fut: concurrent.futures.Future) -> None:
        e = fut.exception()
        # a ValueError (a bad adapter) keeps its plain message: the client raises it as one (a 400)
        self._replies.append((client, (call_id, None if e is not None else fut.result(),
                                       None if e is None else str(e) if isinstance(e, ValueError)
                                       else f"{type(e).__name__}: {e}", isinstance(e, ValueError))))

    # --- to the output sockets (engine thread) ------------------------------------------------

    def _drain_commands(self) -> None:
        try:
            super()._drain_commands()
        finally:
            # every turn publishes its statistics; only a changed snapshot is news (a turn between
            # two steps that took no command would otherwise send a second message, and wake each
            # API process, for every step)
            if (self._snapshot != self._sent_stats or self._acks or self._replies
                    or self._forwarder.pending()):
                self._post([])

    def _post(self, batch: list[tuple[str, Any]]) -> None:
        per_client = [msgs.Outputs([], [], [], []) for _ in self._outs]
        for rid, item in batch:
            client = self._client_of.get(rid)
            if client is None:  # its API process already ended it
                continue
            if isinstance(item, BaseException):
                per_client[client].errors.append((rid, type(item).__name__, str(item)))
                self._client_of.pop(rid, None)
            else:
                per_client[client].outputs.append(item)
                if item.finished:
                    self._client_of.pop(rid, None)
        for _ in range(len(self._acks)):
            client, ack = self._acks.popleft()
            per_client[client].acks.append(ack)
        for _ in range(len(self._replies)):
            client, reply = self._replies.popleft()
            per_client[client].replies.append(reply)
        with self._count_lock:
            stats = self._snapshot
        self._sent_stats = stats
        shared = {**self._forwarder.take(), "stats": stats, "max_step_seqs": self.max_step_seqs}
        for out, message in zip(self._outs, per_client):
            for key, value in shared.items():
                setattr(message, key, value)
            out.send(msgs.encoder.encode(message), copy=False)

    def _send_dead(self, exc: BaseException) -> None:
        for out in self._outs:
            out.send(msgs.encoder.encode(msgs.Dead(repr(exc))))


def die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent-id check below still applies
        pass
    if os.getppid() != parent_pid:  # the parent died before we asked
        os._exit(1)


def run_engine_core(config, in_addr: str, out_addrs: list[str], ready_addr: str, parent_pid: int,
                    log_level: str, options: dict[str, Any]) -> None:
    """The core process's main: load, say ready (on ``ready_addr``, to the process that started
    it), then serve the API processes (requests on ``in_addr``, which the core binds; outputs to
    ``out_addrs``, one per API process, which they bind) until ``shutdown`` or the parent's death.
    Exits 1 if loading failed or the engine loop crashed."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.bind(in_addr)
    outs = []
    for addr in out_addrs:
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.SNDHWM, 0)  # outputs are never dropped nor block the engine
        out.setsockopt(zmq.LINGER, 5000)  # the last messages (a crash report) still leave
        out.connect(addr)  # queued until that API process is there to read them
        outs.append(out)
    ready = ctx.socket(zmq.PUSH)
    ready.setsockopt(zmq.LINGER, 5000)
    ready.connect(ready_addr)
    from tianxia.engine.llm_engine import LLMEngine

    try:
        engine = build_off_main_thread(lambda: LLMEngine(config))
    except BaseException as e:  # noqa: BLE001 - reported to the API process, which exits
        try:
            blob = pickle.dumps(e)
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            blob = pickle.dumps(RuntimeError(str(e)))
        ready.send(msgs.encoder.encode(msgs.StartupFailed(blob, f"{type(e).__name__}: {e}")))
        ready.close()
        ctx.term()
        os._exit(1)
    core = EngineCore(engine, outs, **options)
    freeze_startup_heap()
    ready.send(msgs.encoder.encode(msgs.Ready(EngineInfo.of(engine).facts())))
    ready.close()
    thread = core.run_thread()
    code = 0
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    while True:
        if not thread.is_alive():
            code = 1  # the engine loop crashed (it sent Dead)
            break
        if os.getppid() != parent_pid:
            logger.error("the API server is gone; the engine core exits")
            code = 1
            break
        if not poller.poll(_PARENT_CHECK_S * 1000):
            continue
        if not core.handle(msgs.to_core.decode(inp.recv())):
            thread.join(timeout=10.0)
            break
    inp.close(linger=0)
    for out in outs:
        out.close()
    ctx.term()
    logging.shutdown()
    os._exit(code)  # no interpreter teardown: torch's and OpenMP's threads may still be parked

