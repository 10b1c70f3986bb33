"""Runs programs: one executor thread per state, so ``s += gen(...)`` returns at once, forks run
in parallel, and ``s["name"]`` waits for the value.

A state keeps its text (``text_``), its chat messages, its variables, and a slot
(``backend_state``) where the backend keeps what it knows about that text: for the tianxia
backends, the token ids the engine has already seen for a prefix of it, so that the next call
sends exactly those ids followed by the tokens of the new text, and the engine's prefix cache
finds the earlier calls' KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from typing_extensions import Self

from tianxia.lang.ir import (
    SglCommitLazy,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglFunction,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglVarScopeBegin,
    SglVarScopeEnd,
)

logger = logging.getLogger(__name__)


class _GlobalConfig:
    default_backend = None
    # before run_batch, prefill the text all programs share (found by running the first two
    # programs up to their first model call, without calling the model)
    enable_precache_with_tracing = True
    precache_min_chars = 64


global_config = _GlobalConfig()


def set_default_backend(backend) -> None:
    global_config.default_backend = backend


class _StopTrace(Exception):
    """Raised inside a traced program at its first model call."""


class StreamExecutor:
    """Executes the expressions appended to one state, in order, on its own thread."""

    def __init__(
        self,
        backend,
        arguments: dict[str, Any],
        default_sampling_para: SglSamplingParams,
        chat_template=None,
        stream: bool = False,
        use_thread: bool = True,
        tracing: bool = False,
    ) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.stream = stream
        self.tracing = tracing

        self.variables: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self.is_finished = False
        self.error_: BaseException | None = None

        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.chat_template = chat_template or backend.get_chat_template()
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos: int | None = None
        # what the backend knows about this text (token ids already sent to the engine)
        self.backend_state: dict[str, Any] = {}

        self.stream_text_event = threading.Event() if stream else None
        self.stream_var_event: dict[str, threading.Event] | None = {} if stream else None

        self.use_thread = use_thread
        self._ended = False
        if use_thread:
            self.queue: queue.Queue = queue.Queue()
            self.worker = threading.Thread(target=self._worker, name=f"sgl-{self.sid[:8]}", daemon=True)
            self.worker.start()

    # --- submission ---------------------------------------------------------------------------

    def submit(self, expr: SglExpr | str) -> None:
        self._init_var_event(expr)
        if self.use_thread:
            self.queue.put(expr)
        else:
            self._execute(expr)

    def sync(self) -> None:
        if self.use_thread:
            self.queue.join()

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self.use_thread:
            self.queue.put(None)
        try:
            self.backend.end_program(self)
        except Exception:
            logger.debug("end_program failed", exc_info=True)

    def _worker(self) -> None:
        while True:
            expr = self.queue.get()
            if expr is None:
                self.queue.task_done()
                break
            if self.error_ is None:
                try:
                    self._execute(expr)
                except BaseException as e:
                    logger.warning("program error in %s: %r", self.sid[:8], e, exc_info=True)
                    self.error_ = e
                    for event in self.variable_event.values():
                        event.set()
                    for event in (self.stream_var_event or {}).values():
                        event.set()
            self.queue.task_done()
            if self.stream_text_event is not None:
                self.stream_text_event.set()
        self.is_finished = True
        if self.stream_text_event is not None:
            self.stream_text_event.set()

    # --- variables ----------------------------------------------------------------------------

    def get_var(self, name: str) -> Any:
        if self.tracing and name not in self.variables:
            raise _StopTrace
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name not in self.variables:
            if self.error_ is not None:
                raise RuntimeError(f"the program failed before setting {name!r}: {self.error_!r}") from self.error_
            raise KeyError(name)
        return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def get_meta_info(self, name: str, timeout: float | None = None) -> Any:
        event = self.variable_event.get(name)
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"timed out waiting for {name!r}")
        return self.meta_info.get(name)

    def _init_var_event(self, expr: Any) -> None:
        if isinstance(expr, (SglGen, SglSelect, SglVarScopeBegin)):
            self.variable_event[expr.name] = threading.Event()
            if self.stream_var_event is not None:
                self.stream_var_event[expr.name] = threading.Event()
        elif isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._init_var_event(e)

    # --- fork ---------------------------------------------------------------------------------

    def fork(self, size: int = 1) -> list[StreamExecutor]:
        if self.tracing:
            raise _StopTrace
        size = int(size)
        if size > 1:
            self.submit(SglCommitLazy())  # prefill once; the forks then share its KV blocks
        self.sync()
        children = []
        for _ in range(size):
            child = StreamExecutor(
                self.backend, self.arguments, self.default_sampling_para, self.chat_template,
                self.stream,
            )
            child.variables = dict(self.variables)
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.fork_start_text_pos = len(self.text_)
            child.backend_state = dict(self.backend_state)
            children.append(child)
        return children

    # --- reading ------------------------------------------------------------------------------

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return self.messages_

    def error(self) -> BaseException | None:
        self.sync()
        return self.error_

    # --- execution ----------------------------------------------------------------------------

    def _execute(self, expr: Any) -> None:
        if isinstance(expr, str):
            expr = SglConstantText(expr)
        if isinstance(expr, SglConstantText):
            self._fill(expr.value)
        elif isinstance(expr, SglGen):
            self._gen(expr)
        elif isinstance(expr, SglSelect):
            self._select(expr)
        elif isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._execute(e)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self.variables[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            self.variables[expr.name] = self.text_[self.variables[expr.name] :]
            self.variable_event[expr.name].set()
        elif isinstance(expr, SglCommitLazy):
            if self.tracing:
                raise _StopTrace
            self.backend.commit_lazy_operations(self)
        elif isinstance(expr, SglConcateAndAppend):
            text = ""
            for state in expr.states:
                ex = state.stream_executor
                ex.sync()
                text += ex.text_[ex.fork_start_text_pos :]
            self._fill(text)
        else:
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")

    def _fill(self, value: Any) -> None:
        self.text_ += str(value)

    def _resolve_sampling_params(self, override: SglSamplingParams) -> SglSamplingParams:
        params = self.default_sampling_para.merged(override)
        if self.chat_template.stop_str:
            params.stop = params.stop_list + [s for s in self.chat_template.stop_str if s not in params.stop_list]
        params.resolve_dtype()
        return params

    def _gen(self, expr: SglGen) -> None:
        if self.tracing:
            raise _StopTrace
        params = self._resolve_sampling_params(expr.sampling_params)
        if params.n not in (None, 1):
            raise ValueError("gen(n=...) is not supported; use s.fork(n) for parallel samples")
        name = expr.name
        if not self.stream:
            comp, meta = self.backend.generate(self, params)
            self.text_ += comp
            self.variables[name] = comp
            self.meta_info[name] = meta
            self.backend.token_usage.add(meta)
            self.variable_event[name].set()
            return
        self.variables[name] = ""
        self.stream_var_event[name].set()
        for delta, meta in self.backend.generate_stream(self, params):
            self.meta_info[name] = meta  # first: a reader that sees the text finds its meta info
            self.text_ += delta
            self.variables[name] += delta
            self.stream_var_event[name].set()
            self.stream_text_event.set()
        self.backend.token_usage.add(self.meta_info.get(name) or {})
        self.variable_event[name].set()
        self.stream_var_event[name].set()

    def _select(self, expr: SglSelect) -> None:
        if self.tracing:
            raise _StopTrace
        if not expr.choices:
            raise ValueError("select needs at least one choice")
        if any(not isinstance(c, str) or not c for c in expr.choices):
            raise ValueError("select choices must be non-empty strings")
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        if expr.name is not None:
            self.variables[expr.name] = decision.decision
            self.meta_info[expr.name] = decision.meta_info
            self.variable_event[expr.name].set()
            if self.stream_var_event is not None:
                self.stream_var_event[expr.name].set()
        self.text_ += decision.decision

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"roles cannot nest ({role!r} inside {self.cur_role!r})")
        default_system = self.chat_template.default_system_prompt
        if not self.messages_ and role != "system" and default_system:
            self._role_begin("system")
            self._fill(default_system)
            self._role_end("system")
        self.cur_role = role
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role}_end() without {role}_begin()")
        content = self.text_[self.cur_role_begin_pos :].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
        self.cur_role_begin_pos = None


class ProgramState:
    """The ``s`` of a program: ``s += ...``, ``s["name"]``, ``s.text()``, ``s.fork(n)``."""

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    def _role_common(self, name: str, expr: Any = None):
        if expr is not None:
            role_expr = SglExprList([SglRoleBegin(name), _expr(expr), SglRoleEnd(name)])
            self.stream_executor.submit(role_expr)
            return role_expr

        @contextmanager
        def role_scope():
            self.stream_executor.submit(SglRoleBegin(name))
            yield
            self.stream_executor.submit(SglRoleEnd(name))

        return role_scope()

    def system(self, expr: Any = None):
        return self._role_common("system", expr)

    def user(self, expr: Any = None):
        return self._role_common("user", expr)

    def assistant(self, expr: Any = None):
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str):
        self.stream_executor.submit(SglVarScopeBegin(name))
        yield
        self.stream_executor.submit(SglVarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """``size`` copies of this state; each runs on its own thread, all share the KV cache of
        the text so far. Read their variables with ``forks[i]["name"]`` or :meth:`ProgramStateGroup.join`."""
        return ProgramStateGroup([ProgramState(x) for x in self.stream_executor.fork(size)], self)

    @contextmanager
    def copy(self, position_ids_offset: Any = None):
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, Any]]:
        return self.stream_executor.messages()

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        return self.stream_executor.error()

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is generated (``run(stream=True)``); without streaming, the whole text
        (or variable) at once."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        prev = 0
        if var_name is None:
            event = ex.stream_text_event
            while True:
                event.wait()
                event.clear()
                finished = ex.is_finished
                out = ex.text_[prev:]
                prev += len(out)
                if out:
                    yield out
                if finished:
                    break
            return
        while var_name not in ex.stream_var_event:
            if ex.is_finished:
                return
            ex.stream_text_event.wait(0.05)
        event = ex.stream_var_event[var_name]
        while True:
            event.wait()
            event.clear()
            done = ex.variable_event[var_name].is_set()
            out = str(ex.variables.get(var_name, ""))[prev:]
            prev += len(out)
            if out:
                yield out
            if done or ex.error_ is not None:
                break

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """:meth:`text_iter` for asyncio code (SGLang's): the waiting happens in a worker thread,
        so the event loop runs on. With ``return_meta_data``, ``(text, meta_info)`` pairs, the
        meta info of ``var_name`` as it was when the text was read."""
        loop = asyncio.get_running_loop()
        chunks = self.text_iter(var_name)
        done = object()
        while True:
            chunk = await loop.run_in_executor(None, next, chunks, done)
            if chunk is done:
                return
            if return_meta_data:
                meta = self.stream_executor.meta_info.get(var_name) if var_name else None
                yield chunk, meta
            else:
                yield chunk

    def __iadd__(self, other: Any) -> Self:
        if other is None:
            raise ValueError("tried to append None to a program state")
        self.stream_executor.submit(other)
        return self

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def __del__(self) -> None:
        try:
            self.stream_executor.end()
        except Exception:
            logger.debug("ending a state failed", exc_info=True)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


def _expr(x: Any) -> SglExpr:
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    raise TypeError(f"cannot append {type(x).__name__} to a program state")


class ProgramStateGroup:
    """The states made by ``s.fork(n)``."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState | None = None) -> None:
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for the forks. ``gather_variable``: each variable the forks made becomes, in the
        parent, the list of their values. ``concate_and_append``: the text each fork added is
        appended to the parent's text, in order."""
        if mode == "gather_variable":
            parent = self.src_state.stream_executor
            before = set(parent.variables)
            for child in self.states:
                ex = child.stream_executor
                ex.sync()
                for k in set(ex.variables) - before:
                    parent.variables.setdefault(k, []).append(ex.variables[k])
        elif mode == "concate_and_append":
            self.src_state += SglConcateAndAppend(self.states)
            self.src_state.stream_executor.sync()
        else:
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for s in self.states:
            s.stream_executor.end()

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if self.states[i] is not value:
            raise ValueError("cannot replace a fork")

    def __iadd__(self, other: Any) -> Self:
        if callable(other) and not isinstance(other, SglExpr):
            for i, s in enumerate(self.states):
                s += other(i)
        elif isinstance(other, (SglExpr, str)):
            for s in self.states:
                s += other
        elif isinstance(other, (list, tuple)):
            for s, o in zip(self.states, other):
                s += o
        else:
            raise TypeError(f"cannot append {type(other).__name__} to forks")
        return self


# --- running ----------------------------------------------------------------------------------


def _backend(backend):
    backend = backend or global_config.default_backend
    if backend is None:
        raise RuntimeError("no backend: call set_default_backend(...) or pass backend=...")
    return backend


def _run_internal(state: ProgramState, program: SglFunction, args, kwargs, sync: bool) -> None:
    ex = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except BaseException as e:
        if ex.stream and ex.error_ is None:
            ex.error_ = e
        raise
    finally:
        ex.end()
    if sync:
        ex.sync()


def run_program(
    program: SglFunction,
    backend,
    func_args: tuple,
    func_kwargs: dict[str, Any],
    default_sampling_para: SglSamplingParams,
    stream: bool,
    sync: bool = False,
) -> ProgramState:
    backend = _backend(backend)
    kwargs = {**func_kwargs, **program.bind_arguments}
    state = ProgramState(StreamExecutor(backend, kwargs, default_sampling_para, None, stream))
    if stream:

        def target() -> None:
            try:
                _run_internal(state, program, func_args, kwargs, sync)
            except BaseException:
                logger.warning("program %s failed", program.__name__, exc_info=True)

        threading.Thread(target=target, name="sgl-program", daemon=True).start()
        return state
    _run_internal(state, program, func_args, kwargs, sync)
    return state


def trace_prefix(program: SglFunction, backend, batch_kwargs: list[dict[str, Any]],
                 default_sampling_para: SglSamplingParams) -> str:
    """The text that the programs of a batch share before their first model call: the first two
    programs are run without calling the model (stopping at their first gen/select or variable
    read), and their common prefix is cut back to the last whitespace."""
    texts = []
    for kwargs in batch_kwargs[:2]:
        ex = StreamExecutor(backend, {}, default_sampling_para, None, False, use_thread=False, tracing=True)
        try:
            program.func(ProgramState(ex), **{**kwargs, **program.bind_arguments})
        except Exception:
            logger.debug("tracing stopped", exc_info=True)
        ex._ended = True
        texts.append(ex.text_)
    prefix = os.path.commonprefix(texts)
    cut = max(prefix.rfind(" "), prefix.rfind("\n"))
    return prefix[: cut + 1] if cut >= 0 else ""


def run_program_batch(
    program: SglFunction,
    backend,
    batch_arguments: list[dict[str, Any]],
    default_sampling_para: SglSamplingParams,
    num_threads: str | int,
    progress_bar: bool,
) -> list[ProgramState]:
    backend = _backend(backend)
    if global_config.enable_precache_with_tracing and len(batch_arguments) > 1:
        prefix = trace_prefix(program, backend, batch_arguments, default_sampling_para)
        if len(prefix) > global_config.precache_min_chars:
            backend.cache_prefix(prefix)
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    num_threads = max(1, min(int(num_threads), len(batch_arguments)))

    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batch_arguments), desc=program.__name__)

    def one(arguments: dict[str, Any]) -> ProgramState:
        return run_program(program, backend, (), arguments, default_sampling_para, False, True)

    try:
        if num_threads == 1:
            states = []
            for arguments in batch_arguments:
                states.append(one(arguments))
                if bar is not None:
                    bar.update(1)
            return states
        with ThreadPoolExecutor(num_threads, thread_name_prefix="sgl-batch") as pool:
            futures = []
            for arguments in batch_arguments:
                fut = pool.submit(one, arguments)
                if bar is not None:
                    fut.add_done_callback(lambda _: bar.update(1))
                futures.append(fut)
            return [f.result() for f in futures]
    finally:
        if bar is not None:
            bar.close()


__all__ = [
    "ProgramState", "ProgramStateGroup", "StreamExecutor", "global_config", "run_program",
    "run_program_batch", "set_default_backend", "trace_prefix",
]
