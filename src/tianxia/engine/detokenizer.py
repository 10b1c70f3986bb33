"""Incremental detokenization and stop strings.

Each step decodes only a short window of tokens: the text of ``ids[prefix:read]`` is already known,
so the new text is ``decode(ids[prefix:])`` minus it. A window that ends in U+FFFD is an unfinished
multi-byte character (byte-fallback or split UTF-8) and is held back until the next token
completes it, so streamed deltas never carry broken characters.

With a fast tokenizer whose decode is the Rust tokenizer's own, the same window runs inside
``tokenizers``' ``DecodeStream`` (one call per token instead of two decodes and two list slices
here; vLLM's fast detokenizer does the same). The token ids and window offsets are still kept
here, for the end of a sequence and for a stream that gives up.
"""

from __future__ import annotations

from typing import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# Tokens decoded before the new ones, so that leading-space rules (SentencePiece) come out right.
_CONTEXT_TOKENS = 5

Decode = Callable[[list[int], bool], str]


def rust_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer under ``tokenizer`` where its decode gives the same text as
    transformers' wrapper (a fast tokenizer whose class keeps the base decode and does no
    clean-up), else None."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and type(tokenizer)._decode is TokenizersBackend._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return backend
    return None


def fast_decode(tokenizer: PreTrainedTokenizerBase) -> Decode:
    """``decode(ids, skip_special_tokens)``: the Rust tokenizer's own decode where it gives the
    same text, which skips the wrapper's argument conversion (a few microseconds a call, which
    per generated token add up to a tenth of a large batch's step on a GPU)."""
    backend = rust_tokenizer(tokenizer)
    if backend is not None:
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
        backend: Tokenizer | None = None,
    ) -> None:
        """``backend``: :func:`rust_tokenizer` of ``tokenizer`` (None: decode in Python)."""
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
        self.backend = backend
        self.stream: DecodeStream | None = None
        # a context that ends inside a character is a window DecodeStream splits otherwise
        if backend is not None and enabled and not (
                self.ids and self._decode(self.ids).endswith("\ufffd")):
            try:
                self.stream = DecodeStream(ids=self.ids, skip_special_tokens=skip_special_tokens)
            except TypeError:  # tokenizers before 0.22 take no context
                pass

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, self.skip_special)

    def append(self, token_id: int) -> str | None:
        """Add one token; returns the stop string if the text now contains one."""
        if not self.enabled:
            return None
        self.ids.append(token_id)
        if self.stream is not None:
            try:
                new = self.stream.step(self.backend, token_id)
            except Exception:  # noqa: BLE001 - the Python window below takes over from here
                self.stream = None
            else:
                if new is None:
                    return None
                return self._take(new)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            return self._take(full[len(prefix) :])
        return None

    def _take(self, new: str) -> str | None:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        start = max(0, len(self.text) - self.stop_hold)
        self.text += new
        return self._check_stop(start)

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
