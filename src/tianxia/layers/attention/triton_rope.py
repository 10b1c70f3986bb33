"""RoPE and the KV-cache write in one Triton kernel, for the GPU decode step.

``rope_write_kv``: from a fused qkv row, the optional per-head RMSNorm of q and k (Qwen3, Gemma 3),
RoPE of q and k (rotate-half or interleaved pairs, over the leading ``rotary_dim`` dimensions of
a head), k and v written straight into the paged cache (slots below zero skipped), q returned.
Each element is rounded as the eager modules round it (the norm's output and the rotation's
output in the model dtype, k then in the cache's), so greedy decoding follows the eager path.
An fp8 cache stores k and v divided by the layer's scales, as ``write_kv`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tianxia.layers.attention.triton_attention import FP8_KV, fp8_quantize, fp8_scales
from tianxia.layers.triton_pointwise import normed


@triton.jit
def _heads(row, h, d, m, pos, cs_ptr, nw_ptr, eps, D: tl.constexpr, ROT: tl.constexpr,
           INTERLEAVED: tl.constexpr, NORM: tl.constexpr, GEMMA: tl.constexpr):
    """Heads ``h`` (rows) of one token's q or k: normed, rotated, as float32 [H_PAD, D_PAD]."""
    xdt = row.dtype.element_ty
    HALF = ROT // 2
    if INTERLEAVED:
        partner = d ^ 1
        j = d // 2
        first = (d % 2) == 0
    else:
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        j = tl.where(d < HALF, d, d - HALF)
        first = d < HALF
    rot = d < ROT
    x = tl.load(row + h[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(row + h[:, None] * D + partner[None, :], mask=m & rot[None, :], other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        dm = d < D
        x = normed(x, rstd, tl.load(nw_ptr + d, mask=dm, other=0.0)[None, :], GEMMA, xdt).to(tl.float32)
        xp = normed(xp, rstd, tl.load(nw_ptr + partner, mask=dm & rot, other=0.0)[None, :], GEMMA,
                    xdt).to(tl.float32)
    cos = tl.load(cs_ptr + pos * ROT + j, mask=rot, other=1.0)[None, :]
    sin = tl.load(cs_ptr + pos * ROT + HALF + j, mask=rot, other=0.0)[None, :]
    a = x * cos
    b = xp * sin
    return tl.where(rot[None, :], tl.where(first[None, :], a - b, a + b), x)


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, q_out_ptr, qn_ptr, kn_ptr,
                          kvs_ptr, eps, HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr,
                          HK_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                          ROT: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
                          GEMMA: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, D_PAD)
    dm = d < D
    row = qkv_ptr + t * ((HQ + 2 * HK) * D)
    kdt = qkv_ptr.dtype.element_ty

    hq = tl.arange(0, HQ_PAD)
    qm = (hq < HQ)[:, None] & dm[None, :]
    q = _heads(row, hq, d, qm, pos, cs_ptr, qn_ptr, eps, D, ROT, INTERLEAVED, NORM, GEMMA)
    tl.store(q_out_ptr + t * HQ * D + hq[:, None] * D + d[None, :], q.to(q_out_ptr.dtype.element_ty), mask=qm)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        hk = tl.arange(0, HK_PAD)
        km = (hk < HK)[:, None] & dm[None, :]
        k = _heads(row + HQ * D, hk, d, km, pos, cs_ptr, kn_ptr, eps, D, ROT, INTERLEAVED, NORM, GEMMA)
        cdt = kc_ptr.dtype.element_ty
        # k rounds to the model dtype first, as the eager rotary returns it, then to the cache's
        offs = slot * HK * D + hk[:, None] * D + d[None, :]
        k = k.to(kdt)
        v = tl.load(row + (HQ + HK) * D + hk[:, None] * D + d[None, :], mask=km, other=0.0)
        if FP8:
            k = fp8_quantize(k, tl.load(kvs_ptr))
            v = fp8_quantize(v, tl.load(kvs_ptr + 1))
        tl.store(kc_ptr + offs, k.to(cdt), mask=km)
        tl.store(vc_ptr + offs, v.to(cdt), mask=km)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                  slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, *,
                  rotary_dim: int | None = None, interleaved: bool = False,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 1e-6, gemma_norm: bool = False,
                  kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``qkv`` [T, (Hq + 2 Hk) D] -> rotated q [T, Hq, D]; rotated k and v go to the cache.

    ``cos_sin`` is the rotary table ``[max_pos, rotary_dim]`` (cos in the first half, sin in the
    second), float32, covering every position passed. ``q_norm`` / ``k_norm``: the weights of a
    per-head RMSNorm applied before RoPE (both or neither). ``kv_scale`` [2]: an fp8 cache's
    K and V scales.
    """
    T = qkv.shape[0]
    rot = rotary_dim or head_dim
    q_out = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    _rope_write_kv_kernel[(T,)](
        qkv.contiguous(), positions, cos_sin, kv_cache[0], kv_cache[1], slots, q_out,
        q_norm if norm else cos_sin, k_norm if norm else cos_sin, fp8_scales(kv_cache, kv_scale, cos_sin),
        float(eps),
        HQ=num_heads, HK=num_kv_heads, HQ_PAD=triton.next_power_of_2(num_heads),
        HK_PAD=triton.next_power_of_2(num_kv_heads), D=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        ROT=rot, INTERLEAVED=interleaved, NORM=norm, GEMMA=gemma_norm, FP8=kv_cache.dtype == FP8_KV,
        num_warps=4,
    )
    return q_out


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, q_out_ptr, k_out_ptr, stride_q, stride_k,
                 HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
                 D: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, D_PAD)
    dm = d < D
    hq = tl.arange(0, HQ_PAD)
    qm = (hq < HQ)[:, None] & dm[None, :]
    q = _heads(q_ptr + t * stride_q, hq, d, qm, pos, cs_ptr, cs_ptr, 0.0, D, ROT, INTERLEAVED, False, False)
    tl.store(q_out_ptr + t * HQ * D + hq[:, None] * D + d[None, :], q.to(q_out_ptr.dtype.element_ty), mask=qm)
    hk = tl.arange(0, HK_PAD)
    km = (hk < HK)[:, None] & dm[None, :]
    k = _heads(k_ptr + t * stride_k, hk, d, km, pos, cs_ptr, cs_ptr, 0.0, D, ROT, INTERLEAVED, False, False)
    tl.store(k_out_ptr + t * HK * D + hk[:, None] * D + d[None, :], k.to(k_out_ptr.dtype.element_ty), mask=km)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
         rotary_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``q`` [T, Hq, D] and ``k`` [T, Hk, D] (rows of D contiguous, e.g. views of a fused
    qkv output) in one launch, rounded as :class:`tianxia.layers.rotary.RotaryEmbedding` rounds:
    the module forward's rotation on a GPU (one kernel where the eager form takes about twenty)."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    q_out, k_out = torch.empty(T, HQ, D, dtype=q.dtype, device=q.device), torch.empty(T, HK, D, dtype=k.dtype,
                                                                                       device=k.device)
    if T == 0:
        return q_out, k_out
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    if k.stride(2) != 1 or k.stride(1) != D:
        k = k.contiguous()
    _rope_kernel[(T,)](
        q, k, positions, cos_sin, q_out, k_out, q.stride(0), k.stride(0), HQ=HQ, HK=HK,
        HQ_PAD=triton.next_power_of_2(HQ), HK_PAD=triton.next_power_of_2(HK), D=D,
        D_PAD=triton.next_power_of_2(D), ROT=rotary_dim, INTERLEAVED=interleaved, num_warps=4,
    )
    return q_out, k_out
