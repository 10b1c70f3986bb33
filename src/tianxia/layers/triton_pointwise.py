"""Fused pointwise Triton ops of the GPU decode step (residual add + RMSNorm or LayerNorm, gated
activations).

Each op reproduces the rounding of the eager PyTorch layer it replaces (bf16/fp16 storage between
ops, float32 inside), so greedy decoding follows the same tokens:

- ``add_rmsnorm``: residual add + RMSNorm in one pass (:class:`tianxia.layers.norm.RMSNorm`, or
  with ``gemma=True`` :class:`tianxia.layers.norm.GemmaRMSNorm`, whose weight is an offset from 1
  applied in float32).
- ``add_layernorm``: residual add + LayerNorm (mean and variance, weight and bias) in one pass
  (``nn.LayerNorm``: GPT-2, Falcon).
- ``act_mul``: ``act(gate) * up`` over a fused ``[gate | up]`` row, for SiLU
  (:class:`tianxia.layers.activation.SiluAndMul`) and the tanh GELU of GeGLU (Gemma).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# activations by config name, as the kernels' ACT constant (gelu_new / gelu_fast are the tanh GELU)
ACTIVATIONS = {"silu": 1, "swish": 1, "gelu_pytorch_tanh": 2, "gelu_new": 2, "gelu_fast": 2, "gelu": 3}


@triton.jit
def tanh(x):
    """tanh through exp, accurate in float32 and available in the interpreter."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def activation(g, ACT: tl.constexpr):
    """``act(g)`` in float32: SiLU (ACT 1), the tanh approximation of GELU (ACT 2) or the exact,
    erf GELU (ACT 3)."""
    if ACT == 1:
        return g / (1.0 + tl.exp(-g))
    elif ACT == 2:
        return 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))


@triton.jit
def normed(x, rstd, w, GEMMA: tl.constexpr, xdt: tl.constexpr):
    """RMSNorm of float32 ``x`` given its ``rstd``, rounded as the eager modules round: Llama-style
    ``w * round(x * rstd)`` in the storage dtype, Gemma-style ``round(x * rstd * (1 + w))``."""
    if GEMMA:
        return (x * rstd * (1.0 + w.to(tl.float32))).to(xdt)
    else:
        return (w.to(tl.float32) * (x * rstd).to(xdt).to(tl.float32)).to(xdt)


@triton.jit
def layer_normed(x, mean, rstd, w, b, HAS_BIAS: tl.constexpr, xdt: tl.constexpr):
    """LayerNorm of float32 ``x`` given its ``mean`` and ``rstd``, in float32 and rounded once,
    as ``nn.LayerNorm`` rounds."""
    y = (x - mean) * rstd * w.to(tl.float32)
    if HAS_BIAS:
        y += b.to(tl.float32)
    return y.to(xdt)


@triton.jit
def mean_rstd(x, mask, n, eps):
    """Mean and 1/sqrt(variance + eps) of the float32 row ``x`` (its ``n`` unmasked elements):
    two passes over registers, the biased variance ``nn.LayerNorm`` uses."""
    mean = tl.sum(x, 0) / n
    c = tl.where(mask, x - mean, 0.0)
    return mean, tl.rsqrt(tl.sum(c * c, 0) / n + eps)


# --- residual add + RMSNorm -------------------------------------------------------------------------


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, eps, N,
                        HAS_RES: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
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
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + offs, normed(h, rstd, w, GEMMA, x_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm(x + residual)`` and the new residual (``x`` itself when ``residual`` is None)."""
    M, N = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(N)
    _add_rmsnorm_kernel[(M,)](
        x, residual.contiguous() if residual is not None else x, weight, out, rout, float(eps), N,
        HAS_RES=residual is not None, GEMMA=gemma, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out, rout


# --- residual add + LayerNorm ------------------------------------------------------------------------


@triton.jit
def _add_layernorm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, rout_ptr, eps, N,
                          HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * N + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(rout_ptr + row * N + offs, x, mask=mask)
    h = x.to(tl.float32)
    mean, rstd = mean_rstd(h, mask, N, eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0)
    y = layer_normed(h, mean, rstd, w, b, HAS_BIAS, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + offs, y, mask=mask)


def add_layernorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``LayerNorm(x + residual)`` and the new residual (``x`` itself when ``residual`` is None)."""
    M, N = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(N)
    _add_layernorm_kernel[(M,)](
        x, residual.contiguous() if residual is not None else x, weight,
        bias if bias is not None else weight, out, rout, float(eps), N,
        HAS_RES=residual is not None, HAS_BIAS=bias is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, rout


# --- act(gate) * up -----------------------------------------------------------------------------------


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * 2 * N + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * N + N + offs, mask=mask, other=0.0).to(tl.float32)
    s = activation(g, ACT).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def act_mul(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for ``x`` = ``[gate | up]`` of shape [M, 2N] (``act`` a name of
    :data:`ACTIVATIONS`)."""
    M, N2 = x.shape
    N = N2 // 2
    x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(N))
    _act_mul_kernel[(M, triton.cdiv(N, block))](x, out, N, ACT=ACTIVATIONS[act], BLOCK=block, num_warps=4)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    return act_mul(x, "silu")
