"""Token-level state for the tianxia backends: prompts are token ids that start with exactly the
ids the engine saw in the state's earlier calls, so its prefix cache finds their KV blocks and
each call prefills only the new text.

A state remembers ``TokenCache(text, ids)``: the ids of the prompt it last sent (plus, in-process,
the generated ids whose text the state kept). The next prompt is ``ids`` followed by the tokens of
the text appended since; text appended between two calls is tokenized together, so only the
boundaries of model calls can tokenize differently from tokenizing the whole text at once.
"""

from __future__ import annotations

import threading

from tianxia.lang.backend.base import BaseBackend, TokenCache

_KEY = "tokens"
_DECODE_TRIES = 24


class TokenStateBackend(BaseBackend):
    block_size = 16
    bos_token: str | None = None
    bos_token_id: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self._tok_lock = threading.Lock()

    # subclasses: the model's tokenizer
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        """Decode keeping special tokens (so ids and text stay in one-to-one correspondence)."""
        raise NotImplementedError

    # --- the state's tokens -------------------------------------------------------------------

    def encode_text(self, text: str, first: bool) -> list[int]:
        """Tokens of ``text``; at the start of a state, with the tokenizer's special tokens (BOS)
        unless the text already starts with the BOS text (a chat template renders it)."""
        add = first and not (self.bos_token and text.startswith(self.bos_token))
        with self._tok_lock:
            return self._encode(text, add)

    def prompt_ids(self, s) -> tuple[list[int], int]:
        """The prompt for the state's whole text, and how many of its leading ids the engine has
        already seen (their KV blocks are likely still cached)."""
        cache: TokenCache | None = s.backend_state.get(_KEY)
        text = s.text_
        if cache is not None and text.startswith(cache.text):
            ids, pending = list(cache.ids), text[len(cache.text) :]
        else:
            ids, pending = [], text
        known = len(ids)
        if pending:
            ids += self.encode_text(pending, first=not ids)
        if not ids:
            if self.bos_token_id is None:
                raise ValueError("cannot call the model on an empty state: append some text first")
            ids = [self.bos_token_id]
        return ids, known

    @staticmethod
    def remember(s, text: str, ids: list[int]) -> None:
        s.backend_state[_KEY] = TokenCache(text, tuple(ids))

    @staticmethod
    def known_tokens(s) -> int:
        cache: TokenCache | None = s.backend_state.get(_KEY)
        return len(cache.ids) if cache is not None and s.text_.startswith(cache.text) else 0

    def remember_output(
        self, s, prompt_text: str, prompt_ids: list[int], out_ids: list[int], comp: str
    ) -> None:
        """After a call that returned ``comp`` (appended to the state's text) from ``out_ids``:
        remember the prompt plus the longest run of output ids whose text begins ``comp``. The
        rest of ``comp`` (after a stop string cut a token, say) is tokenized with the next text.
        An EOS or other special token is never kept: the text does not contain it."""
        keep = 0
        if out_ids:
            context = list(prompt_ids[-4:])
            with self._tok_lock:
                base = self._decode(context)
                lengths = range(len(out_ids), max(-1, len(out_ids) - _DECODE_TRIES), -1)
                for k in lengths:
                    full = self._decode(context + list(out_ids[:k]))
                    if full.startswith(base) and comp.startswith(full[len(base) :]):
                        keep = k
                        text = full[len(base) :]
                        break
        if keep:
            self.remember(s, prompt_text + text, list(prompt_ids) + list(out_ids[:keep]))
        else:
            self.remember(s, prompt_text, prompt_ids)
