"""Batched sampling: one pass over the logits of every sequence that samples this step.

Order, as in vLLM: log-probabilities are taken from the raw logits; then allowed/banned tokens,
``logit_bias``, and the repetition, frequency and presence penalties; greedy rows take the argmax
there; the others get temperature, min-p, top-k and top-p, then a draw by the exponential race
(``argmax(p / q)`` with ``q ~ Exp(1)``), which equals a categorical draw and lets each seeded row
take its noise from its own generator, so a seeded request's tokens do not depend on the batch.
Everything is a tensor op over the batch; Python loops only touch rows that use a rare feature
(logit_bias, allowed_token_ids, bad_words, a seed).

On a GPU the truncation and the draw run in two Triton kernels (``triton_sampling``): top-k and
top-p thresholds found by a search over logit values instead of a sort, and a Gumbel-max draw
whose noise is hashed on the device from each row's key (a seeded row's from its seed and
position, so it is batch-invariant there too), with no host sync but the copy of the tokens. On
a CPU with the kernels built (``quant/csrc/sampling.cpp``), the Gumbel-max draw is one C++ pass
per row, the noise hashed the same way, that computes the noise only of the logits it may lift
to the lead; a top-p row then checks that its winner is in the nucleus.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from tianxia.layers.sampler_graphs import SamplerGraphs, apply_min_p, batch_kind, draw
from tianxia.quant.cpu_kernels import fused_ops


class SampledRow(Protocol):
    """What the sampler reads of a sequence (the engine's ``Sequence``, or a view of one)."""

    params: Any
    sampling_terms: tuple  # ``sampling_terms(params)``, built once per sequence
    output_token_ids: list[int]
    prompt_token_ids: list[int]
    num_output_tokens: int
    bad_words_ids: list[list[int]]
    generator: torch.Generator | None
    sample_seed: int | None
    grammar: Any


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32; 0 for greedy rows
    top_k: torch.Tensor  # [S] int64; 0 = disabled
    top_p: torch.Tensor  # [S] float32; 1 = disabled
    min_p: torch.Tensor  # [S] float32; 0 = disabled
    presence: torch.Tensor  # [S]
    frequency: torch.Tensor  # [S]
    repetition: torch.Tensor  # [S]
    output_ids: torch.Tensor | None  # [S, max_out] padded with -1, when penalties are used
    prompt_ids: torch.Tensor | None  # [S, max_prompt] padded with -1, for the repetition penalty
    generators: list[torch.Generator | None]
    banned: list[list[int]]  # per row: token ids that must not be sampled this step
    allowed: list[list[int] | None]  # per row: the only token ids that may be sampled
    bias: list[dict[int, float] | None]
    num_logprobs: list[int | None]
    grammars: list[Any]  # per row: an xgrammar matcher, or None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    seeds: list[int | None]  # per row: the seed of its own noise stream (None: the sampler's)
    steps: list[int]  # per row: its position in that stream (the number of tokens it has)

    @classmethod
    def from_sequences(cls, seqs: list[SampledRow], eos_ids: tuple[int, ...],
                       ahead: int | list[int] = 0) -> SamplingBatch:
        """``ahead`` (per row, or one for all): how many tokens past its outputs so far a row
        samples (a step scheduled before the previous one's tokens are appended; penalties and
        bad words, which read those tokens, are not allowed there)."""
        if isinstance(ahead, int):
            ahead = [ahead] * len(seqs)
        # a step samples a few hundred rows whose requests mostly ask the same terms (clients at
        # their defaults; seeds and stop conditions are not terms): equal terms are one object
        # (sampling_terms), each distinct row of terms is built once, and a gather spreads them
        # over the rows (building this batch is on the host's path of every decode step)
        by_id: dict[int, int] = {}
        distinct_terms: dict[tuple, int] = {}
        row_terms = []
        for s in seqs:
            t = s.sampling_terms
            k = by_id.get(id(t))
            if k is None:
                k = by_id[id(t)] = distinct_terms.setdefault(t, len(distinct_terms))
            row_terms.append(k)
        terms = list(distinct_terms)
        numbers = torch.tensor([t[0] for t in terms], dtype=torch.float32).reshape(-1, 7)[host_ints(row_terms)]
        penalized = [terms[k][2] for k in row_terms]
        output_ids = prompt_ids = None
        if any(penalized):
            output_ids = _pad([s.output_token_ids if pen else [] for s, pen in zip(seqs, penalized)])
            rep = [s.prompt_token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs]
            prompt_ids = _pad(rep)
        banned = []
        for s, extra in zip(seqs, ahead):
            ids: list[int] = []
            if s.num_output_tokens + extra < s.params.min_tokens:
                ids.extend((*eos_ids, *s.params.stop_token_ids))
            if s.bad_words_ids:
                ids.extend(_bad_word_bans(s.output_token_ids, s.bad_words_ids))
            banned.append(ids)
        distinct = [t for t in terms if t[1]]  # the sampled rows' parameters
        return cls(
            temperature=numbers[:, 0].contiguous(),
            top_k=numbers[:, 1].to(torch.int64),
            top_p=numbers[:, 2].contiguous(),
            min_p=numbers[:, 3].contiguous(),
            presence=numbers[:, 4].contiguous(),
            frequency=numbers[:, 5].contiguous(),
            repetition=numbers[:, 6].contiguous(),
            output_ids=output_ids,
            prompt_ids=prompt_ids,
            generators=[s.generator for s in seqs],
            banned=banned,
            allowed=[s.params.allowed_token_ids for s in seqs],
            bias=[s.params.logit_bias for s in seqs],
            num_logprobs=[s.params.logprobs for s in seqs],
            grammars=[s.grammar for s in seqs],
            all_greedy=not distinct,
            any_top_k=any(t[0][1] > 0 for t in distinct),
            any_top_p=any(t[0][2] < 1.0 for t in distinct),
            any_min_p=any(t[0][3] > 0.0 for t in distinct),
            seeds=[s.sample_seed for s in seqs],
            steps=[s.num_output_tokens + extra for s, extra in zip(seqs, ahead)],
        )


_INTERNED_TERMS: dict[tuple, tuple] = {}


def sampling_terms(p: Any) -> tuple[tuple[float, ...], bool, bool]:
    """One SamplingParams as a row of the batch's numbers, whether it samples, whether it is
    penalized. Equal terms come back as one object, so a batch tells its rows apart by identity
    where it can: served requests each bring their own SamplingParams, most with the same terms
    (the comparison by value cost a step of 256 such rows about 0.2 ms more than shared ones)."""
    greedy = p.greedy
    numbers = (0.0 if greedy else p.temperature, float(p.top_k), p.top_p, p.min_p,
               p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    terms = (numbers, not greedy, p.needs_penalties)
    if len(_INTERNED_TERMS) >= 4096:
        _INTERNED_TERMS.clear()  # clients that send ever new values: only the sharing is lost
    return _INTERNED_TERMS.setdefault(terms, terms)


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out


def _bad_word_bans(output: list[int], bad_words_ids: list[list[int]]) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    bans = []
    for word in bad_words_ids:
        prefix = word[:-1]
        if not prefix or output[-len(prefix):] == prefix:
            bans.append(word[-1])
    return bans


def _row_token_index(per_row: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column index tensors of every row's token ids (a row may have none), made with one
    host-to-device copy."""
    rows = [row for row, ids in enumerate(per_row) if ids for _ in ids]
    cols = [i for ids in per_row if ids for i in ids]
    where = to_device(host_ints(rows + cols), device)
    return where[: len(rows)], where[len(rows):]


def host_ints(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of Python ints. ``torch.tensor`` converts a list element by element at
    about 100 ns each; packing them into an ``array`` first takes a third of that, and a step
    sends thousands (its ids, positions, slots and block tables). Shares the array's memory."""
    return torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the kernels queued there: a blocking copy
    to a GPU waits for the whole stream, which would stall a step launched ahead of its
    predecessor's end (the copy goes from pinned memory instead). A copy from pageable memory
    waits too, even with ``non_blocking``; so does ``gpu_tensor[index] = python_number``, whose
    number crosses as a host tensor: write device scalars (``new_full``) instead."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _counts(ids: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """[S, V] occurrence counts of the (padded with -1) token ids of each row, built where the
    logits are (the ids cross, not an [S, V] table)."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=device)
    ids = to_device(ids, device)
    idx = torch.where(ids < 0, vocab, ids)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[-1]
    out_counts = _counts(batch.output_ids, vocab, logits.device)
    seen = out_counts > 0
    if batch.prompt_ids is not None:
        seen_any = seen | (_counts(batch.prompt_ids, vocab, logits.device) > 0)
    else:
        seen_any = seen
    rep = to_device(batch.repetition, logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen_any, penalized, logits)
    logits = logits - to_device(batch.frequency, logits.device)[:, None] * out_counts
    logits = logits - to_device(batch.presence, logits.device)[:, None] * seen.float()
    return logits


# How many of the largest logits a top-p row without top-k looks among first: sampled rows of
# SmolLM2 at temperature 0.8, top-p 0.95 on text keep a median of 18 tokens, and 2.5% more than
# 1024. A wider nucleus (flat distributions: random-token prompts, high temperatures) is found by
# ``nucleus_floor`` without a sort: a full sort of a 49k vocabulary costs about 4 ms per row on a
# CPU core, ``topk(256)`` about 0.1 ms.
TOP_P_CANDIDATES = (256,)

# nucleus_floor's bins: NUCLEUS_BINS over the NUCLEUS_SPAN logits below a row's largest (all lower
# logits share the last bin; e^-30 of the top token's weight each, they matter only for a top-p
# within a rounding error of 1)
NUCLEUS_BINS = 2048
NUCLEUS_SPAN = 30.0


def _truncate_sorted(values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                     row_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of logits in descending order: which to keep under top-k ``k`` and top-p, and
    whether the top-p mass was reached among them. The top-p probabilities are normalized over
    the top-k set (as vLLM), or by ``row_norm`` (a whole row's log-sum-exp) where that is not NaN."""
    ranks = torch.arange(values.shape[-1], device=values.device)
    in_k = ranks[None, :] < k[:, None]
    norm = values.masked_fill(~in_k, float("-inf")).logsumexp(dim=-1, keepdim=True)
    if row_norm is not None:
        norm = torch.where(row_norm.isnan(), norm, row_norm)
    probs = (values - norm).exp().masked_fill(~in_k, 0.0)
    mass = probs.cumsum(dim=-1)
    # a token is kept while the mass strictly before it is below p; the top token always stays
    keep = (mass - probs < top_p[:, None]) & in_k
    keep[:, 0] = True
    return keep, mass[:, -1] >= top_p


def nucleus_floor(logits: torch.Tensor, top_p: torch.Tensor, row_norm: torch.Tensor) -> torch.Tensor:
    """[R] the smallest logit each row's top-p nucleus keeps, over the whole row's distribution
    (``row_norm``: [R, 1] log-sum-exps), without sorting the row: its probability mass is binned
    by logit below the row's largest, the bin where the mass before a token reaches p is found
    from the bins' running sum, and only that bin's logits (a few dozen) are ordered. The kept
    set is the sort's but for ties with the last kept logit, which are kept too."""
    rows = logits.shape[0]
    # a finite top keeps every bin index a number (-inf logits: bans, min-p, land in the last bin)
    top = logits.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(logits.dtype).min)
    probs = (logits - row_norm).exp_()
    bins = (top - logits).mul_(NUCLEUS_BINS / NUCLEUS_SPAN).clamp_(max=NUCLEUS_BINS - 1).long()
    running = probs.new_zeros(rows, NUCLEUS_BINS).scatter_add_(1, bins, probs).cumsum_(dim=1)
    # the first bin whose running mass reaches p holds the last kept token
    last = torch.searchsorted(running, top_p[:, None].to(running.dtype)).clamp_(max=NUCLEUS_BINS - 1)
    before = torch.where(last > 0, running.gather(1, (last - 1).clamp(min=0)), 0.0).squeeze(1)
    # that bin's tokens of every row, in one list ordered by row, then by logit, descending
    row, col = (bins == last).nonzero(as_tuple=True)
    order = logits[row, col].argsort(descending=True, stable=True)
    order = order[row[order].argsort(stable=True)]
    row, col = row[order], col[order]
    values, mass = logits[row, col], probs[row, col].double()
    counts = torch.bincount(row, minlength=rows)
    first = counts.cumsum(0) - counts
    exclusive = mass.cumsum(0) - mass
    exclusive = exclusive - exclusive[first[row]]  # the mass before each token within its row's bin
    kept = before.double()[row] + exclusive < top_p.double()[row]
    kept[first[counts > 0]] = True  # the bin holds the crossing token: its largest logit stays
    floor = torch.full((rows,), float("inf"), dtype=logits.dtype, device=logits.device)
    floor.scatter_reduce_(0, row[kept], values[kept], reduce="amin")
    # a row whose running mass never reached p (a top-p within rounding of 1) keeps everything
    return floor.masked_fill_(counts == 0, float("-inf"))


@dataclass
class Nucleus:
    """Each row's kept tokens under its top-k and top-p: for a row whose kept tokens are all
    among its ``values.shape[1]`` largest logits (``fits``), those; for the others, every logit
    at or above ``floor`` (-inf for a row without truncation: all of them)."""

    values: torch.Tensor  # [S, W] each row's largest logits, descending; -inf where not kept
    ids: torch.Tensor  # [S, W] their token ids
    fits: torch.Tensor  # [S] bool
    floor: torch.Tensor  # [S] float


def find_nucleus(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool, use_p: bool,
    kernels: Any = None,
) -> Nucleus | None:
    """Each row's top-k and top-p nucleus (None where no row truncates), found among its largest
    logits (``topk``): as many as its top-k or, for a top-p row without one, TOP_P_CANDIDATES[0];
    a wider top-p nucleus by its floor. With the CPU kernels (``kernels``: the extension, or None
    for torch alone), a top-p row without a top-k goes to its floor directly (``nucleus_floor``
    there costs about a ``topk``)."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab) if use_k else torch.full_like(top_k, vocab)
    p = top_p if use_p else torch.ones_like(top_p)
    has_k, has_p = k < vocab, p < 1.0
    truncated = has_k | has_p
    if not bool(truncated.any()):
        return None
    direct = has_p & ~has_k if kernels is not None else torch.zeros_like(has_p)
    first = TOP_P_CANDIDATES[0]
    width = int(torch.where(has_k, k, torch.where(has_p & ~direct, first, 0)).clamp(max=vocab).max())
    row_norm = None
    if width > 0:
        values, ids = logits.topk(width, dim=-1)
        # without a top-k, a row's nucleus is measured against its whole distribution
        if bool((has_p & ~has_k & ~direct).any()):
            row_norm = torch.where(has_k, float("nan"), logits.logsumexp(dim=-1))[:, None]
        keep, reached = _truncate_sorted(values, k.clamp(max=width), p, row_norm)
        wide = has_p & ~has_k & ~direct & ~reached
        fits = truncated & ~direct & ~wide
        values = values.masked_fill(~keep, float("-inf"))
    else:
        values = logits.new_empty(logits.shape[0], 0)
        ids = torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
        wide = fits = torch.zeros_like(has_p)
    floor = torch.full_like(p, float("-inf"))
    if bool((wide | direct).all()) and kernels is not None:
        floor = kernels.nucleus_floor(logits, p, NUCLEUS_BINS, NUCLEUS_SPAN)  # no copy of the rows
    elif bool((wide | direct).any()):
        rows = (wide | direct).nonzero().flatten()
        if kernels is not None:
            floor[rows] = kernels.nucleus_floor(logits[rows], p[rows], NUCLEUS_BINS, NUCLEUS_SPAN)
        else:
            floor[rows] = nucleus_floor(logits[rows], p[rows], row_norm[rows])
    return Nucleus(values, ids, fits, floor)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool, use_p: bool
) -> torch.Tensor:
    """Set every logit outside each row's top-k and top-p nucleus (:func:`find_nucleus`) to -inf.
    Rows with neither are left as they are."""
    nucleus = find_nucleus(logits, top_k, top_p, use_k, use_p, fused_ops(logits))
    if nucleus is None:
        return logits
    out = logits.masked_fill(logits < nucleus.floor[:, None], float("-inf"))
    rows = nucleus.fits.nonzero().flatten()
    if len(rows):
        out[rows] = torch.full_like(out[rows], float("-inf")).scatter_(-1, nucleus.ids[rows],
                                                                      nucleus.values[rows])
    return out


@dataclass
class SamplerOutput:
    tokens: list[int]
    # per row: None, or (top ids, top logprobs, chosen logprob, chosen rank)
    logprobs: list[tuple[list[int], list[float], float, int] | None]
    # rows whose constraints (grammar, allowed ids, bans) left no token to sample
    dead_rows: list[int] = field(default_factory=list)


def _truncation(batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k and top-p, disabled on greedy rows (their token is the argmax: there is
    no truncation to find) and wherever no row of the batch asks for it."""
    greedy = batch.temperature == 0
    top_k = torch.where(greedy, 0, batch.top_k) if batch.any_top_k else torch.zeros_like(batch.top_k)
    top_p = torch.where(greedy, 1.0, batch.top_p) if batch.any_top_p else torch.ones_like(batch.top_p)
    return top_k, top_p


def may_empty_rows(batch: SamplingBatch, vocab: int) -> bool:
    """Whether a row's constraints may leave it no token. A grammar or an allowed list can; bans
    alone (min_tokens' stop tokens, bad words: a handful of ids a row) only when they cover the
    vocabulary, so the usual min_tokens request skips the two passes over every logit that
    finding such rows costs."""
    return (any(g is not None for g in batch.grammars) or any(a is not None for a in batch.allowed)
            or any(len(b) >= vocab for b in batch.banned))


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_keys(rng: random.Random, seeds: list[int | None], steps: list[int]) -> torch.Tensor:
    """[S, 2] int64: the two 32-bit halves of each row's noise key for this step, splitmix64 of
    a seeded row's seed and position (so its draw is the same in any batch), of one fresh draw
    of ``rng`` and the row's index for the others (vectorized: a per-row Python draw costs a large
    batch 0.15 ms a step)."""
    z = np.arange(1, len(seeds) + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(rng.getrandbits(64))
    seeded = [i for i, seed in enumerate(seeds) if seed is not None]
    if seeded:
        seed = np.array([seeds[i] for i in seeded], dtype=np.uint64)
        step = np.array([steps[i] + 1 for i in seeded], dtype=np.uint64)
        z[seeded] = seed * np.uint64(0x9E3779B97F4A7C15) + step * np.uint64(0xD1B54A32D192ED03)
    keys = _splitmix64(z)
    halves = np.stack([keys & np.uint64(0xFFFFFFFF), keys >> np.uint64(32)], axis=1)
    return torch.from_numpy(halves.astype(np.int64))


class Sampler:
    def __init__(self, seed: int = 0, device_kernels: bool | None = None, host_kernels: bool = True) -> None:
        """``device_kernels``: draw with the Triton kernels (None: where the logits are on a GPU
        and Triton is installed; True also runs them on CPU tensors under Triton's interpreter).
        ``host_kernels``: draw CPU logits with the CPU kernels' race where they are built."""
        self.host_kernels = host_kernels
        self.generator = torch.Generator().manual_seed(seed)
        self.keys = random.Random(seed)  # unseeded rows' noise keys of the kernels' draws
        self.device_kernels = device_kernels
        self.grammar_backend = None  # set by the engine when a request is constrained
        self.graphs: SamplerGraphs | None = None  # set by the runner where decode steps are graphed

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if any(k is not None for k in batch.num_logprobs):
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = self.process(logits, batch)
        dead_rows: list[int] = []
        if may_empty_rows(batch, logits.shape[1]):
            dead = torch.isneginf(logits).all(dim=-1)
            if bool(dead.any()):
                dead_rows = dead.nonzero().flatten().tolist()
                logits[dead] = 0.0  # sample something harmless; the caller discards these rows
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1).cpu()
        else:
            tokens = self._sample(logits, batch)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self.logprobs(raw_logprobs, token_list, batch), dead_rows)

    def sample_on_device(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[rows] int64 tokens left on the logits' device, and the rows left with no admissible
        token (None where no row is constrained), with no host sync: the caller copies them back
        when it needs them. For logits :meth:`samples_on_device` takes, with no logprobs asked."""
        logits = self.process(logits.float(), batch)
        dead = None
        if may_empty_rows(batch, logits.shape[1]):
            dead = torch.isneginf(logits).all(dim=-1)
            logits.masked_fill_(dead[:, None], 0.0)  # sample something harmless; the caller drops these rows
        if batch.all_greedy:
            return logits.argmax(dim=-1), dead
        return self._draw_on_device(logits, batch), dead

    def process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        neg_inf = float("-inf")
        constrained = [i for i, g in enumerate(batch.grammars) if g is not None]
        if constrained:
            self.grammar_backend.apply(logits, constrained, [batch.grammars[i] for i in constrained])
        # each kind of per-row constraint goes in as one indexed write: an index tensor per row
        # would be a host-to-device copy and a launch per row on a GPU
        with_allowed = [row for row, allowed in enumerate(batch.allowed) if allowed is not None]
        if with_allowed:
            rows, cols = _row_token_index([batch.allowed[row] for row in with_allowed], logits.device)
            keep = torch.full((len(with_allowed), logits.shape[1]), neg_inf, dtype=logits.dtype,
                              device=logits.device)
            keep.index_put_((rows, cols), keep.new_zeros(()))
            # a list index would cross as a pageable host tensor, a copy that waits for the stream
            logits[to_device(host_ints(with_allowed), logits.device)] += keep
        if any(batch.bias):
            rows, cols = _row_token_index(batch.bias, logits.device)
            vals = [v for bias in batch.bias if bias for v in bias.values()]
            logits.index_put_((rows, cols), to_device(torch.tensor(vals, dtype=logits.dtype), logits.device),
                              accumulate=True)
        if batch.output_ids is not None:
            logits = apply_penalties(logits, batch)
        if any(batch.banned):
            # min_tokens bans the stop tokens of every row still short of it, every step
            # (benchmarks send min_tokens = max_tokens)
            rows, cols = _row_token_index(batch.banned, logits.device)
            logits.index_put_((rows, cols), logits.new_full((), neg_inf))
        return logits

    def _draw_on_device(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # temperature and min-p as on the host path, then the truncation thresholds and the
        # Gumbel-max draw in Triton (no sort, no host noise, no host sync): replayed from the
        # sampler's graphs where there are some, launched otherwise
        top_k, top_p = _truncation(batch)
        numbers = torch.stack([batch.temperature, top_k.float(), top_p, batch.min_p])
        kind = batch_kind(top_k, batch.any_top_k, batch.any_top_p, batch.any_min_p, logits.shape[1])
        keys = row_keys(self.keys, batch.seeds, batch.steps)
        if self.graphs is not None and self.graphs.fits(logits):
            return self.graphs.sample(logits, numbers, keys, kind)
        dev = logits.device
        return draw(logits, to_device(numbers, dev), to_device(keys, dev), kind)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if self.samples_on_device(logits):
            return self._draw_on_device(logits, batch).cpu()
        greedy_cpu = batch.temperature == 0
        greedy_rows = greedy_cpu.to(logits.device, non_blocking=True)
        # the greedy rows' tokens first: what follows works in place on this step's logits
        greedy_tokens = logits.argmax(dim=-1) if bool(greedy_cpu.any()) else None
        kernels = fused_ops(logits) if self.host_kernels else None
        if kernels is not None:  # they take min-p's floor in their own passes over each row
            tokens = self._race_in_nucleus(kernels, Sampler.scaled(logits, batch, min_p=False), batch)
        else:
            tokens = self.draw_truncated(Sampler.scaled(logits, batch), batch)
        if greedy_tokens is not None:
            tokens = torch.where(greedy_rows, greedy_tokens, tokens)
        return tokens.cpu()

    def draw_truncated(self, scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per sampled row from scaled logits (min-p applied) under each row's top-k
        and top-p, by the exponential race in torch, where the CPU kernels are not built
        (:meth:`_race_in_nucleus` where they are), with a noise per candidate where the
        candidates are few:

        - a row whose kept tokens are all among its largest logits races only those;
        - a row that keeps every token (temperature alone, or min-p, whose floor is already in the
          logits) draws whether its token is among its TOP_P_CANDIDATES[0] largest (with their
          share of the mass) and races those, or the rest of the row;
        - a row with a wider top-p nucleus races the whole row above its floor.

        A seeded row draws a noise for every token of the vocabulary from its generator, indexed
        by token id, whichever way it goes: its tokens are those of a race over the whole
        truncated row, in any batch. Greedy rows get 0 (the caller takes their argmax)."""
        rows, vocab = scaled.shape
        nucleus = None
        if batch.any_top_k or batch.any_top_p:
            top_k, top_p = _truncation(batch)
            nucleus = find_nucleus(scaled, top_k.to(scaled.device), top_p.to(scaled.device),
                                   batch.any_top_k, batch.any_top_p)
        tokens = torch.zeros(rows, dtype=torch.int64, device=scaled.device)
        fits = torch.zeros(rows, dtype=torch.bool) if nucleus is None else nucleus.fits.cpu()
        keeps_all = torch.ones(rows, dtype=torch.bool) if nucleus is None else \
            (nucleus.floor == float("-inf")).cpu() & ~fits
        sampled = batch.temperature != 0
        seeded = torch.tensor([g is not None for g in batch.generators], dtype=torch.bool)
        whole = sampled & ~fits & (seeded | ~keeps_all)  # races over the whole row

        near = (sampled & fits & ~seeded).nonzero().flatten()
        if len(near):
            tokens[near] = self._race_candidates(nucleus.values[near], nucleus.ids[near])
        for row in (sampled & fits & seeded).nonzero().flatten().tolist():
            noise = self.uniform([batch.generators[row]], vocab)[0].log_().neg_()
            ids, values = nucleus.ids[row], nucleus.values[row]
            weight = (values - values[0]).exp_()
            tokens[row] = ids[(weight / noise.to(ids.device)[ids]).argmax()]

        mixed = (sampled & keeps_all & ~seeded).nonzero().flatten()
        if len(mixed):
            x = scaled[mixed]
            values, ids = x.topk(min(TOP_P_CANDIDATES[0], vocab), dim=-1)
            share = (values.logsumexp(dim=-1) - x.logsumexp(dim=-1)).exp_().cpu()
            rest = x.scatter_(1, ids, float("-inf"))  # x is a copy of the rows
            # a row all of whose finite logits are candidates has nothing else to draw
            inside = (torch.rand(len(mixed), generator=self.generator) < share) | \
                torch.isneginf(rest).all(dim=-1).cpu()
            if bool(inside.any()):
                tokens[mixed[inside]] = self._race_candidates(values[inside], ids[inside])
            if not bool(inside.all()):
                out = (~inside).nonzero().flatten()
                tokens[mixed[out]] = self.draw(rest[out].softmax(dim=-1), [None] * len(out))

        wide = whole.nonzero().flatten()
        if len(wide):
            x = scaled[wide]
            if nucleus is not None:
                x = x.masked_fill_(x < nucleus.floor[wide][:, None], float("-inf"))
            tokens[wide] = self.draw(x.softmax(dim=-1), [batch.generators[i] for i in wide.tolist()])
        return tokens

    def _race_in_nucleus(self, kernels: Any, scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The CPU kernels' race over scaled logits (min-p not applied): one pass over each row
        races its logits, with noise hashed from the row's key and the token id as on the GPU (a
        seeded row's key from its seed and position, so its tokens do not depend on the batch).
        Min-p's floor is the row's largest logit plus ln(min_p), found by the kernels; a row with
        a top-k keeps the logits at or above the smallest its min-p, top-k and top-p keep
        (``top_k_floor``, one pass over the row); a row with top-p alone is truncated by the race,
        which finds the nucleus (of the distribution above min-p's floor) only when its winner is
        not in it."""
        rows, vocab = scaled.shape
        floor = torch.full((rows,), float("-inf"))
        top_p = torch.ones(rows)
        min_p = batch.min_p  # 0 where a row has none
        if batch.any_top_k or batch.any_top_p:
            top_k, p = _truncation(batch)
            has_k = (top_k > 0) & (top_k < vocab)
            top_p = torch.where(has_k, 1.0, p)
            if bool(has_k.any()):
                floor = kernels.top_k_floor(scaled, torch.where(has_k, top_k, 0), p, min_p)
        keys = row_keys(self.keys, batch.seeds, batch.steps)
        sampled = batch.temperature != 0
        if bool(sampled.all()):
            return kernels.race_draw(scaled, floor, keys, top_p, min_p, NUCLEUS_BINS, NUCLEUS_SPAN)
        tokens = torch.zeros(rows, dtype=torch.int64)
        at = sampled.nonzero().flatten()
        tokens[at] = kernels.race_draw(scaled[at], floor[at], keys[at], top_p[at], min_p[at], NUCLEUS_BINS,
                                       NUCLEUS_SPAN)
        return tokens

    def _race_candidates(self, values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The exponential race among each row's candidates (logits in descending order, -inf
        where not kept), with noise from the sampler's generator."""
        noise = torch.rand(values.shape, generator=self.generator).log_().neg_().to(values.device)
        weight = (values - values[:, :1]).exp_()
        return ids.gather(1, (weight / noise).argmax(dim=-1, keepdim=True)).squeeze(1)

    def samples_on_device(self, logits: torch.Tensor) -> bool:
        """Whether these logits are sampled by the Triton kernels (which, unlike a draw from a
        softmax, take a NaN row without failing: the caller may look for NaN rows afterwards)."""
        if self.device_kernels is None:
            from tianxia.layers.attention.backend import triton_available

            self.device_kernels = logits.is_cuda and triton_available()
        return self.device_kernels

    @staticmethod
    def scaled(logits: torch.Tensor, batch: SamplingBatch, min_p: bool = True) -> torch.Tensor:
        """Logits divided by each row's temperature, and min-p's floor applied where ``min_p``
        (in place)."""
        temp = torch.where(batch.temperature == 0, torch.ones_like(batch.temperature), batch.temperature)
        scaled = logits.div_(temp.to(logits.device)[:, None]) if bool((temp != 1).any()) else logits
        if min_p and batch.any_min_p:
            apply_min_p(scaled, batch.min_p.to(logits.device))
        return scaled

    @staticmethod
    def probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution each sampled row draws from, from processed logits (in place):
        temperature, min-p, top-k and top-p. Greedy rows get a meaningless row."""
        scaled = Sampler.scaled(logits, batch)
        if batch.any_top_k or batch.any_top_p:
            top_k, top_p = _truncation(batch)
            scaled = apply_top_k_top_p(scaled, top_k.to(logits.device), top_p.to(logits.device),
                                       batch.any_top_k, batch.any_top_p)
        return scaled.softmax(dim=-1)

    def draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row by the exponential race, ``argmax(p / q)`` with ``q ~ Exp(1)``, which
        is a categorical draw; a seeded row takes its noise from its own generator, so its tokens
        do not depend on the batch it is in. (A draw by inverse transform, one uniform number per
        row, is cheaper, but its running sum over the vocabulary turns the last-bit differences
        of a row's logits between batch compositions into different tokens far more often.) The
        noise is ``-log(u)`` of uniform numbers: torch's ``exponential_`` takes 3x as long."""
        noise = self.uniform(generators, probs.shape[1])
        noise = noise.log_().neg_().to(probs.device)
        return (probs / noise).argmax(dim=-1)

    def uniform(self, generators: list[torch.Generator | None], width: int) -> torch.Tensor:
        """[rows, width] uniform numbers on the host: a seeded row's from its own generator, the
        others' from the sampler's."""
        out = torch.empty(len(generators), width, dtype=torch.float32)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            out[shared] = torch.rand(len(shared), width, generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                out[i] = torch.rand(width, generator=g)
        return out

    @staticmethod
    def logprobs(raw: torch.Tensor | None, tokens: list[int], batch: SamplingBatch):
        if raw is None:
            return [None] * len(tokens)
        rows = [i for i, k in enumerate(batch.num_logprobs) if k is not None]
        k_max = max(batch.num_logprobs[i] for i in rows)
        sub = raw[rows]
        top_vals, top_ids = sub.topk(max(k_max, 1), dim=-1)
        chosen_ids = torch.tensor([tokens[i] for i in rows], device=raw.device)
        chosen = sub.gather(1, chosen_ids[:, None]).squeeze(1)
        ranks = (sub > chosen[:, None]).sum(dim=-1) + 1
        out: list = [None] * len(tokens)
        top_vals, top_ids = top_vals.cpu().tolist(), top_ids.cpu().tolist()
        chosen, ranks = chosen.cpu().tolist(), ranks.cpu().tolist()
        for j, i in enumerate(rows):
            k = batch.num_logprobs[i]
            out[i] = (top_ids[j][:k], top_vals[j][:k], chosen[j], ranks[j])
        return out
