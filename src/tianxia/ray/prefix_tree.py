"""Which replica most likely still holds a prompt's prefix in its KV cache.

A prefix tree over the token ids recently routed to each replica (as SGLang's router and Ray's
``PrefixCacheAffinityRouter`` keep), whose edges are blocks of ``block_size`` tokens: a replica's
prefix cache reuses whole KV blocks only, so a match shorter than a block is worth nothing. The
tree is stored flat: a node is the chained hash of its whole prefix (``hash(parent, block)``, as
the engine's prefix cache keys its blocks), mapped to the replicas that hold it. Matching and
inserting cost one hash per block. Pure Python, no Ray, so it is testable on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class PrefixTree:
    """Prompts inserted per replica; past ``max_blocks`` (replica, block) entries the least
    recently used go first, deepest first (a replica's cache evicts too, so an old match is worth
    little)."""

    def __init__(self, block_size: int = 16, max_blocks: int = 1 << 16) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._owners: dict[int, set[str]] = {}
        self._recent: OrderedDict[tuple[str, int], None] = OrderedDict()

    def _nodes(self, tokens: Sequence[int]) -> Iterator[int]:
        """The node of each full block of ``tokens``, root outwards."""
        h, bs = 0, self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            h = hash((h, tuple(tokens[start:start + bs])))
            yield h

    def insert(self, tokens: Sequence[int], replica: str) -> None:
        # deepest first: a prefix ends up more recent than its extensions, so it is forgotten
        # after them and no remembered node is cut off from the root
        for node in reversed(list(self._nodes(tokens))):
            self._owners.setdefault(node, set()).add(replica)
            self._recent[(replica, node)] = None
            self._recent.move_to_end((replica, node))
        while len(self._recent) > self.max_blocks:
            (old_replica, node), _ = self._recent.popitem(last=False)
            self._drop(node, old_replica)

    def _drop(self, node: int, replica: str) -> None:
        owners = self._owners.get(node)
        if owners is not None:
            owners.discard(replica)
            if not owners:
                del self._owners[node]

    def remove_replica(self, replica: str) -> None:
        for key in [k for k in self._recent if k[0] == replica]:
            del self._recent[key]
            self._drop(key[1], replica)

    def match(self, tokens: Sequence[int], replicas: set[str]) -> tuple[int, set[str]]:
        """The longest block-aligned prefix of ``tokens`` held by one of ``replicas``: (its length
        in tokens, the replicas that hold it)."""
        depth, best = 0, set()
        for node in self._nodes(tokens):
            owners = self._owners.get(node, set()) & replicas
            if not owners:
                break
            depth, best = depth + self.block_size, owners
        return depth, best


def prefix_holders(
    tree: PrefixTree, tokens: Sequence[int], loads: dict[str, int], *, min_match_tokens: int,
    match_ratio: float, imbalanced_threshold: int,
) -> list[str]:
    """Where a request goes for its prefix: the replicas among ``loads`` (the available ones, with
    their requests in flight) that hold the longest prefix of ``tokens``, least loaded first; []
    when load alone should decide: the match is shorter than ``min_match_tokens`` or
    ``match_ratio`` of the prompt, or even the least loaded holder has more than
    ``imbalanced_threshold`` requests over the least loaded replica (a cache hit is not worth a
    queue; SGLang's router and Ray's ``PrefixCacheAffinityRouter`` balance likewise)."""
    if not tokens or not loads:
        return []
    depth, owners = tree.match(tokens, set(loads))
    if not depth or depth < max(min_match_tokens, match_ratio * len(tokens)):
        return []
    holders = sorted(owners, key=lambda r: (loads[r], r))
    if loads[holders[0]] - min(loads.values()) > imbalanced_threshold:
        return []
    return holders
