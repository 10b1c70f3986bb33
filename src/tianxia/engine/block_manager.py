"""The KV block pool: allocation, reference counts, and the prefix cache.

A full block is identified by a chained key: the key of the block before it plus its own tokens,
so equal keys mean equal prefixes. Freed blocks that carry a key stay in the cache, in an LRU
free list (``OrderedDict`` gives O(1) removal from the middle when a cached block is hit again);
allocation takes the least recently freed block and evicts its key.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tianxia.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None  # prefix-cache key, set once the block is full and computed


def block_key(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # key -> block_id
        # prompt tokens looked up in / found in the prefix cache (vLLM's prefix_cache_queries/hits)
        self.prefix_queries = 0
        self.prefix_hits = 0
        # (src, dst) block copies the runner must do before the next forward (copy-on-write)
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # --- prefix cache -------------------------------------------------------------------------

    def _keys(self, token_ids: list[int], num_full_blocks: int) -> list[int]:
        keys, parent, bs = [], None, self.block_size
        for i in range(num_full_blocks):
            parent = block_key(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            keys.append(parent)
        return keys

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, leaving at least one token to compute
        (the model must run on the last prompt token to produce the first output token)."""
        if not self.enable_prefix_caching:
            return []
        num_tokens = len(seq) - 1
        if seq.prompt_logprobs is not None:
            # prompt logprobs are owed from position len(seq.prompt_logprobs) on (1 unless the
            # request set "prompt_logprobs_start"): the logits of the position before it must be
            # computed, so only blocks before that position can be hits
            num_tokens = min(num_tokens, len(seq.prompt_logprobs) - 1)
        hits = []
        for key in self._keys(seq.token_ids, num_tokens // self.block_size):
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # --- allocation ---------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Whether ``seq`` can hold ``num_new_tokens`` more tokens (after taking ``cached``)."""
        have = len(seq.block_table) + len(cached)
        need = self.blocks_needed(seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens) - have
        need += self._needs_cow(seq)
        # cached blocks that sit in the free list are not available for new allocations
        reclaimed = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return need <= len(self.free) - reclaimed

    def take_cached(self, seq: Sequence, cached: list[int]) -> None:
        """Attach prefix-cache hits to a sequence that has no blocks yet."""
        assert not seq.block_table
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        seq.block_table = list(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += seq.num_computed_tokens

    def _needs_cow(self, seq: Sequence) -> bool:
        """Whether the next token lands in a partly filled block shared with a sibling."""
        return (
            bool(seq.block_table)
            and seq.num_computed_tokens % self.block_size != 0
            and self.blocks[seq.block_table[-1]].ref_count > 1
        )

    def _pop_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key = None
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        if self._needs_cow(seq):
            shared = seq.block_table[-1]
            self.blocks[shared].ref_count -= 1
            copy = self._pop_free()
            seq.block_table[-1] = copy
            self.pending_copies.append((shared, copy))
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._pop_free())

    def share(self, seq: Sequence) -> None:
        """Add a reference to each block of a newly forked sequence."""
        for block_id in seq.block_table:
            self.blocks[block_id].ref_count += 1

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks first, so that under pressure the end of a prefix is evicted before its start.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is None or not self.enable_prefix_caching:
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)  # uncached blocks go first
                else:
                    self.free[block_id] = None
        seq.block_table = []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the keys of blocks that became full and computed in this step."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, len(seq)) // self.block_size
        parent = None
        bs = self.block_size
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.key is None:
                key = block_key(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
                block.key = key
                self.cached.setdefault(key, block.block_id)
            parent = block.key
