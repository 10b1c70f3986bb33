"""What a backend does for the interpreter."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tianxia.lang.chat_template import DEFAULT, ChatTemplate
from tianxia.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from tianxia.lang.ir import SglSamplingParams


@dataclass
class TokenUsage:
    """Tokens a backend's calls used (SGLang's ``backend.token_usage``), summed over its gens."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, meta: dict[str, Any]) -> None:
        with self._lock:  # the states of a batch or of forks finish on their own threads
            self.prompt_tokens += meta.get("prompt_tokens") or 0
            self.completion_tokens += meta.get("completion_tokens") or 0

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = 0


_USAGE_LOCK = threading.Lock()


class BaseBackend:
    is_chat_model = False
    support_concate_and_append = False

    def __init__(self) -> None:
        self._token_usage = TokenUsage()

    @property
    def token_usage(self) -> TokenUsage:
        # Created on first use too: a subclass whose __init__ skips super() still counts tokens.
        usage = self.__dict__.get("_token_usage")
        if usage is None:
            with _USAGE_LOCK:
                usage = self.__dict__.setdefault("_token_usage", TokenUsage())
        return usage

    def get_chat_template(self) -> ChatTemplate:
        return DEFAULT

    def get_model_name(self) -> str:
        return type(self).__name__

    def cache_prefix(self, prefix_str: str) -> None:
        """Prefill a text that many programs will start with (run_batch calls it)."""

    def commit_lazy_operations(self, s) -> None:
        """Prefill the state's text so far (before a fork)."""

    def end_program(self, s) -> None:
        """A state is done."""

    def generate(self, s, sampling_params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def generate_stream(self, s, sampling_params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        comp, meta = self.generate(s, sampling_params)
        yield comp, meta

    def select(
        self, s, choices: list[str], temperature: float, choices_method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        raise NotImplementedError(f"{type(self).__name__} does not support select")

    def flush_cache(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass


@dataclass(frozen=True)
class TokenCache:
    """``ids`` are the tokens the engine saw for ``text``, a prefix of the state's text."""

    text: str
    ids: tuple[int, ...]
