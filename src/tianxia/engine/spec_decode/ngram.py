"""Prompt lookup (n-gram) proposals: continue the longest earlier match of the context's end.

For each n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens of the
sequence (prompt and output) are searched for earlier in it; the first n that matches wins, and
the tokens that followed its latest earlier occurrence are proposed. Editing, summarising and
code tasks repeat long spans of their prompt, which this finds for no model cost.
"""

from __future__ import annotations


class NgramIndex:
    """Where each n-gram of one sequence last ended (the position of the token after it), for
    every n the proposer matches, brought up to date as the sequence grows: a proposal costs a few
    dict reads instead of a scan of the whole context (which, at 64 sequences of a few hundred
    tokens, cost as much host time as the step itself on a GPU)."""

    __slots__ = ("ends", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # the n-grams ending at or before this position are in ``ends``

    def extend(self, token_ids: list[int]) -> None:
        """Add the n-grams that end before the last token (each has a token after it)."""
        last = len(token_ids) - 1
        if last < self.indexed:  # not the sequence it indexed: start again
            for ends in self.ends.values():
                ends.clear()
            self.indexed = 0
        for end in range(self.indexed + 1, last + 1):
            for n, ends in self.ends.items():
                if end >= n:
                    ends[tuple(token_ids[end - n : end])] = end
        self.indexed = max(self.indexed, last)


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, token_ids: list[int], k: int, index: NgramIndex | None = None) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier match of the context's end.
        ``index``: the sequence's own, kept between calls (a token list only ever grows)."""
        length = len(token_ids)
        if length < self.min_n + 1 or k < 1:
            return []
        index = index if index is not None else self.new_index()
        index.extend(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.ends[n].get(tuple(token_ids[length - n :]))
            if end is not None:
                return token_ids[end : end + k]
        return []
