"""What the API process and an engine core process say to each other, over ZeroMQ in msgpack.

Only data crosses: request ids, prompts (token ids, text), sampling parameters as their fields,
new token ids, finish reasons, statistics; never text the core decoded (it decodes none: see
``output_processor``). To the core, plain tuples (``("add", rid, prompt, params, arrival,
adapter, client)``, ``("abort", rid[, finish reason, generated tokens])``, ``("stop_choice",
rid, index)`` (one choice of ``n > 1`` met a stop string), ``("utility", call_id,
name, args, client)``, ``("shutdown",)``; ``client`` is the sending API process's index, where the
core sends the answer); from the core, the tagged structs below, decoded into their types by one
typed decoder.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import msgspec

from tianxia.engine.async_engine import RequestStats, StepStats
from tianxia.engine.output_processor import RequestDelta
from tianxia.sampling_params import SamplingParams


class Ready(msgspec.Struct, tag=True):
    """The engine is loaded and warmed up; ``facts`` are :meth:`EngineInfo.facts`."""

    facts: dict[str, Any]


class StartupFailed(msgspec.Struct, tag=True):
    """Loading failed; ``error`` is the pickled exception (for the same one-line CLI error)."""

    error: bytes
    text: str


class Outputs(msgspec.Struct, tag=True, omit_defaults=True):
    """Everything one engine-loop turn produced, in one message."""

    outputs: list[RequestDelta] = []
    # request id, error class name (``async_engine``'s), message
    errors: list[tuple[str, str, str]] = []
    # request id, error message (None: accepted), whether it is a ValueError (a 400)
    acks: list[tuple[str, str | None, bool]] = []
    # call id, result, error message, whether it is a ValueError (a 400)
    replies: list[tuple[int, Any, str | None, bool]] = []
    steps: list[StepStats] = []
    first_tokens: list[float] = []
    inter_tokens: list[tuple[float, int]] = []
    done: list[RequestStats] = []
    # counters; per-position ones as lists (speculative decoding's accepted tokens per position)
    # and LoRA's: the adapters in use (a comma-separated text), requests per adapter
    stats: dict[str, int | float | list[float] | str | dict[str, int]] | None = None
    max_step_seqs: int = 0


class Dead(msgspec.Struct, tag=True):
    """The engine loop crashed; the core exits after sending this."""

    reason: str


FromCore = Union[Ready, StartupFailed, Outputs, Dead]

encoder = msgspec.msgpack.Encoder()
from_core = msgspec.msgpack.Decoder(FromCore)
to_core = msgspec.msgpack.Decoder()


def params_fields(params: SamplingParams) -> dict[str, Any]:
    """The constructor arguments of ``params`` (the core builds and validates it again)."""
    out = {}
    for f in dataclasses.fields(params):
        if f.init:
            value = getattr(params, f.name)
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out
