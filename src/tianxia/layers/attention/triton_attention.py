"""Paged attention in Triton: the KV-cache write, split-K decode and paged prefill.

Three kernels over the cache layout ``[num_blocks, block_size, Hk, D]`` (one per K and V):

- ``write_kv``: each new token's K/V goes to its slot (``block * block_size + offset``); slots
  below zero (the padding rows of a CUDA-graph batch) are skipped.
- ``decode_attention``: one query token per sequence. One program per (sequence, KV head, split)
  computes the whole GQA group of query heads against its share of the context with ``tl.dot``
  (the group padded to 16 rows), so each K/V tile is read once per group. With more than one split
  the partial results (max, sum, unnormalized output) go to a scratch buffer and a second kernel
  combines them. The split count is fixed by the caller (the batch size and a bound on the context,
  so a captured CUDA graph keeps its grid); each program finds its token range from the actual
  length, so empty splits cost one early exit.
- ``prefill_attention``: flash attention for the prompt chunks of a step, reading K and V from the
  paged cache (after ``write_kv``), so chunked prefill and prefix-cache hits need no gather:
  one program per (sequence, query head, query tile), causal, with optional sliding window and
  soft-capping.

All three run under ``TRITON_INTERPRET=1`` on CPU tensors (the tests check them there against the
``torch`` backend).

An fp8 cache (``--kv-cache-dtype fp8``: float8 e4m3, vLLM's format) has one float32 scale for K
and one for V per layer, ``kv_scale`` [2] on the device: the write stores ``clamp(x / scale,
±448)``, the attention kernels read fp8 and apply the scales to the f32 scores and output (an
fp8 value is exact in bfloat16, so only the products' inputs change). The kernels load the scales
from memory, so a CUDA graph stays valid when they change. ``FP8`` is a constexpr: for the other
cache types the scale path is not compiled at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tianxia.layers.attention.backend import AttentionBackend, AttentionMetadata, register_backend
from tianxia.layers.triton_pointwise import tanh
from tianxia.layers.triton_utils import interpreting

_LOG2E = 1.4426950408889634


# --- KV write -------------------------------------------------------------------------------------


FP8_KV = torch.float8_e4m3fn


@triton.jit
def fp8_quantize(x, scale):
    """``x / scale`` in float32, clamped to e4m3's finite range (448: e4m3fn has no infinity, an
    overflow would store NaN), ready to store as fp8. IEEE division, as torch's ``x / scale``
    (Triton's ``/`` is an approximate one)."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -448.0), 448.0)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, kvs_ptr, stride_k, stride_v,
                     HKD: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < HKD
        k = tl.load(k_ptr + t.to(tl.int64) * stride_k + offs, mask=mask)
        v = tl.load(v_ptr + t.to(tl.int64) * stride_v + offs, mask=mask)
        if FP8:
            k = fp8_quantize(k, tl.load(kvs_ptr))
            v = fp8_quantize(v, tl.load(kvs_ptr + 1))
        tl.store(kc_ptr + slot * HKD + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * HKD + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _rows_ok(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with (H, D) contiguous; views of a fused qkv output qualify as they are."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def fp8_scales(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """The scales pointer a kernel gets: ``kv_scale`` for an fp8 cache (required), else
    ``fallback``, an unread placeholder."""
    if kv_cache.dtype != FP8_KV:
        return fallback
    if kv_scale is None:
        raise ValueError("an fp8 KV cache (--kv-cache-dtype fp8) needs the layer's kv_scale")
    return kv_scale


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """Write ``k``/``v`` [T, Hk, D] into ``kv_cache`` [2, blocks, bs, Hk, D] at ``slots`` [T];
    an fp8 cache stores them divided by ``kv_scale`` [2] (K's, V's)."""
    T = k.shape[0]
    if T == 0:
        return
    k, v = _rows_ok(k), _rows_ok(v)
    hkd = k.shape[1] * k.shape[2]
    _write_kv_kernel[(T,)](
        k, v, kv_cache[0], kv_cache[1], slots, fp8_scales(kv_cache, kv_scale, slots), k.stride(0), v.stride(0),
        HKD=hkd, BLOCK=triton.next_power_of_2(hkd), FP8=kv_cache.dtype == FP8_KV,
        num_warps=1 if hkd <= 256 else 4,
    )


def _dot_f32(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the attention products run in float32: a float32 cache, or an fp8 cache under a
    float32 model (fp8 K/V are widened to q's dtype), and always in the interpreter."""
    dot_dtype = q.dtype if kv_cache.dtype == FP8_KV else kv_cache.dtype
    return dot_dtype == torch.float32 or interpreting()


# --- decode -----------------------------------------------------------------------------------------


# Integer arguments that change from step to step are not specialized on (Triton compiles a variant
# per "equals 1 / divisible by 16" pattern of its integer arguments): a served workload would
# otherwise meet new patterns minutes after start-up and stall a step for the compile.
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, out_ptr, ml_ptr, acc_ptr, kvs_ptr,
    scale, softcap, window, num_splits,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    FP8: tl.constexpr,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    per = ((seq_len - lo + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = lo + s * per
    end = tl.minimum(start + per, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < G
    dmask = d < D
    heads = hk * G + g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if FP8:
        scale = scale * tl.load(kvs_ptr)  # K's scale, on the scores
    else:
        q = q.to(kc_ptr.dtype.element_ty)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tmask = toks < end
        page = tl.load(bt_row + toks // BS, mask=tmask, other=0).to(tl.int64)
        slot = page * BS + (toks % BS)
        kv_off = (slot[:, None] * HK + hk) * D + d[None, :]
        kvmask = tmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + kv_off, mask=kvmask, other=0.0)
        v = tl.load(vc_ptr + kv_off, mask=kvmask, other=0.0)
        if FP8:  # exact: every e4m3 value is a bfloat16 / float16 / float32 value
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_F32:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if HAS_SOFTCAP:
            qk = softcap * tanh(qk * scale / softcap) * 1.4426950408889634
        else:
            qk = qk * qk_scale
        qk = tl.where(tmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if FP8:
        acc = acc * tl.load(kvs_ptr + 1)  # V's scale, on the weighted sum

    if SPLIT:
        row = (b * HQ + heads) * num_splits + s  # [G_PAD]
        tl.store(ml_ptr + row * 2, m_i, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=gmask)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    else:
        denom = tl.where(l_i > 0, l_i, 1.0)
        o = acc / denom[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(ml_ptr, acc_ptr, out_ptr, num_splits, stride_ob, stride_oh,
                    HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < num_splits
    row = (b * HQ + h) * num_splits + s
    m = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"))
    lsum = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # the partial maxima are already in log2 units
    w = tl.where(smask, w, 0.0)
    total = tl.sum(w * lsum, 0)
    part = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D),
                   other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < D)


_DECODE_BLOCK_N = 64
_TARGET_PROGRAMS = 264  # two waves of an H200's 132 multiprocessors


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    """Splits of the context per (sequence, KV head): enough programs to fill the GPU, but no
    split shorter than 256 tokens."""
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    by_length = triton.cdiv(max(1, max_context), 256)
    return max(1, min(by_occupancy, by_length, 128))


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [2, blocks, bs, Hk, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [B] int32/int64, 0 = padding row (output zeros)
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_scale: torch.Tensor | None = None,  # [2] float32: an fp8 cache's K and V scales
) -> torch.Tensor:
    B, HQ, D = q.shape
    _, _, bs, HK, _ = kv_cache.shape
    G = HQ // HK
    if out is None:
        out = torch.empty(B, HQ, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    split = num_splits > 1
    if split:
        ml = torch.empty(B * HQ * num_splits * 2, dtype=torch.float32, device=q.device)
        acc = torch.empty(B * HQ * num_splits * D, dtype=torch.float32, device=q.device)
    else:
        ml = acc = out  # unused
    d_pad = max(16, triton.next_power_of_2(D))
    _decode_kernel[(B, HK, num_splits)](
        q, kv_cache[0], kv_cache[1], block_tables, seq_lens, out, ml, acc, fp8_scales(kv_cache, kv_scale, seq_lens),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), num_splits,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        HQ=HQ, HK=HK, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, D_PAD=d_pad, BS=bs,
        BLOCK_N=_DECODE_BLOCK_N, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None, SPLIT=split, DOT_F32=_dot_f32(q, kv_cache), FP8=kv_cache.dtype == FP8_KV,
        num_warps=4, num_stages=2,
    )
    if split:
        _combine_kernel[(B, HQ)](
            ml, acc, out, num_splits, out.stride(0), out.stride(1),
            HQ=HQ, D=D, D_PAD=d_pad, S_PAD=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
        )
    return out


# --- prefill ----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["window", "seq_offset", "stride_bt"])
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, qsl_ptr, out_ptr, kvs_ptr,
    scale, softcap, window, seq_offset,
    stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
    HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
):
    i = tl.program_id(0) + seq_offset
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(qsl_ptr + i).to(tl.int32)
    q_len = tl.load(qsl_ptr + i + 1).to(tl.int32) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(lens_ptr + i).to(tl.int32)
        ctx = seq_len - q_len
        hk = h // G
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < q_len
        qpos = ctx + m
        d = tl.arange(0, D_PAD)
        dmask = d < D
        rows = (q_start + m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)
        if FP8:
            scale = scale * tl.load(kvs_ptr)  # K's scale, on the scores
        else:
            q = q.to(kc_ptr.dtype.element_ty)

        hi = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)
        lo = hi * 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx + tile * BLOCK_M - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        qk_scale = scale * 1.4426950408889634
        bt_row = bt_ptr + i.to(tl.int64) * stride_bt
        for n0 in range(lo, hi, BLOCK_N):
            kp = n0 + tl.arange(0, BLOCK_N)
            kmask = kp < hi
            page = tl.load(bt_row + kp // BS, mask=kmask, other=0).to(tl.int64)
            slot = page * BS + (kp % BS)
            kv_off = (slot[:, None] * HK + hk) * D + d[None, :]
            kvmask = kmask[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + kv_off, mask=kvmask, other=0.0)
            v = tl.load(vc_ptr + kv_off, mask=kvmask, other=0.0)
            if FP8:  # exact: every e4m3 value is a bfloat16 / float16 / float32 value
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            if DOT_F32:
                qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            if HAS_SOFTCAP:
                qk = softcap * tanh(qk * scale / softcap) * 1.4426950408889634
            else:
                qk = qk * qk_scale
            visible = kmask[None, :] & (kp[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                visible = visible & (kp[None, :] > qpos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if FP8:
            acc = acc * tl.load(kvs_ptr + 1)  # V's scale, on the weighted sum
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], the whole flat batch
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1] on the device
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_scale: torch.Tensor | None = None,  # [2] float32: an fp8 cache's K and V scales
) -> torch.Tensor:
    """Attention for sequences ``first_seq .. first_seq + num_seqs - 1`` (their K/V already in
    the cache); writes their rows of ``out``."""
    if num_seqs == 0:
        return out
    _, HQ, D = q.shape
    _, _, bs, HK, _ = kv_cache.shape
    d_pad = max(16, triton.next_power_of_2(D))
    interp = interpreting()
    block_m = 16 if interp else (64 if d_pad <= 128 else 32)
    block_n = 16 if interp else (64 if d_pad <= 128 else 32)
    grid = (num_seqs, HQ, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start_loc, out,
        fp8_scales(kv_cache, kv_scale, seq_lens), float(scale), float(softcap or 1.0), int(sliding_window or 0),
        first_seq,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        HK=HK, G=HQ // HK, D=D, D_PAD=d_pad, BS=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        DOT_F32=_dot_f32(q, kv_cache), FP8=kv_cache.dtype == FP8_KV, num_warps=4, num_stages=2,
    )
    return out


# --- the backend ------------------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]: the step's rows, decodes first
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a step's rows over the paged cache, their K/V already written: split-K decode
    for the one-token rows, paged flash prefill for the prompt chunks. ``num_splits`` (the
    decode's split count) defaults to :func:`decode_splits`'s."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        if num_splits is None:
            num_splits = decode_splits(meta, kv_cache.shape[3], sliding_window)
        decode_attention(
            q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd], scale, num_splits,
            out=out[:nd], sliding_window=sliding_window, softcap=softcap, kv_scale=kv_scale,
        )
    if meta.num_seqs > nd:
        prefill_attention(
            q, kv_cache, meta.block_tables, meta.seq_lens_tensor, _step_tensors(meta, q.device), nd,
            meta.num_seqs - nd, aux_max_query_len(meta), scale, out, sliding_window=sliding_window,
            softcap=softcap, kv_scale=kv_scale,
        )
    return out


def decode_splits(meta: AttentionMetadata, num_kv_heads: int, sliding_window: int | None = None) -> int:
    """The decode rows' split count: the one a CUDA-graph capture fixed, else from their longest
    context (what a window lets them see of it)."""
    if meta.num_splits is not None:
        return meta.num_splits
    nd = meta.num_decodes
    max_ctx = max(meta.seq_lens[:nd], default=1)
    if sliding_window is not None:
        max_ctx = min(max_ctx, sliding_window)
    return decode_num_splits(nd, num_kv_heads, max_ctx)


@register_backend("triton")
class TritonAttention(AttentionBackend):
    """The CUDA backend: Triton KV write, split-K paged decode, paged flash prefill."""

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping, kv_scale)
        return paged_attention(q, kv_cache, meta, scale, sliding_window=sliding_window, softcap=softcap,
                               kv_scale=kv_scale)


def aux_max_query_len(meta: AttentionMetadata) -> int:
    return max(meta.query_lens[meta.num_decodes:], default=0)


def _step_tensors(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """``query_start_loc`` on the device: the runner's copy, or one made once per step and kept
    on the metadata object."""
    if meta.query_start_tensor is not None:
        return meta.query_start_tensor
    qsl = getattr(meta, "_triton_qsl", None)
    if qsl is None:
        qsl = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
        meta._triton_qsl = qsl
    return qsl
