"""What a backend does for the interpreter."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tianxia.lang.chat_template import DEFAULT, ChatTemplate
from tianxia.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from tianxia.lang.ir import SglSamplingParams


class BaseBackend:
    is_chat_model = False
    support_concate_and_append = False

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
