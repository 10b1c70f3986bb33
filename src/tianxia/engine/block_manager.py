"""The KV block pool: allocation, reference counts, and the prefix cache.

A full block is identified by a chained key: a SHA-256 digest of the key of the block before it,
the sequence's extra key (its ``cache_salt`` and LoRA adapter, for the first block) and its own tokens, so equal
keys mean equal prefixes, and no two different prefixes can be made to share one (Python's
``hash`` of the tokens, used before, collides by construction: ``hash(0) == hash(2**61 - 1)``,
and a hit serves the cached K/V without comparing tokens). Freed blocks that carry a key stay in
the cache, in an LRU
free list (``OrderedDict`` gives O(1) removal from the middle when a cached block is hit again);
allocation takes the least recently freed block and evicts its key.

Sliding-window attention: when every attention layer only sees the last ``sliding_window``
positions, a running sequence's blocks that lie wholly before the window of its next token are
given back after each step (:meth:`BlockManager.free_out_of_window`). Their entries in the block
table become the *null block*, a block reserved at start-up that is never allocated or written
(it stays zero), so positions keep their table index, and a kernel that reads a freed position
(the torch backend's batched decode reads from the earliest window of the batch) reads finite
zeros under its mask instead of another sequence's K/V.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass

from tianxia.engine.sequence import Sequence

_ROOT = bytes(32)  # the parent of a sequence's first block


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None  # prefix-cache key, set once the block is full and computed


def block_key(parent: bytes | None, tokens: TokenIds[int], extra: bytes = b"") -> bytes:
    """SHA-256 of the parent key, ``extra`` (length-prefixed) and the block's token ids."""
    h = hashlib.sha256(parent or _ROOT)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        """``sliding_window``: the window of every attention layer of the model (a query at p sees
        keys p - window < pos <= p); None when any layer attends to the whole context, as then
        every block of a sequence stays needed until it finishes."""
        # the null block (block 0) is reserved only when blocks can be given back early
        self.null_block: int | None = 0 if sliding_window is not None else None
        first = 0 if self.null_block is None else 1
        if num_blocks < first + 1:
            raise ValueError("the KV cache needs at least one block (two with a sliding window)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_usable_blocks = num_blocks - first  # all but the null block
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(first, num_blocks))
        self.cached: dict[bytes, int] = {}  # key -> block_id
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
        return 1.0 - len(self.free) / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no attention layer reads again once ``num_computed_tokens`` are computed.

        The next query is at position ``n = num_computed_tokens`` and sees keys from
        ``n - window + 1`` on (later queries see even less), so a block is dead when its last
        position is below that: blocks ``[0, (n - window + 1) // block_size)``.
        """
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def max_blocks_per_seq(self, max_step_tokens: int) -> int | None:
        """Most blocks one sequence ever holds when each step adds at most ``max_step_tokens``
        tokens to it (None without a sliding window: it grows with the sequence).

        Before a step at ``n`` computed tokens the sequence holds the blocks from
        ``(n - window + 1) // block_size`` to those of its ``n + max_step_tokens`` tokens; the
        worst case is a window that starts at the last position of a block.
        """
        if self.sliding_window is None:
            return None
        return self.blocks_needed(self.block_size - 1 + self.sliding_window - 1 + max_step_tokens)

    # --- prefix cache -------------------------------------------------------------------------

    def _keys(self, seq: Sequence, start: int, end: int) -> list[bytes]:
        """Keys of full blocks ``start..end-1`` of ``seq``, chained on its keys before ``start``."""
        keys, bs = [], self.block_size
        parent = seq.block_keys[start - 1] if start else None
        for i in range(start, end):
            parent = block_key(parent, seq.token_ids[i * bs : (i + 1) * bs], b"" if i else seq.prefix_key_extra)
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
        for key in self._keys(seq, 0, num_tokens // self.block_size):
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
        # cached blocks that sit in the free list are not available for new allocations (hits
        # already outside the window are not taken: see take_cached)
        skipped = self.num_skipped_blocks(len(cached) * self.block_size)
        reclaimed = sum(1 for b in cached[skipped:] if self.blocks[b].ref_count == 0)
        return need <= len(self.free) - reclaimed

    def take_cached(self, seq: Sequence, cached: list[int]) -> None:
        """Attach prefix-cache hits to a sequence that has no blocks yet; with a sliding window,
        hits that the next token's window no longer reaches stay where they are (null block)."""
        assert not seq.block_table
        skipped = self.num_skipped_blocks(len(cached) * self.block_size)
        seq.block_keys = [self.blocks[b].key for b in cached]
        seq.block_table = [self.null_block] * skipped
        for block_id in cached[skipped:]:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
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

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks stay free); only while no sequence holds one."""
        for block_id in self.free:
            self.blocks[block_id].key = None
        self.cached.clear()

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
            if block_id != self.null_block:
                self.blocks[block_id].ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.key is None or not self.enable_prefix_caching:
                self.free.move_to_end(block_id, last=False)  # uncached blocks go first

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks first, so that under pressure the end of a prefix is evicted before its start.
        for block_id in reversed(seq.block_table):
            if block_id != self.null_block:
                self._release(block_id)
        seq.block_table = []
        seq.block_keys = []

    def truncate(self, seq: Sequence) -> None:
        """Give back the blocks past the last token of ``seq``: after speculative decoding, those
        that only held rejected proposals (allocated this step, so unshared and unkeyed)."""
        keep = self.blocks_needed(len(seq))
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free_out_of_window(self, seq: Sequence) -> int:
        """Give back the blocks of ``seq`` that lie wholly before the window of its next token
        (after :meth:`cache_full_blocks`, so they keep their prefix-cache key); returns how many
        table entries became the null block. A block shared with a sibling or cached survives
        through its reference count or key."""
        skipped = self.num_skipped_blocks(seq.num_computed_tokens)
        table = seq.block_table
        released = 0
        # walk back from the last dead block; everything before a null entry is already null
        for i in range(min(skipped, len(table)) - 1, -1, -1):
            if table[i] == self.null_block:
                break
            self._release(table[i])
            table[i] = self.null_block
            released += 1
        return released

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the keys of blocks that became full and computed in this step."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, len(seq)) // self.block_size
        keys = seq.block_keys  # the chain so far, kept on the sequence: freed blocks lose theirs
        first = len(keys)
        keys.extend(self._keys(seq, first, num_full))
        for i in range(first, num_full):
            key = keys[i]
            block_id = seq.block_table[i]
            if block_id == self.null_block:
                continue  # given back before this sequence keyed it (a fork keys its chain a step late)
            block = self.blocks[block_id]
            if block.key is None:
                block.key = key
                self.cached.setdefault(key, block_id)
