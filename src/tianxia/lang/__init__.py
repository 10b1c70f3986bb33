"""SGLang-style programs on tianxia: ``import tianxia.lang as sgl``.

::

    import tianxia.lang as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.Runtime("smollm2-135m"))
    state = qa.run(question="What is the capital of France?")
    print(state["answer"])

A program's state keeps the token ids the engine already saw, so each call prefills only the
text added since the last one; forks and the programs of a batch share their common prefix
through the engine's prefix cache. See ``docs/LANG.md``.
"""

from __future__ import annotations

from typing import Any

from tianxia.lang.backend.base import BaseBackend
from tianxia.lang.backend.openai import OpenAI, SelectUnsupportedError
from tianxia.lang.backend.runtime_endpoint import RuntimeEndpoint
from tianxia.lang.chat_template import ChatTemplate, get_chat_template
from tianxia.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from tianxia.lang.interpreter import (
    ProgramState,
    ProgramStateGroup,
    global_config,
    set_default_backend,
)
from tianxia.lang.ir import (
    SglExpr,
    SglExprList,
    SglFunction,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    check_regex,
)


def function(func=None, num_api_spec_tokens: int | None = None):
    """Decorate ``def program(s, ...)`` to make an :class:`SglFunction`."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)


def Runtime(*args: Any, **kwargs: Any):
    """The engine in this process (see :class:`tianxia.lang.backend.runtime.Runtime`)."""
    from tianxia.lang.backend.runtime import Runtime as _Runtime

    return _Runtime(*args, **kwargs)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: Any = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
):
    """Generate into variable ``name``; unset arguments take the program's defaults (``run(...)``).
    With ``choices`` it is :func:`select`."""
    if choices:
        return SglSelect(
            name, choices, 0.0 if temperature is None else temperature,
            choices_method or token_length_normalized,
        )
    check_regex(regex)
    return SglGen(
        name,
        SglSamplingParams(
            max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
            stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex,
            json_schema=json_schema,
        ),
    )


def gen_int(name: str | None = None, **kwargs: Any):
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any):
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
):
    """Append the choice the model finds most likely (see ``choices.py`` for the methods)."""
    if not choices:
        raise ValueError("select needs choices")
    return SglSelect(name, choices, temperature, choices_method)


def _role(name: str, expr: Any = None):
    if expr is None:
        return SglExprList([SglRoleBegin(name), SglRoleEnd(name)])
    if isinstance(expr, str):
        from tianxia.lang.ir import SglConstantText

        expr = SglConstantText(expr)
    return SglExprList([SglRoleBegin(name), expr, SglRoleEnd(name)])


def system(expr: Any = None):
    return _role("system", expr)


def user(expr: Any = None):
    return _role("user", expr)


def assistant(expr: Any = None):
    return _role("assistant", expr)


def system_begin():
    return SglRoleBegin("system")


def system_end():
    return SglRoleEnd("system")


def user_begin():
    return SglRoleBegin("user")


def user_end():
    return SglRoleEnd("user")


def assistant_begin():
    return SglRoleBegin("assistant")


def assistant_end():
    return SglRoleEnd("assistant")


def image(*args: Any, **kwargs: Any):
    raise NotImplementedError("tianxia.lang has no image inputs (tianxia runs text models)")


def video(*args: Any, **kwargs: Any):
    raise NotImplementedError("tianxia.lang has no video inputs (tianxia runs text models)")


def flush_cache(backend=None) -> bool:
    backend = backend or global_config.default_backend
    return bool(backend is not None and backend.flush_cache())


def get_server_info(backend=None):
    backend = backend or global_config.default_backend
    info = getattr(backend, "get_server_info", None)
    return info() if info is not None else None


__all__ = [
    "BaseBackend", "ChatTemplate", "ChoicesDecision", "ChoicesSamplingMethod", "OpenAI",
    "ProgramState", "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "SelectUnsupportedError",
    "SglExpr", "SglFunction", "assistant", "assistant_begin", "assistant_end", "flush_cache",
    "function", "gen", "gen_int", "gen_string", "get_chat_template", "get_server_info",
    "global_config", "greedy_token_selection", "image", "select", "set_default_backend", "system",
    "system_begin", "system_end", "token_length_normalized", "unconditional_likelihood_normalized",
    "user", "user_begin", "user_end", "video",
]
