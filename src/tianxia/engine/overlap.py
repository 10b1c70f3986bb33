"""Async scheduling: step N+1 scheduled and launched before step N's tokens are read (vLLM's
async scheduling, SGLang's overlap scheduler).

:func:`next_step` schedules step N+1 as :meth:`Scheduler.schedule` would once step N is applied,
before ``Scheduler.update`` has applied it: a sequence that step N samples decodes its next
position, its input token its row of step N's sampled ids, which the runner still holds on the
device (``StepInput.prev_rows``), and its sampling reads the sequence one token ahead; a prompt
in chunks takes its next chunk; waiting requests are admitted into the budget left, and into the
slots of sequences that step N ends by length (as the scheduler after ``update`` would). The engine
launches it, then applies step N (stop checks, detokenization, outputs) while the GPU computes
step N+1, and hands step N+1 to ``update`` on its next step. A sequence that step N ends (EOS, a
stop string, an abort) has computed one row for nothing; ``update`` passes over it. Where step
N+1 depends on step N's tokens on the host (penalties, bad words and grammars read them; n > 1
forks, proposals, adapters and prompt logprobs take the scheduler's own path) or the cache is
short of blocks (the scheduler decides whom to preempt), there is no step N+1 ahead and the
scheduler runs after ``update`` as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from tianxia.engine import faults
from tianxia.engine.scheduler import Scheduler, SchedulerOutput
from tianxia.engine.sequence import Sequence
from tianxia.engine.step_io import RunnerOutput, StepInput, TokenRun, prepare_batch
from tianxia.layers.sampler import SamplingBatch


@dataclass
class LaunchedStep:
    """A step handed to the runner whose results ``Scheduler.update`` has yet to apply."""

    out: SchedulerOutput
    step: StepInput
    result: RunnerOutput

    def live(self) -> list[Sequence]:
        return [seq for seq, _ in self.out.scheduled if not seq.is_finished]


class _Unread:
    """The token ids of a sequence one token past what it holds, as ``prepare_batch`` reads them
    (a slice at its next position): placeholders, which the runner replaces by step N's ids on
    the device. Not a copy of the sequence's tokens, which would cost every row a step."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, where: slice) -> list[int]:
        return [0] * len(range(*where.indices(self.length)))


def samples_ahead(seq: Sequence) -> bool:
    """Whether the sequence's next token can be sampled before its current one is known: its
    penalties, bad words and grammar read the tokens themselves."""
    return seq.grammar is None and not seq.bad_words_ids and not seq.params.needs_penalties


def own_path(seq: Sequence) -> bool:
    """Whether the sequence needs the scheduler's own step: an adapter, prompt logprobs owed, or
    n > 1 siblings to fork at its first token."""
    return (seq.lora_slot >= 0 or bool(seq.pending_forks)
            or (seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens))


def _ends_by_length(seq: Sequence, max_len: int) -> bool:
    """Whether the token step N appends ends the sequence by max_tokens or the context length."""
    max_tokens = seq.params.max_tokens
    return (max_tokens is not None and seq.num_output_tokens + 1 >= max_tokens) or len(seq) + 1 >= max_len


def next_step(scheduler: Scheduler, prev: LaunchedStep) -> tuple[SchedulerOutput, StepInput] | None:
    """Step N+1 for a launched step N, or None where it cannot be scheduled before N is applied.
    Its sequences' KV slots are allocated and its admissions made."""
    step = prev.step
    if prev.out.forks or step.spec_groups is not None or step.all_rows:
        return None
    if scheduler.waiting and own_path(scheduler.waiting[0]):
        return None  # the scheduler admits it
    sampled_row = {sid: i for i, sid in enumerate(step.sample_seq_ids)}
    scheduled_before = {id(seq): n for seq, n in prev.out.scheduled}
    max_len = scheduler.config.max_model_len
    budget = scheduler.config.max_num_batched_tokens
    bm = scheduler.block_manager
    out = SchedulerOutput()
    runs: list[tuple[TokenRun, int]] = []
    ending = 0  # sequences that step N ends by length: their slots are free in step N+1
    row_info: dict[int, tuple[Sequence, int, int]] = {}  # id(run) -> (seq, ahead, row of step N)
    for seq in scheduler.running:
        if budget <= 0:
            break
        if own_path(seq):
            return None
        computed = seq.num_computed_tokens + scheduled_before.get(id(seq), 0)
        if id(seq) in scheduled_before and computed == len(seq):  # step N samples its next token
            if not samples_ahead(seq):
                return None
            if _ends_by_length(seq, max_len):
                ending += 1
                continue
            run = TokenRun(_Unread(len(seq) + 1), computed, seq.block_table, seq_id=seq.seq_id)
            row_info[id(run)] = (seq, 1, sampled_row[seq.seq_id])
        else:
            run = TokenRun(seq.token_ids, computed, seq.block_table, seq_id=seq.seq_id)
            row_info[id(run)] = (seq, 0, -1)
        num_new = min(len(run) - computed, budget)
        need = computed - seq.num_computed_tokens + num_new
        if not bm.can_allocate(seq, need):
            return None
        bm.allocate(seq, need)
        out.scheduled.append((seq, num_new))
        runs.append((run, num_new))
        budget -= num_new
    admitted = len(out.scheduled)
    scheduler.admit(out, budget, ending)
    for seq, n in out.scheduled[admitted:]:
        run = TokenRun(seq.token_ids, seq.num_computed_tokens, seq.block_table, seq_id=seq.seq_id)
        row_info[id(run)] = (seq, 0, -1)
        runs.append((run, n))
    out.copies, bm.pending_copies = bm.pending_copies, []
    if not runs:
        return None
    order, nxt = prepare_batch(runs, bm.block_size)
    nxt.copies = out.copies
    prev_rows: list[int] = []
    rows, seqs, ahead = [], [], []
    start = 0
    for run, n in order:
        seq, seq_ahead, prev_row = row_info[id(run)]
        prev_rows += [prev_row] + [-1] * (n - 1)
        if run.num_computed_tokens + n == len(run):
            rows.append(start + n - 1)
            seqs.append(seq)
            ahead.append(seq_ahead)
        start += n
    nxt.sample_rows = rows
    nxt.sample_seq_ids = [seq.seq_id for seq in seqs]
    if any(r >= 0 for r in prev_rows):
        nxt.prev_rows = prev_rows
    if seqs:
        nxt.sampling = SamplingBatch.from_sequences(seqs, scheduler.eos_ids, ahead=ahead)
        if faults.ACTIVE:
            nxt.fault_nan_rows = [i for i, s in enumerate(seqs) if faults.hits("nan", s.prompt)]
    return out, nxt
