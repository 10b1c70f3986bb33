"""RoPE and the KV-cache write in one Triton kernel, for the GPU decode step.

``rope_write_kv``: rotate-half RoPE of q and k from a fused qkv row, k and v written straight
into the paged cache (slots below zero skipped), q returned. It rounds as the eager rotary does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# --- RoPE + KV write ----------------------------------------------------------------------------------


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, q_out_ptr,
                          HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr,
                          HK_PAD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                          HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    cos = tl.load(cs_ptr + pos * 2 * HALF + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * 2 * HALF + HALF + j, mask=jm, other=0.0)[None, :]
    row = qkv_ptr + t * ((HQ + 2 * HK) * D)

    hq = tl.arange(0, HQ_PAD)
    qm = (hq < HQ)[:, None] & jm[None, :]
    q1 = tl.load(row + hq[:, None] * D + j[None, :], mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(row + hq[:, None] * D + HALF + j[None, :], mask=qm, other=0.0).to(tl.float32)
    qo = q_out_ptr + t * HQ * D + hq[:, None] * D + j[None, :]
    tl.store(qo, (q1 * cos - q2 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)
    tl.store(qo + HALF, (q2 * cos + q1 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        hk = tl.arange(0, HK_PAD)
        km = (hk < HK)[:, None] & jm[None, :]
        kb = row + HQ * D + hk[:, None] * D + j[None, :]
        k1 = tl.load(kb, mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(kb + HALF, mask=km, other=0.0).to(tl.float32)
        # k rounds to the model dtype first, as the eager rotary returns it, then to the cache's
        kdt = qkv_ptr.dtype.element_ty
        cdt = kc_ptr.dtype.element_ty
        ko = kc_ptr + slot * HK * D + hk[:, None] * D + j[None, :]
        tl.store(ko, (k1 * cos - k2 * sin).to(kdt).to(cdt), mask=km)
        tl.store(ko + HALF, (k2 * cos + k1 * sin).to(kdt).to(cdt), mask=km)
        vb = row + (HQ + HK) * D + hk[:, None] * D + j[None, :]
        vo = vc_ptr + slot * HK * D + hk[:, None] * D + j[None, :]
        tl.store(vo, tl.load(vb, mask=km, other=0.0).to(cdt), mask=km)
        tl.store(vo + HALF, tl.load(vb + HALF, mask=km, other=0.0).to(cdt), mask=km)


def rope_write_kv(qkv, positions, cos_sin, kv_cache, slots, num_heads, num_kv_heads, head_dim):
    """``qkv`` [T, (Hq + 2 Hk) D] -> rotated q [T, Hq, D]; rotated k and v go to the cache.

    ``cos_sin`` is the rotary table ``[max_pos, D]`` (cos in the first half, sin in the second),
    float32, covering every position passed.
    """
    T = qkv.shape[0]
    q_out = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    _rope_write_kv_kernel[(T,)](
        qkv.contiguous(), positions, cos_sin, kv_cache[0], kv_cache[1], slots, q_out,
        HQ=num_heads, HK=num_kv_heads, HQ_PAD=triton.next_power_of_2(num_heads),
        HK_PAD=triton.next_power_of_2(num_kv_heads), D=head_dim, HALF=half,
        HALF_PAD=triton.next_power_of_2(half), num_warps=4,
    )
    return q_out
