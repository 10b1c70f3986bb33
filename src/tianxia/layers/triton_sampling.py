"""Sampling on the GPU without sorting the vocabulary and without host noise: two Triton kernels.

- ``truncation_thresholds``: for each row, the smallest logit it keeps under its top-k and top-p
  (vLLM's rule: the top-p mass is taken over the top-k set), found by a search over logit values
  rather than a sort. Each pass over the row evaluates ``NCAND`` candidate thresholds at once
  (how many logits, or how much probability mass, lies at or above each) and narrows the
  interval that holds the answer ``NCAND``-fold; ``PASSES`` passes narrow it past float32's
  resolution, so the kept set is the sort's, up to logits equal to the last one kept. The first
  ``FULL_PASSES`` passes read the whole row, as launches over (row, chunk of the vocabulary)
  programs, each weighing its chunk: the row's chunk sums (in chunk order) narrow the interval at
  the start of the next launch. After them the interval holds a few logits of each chunk: one
  launch copies those (in index order) into per-chunk slots and sums the weight above the
  interval, and one program per row runs the remaining passes over the copies alone. A row with
  more logits inside than its slots hold (never seen on model logits) runs them over the whole
  row instead; either way the result depends on the row alone.
- ``gumbel_argmax``: one token per row by the Gumbel-max trick, ``argmax(logit + g)`` over the
  kept logits with ``g = -log(-log u)``, which is a categorical draw from their softmax. ``u`` is
  a counter-based hash of (the row's 64-bit key, the token id): a seeded sequence's key comes from
  its seed and position, so its draw is the same in any batch, and no noise crosses the bus.

The chunks are of a fixed size, so no sum's order depends on the batch. Both run in Triton's interpreter on CPU tensors (the tests), as the other kernels of ``layers/``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NCAND = 16
_PASSES = 8  # 16**8 = 2**32 narrowing: past float32's spacing for any logit range under 2**8
# passes over the whole row; a pass over 256 rows x 152k logits costs ~150 us on an H200 (bound by
# the 16 compare-and-add per logit), while after two the interval holds ~1/256 of the value range
_FULL_PASSES = 2
# slots per chunk for the logits left inside the interval (flat Gaussian logits leave ~15 of 4096)
_SLOTS = 128
# Each row is cut into chunks of a fixed size, one program each, so that a pass over 256 rows of a
# 152k vocabulary runs as ~10k programs instead of 256 long ones; the size does not depend on the
# batch, so neither does the order of any sum (a seeded row's draw is batch-invariant)
_CHUNK = 4096
_BLOCK = 256
# the largest top-k read off torch's ``topk`` (faster than the search for small k: 0.64 vs 1.55 ms
# for 256 rows of 152k logits and k = 40 on an H200); a larger one is searched for
TOPK_DIRECT = 1024


@triton.jit
def _mix32(x):
    """A 32-bit integer hash with full avalanche (the "lowbias32" constants)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _extrema_kernel(logits_ptr, stride, max_ptr, min_ptr, V, C,
                    CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Each chunk's largest logit and smallest finite one."""
    row, c = tl.program_id(0), tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    mnv = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
        mv = tl.maximum(mv, x)
        mnv = tl.minimum(mnv, tl.where(x > float("-inf"), x, float("inf")))
    tl.store(max_ptr + row * C + c, tl.max(mv, axis=0))
    tl.store(min_ptr + row * C + c, tl.min(mnv, axis=0))


@triton.jit
def _row_terms(row, cmax_ptr, cmin_ptr, lo0_ptr, k_ptr, p_ptr, zpart_ptr, V, C,
               MASS: tl.constexpr, HAS_LO0: tl.constexpr, CPAD: tl.constexpr):
    """A row's largest logit, the low end of its search, whether it searches, and its target
    (top-k's count, or top-p's share of the mass at or above the low end)."""
    cc = tl.arange(0, CPAD)
    m = tl.max(tl.load(cmax_ptr + row * C + cc, mask=cc < C, other=float("-inf")), axis=0)
    if HAS_LO0:
        lo0 = tl.load(lo0_ptr + row)
    else:
        lo0 = tl.min(tl.load(cmin_ptr + row * C + cc, mask=cc < C, other=float("inf")), axis=0)
    if MASS:
        p = tl.load(p_ptr + row)
        active = p < 1.0
        target = p * tl.sum(tl.load(zpart_ptr + row * C + cc, mask=cc < C, other=0.0), axis=0)
    else:
        k = tl.load(k_ptr + row)
        active = (k > 0) & (k < V)
        target = k.to(tl.float32)
    return m, lo0, active, target


@triton.jit
def _mass_kernel(logits_ptr, stride, cmax_ptr, cmin_ptr, lo0_ptr, out_ptr, V, C,
                 HAS_LO0: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, CPAD: tl.constexpr):
    """Each chunk's ``sum(exp(x - max))`` over the logits at or above the row's low end."""
    row, c = tl.program_id(0), tl.program_id(1)
    m, thr, _, _ = _row_terms(row, cmax_ptr, cmin_ptr, lo0_ptr, lo0_ptr, lo0_ptr, lo0_ptr, V, C,
                              False, HAS_LO0, CPAD)
    base = logits_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    zv = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
        zv += tl.where((x >= thr) & (x > float("-inf")), tl.exp(x - m), 0.0)
    tl.store(out_ptr + row * C + c, tl.sum(zv, axis=0))


@triton.jit
def _weight(x, m, MASS: tl.constexpr):
    """What a logit weighs in the search: its ``exp(x - max)`` (top-p) or 1 (top-k)."""
    if MASS:
        return tl.where(x > float("-inf"), tl.exp(x - m), 0.0)
    return tl.where(x > float("-inf"), 1.0, 0.0)


@triton.jit
def _candidates(lo, hi, NCAND: tl.constexpr):
    """``NCAND`` thresholds evenly spaced in ``(lo, hi]``."""
    return lo + (hi - lo) * ((tl.arange(0, NCAND) + 1).to(tl.float32) / NCAND)


@triton.jit
def _weigh(base, start, end, cands, m, V, MASS: tl.constexpr, BLOCK: tl.constexpr, NCAND: tl.constexpr):
    """[NCAND]: the weight of the logits ``base[start:end]`` (those below ``V``) at or above each
    candidate. Sums are kept per lane and reduced once (a reduction across the block in every
    iteration costs more than the loads), laid out [NCAND, BLOCK] so that each thread compares
    its own logits with every candidate: [BLOCK, NCAND] shuffles x between threads (190 vs 150 us
    a pass over 256 rows of 152k logits on an H200)."""
    offs = tl.arange(0, BLOCK)
    acc2 = tl.zeros([NCAND, BLOCK], dtype=tl.float32)
    for at in range(start, end, BLOCK):
        x = tl.load(base + at + offs, mask=at + offs < V, other=float("-inf"))
        acc2 += tl.where(x[None, :] >= cands[:, None], _weight(x, m, MASS)[None, :], 0.0)
    return tl.sum(acc2, axis=1)


@triton.jit
def _step(lo, hi, acc, target, NCAND: tl.constexpr):
    """The interval after weighing the candidates of ``(lo, hi]``: between the last whose weight
    ``acc`` still reaches ``target`` and the first that does not."""
    j = tl.arange(0, NCAND)
    cands = _candidates(lo, hi, NCAND)
    ok = tl.sum((acc >= target).to(tl.int32), axis=0)
    new_lo = tl.sum(tl.where(j == ok - 1, cands, 0.0), axis=0)
    new_hi = tl.sum(tl.where(j == ok, cands, 0.0), axis=0)
    return tl.where(ok > 0, new_lo, lo), tl.where(ok < NCAND, new_hi, hi)


@triton.jit
def _narrow(lohi_ptr, part_ptr, row, target, C, NCAND: tl.constexpr, CPAD: tl.constexpr):
    """The interval after a launch over the whole row: its chunks' sums, added in chunk order."""
    j = tl.arange(0, NCAND)
    cc = tl.arange(0, CPAD)
    part = tl.load(part_ptr + (row * C + cc[:, None]) * NCAND + j[None, :], mask=cc[:, None] < C, other=0.0)
    return _step(tl.load(lohi_ptr + 2 * row), tl.load(lohi_ptr + 2 * row + 1), tl.sum(part, axis=0),
                 target, NCAND)


@triton.jit
def _search_pass_kernel(logits_ptr, stride, cmax_ptr, cmin_ptr, lo0_ptr, k_ptr, p_ptr, zpart_ptr,
                        lohi_in, part_in, lohi_out, part_out, V, C,
                        FIRST: tl.constexpr, MASS: tl.constexpr, HAS_LO0: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, NCAND: tl.constexpr, CPAD: tl.constexpr):
    """One pass of the search for one chunk: narrow the row's interval by the last pass's sums
    (every chunk of the row computes the same), then weigh this pass's candidates over the chunk."""
    row, c = tl.program_id(0), tl.program_id(1)
    m, lo0, active, target = _row_terms(row, cmax_ptr, cmin_ptr, lo0_ptr, k_ptr, p_ptr, zpart_ptr, V, C,
                                        MASS, HAS_LO0, CPAD)
    if active:
        if FIRST:
            lo = lo0
            hi = m
        else:
            lo, hi = _narrow(lohi_in, part_in, row, target, C, NCAND, CPAD)
        if c == 0:
            tl.store(lohi_out + 2 * row, lo)
            tl.store(lohi_out + 2 * row + 1, hi)
        base = logits_ptr + row.to(tl.int64) * stride
        weights = _weigh(base, c * CHUNK, c * CHUNK + CHUNK, _candidates(lo, hi, NCAND), m, V, MASS, BLOCK, NCAND)
        tl.store(part_out + (row * C + c) * NCAND + tl.arange(0, NCAND), weights)


@triton.jit
def _compact_kernel(logits_ptr, stride, cmax_ptr, cmin_ptr, lo0_ptr, k_ptr, p_ptr, zpart_ptr,
                    lohi_in, part_in, lohi_out, slots_ptr, count_ptr, above_ptr, V, C,
                    MASS: tl.constexpr, HAS_LO0: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                    NCAND: tl.constexpr, CPAD: tl.constexpr, SLOTS: tl.constexpr):
    """After the full passes, for one chunk: the logits inside the row's interval, copied in index
    order into the chunk's slots (their count, even past ``SLOTS``, tells the row overflowed),
    and the weight of the chunk's logits above the interval, which every candidate gets."""
    row, c = tl.program_id(0), tl.program_id(1)
    m, _lo0, active, target = _row_terms(row, cmax_ptr, cmin_ptr, lo0_ptr, k_ptr, p_ptr, zpart_ptr, V, C,
                                        MASS, HAS_LO0, CPAD)
    if active:
        lo, hi = _narrow(lohi_in, part_in, row, target, C, NCAND, CPAD)
        if c == 0:
            tl.store(lohi_out + 2 * row, lo)
            tl.store(lohi_out + 2 * row + 1, hi)
        base = logits_ptr + row.to(tl.int64) * stride
        slots = slots_ptr + (row * C + c).to(tl.int64) * SLOTS
        offs = tl.arange(0, BLOCK)
        above = tl.zeros([BLOCK], dtype=tl.float32)
        n = 0
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
            inside = (x >= lo) & (x < hi)
            at = n + tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.store(slots + at, x, mask=inside & (at < SLOTS))
            n += tl.sum(inside.to(tl.int32), axis=0)
            above += tl.where(x >= hi, _weight(x, m, MASS), 0.0)
        tl.store(count_ptr + row * C + c, n)
        tl.store(above_ptr + row * C + c, tl.sum(above, axis=0))


@triton.jit
def _finish_kernel(logits_ptr, stride, cmax_ptr, cmin_ptr, lo0_ptr, k_ptr, p_ptr, zpart_ptr,
                   lohi_in, slots_ptr, count_ptr, above_ptr, out_ptr, V, C,
                   MASS: tl.constexpr, HAS_LO0: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr,
                   NCAND: tl.constexpr, CPAD: tl.constexpr, SLOTS: tl.constexpr):
    """The remaining passes of one row, in one program: over its copied logits (plus the weight
    above the interval), or over the whole row where a chunk had more than its slots hold."""
    row = tl.program_id(0)
    m, thr, active, target = _row_terms(row, cmax_ptr, cmin_ptr, lo0_ptr, k_ptr, p_ptr, zpart_ptr, V, C,
                                        MASS, HAS_LO0, CPAD)
    if active:
        lo = tl.load(lohi_in + 2 * row)
        hi = tl.load(lohi_in + 2 * row + 1)
        cc = tl.arange(0, CPAD)
        counts = tl.load(count_ptr + row * C + cc, mask=cc < C, other=0)
        offs = tl.arange(0, BLOCK)
        if tl.max(counts, axis=0) > SLOTS:
            base = logits_ptr + row.to(tl.int64) * stride
            for _ in range(PASSES):
                lo, hi = _step(lo, hi, _weigh(base, 0, V, _candidates(lo, hi, NCAND), m, V, MASS, BLOCK, NCAND),
                               target, NCAND)
        else:
            above = tl.sum(tl.load(above_ptr + row * C + cc, mask=cc < C, other=0.0), axis=0)
            slots = slots_ptr + row.to(tl.int64) * C * SLOTS
            for _ in range(PASSES):
                cands = _candidates(lo, hi, NCAND)
                acc2 = tl.zeros([NCAND, BLOCK], dtype=tl.float32)
                # the row's slots as one flat array, a chunk's valid ones first in its SLOTS
                for start in range(0, C * SLOTS, BLOCK):
                    at = start + offs
                    n = tl.load(count_ptr + row * C + at // SLOTS, mask=at < C * SLOTS, other=0)
                    x = tl.load(slots + at, mask=(at < C * SLOTS) & (at % SLOTS < n), other=float("-inf"))
                    acc2 += tl.where(x[None, :] >= cands[:, None], _weight(x, m, MASS)[None, :], 0.0)
                lo, hi = _step(lo, hi, above + tl.sum(acc2, axis=1), target, NCAND)
        thr = lo
    tl.store(out_ptr + row, thr)


def _search(logits: torch.Tensor, cmax: torch.Tensor, cmin: torch.Tensor, lo0: torch.Tensor | None,
            top_k: torch.Tensor, top_p: torch.Tensor, zpart: torch.Tensor | None) -> torch.Tensor:
    """[S]: for each searching row, the largest threshold in ``[lo0, max]`` whose weight at or
    above it (a count of logits, or with ``zpart`` given their ``exp(x - max)``) still reaches
    its target (``lo0``, the smallest finite logit where None, must); other rows keep ``lo0``.
    ``_PASSES`` passes each narrow the interval that holds it ``_NCAND``-fold: ``_FULL_PASSES``
    launches over the whole rows, then one that copies what is left inside, then one program per
    row for the rest."""
    S, V = logits.shape
    C = cmax.shape[1]
    dev = logits.device
    lohi = [torch.empty(S, 2, device=dev), torch.empty(S, 2, device=dev)]
    part = [torch.empty(S, C, _NCAND, device=dev), torch.empty(S, C, _NCAND, device=dev)]
    mass, has_lo0 = zpart is not None, lo0 is not None
    lo0 = lo0 if has_lo0 else cmin  # unread without HAS_LO0
    zpart = zpart if mass else cmax  # unread without MASS
    row_args = (cmax, cmin, lo0, top_k, top_p, zpart)
    flags = {"MASS": mass, "HAS_LO0": has_lo0, "NCAND": _NCAND, "CPAD": triton.next_power_of_2(C)}
    for i in range(_FULL_PASSES):
        src, dst = (i + 1) % 2, i % 2
        _search_pass_kernel[(S, C)](logits, logits.stride(0), *row_args, lohi[src], part[src], lohi[dst],
                                    part[dst], V, C, FIRST=i == 0, CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=4,
                                    **flags)
    last = (_FULL_PASSES - 1) % 2
    slots = torch.empty(S, C, _SLOTS, device=dev)
    count = torch.empty(S, C, dtype=torch.int32, device=dev)
    above = torch.empty(S, C, device=dev)
    _compact_kernel[(S, C)](logits, logits.stride(0), *row_args, lohi[last], part[last], lohi[1 - last],
                            slots, count, above, V, C, CHUNK=_CHUNK, BLOCK=1024, SLOTS=_SLOTS, num_warps=4,
                            **flags)
    out = torch.empty(S, dtype=torch.float32, device=dev)
    _finish_kernel[(S,)](logits, logits.stride(0), *row_args, lohi[1 - last], slots, count, above, out, V, C,
                         PASSES=_PASSES - _FULL_PASSES, BLOCK=512, SLOTS=_SLOTS, num_warps=4, **flags)
    return out


def truncation_thresholds(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          use_k: bool = True, use_p: bool = True, k_max: int | None = None) -> torch.Tensor:
    """[S] float32: each row keeps the logits at or above its threshold. ``top_k`` (int, ``>= V``
    or 0 for none) and ``top_p`` (float, 1 for none) are per row, on the logits' device;
    ``use_k`` / ``use_p`` False skip a search no row asks for, and ``k_max`` (the largest top-k,
    known on the host) lets a top-k up to ``TOPK_DIRECT`` be read off ``topk`` instead."""
    S, V = logits.shape
    C = triton.cdiv(V, _CHUNK)
    dev = logits.device
    top_p = top_p.float()
    cmax = torch.empty(S, C, dtype=torch.float32, device=dev)
    cmin = torch.empty(S, C, dtype=torch.float32, device=dev)
    _extrema_kernel[(S, C)](logits, logits.stride(0), cmax, cmin, V, C, CHUNK=_CHUNK, BLOCK=1024, num_warps=4)
    thr = None
    if use_k and k_max is not None and 0 < k_max <= TOPK_DIRECT:
        # the k-th largest logit itself: exact, and a copy of an input, so batch-invariant
        kth = logits.topk(min(k_max, V), dim=-1, sorted=True).values
        k = top_k.clamp(min=1, max=min(k_max, V)) - 1
        has_k = (top_k > 0) & (top_k < V)
        thr = torch.where(has_k, kth.gather(1, k[:, None]).squeeze(1), cmin.amin(dim=1))
    elif use_k:
        thr = _search(logits, cmax, cmin, None, top_k, top_p, None)
    if use_p or thr is None:
        # the top-p mass is measured over the top-k set, as vLLM renormalizes after top-k
        zpart = torch.empty(S, C, dtype=torch.float32, device=dev)
        _mass_kernel[(S, C)](logits, logits.stride(0), cmax, cmin, thr if thr is not None else cmin, zpart, V, C,
                             HAS_LO0=thr is not None, CHUNK=_CHUNK, BLOCK=1024, CPAD=triton.next_power_of_2(C),
                             num_warps=4)
        thr = _search(logits, cmax, cmin, thr, top_k, top_p if use_p else torch.ones_like(top_p), zpart)
    return thr


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, keys_ptr, thr_ptr, best_ptr, idx_ptr, V, C,
                          HAS_THR: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Each chunk's best noisy score and its token (the first on ties)."""
    row, c = tl.program_id(0), tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    key_lo = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    key_hi = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    if HAS_THR:
        thr = tl.load(thr_ptr + row)
    else:
        thr = float("-inf")
    offs = tl.arange(0, BLOCK)
    # each lane keeps its own best; one reduction at the end
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf"))
        h = _mix32(_mix32(idx.to(tl.uint32) ^ key_lo) ^ key_hi)
        # 24 bits, so u is exact in float32 and never 0 or 1
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where((x >= thr) & (x > float("-inf")), x - tl.log(-tl.log(u)), float("-inf"))
        better = score > best
        best_i = tl.where(better, idx, best_i)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    tl.store(best_ptr + row * C + c, top)
    tl.store(idx_ptr + row * C + c, tl.min(tl.where(best == top, best_i, V), axis=0))


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor, thresholds: torch.Tensor | None) -> torch.Tensor:
    """[S] int64 tokens: a categorical draw from each row's softmax over its logits at or above
    its threshold. ``keys``: [S, 2] int64, the two 32-bit halves of each row's noise key."""
    S, V = logits.shape
    C = triton.cdiv(V, _CHUNK)
    best = torch.empty(S, C, dtype=torch.float32, device=logits.device)
    idx = torch.empty(S, C, dtype=torch.int32, device=logits.device)
    thr = thresholds if thresholds is not None else best  # unread without HAS_THR
    _gumbel_argmax_kernel[(S, C)](logits, logits.stride(0), keys.contiguous(), thr, best, idx, V, C,
                                  HAS_THR=thresholds is not None, CHUNK=_CHUNK, BLOCK=1024, num_warps=4)
    # the best chunk; on a tie, the lowest token id
    top = best.amax(dim=1, keepdim=True)
    return torch.where(best == top, idx, V).amin(dim=1).long()
