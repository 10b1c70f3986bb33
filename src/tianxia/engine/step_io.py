"""What crosses between the scheduler and the model runner each step: plain data, no ``Sequence``.

The scheduler turns its decisions into a :class:`StepInput` (token ids, positions, slot mapping,
block tables, adapter slots, the rows to sample and how, the proposals to verify); the runner
reads nothing else, runs the step and returns a :class:`RunnerOutput` (sampled ids, logprobs,
accepted proposals, per-sequence errors), which ``Scheduler.update`` applies to the sequences.
This is vLLM V1's ``SchedulerOutput -> ModelRunner.execute_model -> ModelRunnerOutput ->
Scheduler.update_from_output``, and the seam where step N+1 is prepared while step N runs
(``engine/overlap.py``): nothing here refers to state that the step itself changes, a step's
input tokens may be the previous step's sampled ids where they still are on the device
(``StepInput.prev_rows``), and a step's output may hold its ids there until ``update`` reads them.

Two per-request objects still travel by reference inside the sampling inputs: each seeded row's
``torch.Generator`` and each constrained row's grammar matcher, both read (and advanced) by the
sampler where it runs, in this process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Protocol

import torch

from tianxia.engine import faults
from tianxia.engine.spec_decode.rejection_sampler import DraftedView, Group
from tianxia.layers.sampler import SamplingBatch

# (top token ids, their logprobs, the chosen token's logprob, its rank)
TokenLogprobs = tuple[list[int], list[float], float, int]


NO_ADMISSIBLE_TOKEN = (
    "no token of the vocabulary satisfies this request's constraints "
    "(guided decoding, allowed_token_ids, bad_words, min_tokens) at this point"
)
NAN_LOGITS = "the model produced NaN logits for this request"


@dataclass(frozen=True)
class RequestFailure:
    """Why a request got no token. ``invalid_request`` when its own parameters are at fault (an
    HTTP client gets a 400), otherwise the server failed it (a 500)."""

    message: str
    invalid_request: bool = False


class BatchItem(Protocol):
    """What :func:`prepare_batch` reads of a scheduled item (a ``Sequence``, or a :class:`TokenRun`)."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    lora_slot: int

    def __len__(self) -> int: ...


