"""An asyncio front over :class:`LLMEngine`: many concurrent requests, one step loop.

The engine is not thread-safe, so exactly one thread (the *engine thread*) ever touches it. The
asyncio side talks to that thread through a command queue (add, abort, call) that is drained
between steps; outputs travel back through ``loop.call_soon_threadsafe`` into one
``asyncio.Queue`` per request. Requests that arrive while a step runs join the next step, so
concurrent requests share the same forward passes (continuous batching).

::

    engine = AsyncLLMEngine(LLMEngine(config))
    engine.start()  # inside a running event loop
    async for out in engine.generate(prompt, SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)

The engine thread posts only what each step added (:class:`RequestDelta`: new token ids,
logprobs, finish reasons); the event-loop side turns them into text and cumulative
``RequestOutput`` snapshots (:class:`OutputProcessor`: detokenization and stop strings), as it
does for engine core processes. A snapshot holds the whole text so far, so a slow consumer may
skip intermediate ones: :meth:`generate` hands out the newest output queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tianxia.engine import faults
from tianxia.engine.engine_info import EngineInfo
from tianxia.engine.llm_engine import LLMEngine, PromptType
from tianxia.engine.lora_manager import LoRARequest
from tianxia.engine.output_processor import OutputProcessor, RequestDelta, engine_params
from tianxia.outputs import RequestOutput
from tianxia.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


def build_off_main_thread(build: Callable[[], T]) -> T:
    """``build()`` (the engine's load and warm-up) run in a thread that ends with it.

    The engine steps on a thread of its own. Had the main thread run the load's parallel torch
    ops, it would keep an OpenMP thread pool for the life of the process; with two pools libgomp
    manages more threads than there are cores, stops spinning between parallel regions, and each
    of a decode step's few hundred regions waits for a worker to wake (a CPU step took twice as
    long). A pool ends with its thread, so the engine thread's pool is then the only one.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(build())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=target, name="tianxia-load", daemon=True)  # Ctrl-C exits
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


async def run_in_own_thread(build: Callable[[], T]) -> T:
    """:func:`build_off_main_thread` for a running event loop: ``build()`` runs in a thread that
    ends with it (for the same reason), and the loop keeps serving meanwhile."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # the waiter was cancelled
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def target() -> None:
        try:
            result = build()
        except BaseException as e:  # noqa: BLE001 - re-raised in the event loop
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name="tianxia-load", daemon=True).start()
    return await done


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crashed, or the engine was shut down)."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in that step were failed and freed."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; retry later."""


class RequestAbortedError(RuntimeError):
    """The request was ended by the server (see :meth:`AsyncLLMEngine.abort_all`)."""


class RequestFailedError(EngineStepError):
    """This request's own processing failed (NaN logits, detokenizer, grammar); others go on."""


class RequestUnsatisfiableError(RequestFailedError):
    """The request's own constraints left no token to generate (a client error)."""


class RequestTimeoutError(RequestAbortedError):
    """The request ran past ``request_timeout`` seconds and was aborted."""


@dataclass
class StepStats:
    """One engine step, as seen from the engine thread."""

    num_seqs: int  # sequences in the batch (decodes + prefill chunks)
    num_tokens: int  # tokens in the batch
    num_decodes: int
    duration_s: float


@dataclass
class RequestStats:
    """Timings of one finished (or aborted) request, in seconds of ``time.monotonic``."""

    request_id: str
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    finish_reason: str | None = None
    max_tokens: int | None = None
    n: int = 1


class StatsListener:
    """Receives engine statistics on the engine thread; override what you need (keep it cheap)."""

    def on_step(self, step: StepStats) -> None: ...

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_inter_token(self, latency_s: float, num_tokens: int) -> None: ...

    def on_inter_tokens(self, samples: list[tuple[float, int]]) -> None:
        """Many ``(latency_s, num_tokens)`` at once (one engine step's worth)."""
        for latency_s, num_tokens in samples:
            self.on_inter_token(latency_s, num_tokens)

    def on_request_done(self, stats: RequestStats) -> None: ...


@dataclass
class _Tracked:
    stats: RequestStats
    tokens: int = 0  # output tokens seen so far (all choices)
    deadline: float = math.inf  # time.monotonic() past which the request is aborted


@dataclass
class _Stream:
    queue: asyncio.Queue
    finished: bool = False
    pending: list[Any] = field(default_factory=list)


