"""Prompt lookup (n-gram) proposals: continue the longest earlier match of the context's end.

For each n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens of the
sequence (prompt and output) are searched for earlier in it; the first n that matches wins, and
the tokens that followed its latest earlier occurrence are proposed. Editing, summarising and
code tasks repeat long spans of their prompt, which this finds for no model cost.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier match of the context's end."""
        length = len(token_ids)
        if length < self.min_n + 1 or k < 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows that end before the last token: each has at least one token after it
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start : start + k]
        return []