@dataclass(slots=True)
class TokenRun:
    """Tokens outside the scheduler (a draft model's steps, a scored or embedded prompt): all of
    them, how many the KV cache holds, and the blocks that hold them."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    lora_slot: int = -1  # drafts and prompt passes run without adapters
    seq_id: int = -1

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class PromptLogprobsRequest:
    """A prompt chunk whose prompt logprobs are owed: position ``p`` predicts token ``p + 1``."""

    index: int  # the sequence's place in the batch
    seq_id: int
    start: int  # the chunk's first position
    targets: list[int]  # prompt positions (of the predicted tokens) not reported yet
    target_ids: list[int]  # the prompt's tokens there
    k: int  # top logprobs to report


@dataclass
class StepInput:
    """One step's flat batch: every scheduled sequence's new tokens in a row (decodes first, then
    by adapter), and what to sample from which rows."""

    seq_ids: list[int]  # the scheduled sequences, in batch order
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # where each new token's K/V goes in the cache
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # tokens per sequence once the step is done
    block_tables: list[list[int]]
    lora_slots: list[int]  # per sequence (-1: the base model)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks, first
    # the token rows sampled, and the sequence each one's token goes to (the n > 1 siblings forked in
    # this step share their parent's row; a sequence verifying k proposals has k + 1 rows)
    sample_rows: list[int] = field(default_factory=list)
    sample_seq_ids: list[int] = field(default_factory=list)
    sampling: SamplingBatch | None = None  # per sampled row
    spec_groups: list[Group] | None = None  # the sampled rows by sequence, when any verifies proposals
    prompt_logprobs: list[PromptLogprobsRequest] = field(default_factory=list)
    # a prompt chunk owes prompt logprobs: every row's hidden state is needed
    all_rows: bool = False
    fault_nan_rows: list[int] = field(default_factory=list)  # sampled rows made NaN (fault injection)
    # a step prepared before its previous one's tokens were read: row i's input token is row
    # prev_rows[i] of the previous step's sampled ids, which the runner still holds on the device
    # (``input_ids`` holds placeholders there)
    prev_rows: list[int] | None = None

    def batch_only(self) -> StepInput:
        """The batch without what only the sampling rank reads: what a tensor-parallel worker
        gets (the sampling inputs hold generators and grammar matchers, which stay here)."""
        return StepInput(self.seq_ids, self.input_ids, self.positions, self.slot_mapping, self.query_lens,
                         self.seq_lens, self.block_tables, self.lora_slots, self.copies)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_decodes(self) -> int:
        return sum(1 for n in self.query_lens if n == 1)


@dataclass
class RunnerOutput:
    """What a step produced, by sequence id."""

    seq_ids: list[int]  # the sequence of each sampled row (``StepInput.sample_seq_ids``)
    # [sampled rows] int64: each row's token, -1 where its sequence took tokens in ``accepted``
    # instead; a tensor, so that a step whose sampler leaves its ids on the device hands them on as
    # they are and the host reads them once, in :meth:`tokens`
    sampled_token_ids: torch.Tensor | None = None
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    errors: dict[int, RequestFailure] = field(default_factory=dict)  # why a sequence got no token
    # sequences that verified proposals: their accepted proposals, then one more token
    accepted: dict[int, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # a step sampled on the device and not waited for: its ids and row flags on their way to the
    # host, read by :meth:`tokens`
    pending: DeviceTokens | None = None

    def tokens(self) -> dict[int, int]:
        """Sequence id -> its sampled token, for the sequences that got one (not in ``errors``)."""
        if self.pending is not None:
            ids = self.pending.wait(self)
            self.pending = None
        elif self.sampled_token_ids is None:
            return {}
        else:
            ids = self.sampled_token_ids.tolist()
        return {sid: t for sid, t in zip(self.seq_ids, ids) if t >= 0 and sid not in self.errors}


class DeviceTokens:
    """A step's sampled ids and per-row flags (NaN logits, no admissible token), copied from the
    device to pinned host memory behind the step's kernels: the host waits for them only when it
    reads them, so it may launch the next step first."""

    NAN, DEAD = 1, 2

    def __init__(self, tokens: torch.Tensor, nan_rows: torch.Tensor, dead_rows: torch.Tensor | None) -> None:
        flags = nan_rows.to(torch.int64) * self.NAN
        if dead_rows is not None:
            flags = flags + dead_rows.to(torch.int64) * self.DEAD
        both = torch.stack([tokens, flags])
        self.host = torch.empty(both.shape, dtype=torch.int64, pin_memory=both.is_cuda)
        self.host.copy_(both, non_blocking=True)
        self.event = None
        if both.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self, out: RunnerOutput) -> list[int]:
        """The ids, once copied; a flagged row's sequence gets its error in ``out.errors``."""
        if self.event is not None:
            self.event.synchronize()
        ids, flags = self.host.tolist()
        for sid, flag in zip(out.seq_ids, flags):
            if flag & self.NAN:
                out.errors[sid] = RequestFailure(NAN_LOGITS)
            elif flag & self.DEAD:
                out.errors.setdefault(sid, RequestFailure(NO_ADMISSIBLE_TOKEN, invalid_request=True))
        return ids


