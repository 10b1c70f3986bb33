"""Fused pointwise Triton ops of the GPU decode step (residual add + RMSNorm, gated activations).

Each op reproduces the rounding of the eager PyTorch layer it replaces (bf16/fp16 storage between
ops, float32 inside), so greedy decoding follows the same tokens:

- ``add_rmsnorm``: residual add + RMSNorm in one pass (:class:`tianxia.layers.norm.RMSNorm`).
- ``silu_mul``: ``silu(gate) * up`` (:class:`tianxia.layers.activation.SiluAndMul`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# --- residual add + RMSNorm -------------------------------------------------------------------------


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, eps, N,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * N + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(rout_ptr + row * N + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    hn = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (w * hn).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``RMSNorm(x + residual)`` and the new residual (``x`` itself when ``residual`` is None)."""
    M, N = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(N)
    _add_rmsnorm_kernel[(M,)](
        x, residual.contiguous() if residual is not None else x, weight, out, rout, float(eps), N,
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out, rout


# --- silu(gate) * up ----------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * 2 * N + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * N + N + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    M, N2 = x.shape
    N = N2 // 2
    x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(N))
    _silu_mul_kernel[(M, triton.cdiv(N, block))](x, out, N, BLOCK=block, num_warps=4)
    return out
