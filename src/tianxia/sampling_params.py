"""Sampling parameters with vLLM's names and meanings, validated when they are created.

Every invalid value raises ``ValueError`` naming the field and its allowed range, so the server can
turn it into a 400 with ``param`` set.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass, field
from typing import Any

from tianxia.structured.backend import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_N = 256
MAX_LOGPROBS = 20
MAX_STOP = 64
# each generated token is checked against every stop string, and the longest one sets how much
# streamed text is held back: both stay small
MAX_STOP_LEN = 512


@dataclass
class SamplingParams:
    """How to sample one request (see vLLM's ``SamplingParams``).

    ``temperature=0`` is greedy. ``top_k`` of 0 or -1 disables top-k. Penalties follow vLLM:
    presence and frequency penalties count output tokens only; the repetition penalty counts prompt
    and output tokens (logits > 0 are divided by it, others multiplied). ``stop`` strings end the
    output and are left out of the text unless ``include_stop_str_in_output``. ``logprobs=k``
    returns, for each generated token, the top-k log-probabilities plus the chosen token's, taken
    from the model's raw distribution (before penalties and temperature).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_shapes()
        self._stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers ({e})") from None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        self._validate()

    def _check_shapes(self) -> None:
        """Containers of the wrong kind fail here, before they are iterated or converted."""
        kinds: dict[str, tuple[type, ...]] = {
            "stop": (str, list, tuple),
            "stop_token_ids": (list, tuple),
            "allowed_token_ids": (list, tuple),
            "bad_words": (list, tuple),
            "logit_bias": (dict,),
            "structured_outputs": (dict, StructuredOutputsParams),
        }
        for name, allowed in kinds.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, allowed):
                names = " or ".join("a list" if t in (list, tuple) else f"a {t.__name__}"
                                    for t in allowed if t is not tuple)
                raise ValueError(f"{name} must be {names}, got {type(value).__name__}")

    def _validate(self) -> None:
        def fail(name: str, rule: str, value: object) -> None:
            shown = repr(value)
            if len(shown) > 200:  # the message goes back to the client: do not echo megabytes
                shown = shown[:200] + "..."
            raise ValueError(f"{name} must be {rule}, got {shown}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            fail("n", f"an integer in [1, {MAX_N}]", self.n)
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            fail("temperature", "in [0, 100]", self.temperature)
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]", self.top_p)
        if not is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "-1 or 0 (disabled) or a positive integer", self.top_k)
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2.0 <= value <= 2.0:
                fail(name, "in [-2, 2]", value)
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", "in (0, 2]", self.repetition_penalty)
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            fail("seed", "a 64-bit integer or None", self.seed)
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1 or None", self.max_tokens)
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if len(self._stop) > MAX_STOP or any(
            not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LEN for s in self._stop
        ):
            fail("stop", f"a list of at most {MAX_STOP} non-empty strings of at most {MAX_STOP_LEN} "
                 "characters", self.stop)
        if len(self.stop_token_ids) > MAX_STOP or any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", f"a list of at most {MAX_STOP} non-negative integers", self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"an integer in [0, {MAX_LOGPROBS}] or None", value)
        if self.logit_bias:
            if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
                fail("logit_bias", "values in [-100, 100]", self.logit_bias)
            if any(k < 0 for k in self.logit_bias):
                fail("logit_bias", "keys that are non-negative token ids", self.logit_bias)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(not is_int(t) or t < 0 for t in self.allowed_token_ids):
                fail("allowed_token_ids", "a non-empty list of non-negative token ids", self.allowed_token_ids)
        if self.bad_words is not None and (len(self.bad_words) > MAX_STOP or any(
            not isinstance(w, str) or not 0 < len(w) <= MAX_STOP_LEN for w in self.bad_words
        )):
            fail("bad_words", f"a list of at most {MAX_STOP} non-empty strings of at most "
                 f"{MAX_STOP_LEN} characters", self.bad_words)
        if not self.detokenize and self._stop:
            fail("detokenize", "True when stop strings are used", self.detokenize)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids given by the user must exist in the model's vocabulary."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    def without_text(self) -> SamplingParams:
        """These parameters with no stop strings and ``detokenize`` off: what decides tokens is
        unchanged, so they are not checked again (a served request's copy, made per request)."""
        out = copy.copy(self)
        out.stop, out._stop, out.detokenize = None, [], False
        return out

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass
class BeamSearchParams:
    """Beam search, as in vLLM's offline ``LLM.beam_search``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_N:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_N}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError("temperature must be 0 for beam search")
