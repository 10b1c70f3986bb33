"""Batch-invariant GPU kernels (``--batch-invariant``): a token's numbers do not depend on the batch.

cuBLAS picks its kernel, tile shape and split of K by the matrix shapes, so a token's row of a
product changes with the number of rows beside it; torch's reductions split rows across threads by
their count; the decode attention kernel splits the context by the batch size and the prefill
kernel tiles queries by chunk. Greedy and seeded outputs then depend on what else runs and on
prefix-cache hits (Thinking Machines, "Defeating Nondeterminism in LLM Inference"; vLLM's
``VLLM_BATCH_INVARIANT=1``). This mode replaces, for the whole process:

- every CUDA ``mm`` / ``addmm`` (so ``nn.Linear`` and the logits product) with one persistent
  Triton matmul of a fixed tile shape and no split of K: each output element is one program's
  accumulation over K in fixed steps, whatever M is;
- RMSNorm with one program per row (:func:`tianxia.layers.triton_pointwise.add_rmsnorm`);
- attention with the paged prefill kernel for every query, decodes included (a decode is a chunk
  of one token): a query's keys are visited in tiles fixed by their positions, with no split of
  the context, so a token's attention is the same in a prompt, a chunk, after a cache hit and in a
  decode step of any batch.

CUDA graphs are off in this mode (the captured decode step has its own GEMV and fused kernels).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import nn

from tianxia.layers.attention.backend import AttentionBackend, AttentionMetadata, register_backend
from tianxia.layers.attention.triton_attention import (
    TritonAttention,
    _step_tensors,
    prefill_attention,
    write_kv,
)
from tianxia.layers.norm import GemmaRMSNorm, RMSNorm
from tianxia.layers.triton_pointwise import add_rmsnorm
from tianxia.layers.triton_utils import interpreting

logger = logging.getLogger(__name__)


# --- matmul -----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "num_programs"])
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, alpha, beta, num_programs,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_biasm, stride_biasn,
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m_count = tl.cdiv(M, BLOCK_M)
    pid_n_count = tl.cdiv(N, BLOCK_N)
    tiles = pid_m_count * pid_n_count
    k_steps = tl.cdiv(K, BLOCK_K)
    rk = tl.arange(0, BLOCK_K)
    # persistent: each program walks tiles num_programs apart, in groups of GROUP_M row tiles
    # for L2 reuse of the weight; a tile's order over K never changes
    for tile in range(tl.program_id(0), tiles, num_programs):
        group = tile // (GROUP_M * pid_n_count)
        first_m = group * GROUP_M
        group_rows = tl.minimum(pid_m_count - first_m, GROUP_M)
        pid_m = first_m + (tile % group_rows)
        pid_n = (tile % (GROUP_M * pid_n_count)) // group_rows
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = rm < M
        nmask = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for ks in range(0, k_steps):
            k = ks * BLOCK_K + rk
            kmask = k < K
            a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + k[None, :] * stride_ak,
                        mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn,
                        mask=kmask[:, None] & nmask[None, :], other=0.0)
            if DOT_F32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        acc = acc * alpha
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rm[:, None].to(tl.int64) * stride_biasm + rn[None, :] * stride_biasn,
                           mask=mmask[:, None] & nmask[None, :], other=0.0)
            acc = acc + beta * bias.to(tl.float32)
        tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _num_programs(device: torch.device) -> int:
    if interpreting():
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, alpha: float = 1.0,
           beta: float = 1.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``alpha * a @ b + beta * bias`` for 2-D ``a`` [M, K], ``b`` [K, N] (any strides; ``bias``
    broadcast to [M, N]), accumulated in float32 by one fixed tile shape: each output depends on
    its row of ``a`` and column of ``b`` only."""
    M, K = a.shape
    K2, N = b.shape
    assert K == K2, (a.shape, b.shape)
    c = torch.empty(M, N, dtype=out_dtype or a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if bias is not None:
        bias = bias.expand(M, N)
    interp = interpreting()
    # float32 products in full precision (torch's default; not TF32); the interpreter has no
    # bf16 dot
    dot_f32 = a.dtype == torch.float32 or interp
    bm, bn, bk = (16, 16, 16) if interp else (128, 128, 64 if a.element_size() <= 2 else 32)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    programs = min(_num_programs(a.device), tiles)
    _matmul_kernel[(programs,)](
        a, b, c, bias if bias is not None else c, M, N, K, float(alpha), float(beta), programs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        HAS_BIAS=bias is not None, DOT_F32=dot_f32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        num_warps=8 if not interp else 1, num_stages=3 if not interp else 1,
    )
    return c


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return matmul(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    return matmul(a, b, bias, alpha=float(alpha), beta=float(beta))


# --- RMSNorm ----------------------------------------------------------------------------------------


class BatchInvariantRMSNorm(RMSNorm):
    """RMSNorm (and Gemma's, its weight as ``1 + w``) by one Triton program per row."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        shape = x.shape
        weight = getattr(self, "_bi_weight", self.weight)
        out, total = add_rmsnorm(x.reshape(-1, shape[-1]),
                                 None if residual is None else residual.reshape(-1, shape[-1]), weight, self.eps)
        out = out.view(shape)
        return out if residual is None else (out, total.view(shape))


# --- attention --------------------------------------------------------------------------------------


@register_backend("triton_invariant")
class TritonInvariantAttention(TritonAttention):
    """Every query of the step, decodes included, through the paged prefill kernel: one fixed
    visit of key tiles by position per query, no split of the context by the batch."""

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping, kv_scale)
        out = torch.empty_like(q)
        prefill_attention(
            q, kv_cache, meta.block_tables, meta.seq_lens_tensor, _step_tensors(meta, q.device), 0,
            meta.num_seqs, max(meta.query_lens), scale, out, sliding_window=sliding_window, softcap=softcap,
            kv_scale=kv_scale,
        )
        return out


# --- the switch ---------------------------------------------------------------------------------------

_LIBRARY: torch.library.Library | None = None


def enable_matmul_override() -> None:
    """Route every CUDA ``aten::mm`` and ``aten::addmm`` of this process to :func:`matmul`."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("mm", _mm, "CUDA")
    lib.impl("addmm", _addmm, "CUDA")
    _LIBRARY = lib


def make_batch_invariant(model: nn.Module) -> None:
    """Switch a CUDA model to the batch-invariant kernels (norms and attention backends in place;
    the products through the process-wide override)."""
    enable_matmul_override()
    backend = TritonInvariantAttention()
    norms = 0
    for module in model.modules():
        if isinstance(module, RMSNorm) and not isinstance(module, BatchInvariantRMSNorm):
            if isinstance(module, GemmaRMSNorm):
                module._bi_weight = 1.0 + module.weight.detach().float()
            module.__class__ = BatchInvariantRMSNorm
            norms += 1
        if isinstance(getattr(module, "backend", None), AttentionBackend):
            module.backend = backend
    logger.info("batch-invariant kernels: matmul (persistent, fixed tiles), %d RMSNorms, attention", norms)
