"""One token budget per step; no separate prefill and decode phases (vLLM v1's scheduler).

Each step, running sequences are served first (a decode is one token, an unfinished prompt gets
its next chunk), then waiting ones are admitted first-come first-served while budget, sequence
slots and KV blocks last. When a running sequence cannot get a block, the newest running sequence
is preempted: its blocks are freed and it is recomputed later from its tokens (prompt + output).

Block accounting is per step: a sequence asks only for the blocks of its next chunk. With a
sliding window on every layer the engine gives back out-of-window blocks after each step, so a
long sequence keeps needing about ``window / block_size + 1`` blocks (plus its chunk) and never
has to fit the cache whole (``BlockManager.max_blocks_per_seq``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tianxia.config import SchedulerConfig
from tianxia.engine.block_manager import BlockManager
from tianxia.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new_tokens)
    rejected: list[Sequence] = field(default_factory=list)  # can never fit the KV cache
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_loras: int = 0) -> None:
        self.config = config
        self.max_loras = max_loras  # distinct LoRA adapters in one batch (0: no adapters served)
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.spec_token_ids = []
        seq.draft_num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            if seq.spec_token_ids:
                # a decode with proposals: they are verified after its token, within the budget
                del seq.spec_token_ids[budget - 1 :]
                num_new += len(seq.spec_token_ids)
            while not bm.can_allocate(seq, num_new):
                if seq.spec_token_ids:  # give up the proposals before anyone's blocks
                    num_new -= len(seq.spec_token_ids)
                    seq.spec_token_ids = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                bm.allocate(seq, num_new)
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1

        preempted_this_step = out.num_preempted > 0
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if preempted_this_step:
                break  # memory is short right now; admitting more would only thrash
            seq = self.waiting[0]
            if seq.lora_slot >= 0 and not self._lora_fits(seq.lora_slot):
                break  # its adapter would be one too many in the batch: it waits its turn
            cached = bm.lookup_prefix(seq) if not seq.block_table else []
            num_cached_tokens = len(cached) * bm.block_size
            num_new = min(len(seq) - seq.num_computed_tokens - num_cached_tokens, budget)
            if not bm.can_allocate(seq, num_new, cached):
                if not self.running:
                    # Nothing will free memory: the request cannot fit the cache even alone.
                    self.waiting.popleft()
                    seq.status = SequenceStatus.FINISHED
                    out.rejected.append(seq)
                    continue
                break
            self.waiting.popleft()
            bm.take_cached(seq, cached)
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            bm.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        out.copies, bm.pending_copies = bm.pending_copies, []
        return out

    def _lora_fits(self, slot: int) -> bool:
        active = {s.lora_slot for s in self.running if s.lora_slot >= 0}
        return slot in active or len(active) < self.max_loras

    def lora_slots_in_use(self) -> set[int]:
        return {s.lora_slot for s in (*self.running, *self.waiting) if s.lora_slot >= 0}

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks and remove it from the queues."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
