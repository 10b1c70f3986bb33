"""Sampling on the GPU without sorting the vocabulary and without host noise: two Triton kernels.

- ``truncation_thresholds``: for each row, the smallest logit it keeps under its top-k and top-p
  (vLLM's rule: the top-p mass is taken over the top-k set), found by a search over logit values
  rather than a sort. Each pass over the row evaluates ``NCAND`` candidate thresholds at once
  (how many logits, or how much probability mass, lies at or above each) and narrows the
  interval that holds the answer ``NCAND``-fold; ``PASSES`` passes narrow it past float32's
  resolution, so the kept set is the sort's, up to logits equal to the last one kept.
- ``gumbel_argmax``: one token per row by the Gumbel-max trick, ``argmax(logit + g)`` over the
  kept logits with ``g = -log(-log u)``, which is a categorical draw from their softmax. ``u`` is
  a counter-based hash of (the row's 64-bit key, the token id): a seeded sequence's key comes from
  its seed and position, so its draw is the same in any batch, and no noise crosses the bus.

Both run in Triton's interpreter on CPU tensors (the tests), as the other kernels of ``layers/``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NCAND = 16
_PASSES = 8  # 16**8 = 2**32 narrowing: past float32's spacing for any logit range under 2**8


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
def _search(base, V, lo, hi, m, target, MASS: tl.constexpr, BLOCK: tl.constexpr,
            NCAND: tl.constexpr, PASSES: tl.constexpr):
    """The largest threshold ``t`` in ``[lo, hi]`` whose weight at or above it (a count of logits,
    or with ``MASS`` their ``exp(x - m)``) is still at least ``target``; ``lo`` must satisfy it."""
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, NCAND)
    for _ in range(PASSES):
        cands = lo + (hi - lo) * ((j + 1).to(tl.float32) / NCAND)
        acc = tl.zeros([NCAND], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
            if MASS:
                w = tl.where(x > float("-inf"), tl.exp(x - m), 0.0)
            else:
                w = tl.where(x > float("-inf"), 1.0, 0.0)
            acc += tl.sum(tl.where(x[:, None] >= cands[None, :], w[:, None], 0.0), axis=0)
        # the weight falls as the threshold rises: the first `ok` candidates satisfy the target
        ok = tl.sum((acc >= target).to(tl.int32), axis=0)
        new_lo = tl.sum(tl.where(j == ok - 1, cands, 0.0), axis=0)
        new_hi = tl.sum(tl.where(j == ok, cands, 0.0), axis=0)
        lo = tl.where(ok > 0, new_lo, lo)
        hi = tl.where(ok < NCAND, new_hi, hi)
    return lo


@triton.jit
def _thresholds_kernel(logits_ptr, stride, k_ptr, p_ptr, out_ptr, V,
                       BLOCK: tl.constexpr, NCAND: tl.constexpr, PASSES: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    k = tl.load(k_ptr + row)
    p = tl.load(p_ptr + row)
    offs = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    mn = tl.min(tl.full([BLOCK], float("inf"), tl.float32), axis=0)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
        m = tl.maximum(m, tl.max(x, axis=0))
        mn = tl.minimum(mn, tl.min(tl.where(x > float("-inf"), x, float("inf")), axis=0))
    thr = mn
    if k < V:
        thr = _search(base, V, mn, m, m, k.to(tl.float32), False, BLOCK, NCAND, PASSES)
    if p < 1.0:
        # the top-p mass is measured over the top-k set, as vLLM renormalizes after top-k
        z = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
            z += tl.sum(tl.where(x >= thr, tl.exp(x - m), 0.0), axis=0)
        thr = _search(base, V, thr, m, m, p * z, True, BLOCK, NCAND, PASSES)
    tl.store(out_ptr + row, thr)


def truncation_thresholds(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[S] float32: each row keeps the logits at or above its threshold. ``top_k`` (int, ``>= V``
    or 0 for none) and ``top_p`` (float, 1 for none) are per row, on the logits' device."""
    S, V = logits.shape
    k = torch.where(top_k > 0, top_k, V).to(torch.int32)
    out = torch.empty(S, dtype=torch.float32, device=logits.device)
    _thresholds_kernel[(S,)](logits, logits.stride(0), k, top_p.float().contiguous(), out, V,
                             BLOCK=min(512, triton.next_power_of_2(V)), NCAND=_NCAND, PASSES=_PASSES, num_warps=8)
    return out


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, keys_ptr, thr_ptr, out_ptr, V,
                          HAS_THR: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    key_lo = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    key_hi = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    if HAS_THR:
        thr = tl.load(thr_ptr + row)
    else:
        thr = float("-inf")
    offs = tl.arange(0, BLOCK)
    best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    best_i = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf"))
        h = _mix32(_mix32(idx.to(tl.uint32) ^ key_lo) ^ key_hi)
        # 24 bits, so u is exact in float32 and never 0 or 1
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where((x >= thr) & (x > float("-inf")), x - tl.log(-tl.log(u)), float("-inf"))
        bmax = tl.max(score, axis=0)
        barg = tl.argmax(score, axis=0).to(tl.int32)
        best_i = tl.where(bmax > best, start + barg, best_i)
        best = tl.maximum(best, bmax)
    tl.store(out_ptr + row, best_i)


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor, thresholds: torch.Tensor | None) -> torch.Tensor:
    """[S] int64 tokens: a categorical draw from each row's softmax over its logits at or above
    its threshold. ``keys``: [S, 2] int64, the two 32-bit halves of each row's noise key."""
    S, V = logits.shape
    out = torch.empty(S, dtype=torch.int32, device=logits.device)
    thr = thresholds if thresholds is not None else out  # unread without HAS_THR
    _gumbel_argmax_kernel[(S,)](logits, logits.stride(0), keys.contiguous(), thr, out, V,
                                HAS_THR=thresholds is not None,
                                BLOCK=min(2048, triton.next_power_of_2(V)), num_warps=8)
    return out.long()