class EngineClient:
    """The asyncio side of an engine, wherever the engine runs: requests in, outputs out.

    :class:`AsyncLLMEngine` drives an engine on a thread of this process;
    :class:`tianxia.engine.core_client.EngineCoreClient` talks to engine core processes. The
    server uses only this interface. ``max_waiting_requests`` bounds the requests that are queued
    but not yet scheduled; past it :meth:`add_request` raises :class:`QueueFullError` (the server
    turns it into a 503).
    """

    info: EngineInfo

    def __init__(
        self,
        *,
        max_waiting_requests: int | None = None,
        stats_listener: StatsListener | None = None,
    ) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.listener = stats_listener or StatsListener()
        self._streams: dict[str, _Stream] = {}  # event-loop side only
        self._processor: OutputProcessor | None = None  # built from ``info`` on the first request
        # adds sent but not yet taken by the engine: the event loop counts them up, the engine
        # side counts them down in the same critical section that publishes the snapshot that
        # now includes them, so a request is never counted twice or not at all
        self._pending_adds = 0
        self._count_lock = threading.Lock()
        self._snapshot: dict[str, float] = {}
        self.max_step_seqs = 0

    # --- what each kind of client provides ----------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        raise NotImplementedError

    async def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    @property
    def errored(self) -> BaseException | None:
        raise NotImplementedError

    def _send(self, command: tuple) -> None:
        """Hand ``("add", rid, prompt, params, arrival, lora_request, future)`` or
        ``("abort", rid)`` to the engine; raises :class:`EngineDeadError` when it is not running."""
        raise NotImplementedError

    async def utility(self, name: str, *args: Any) -> Any:
        """``LLMEngine.<name>(*args)`` run by the engine between steps (see ``UTILITIES``)."""
        raise NotImplementedError

    # --- the asyncio side ---------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def stats(self) -> dict[str, float]:
        """The latest engine statistics (published by the engine after every step)."""
        with self._count_lock:
            snap = dict(self._snapshot)
            snap["num_waiting"] = snap.get("num_waiting", 0) + self._pending_adds
        return snap

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> asyncio.Queue:
        """Queue a request; returns once the engine accepted it (``ValueError`` if it did not)."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.max_waiting_requests is not None:
            if self.stats()["num_waiting"] >= self.max_waiting_requests:
                raise QueueFullError(
                    f"too many requests are waiting ({self.max_waiting_requests}); retry later"
                )
        stream = _Stream(asyncio.Queue())
        self._streams[request_id] = stream
        if self._processor is None:
            self._processor = OutputProcessor(self.info.tokenizer)
        self._processor.add(request_id, params)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._count_lock:
            self._pending_adds += 1
        try:
            self._send(("add", request_id, prompt, engine_params(params), time.monotonic(),
                        lora_request, fut))
        except BaseException:
            with self._count_lock:
                self._pending_adds -= 1  # never queued
            self._streams.pop(request_id, None)
            self._processor.remove(request_id)
            raise
        try:
            await asyncio.wrap_future(fut)
        except BaseException as e:
            self._streams.pop(request_id, None)
            self._processor.remove(request_id)
            if not isinstance(e, (ValueError, EngineDeadError)):
                # cancelled while the engine was taking it: make sure it does not run unobserved
                self.abort(request_id)
            raise
        return stream.queue

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (at the next step boundary). Never raises."""
        stream = self._streams.pop(request_id, None)
        if self._processor is not None:
            self._processor.remove(request_id)
        if stream is not None and stream.finished:
            return
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass

    def abort_all(self, reason: str) -> int:
        """End every request in flight: each consumer gets a :class:`RequestAbortedError`
        (instead of waiting forever) and the engine frees the requests' KV blocks."""
        count = 0
        for rid, stream in list(self._streams.items()):
            if stream.finished:
                continue
            self.abort(rid)
            stream.finished = True
            stream.queue.put_nowait(RequestAbortedError(reason))
            count += 1
        return count

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; leaving early aborts it."""
        q = await self.add_request(request_id, prompt, params)
        async for out in self.iterate(request_id, q):
            yield out

    async def iterate(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The outputs of a request added with :meth:`add_request`; leaving early aborts it."""
        finished = False
        try:
            while True:
                item = await q.get()
                while not q.empty():  # outputs are cumulative: skip to the newest
                    if isinstance(item, BaseException) or item.finished:
                        break
                    item = q.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                # the newest snapshot is built now, from the request's state (nothing newer has
                # been processed: this task and the deliveries take turns on one event loop)
                yield item.output
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def _deliver(self, batch: list[tuple[str, RequestDelta | BaseException]]) -> None:
        """Event-loop side: turn the engine's deltas into outputs (text, stop strings) and hand
        them (or exceptions) to their request queues."""
        processor = self._processor
        for rid, item in batch:
            stream = self._streams.get(rid)
            if stream is None or processor is None:
                if processor is not None:
                    processor.remove(rid)
                continue
            if isinstance(item, RequestDelta):
                try:
                    result = processor.process(item)
                except Exception as e:  # noqa: BLE001 - one request's fault ends that request only
                    logger.exception("request %s failed", rid)
                    processor.remove(rid)
                    self._stop_in_engine(rid)
                    item = RequestFailedError(f"the request failed: {type(e).__name__}: {e}")
                else:
                    if result is None:
                        continue
                    item = result
                    if result.stop_request:  # its choices all met stop strings here
                        self._stop_in_engine(
                            rid, "stop", sum(len(c.token_ids) for c in result.output.outputs))
                    for index in result.stop_choices:  # n > 1: the others run on
                        self._stop_choice_in_engine(rid, index)
            else:
                processor.remove(rid)
            if isinstance(item, BaseException) or item.finished:
                stream.finished = True
            stream.queue.put_nowait(item)

    def _stop_choice_in_engine(self, rid: str, index: int) -> None:
        """Stop one choice of a request whose other choices run on (it met a stop string here),
        so the engine spends no more steps or KV blocks on it."""
        try:
            self._send(("stop_choice", rid, index))
        except EngineDeadError:
            pass

    def _stop_in_engine(self, rid: str, reason: str = "abort", num_tokens: int | None = None) -> None:
        """Abort a request the API side ended; ``reason`` and ``num_tokens`` (the tokens its
        output kept) are what the engine's request statistics record."""
        try:
            self._send(("abort", rid) if num_tokens is None else ("abort", rid, reason, num_tokens))
        except EngineDeadError:
            pass


