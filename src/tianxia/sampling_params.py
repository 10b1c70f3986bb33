"""Sampling parameters, with vLLM's names and meanings, validated when they are created."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request.

    ``temperature=0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``stop`` strings end the
    output and are not included in the text unless ``include_stop_str_in_output``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop = [self.stop]
        else:
            self._stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, rule: str, value: object) -> None:
            raise ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "an integer >= 1", self.n)
        if self.n != 1:
            fail("n", "1 (n > 1 is not supported yet)", self.n)
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", "in [0, 100]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "0 or -1 (disabled) or a positive integer", self.top_k)
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "an integer or None", self.seed)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1 or None", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if any(not isinstance(s, str) or not s for s in self._stop):
            fail("stop", "a list of non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop
