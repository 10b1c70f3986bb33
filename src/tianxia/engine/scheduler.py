"""One token budget per step; no separate prefill and decode phases (vLLM v1's scheduler).

Each step, running sequences are served first (a decode is one token, an unfinished prompt gets
its next chunk), then waiting ones are admitted first-come first-served while budget, sequence
slots and KV blocks last. When a running sequence cannot get a block, the newest running sequence
is preempted: its blocks are freed and it is recomputed later from its tokens (prompt + output).

After the runner has run a step (its input is :meth:`Scheduler.step_input`, plain data),
:meth:`Scheduler.update` applies the results: it appends the sampled (or verified) tokens,
advances the computed counts, keys newly full blocks in the prefix cache, checks the token-level
stop conditions (EOS, stop token ids, grammar termination, ``max_tokens``, the context length)
and frees finished sequences.
What a token means as text (logprob entries, the detokenizer and its stop strings) and ending a
failed request are the engine's: it passes them in as a :class:`StepHandler`.

Block accounting is per step: a sequence asks only for the blocks of its next chunk. With a
sliding window on every layer ``update`` gives back out-of-window blocks after each step, so a
long sequence keeps needing about ``window / block_size + 1`` blocks (plus its chunk) and never
has to fit the cache whole (``BlockManager.max_blocks_per_seq``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from tianxia.config import SchedulerConfig
from tianxia.engine import faults
from tianxia.engine.block_manager import BlockManager
from tianxia.engine.sequence import Sequence, SequenceStatus
from tianxia.engine.step_io import RequestFailure, RunnerOutput, StepInput, TokenLogprobs, make_step_input

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new_tokens)
    rejected: list[Sequence] = field(default_factory=list)  # can never fit the KV cache
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    num_preempted: int = 0
    # n > 1 siblings forked in this step (by their parent's seq_id): they sample from its row and
    # join the running sequences in :meth:`Scheduler.update`
    forks: dict[int, list[Sequence]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class StepHandler(Protocol):
    """What :meth:`Scheduler.update` leaves to the engine."""

    def on_prompt_logprobs(self, seq: Sequence, logprobs: list[TokenLogprobs]) -> None:
        """Record the prompt logprobs of a chunk."""

    def on_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Take a token just appended (its logprobs, its text); return the stop string its text
        now holds, if any. Raising ends the request (``on_failed``)."""

    def on_finished(self, seq: Sequence, stop_str: str | None) -> None:
        """A sequence ended by a stop condition, before its blocks are freed."""

    def on_failed(self, request_id: str, failure: RequestFailure) -> None:
        """End every sequence of a request (its processing failed, or the runner gave an error)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_loras: int = 0,
                 eos_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.max_loras = max_loras  # distinct LoRA adapters in one batch (0: no adapters served)
        self.block_manager = block_manager
        self.eos_ids = eos_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.speculator = None  # counts each verification, pauses a sequence that keeps failing
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

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

        if not out.num_preempted:  # memory is short right now: admitting more would only thrash
            self.admit(out, budget)
        out.copies, bm.pending_copies = bm.pending_copies, []
        return out

    def admit(self, out: SchedulerOutput, budget: int, ending: int = 0) -> int:
        """Admit waiting sequences first-come first-served into ``out`` while the token budget,
        sequence slots and KV blocks last; the budget left. ``ending``: running sequences that
        the step in flight ends, whose slots this step may already fill."""
        bm = self.block_manager
        while (self.waiting and budget > 0
               and len(self.running) - ending < self.config.max_num_seqs):
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
        return budget

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

    # --- after the runner ----------------------------------------------------------------------

    def step_input(self, out: SchedulerOutput) -> StepInput:
        """The runner's plain-data input for a scheduled step (after its forks and proposals)."""
        return make_step_input(out.scheduled, self.block_manager.block_size, self.eos_ids, out.copies,
                               out.forks)

    def update(self, out: SchedulerOutput, result: RunnerOutput, handler: StepHandler) -> list[str]:
        """Apply a step's results to its sequences; the ids of the requests it touched (new
        tokens, an end, an error), in the order of the step."""
        now = time.monotonic()
        # the one read of the sampled ids on the host: with async scheduling step N+1 is already
        # launched, and this is where the host first waits for step N
        tokens = result.tokens()
        touched: dict[str, None] = {}
        bm = self.block_manager
        for seq, n in out.scheduled:
            if seq.is_finished:  # its request failed earlier in this step
                continue
            if seq.num_computed_tokens + n > len(seq):
                self._append_verified(seq, n, result, now, handler)
                touched[seq.request_id] = None
                continue
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            if seq.prompt_logprobs is not None and seq.seq_id in result.prompt_logprobs:
                handler.on_prompt_logprobs(seq, result.prompt_logprobs[seq.seq_id])
            seq.num_computed_tokens += n
            for s in (seq, *out.forks.get(seq.seq_id, ())):
                s.num_computed_tokens = seq.num_computed_tokens
                if s.is_finished:
                    continue
                error = result.errors.get(s.seq_id)
                if error is not None:
                    handler.on_failed(s.request_id, error)
                    touched[s.request_id] = None
                    continue
                bm.cache_full_blocks(s)
                bm.free_out_of_window(s)
                token = tokens.get(s.seq_id)
                if token is None:
                    continue
                if s.first_token_time is None:
                    s.first_token_time = now
                self._append(s, token, result.logprobs.get(s.seq_id), handler)
                touched[s.request_id] = None
        for children in out.forks.values():
            for child in children:
                if not child.is_finished:
                    self.running.append(child)
        return list(touched)

    def _append_verified(self, seq: Sequence, n: int, result: RunnerOutput, now: float,
                         handler: StepHandler) -> None:
        """A decode that verified ``n - 1`` proposals: append its accepted ones and the token
        after them (stopping where a stop condition does), keep the KV of the accepted positions
        only, and give back the blocks that held nothing else."""
        num_proposed = n - 1
        seq.spec_token_ids = []
        seq.draft_probs = None
        error = result.errors.get(seq.seq_id)
        if error is not None:
            handler.on_failed(seq.request_id, error)
            return
        tokens = result.accepted[seq.seq_id]
        logprobs = result.accepted_logprobs.get(seq.seq_id)
        self.speculator.record(seq, num_proposed, len(tokens) - 1)
        # the KV of the last token and of each accepted proposal is kept
        seq.num_computed_tokens += len(tokens)
        seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed_tokens)
        if seq.first_token_time is None:
            seq.first_token_time = now
        for i, token in enumerate(tokens):
            self._append(seq, token, logprobs[i] if logprobs is not None else None, handler)
            if seq.is_finished:
                return
        self.block_manager.truncate(seq)
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.free_out_of_window(seq)

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, handler: StepHandler) -> None:
        self.num_generation_tokens += 1
        seq.token_ids.append(token)
        try:
            stop_str = handler.on_token(seq, token, logprobs)
            self._check_stop(seq, token, stop_str, handler)
        except Exception as e:  # noqa: BLE001 - one request's fault ends that request only
            logger.exception("request %s failed", seq.request_id)
            handler.on_failed(seq.request_id, RequestFailure(f"{type(e).__name__}: {e}"))

    def _check_stop(self, seq: Sequence, token: int, stop_str: str | None, handler: StepHandler) -> None:
        """End ``seq`` if ``token`` stops it: a stop string in its text (``stop_str``, first), EOS,
        a stop token id or the grammar's end, ``max_tokens``, the context length."""
        params = seq.params
        grammar_done = False
        if seq.grammar is not None:
            if faults.ACTIVE and faults.hits("grammar", seq.prompt):
                raise faults.InjectedFault("the grammar matcher failed (TIANXIA_FAULT_INJECT)")
            if not seq.grammar.accept_token(token):
                raise RuntimeError(f"token {token} violates the grammar of request {seq.request_id}")
            grammar_done = seq.grammar.is_terminated()
        if stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif token in self.eos_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids or grammar_done:
            seq.finish_reason, seq.stop_reason = "stop", token if token in params.stop_token_ids else None
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = "length"
        elif len(seq) >= self.config.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            handler.on_finished(seq, stop_str)
            self.finish(seq)