# what an engine runs for :meth:`EngineClient.utility` (a name crosses a process boundary, a
# function does not)
UTILITIES = frozenset({"reset_prefix_cache", "embed", "add_lora", "remove_lora"})


class AsyncLLMEngine(EngineClient):
    """Owns an :class:`LLMEngine` and drives it from a single background thread.

    ``request_timeout`` (seconds from arrival) aborts a request that runs longer: its KV blocks are
    freed and its consumer gets :class:`RequestTimeoutError`. ``on_dead`` is called (on the engine
    thread) if the engine loop itself crashes, so that the process can exit and be restarted.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting_requests: int | None = None,
        stats_listener: StatsListener | None = None,
        log_stats_interval: float | None = 10.0,
        request_timeout: float | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        super().__init__(max_waiting_requests=max_waiting_requests, stats_listener=stats_listener)
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.request_timeout = request_timeout
        self.on_dead = on_dead
        self.log_stats_interval = log_stats_interval
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._tracked: dict[str, _Tracked] = {}  # engine-thread side only
        self.num_steps = 0
        self._publish_stats()

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tianxia-engine", daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that outputs are delivered on (set by :meth:`start`)."""
        return self._loop

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def errored(self) -> BaseException | None:
        return self._dead

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running and stop the engine thread."""
        self.abort_all("the engine is shutting down")
        self._stopping = True
        self._wakeup.set()
        thread = self._thread
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout)
            if thread.is_alive():
                logger.warning("the engine thread did not stop within %.0fs", timeout)

    def _send(self, command: tuple) -> None:
        if self._dead is not None or self._stopping or self._thread is None:
            raise EngineDeadError(
                "the engine is not running" + (f": {self._dead!r}" if self._dead else "")
            )
        self._commands.put(command)
        self._wakeup.set()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    async def utility(self, name: str, *args: Any) -> Any:
        if name not in UTILITIES:
            raise ValueError(f"unknown engine utility {name!r}")
        return await self.call(lambda engine: getattr(engine, name)(*args))

    # --- the engine thread --------------------------------------------------------------------

    def _publish_stats(self, adds_taken: int = 0) -> None:
        try:
            snap = dict(self.engine.stats())
        except Exception:  # pragma: no cover - stats must never take the loop down
            logger.exception("engine.stats() failed")
            snap = self._snapshot
        with self._count_lock:
            self._snapshot = snap
            self._pending_adds -= adds_taken

    def _post(self, batch: list[tuple[str, Any]]) -> None:
        if batch and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the loop closed under us (shutdown)
                pass

    def _run(self) -> None:
        last_log = time.monotonic()
        last_tokens = (0, 0)
        try:
            while True:
                self._drain_commands()
                if self._stopping:
                    break
                if self.request_timeout is not None:
                    self._expire(time.monotonic())
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                try:
                    self._step()
                except Exception as e:
                    # fail the requests in flight, free them, and keep serving the next ones
                    logger.exception(
                        "engine step failed; failing %d request(s)", len(self._tracked)
                    )
                    self._fail_all(e)
                    if self.engine.has_unfinished_requests():
                        raise
                if (
                    self.log_stats_interval
                    and time.monotonic() - last_log >= self.log_stats_interval
                ):
                    last_log, last_tokens = self._log_stats(last_log, last_tokens)
        except BaseException as e:  # fail every request, then stop
            logger.exception("the engine loop crashed")
            self._dead = e
        finally:
            self._fail_pending_commands()
        if self._dead is not None and self.on_dead is not None:
            self._notify(self.on_dead, self._dead)

    def _expire(self, now: float) -> None:
        expired = [rid for rid, t in self._tracked.items() if now >= t.deadline]
        for rid in expired:
            if rid in self.engine.requests:
                self.engine.abort_request(rid)
            self._finish_aborted(rid, now)
        if expired:
            logger.warning("%d request(s) ran past --request-timeout and were aborted", len(expired))
            err = RequestTimeoutError(
                f"the request did not finish within the server's request timeout "
                f"({self.request_timeout:g}s) and was aborted"
            )
            self._publish_stats()
            self._post([(rid, err) for rid in expired])

    def _finish_aborted(self, rid: str, now: float, reason: str = "abort",
                        num_tokens: int | None = None) -> None:
        tracked = self._tracked.pop(rid, None)
        if tracked is not None:
            tracked.stats.finished = now
            tracked.stats.finish_reason = reason
            tracked.stats.num_generation_tokens = tracked.tokens if num_tokens is None else num_tokens
            self._notify(self.listener.on_request_done, tracked.stats)

    def _fail_all(self, exc: BaseException) -> None:
        err = EngineStepError(f"the engine failed while running this request: {exc!r}")
        rids = list(self._tracked)
        for rid in rids:
            if rid in self.engine.requests:
                self.engine.abort_request(rid)
            self._tracked.pop(rid, None)
        self._publish_stats()
        self._post([(rid, err) for rid in rids])

    def _drain_commands(self) -> None:
        done: list[tuple[concurrent.futures.Future, Any, BaseException | None]] = []
        crash: BaseException | None = None
        adds_taken = 0
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt, params, arrival, lora_request, fut = cmd
                adds_taken += 1
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    self.engine.add_request(rid, prompt, params, lora_request)
                except Exception as e:  # noqa: BLE001 - goes back to the caller
                    done.append((fut, None, e))
                else:
                    seqs = self.engine.requests.get(rid) or []
                    n_prompt = seqs[0].num_prompt_tokens if seqs else 0
                    self._tracked[rid] = _Tracked(
                        RequestStats(
                            rid,
                            arrival,
                            num_prompt_tokens=n_prompt,
                            max_tokens=params.max_tokens,
                            n=getattr(params, "n", 1),
                        ),
                        deadline=arrival + (self.request_timeout or math.inf),
                    )
                    done.append((fut, None, None))
                    if faults.ACTIVE and seqs and faults.hits("engine_loop", seqs[0].prompt):
                        crash = faults.InjectedFault("the engine loop failed (TIANXIA_FAULT_INJECT)")
            elif kind == "abort":  # ("abort", rid[, finish reason, generated tokens])
                rid = cmd[1]
                if rid in self.engine.requests:
                    self.engine.abort_request(rid)
                    logger.debug("aborted %s", rid)
                self._finish_aborted(rid, time.monotonic(), *cmd[2:])
            elif kind == "stop_choice":  # ("stop_choice", rid, index)
                if cmd[1] in self.engine.requests:
                    self.engine.stop_choice(cmd[1], cmd[2])
            elif kind == "call":
                _, fn, fut = cmd
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    done.append((fut, fn(self.engine), None))
                except Exception as e:  # noqa: BLE001 - goes back to the caller
                    done.append((fut, None, e))
        self._publish_stats(adds_taken)  # before answering, so that a new request counts as waiting
        for fut, result, exc in done:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        if crash is not None:
            raise crash

    def _notify(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception:  # pragma: no cover - a listener bug must not stop the engine
            logger.exception("stats listener failed")

    def _step(self) -> None:
        t0 = time.monotonic()
        deltas = self.engine.step_deltas()
        now = time.monotonic()
        sched = self.engine.last_applied
        self.num_steps += 1
        if sched is not None:
            scheduled = sched.scheduled
            num_seqs = len(scheduled)
            num_tokens = sum(n for _, n in scheduled)
            num_decodes = sum(1 for _, n in scheduled if n == 1)
            for seq, _ in scheduled:
                tracked = self._tracked.get(seq.request_id)
                if tracked is not None and tracked.stats.scheduled is None:
                    tracked.stats.scheduled = t0
            if num_seqs:
                self.max_step_seqs = max(self.max_step_seqs, num_seqs)
                self._notify(
                    self.listener.on_step, StepStats(num_seqs, num_tokens, num_decodes, now - t0)
                )
                logger.debug(
                    "step %d at %.4f: %d seqs (%d decodes), %d tokens, %.1f ms",
                    self.num_steps,
                    t0,
                    num_seqs,
                    num_decodes,
                    num_tokens,
                    (now - t0) * 1000,
                )
        batch: list[tuple[str, Any]] = []
        failed = self.engine.failed
        for delta in deltas:
            rid = delta.request_id
            error = failed.get(rid) if failed else None
            if error is None:
                item = delta
            elif error.invalid_request:
                item = RequestUnsatisfiableError(error.message)
            else:
                item = RequestFailedError(f"the request failed: {error.message}")
            batch.append((rid, item))
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            st = tracked.stats
            if st.scheduled is None:
                st.scheduled = t0
            tokens = tracked.tokens
            for c in delta.choices:
                tokens += len(c.new_token_ids)
            if tokens > tracked.tokens:
                if st.first_token is None:
                    st.first_token = now
                    self._notify(self.listener.on_first_token, now - st.arrival)
                else:
                    self._notify(
                        self.listener.on_inter_token, now - st.last_token, tokens - tracked.tokens
                    )
                st.last_token = now
                tracked.tokens = tokens
            if delta.finished:
                del self._tracked[rid]
                st.finished = now
                st.num_generation_tokens = tokens
                reasons = [c.finish_reason for c in delta.choices if c.finish_reason]
                st.finish_reason = reasons[0] if reasons else None
                self._notify(self.listener.on_request_done, st)
        self._publish_stats()
        self._post(batch)

    def _fail_pending_commands(self) -> None:
        err = EngineDeadError(
            "the engine stopped" + (f" after a fault ({self._dead!r})" if self._dead else "")
        )
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            fut = cmd[-1] if cmd[0] in ("add", "call") else None
            if cmd[0] == "add":
                with self._count_lock:
                    self._pending_adds -= 1
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        # requests still in the engine get a final error so that no consumer hangs
        self._post([(rid, err) for rid in list(self._tracked)])

    def _log_stats(
        self, last_log: float, last_tokens: tuple[int, int]
    ) -> tuple[float, tuple[int, int]]:
        now = time.monotonic()
        s = self._snapshot
        tokens = (int(s.get("prompt_tokens", 0)), int(s.get("generation_tokens", 0)))
        dt = max(now - last_log, 1e-6)
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
            "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, "
            "prefix cache hit rate: %.1f%%",
            (tokens[0] - last_tokens[0]) / dt,
            (tokens[1] - last_tokens[1]) / dt,
            s.get("num_running", 0),
            s.get("num_waiting", 0),
            100 * s.get("kv_cache_usage", 0.0),
            100 * s.get("prefix_cache_hits", 0) / max(1, s.get("prefix_cache_queries", 0)),
        )
        return now, tokens
