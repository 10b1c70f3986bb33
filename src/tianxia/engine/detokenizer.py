"""Incremental detokenization and stop strings.

Each step decodes only a short window of tokens: the text of ``ids[prefix:read]`` is already known,
so the new text is ``decode(ids[prefix:])`` minus it. A window that ends in U+FFFD is an unfinished
multi-byte character (byte-fallback or split UTF-8) and is held back until the next token
completes it, so streamed deltas never carry broken characters.
"""

from __future__ import annotations

from typing import Callable

from transformers import PreTrainedTokenizerBase

# Tokens decoded before the new ones, so that leading-space rules (SentencePiece) come out right.
_CONTEXT_TOKENS = 5

Decode = Callable[[list[int], bool], str]


def fast_decode(tokenizer: PreTrainedTokenizerBase) -> Decode:
    """``decode(ids, skip_special_tokens)``: the Rust tokenizer's own decode where transformers'
    wrapper would return the same text (a fast tokenizer whose class keeps the base decode and
    does no clean-up), which skips the wrapper's argument conversion, a few microseconds a call
    that two calls per generated token make a tenth of a large batch's step on a GPU."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and type(tokenizer)._decode is TokenizersBackend._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop: bool,
        skip_special_tokens: bool,
        enabled: bool = True,
        decode: Decode | None = None,
    ) -> None:
        self.enabled = enabled
        self.decode = decode or fast_decode(tokenizer)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.stop_hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, self.skip_special)

    def append(self, token_id: int) -> str | None:
        """Add one token; returns the stop string if the text now contains one."""
        if not self.enabled:
            return None
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            start = max(0, len(self.text) - self.stop_hold)
            self.text += new
            return self._check_stop(start)
        return None

    def _check_stop(self, start: int) -> str | None:
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1:
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                return s
        return None

    def flush(self) -> None:
        """At the end of a sequence, take whatever is held back (even an unfinished character)."""
        if self.enabled and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)

    def stable_len(self, finished: bool) -> int:
        """How many leading characters of ``text`` can no longer change: all of them once the
        sequence finished; while it runs, all but the tail that could begin a stop string."""
        if finished or not self.stop:
            return len(self.text)
        return max(0, len(self.text) - self.stop_hold)
