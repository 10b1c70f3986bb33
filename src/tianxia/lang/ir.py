"""The expressions a program appends to its state (``s += ...``) and the sampling defaults.

The names follow SGLang's frontend (``SglGen``, ``SglSelect``, ...) so that programs and code
that inspects them read the same; see ``docs/LANG.md``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

# the regular expressions SGLang uses for gen(dtype=...)
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

# fields a gen() may override; None means "use the program's default"
_OVERRIDABLE = (
    "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "dtype", "regex",
    "json_schema",
)


@dataclasses.dataclass
class SglSamplingParams:
    """Sampling parameters of one ``gen``: SGLang's names and defaults (``max_new_tokens=128``,
    ``temperature=1.0``). ``run(...)`` sets the program's defaults; ``gen(...)`` overrides them."""

    max_new_tokens: int | None = 128
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | tuple = ()
    stop_token_ids: list[int] | tuple | None = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    # constrained generation
    dtype: Any = None
    regex: str | None = None
    json_schema: str | dict | None = None

    def clone(self) -> SglSamplingParams:
        return dataclasses.replace(
            self,
            stop=list(self.stop) if isinstance(self.stop, (list, tuple)) else self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
        )

    def merged(self, override: SglSamplingParams) -> SglSamplingParams:
        """These defaults with every field that ``override`` sets (is not None)."""
        out = self.clone()
        for name in _OVERRIDABLE:
            value = getattr(override, name, None)
            if value is not None:
                setattr(out, name, value)
        return out

    @property
    def stop_list(self) -> list[str]:
        if not self.stop:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def resolve_dtype(self) -> None:
        """gen(dtype=int/float/str/bool) becomes a regex (and, for numbers, stop strings), as in
        SGLang's runtime backend."""
        if self.dtype is None:
            return
        stops = self.stop_list
        if self.dtype in (int, "int"):
            self.regex = REGEX_INT
            self.stop = stops + [" ", "\n"]
        elif self.dtype in (float, "float"):
            self.regex = REGEX_FLOAT
            self.stop = stops + [" ", "\n"]
        elif self.dtype in (str, "str", "string"):
            self.regex = REGEX_STR
        elif self.dtype in (bool, "bool"):
            self.regex = REGEX_BOOL
        else:
            raise ValueError(f"gen(dtype=...) must be int, float, str or bool, got {self.dtype!r}")
        self.dtype = None

    def json_schema_str(self) -> str | None:
        if self.json_schema is None:
            return None
        if isinstance(self.json_schema, str):
            return self.json_schema
        return json.dumps(self.json_schema)

    def json_schema_obj(self) -> dict | None:
        if self.json_schema is None:
            return None
        if isinstance(self.json_schema, str):
            return json.loads(self.json_schema)
        return dict(self.json_schema)

    def to_openai_kwargs(self) -> dict[str, Any]:
        """The body fields of an OpenAI-compatible ``/v1/completions`` request (vLLM's extras
        only where they are set, so that strict servers are not sent fields they reject)."""
        body: dict[str, Any] = {
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.stop_list:
            body["stop"] = self.stop_list
        if self.frequency_penalty:
            body["frequency_penalty"] = self.frequency_penalty
        if self.presence_penalty:
            body["presence_penalty"] = self.presence_penalty
        if self.top_k is not None and self.top_k > 0:
            body["top_k"] = self.top_k
        if self.min_p:
            body["min_p"] = self.min_p
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.min_new_tokens:
            body["min_tokens"] = self.min_new_tokens
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        if self.regex is not None:
            body["guided_regex"] = self.regex
        if self.json_schema is not None:
            body["guided_json"] = self.json_schema_obj()
        return body


class SglExpr:
    """Anything that can be appended to a state. ``a + b`` builds an :class:`SglExprList`."""

    def __add__(self, other: Any) -> SglExprList:
        return _concat(self, _as_expr(other))

    def __radd__(self, other: Any) -> SglExprList:
        return _concat(_as_expr(other), self)


def _as_expr(x: Any) -> SglExpr:
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    raise TypeError(f"cannot append {type(x).__name__} to a program state (use str or gen/select)")


def _concat(a: SglExpr, b: SglExpr) -> SglExprList:
    left = a.expr_list if isinstance(a, SglExprList) else [a]
    right = b.expr_list if isinstance(b, SglExprList) else [b]
    return SglExprList(left + right)


class SglExprList(SglExpr):
    def __init__(self, expr_list: list[SglExpr]) -> None:
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglGen(SglExpr):
    def __init__(self, name: str | None, sampling_params: SglSamplingParams) -> None:
        self.name = name
        self.sampling_params = sampling_params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    def __init__(self, name: str | None, choices: list[str], temperature: float, choices_method) -> None:
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str) -> None:
        self.name = name


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str) -> None:
        self.name = name


class SglCommitLazy(SglExpr):
    """Prefill the state so far (before a fork, so the forks share its KV cache)."""


class SglConcateAndAppend(SglExpr):
    def __init__(self, states: list) -> None:
        self.states = states


class SglFunction:
    """A program: ``@function def prog(s, arg, ...)``. Call :meth:`run` or :meth:`run_batch`."""

    def __init__(
        self,
        func: Callable,
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = bind_arguments or {}
        spec = inspect.getfullargspec(func)
        if not spec.args or spec.args[0] != "s":
            raise TypeError('the first argument of a @function program must be named "s"')
        self.arg_names = spec.args[1:]
        self.arg_defaults = spec.defaults or ()
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__}() has no arguments {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        stream: bool = False,
        backend=None,
        **kwargs: Any,
    ):
        """Run the program once; returns its :class:`~tianxia.lang.interpreter.ProgramState`.

        With ``stream=True`` it returns at once and ``state.text_iter()`` yields text as it is
        generated."""
        from tianxia.lang.interpreter import run_program

        defaults = SglSamplingParams(
            max_new_tokens=max_new_tokens, stop=stop or (), stop_token_ids=stop_token_ids or (),
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
        )
        return run_program(self, backend, args, kwargs, defaults, stream)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[tuple],
        *,
        max_new_tokens: int = 128,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        backend=None,
        num_threads: str | int = "auto",
        progress_bar: bool = False,
    ):
        """Run the program once per argument dict (or tuple), ``num_threads`` at a time; the
        states come back in order. Concurrent programs are batched together by the engine."""
        from tianxia.lang.interpreter import run_program_batch

        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts")
        if not batch_kwargs:
            return []
        if not isinstance(batch_kwargs[0], dict):
            required = len(self.arg_names) - len(self.arg_defaults)
            converted = []
            for values in batch_kwargs:
                if not isinstance(values, (list, tuple)) or not required <= len(values) <= len(self.arg_names):
                    raise TypeError(f"arguments {values!r} do not match {self.__name__}{self.arg_names}")
                converted.append(dict(zip(self.arg_names, values)))
            batch_kwargs = converted
        defaults = SglSamplingParams(
            max_new_tokens=max_new_tokens, stop=stop or (), stop_token_ids=stop_token_ids or (),
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
        )
        return run_program_batch(self, backend, list(batch_kwargs), defaults, num_threads, progress_bar)

    def __call__(self, *args: Any, **kwargs: Any):
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"SglFunction({self.__name__})"


def check_regex(regex: str | None) -> None:
    if regex is not None:
        re.compile(regex)