def prepare_batch(scheduled: Iterable[tuple[BatchItem, int]],
                  block_size: int) -> tuple[list[tuple[BatchItem, int]], StepInput]:
    """The flat batch of ``(item, num_new_tokens)`` pairs, and the pairs in its order."""
    # decodes (one new token) first, so the attention backend can batch them densely; then by
    # LoRA adapter, so each adapter's rows are a run its product reads in place
    order = sorted(scheduled, key=lambda x: (x[1] != 1, x[0].lora_slot))
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    bs = block_size
    for seq, n in order:
        start = seq.num_computed_tokens
        input_ids.extend(seq.token_ids[start : start + n])
        if start + n > len(seq):  # a decode that verifies its proposed tokens
            input_ids.extend(seq.spec_token_ids[: start + n - len(seq)])
        positions.extend(range(start, start + n))
        table = seq.block_table
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
    step = StepInput(
        seq_ids=[seq.seq_id for seq, _ in order],
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        query_lens=[n for _, n in order],
        seq_lens=[seq.num_computed_tokens + n for seq, n in order],
        block_tables=[list(seq.block_table) for seq, _ in order],
        lora_slots=[seq.lora_slot for seq, _ in order],
    )
    return order, step


def make_step_input(scheduled, block_size: int, eos_ids: tuple[int, ...], copies=(), forks=None) -> StepInput:
    """The runner's input for scheduled ``(Sequence, num_new_tokens)`` pairs: the flat batch, and
    a sampled row for every sequence whose tokens are now all computed (and for each sibling in
    ``forks``, which samples from its parent's row), or k + 1 rows for one verifying k proposals."""
    order, step = prepare_batch(scheduled, block_size)
    step.copies = list(copies)
    forks = forks or {}
    rows, seqs = [], []
    drafted: set[int] = set()  # where the rows of each sequence that verifies proposals start
    start = 0
    for seq, n in order:
        end = seq.num_computed_tokens + n
        if end == len(seq):
            for s in (seq, *forks.get(seq.seq_id, ())):
                rows.append(start + n - 1)
                seqs.append(s)
        elif end > len(seq):  # its last token and n - 1 proposals: every row is sampled
            drafted.add(len(rows))
            rows.extend(range(start, start + n))
            seqs.extend([seq] * n)
        start += n
    owes = [seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens
            for seq, _ in order]
    step.all_rows = any(owes)
    for i, ((seq, n), owed) in enumerate(zip(order, owes)):
        if not owed:
            continue
        first = seq.num_computed_tokens
        # report only prompt tokens not reported yet (a preempted sequence recomputes its prompt)
        targets = [p + 1 for p in range(first, first + n)
                   if len(seq.prompt_logprobs) <= p + 1 < seq.num_prompt_tokens]
        if targets:
            step.prompt_logprobs.append(PromptLogprobsRequest(
                i, seq.seq_id, first, targets, [seq.token_ids[t] for t in targets],
                seq.params.prompt_logprobs))
    step.sample_rows = rows
    step.sample_seq_ids = [s.seq_id for s in seqs]
    if not seqs:
        return step
    if drafted:
        step.spec_groups, views = _spec_groups(seqs, drafted)
        step.sampling = SamplingBatch.from_sequences(views, eos_ids)
    else:
        step.sampling = SamplingBatch.from_sequences(seqs, eos_ids)
    if faults.ACTIVE:
        step.fault_nan_rows = [i for i, s in enumerate(seqs) if faults.hits("nan", s.prompt)]
    return step


def _spec_groups(seqs: list, drafted: set[int]) -> tuple[list[Group], list]:
    """Each sampling sequence's rows, and what the sampler reads for each row: row j of a
    sequence verifying proposals as if its first j proposals were output."""
    groups, views = [], []
    i = 0
    while i < len(seqs):
        seq = seqs[i]
        if i in drafted:
            drafts = seq.spec_token_ids
            groups.append(Group(i, drafts, seq.draft_probs, seq.grammar))
            views.extend(DraftedView(seq, drafts[:j]) for j in range(len(drafts) + 1))
            i += len(drafts) + 1
        else:
            groups.append(Group(i, [], None))
            views.append(seq)
            i += 1
    return groups, views
