"""Triton matrix products of the GPU path: the batch-1 GEMV and the int8 / fp8 weight products.

- ``gemv``: batch-1 ``x @ W.T`` for the memory-bound decode step, each program reading
  ``BLOCK_N`` whole rows of W, with fused prologues (RMSNorm or LayerNorm, or a residual add and
  then the norm, of x: the block's rows need the whole of x anyway) and epilogues (bias, an
  activation of each output, ``act(gate) * up`` over the two halves of a fused gate/up weight,
  the addition of another vector). That removes the norm and activation launches of a layer and
  their round trips through memory. Block shapes are autotuned per (N, K) on the GPU.
- ``wq_matmul``: ``x @ (w * scale).T`` with an int8 or float8 weight widened in registers.
- ``quantize_rows_fp8``: per-row float8 activations for W8A8 products, in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tianxia.layers.triton_pointwise import ACTIVATIONS, activation, layer_normed, mean_rstd, normed
from tianxia.layers.triton_utils import interpreting


# --- batch-1 GEMV with fused prologue / epilogue ------------------------------------------------------


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, r_ptr, rout_ptr, nw_ptr, nb_ptr, s_ptr, a_ptr, eps, N, K,
                 HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GEMMA: tl.constexpr, LAYER: tl.constexpr,
                 HAS_NB: tl.constexpr, ACT: tl.constexpr, OUT_ACT: tl.constexpr, HAS_ADD: tl.constexpr,
                 HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr, K_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    kk = tl.arange(0, BLOCK_K)
    xdt = x_ptr.dtype.element_ty
    rstd = 1.0
    mean = 0.0
    if NORM > 0:
        # the whole row of x at once (one round trip, not one per K block)
        kp = tl.arange(0, K_PAD)
        kpm = kp < K
        xa = tl.load(x_ptr + kp, mask=kpm, other=0.0)
        if NORM == 2:
            ra = tl.load(r_ptr + kp, mask=kpm, other=0.0)
            xa = (xa.to(tl.float32) + ra.to(tl.float32)).to(xdt)
            if pid == 0:
                tl.store(rout_ptr + kp, xa, mask=kpm)
        xaf = xa.to(tl.float32)
        if LAYER:
            mean, rstd = mean_rstd(xaf, kpm, K, eps)
        else:
            rstd = tl.rsqrt(tl.sum(xaf * xaf, 0) / K + eps)

    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + kk
        if EVEN_K:
            xv = tl.load(x_ptr + ks)
        else:
            xv = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
        if NORM == 2:
            if EVEN_K:
                rv = tl.load(r_ptr + ks)
            else:
                rv = tl.load(r_ptr + ks, mask=ks < K, other=0.0)
            xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xdt)
        if NORM > 0:
            if EVEN_K:
                nw = tl.load(nw_ptr + ks)
            else:
                nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0)
            if LAYER:
                nb = nw
                if HAS_NB:
                    if EVEN_K:
                        nb = tl.load(nb_ptr + ks)
                    else:
                        nb = tl.load(nb_ptr + ks, mask=ks < K, other=0.0)
                xv = layer_normed(xv.to(tl.float32), mean, rstd, nw, nb, HAS_NB, xdt)
            else:
                xv = normed(xv.to(tl.float32), rstd, nw, GEMMA, xdt)
        xf = xv.to(tl.float32)[None, :]
        if EVEN_K:
            wmask = nmask[:, None]
        else:
            wmask = nmask[:, None] & (ks < K)[None, :]
        w = tl.load(w_rows + ks[None, :], mask=wmask, other=0.0)
        acc += w.to(tl.float32) * xf
        if ACT > 0:
            w2 = tl.load(w_rows + N * K + ks[None, :], mask=wmask, other=0.0)
            acc2 += w2.to(tl.float32) * xf
    y = tl.sum(acc, 1)
    if HAS_SCALE:
        # per-output-channel scale of an int8 / fp8 weight: constant along K, so applied once here
        y *= tl.load(s_ptr + rn, mask=nmask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    odt = out_ptr.dtype.element_ty
    if ACT > 0:
        g = y.to(odt).to(tl.float32)
        u = tl.sum(acc2, 1)
        if HAS_SCALE:
            u *= tl.load(s_ptr + N + rn, mask=nmask, other=0.0)
        u = u.to(odt).to(tl.float32)
        s = activation(g, ACT).to(odt).to(tl.float32)
        y = s * u
    if OUT_ACT > 0:
        y = activation(y.to(odt).to(tl.float32), OUT_ACT)
    if HAS_ADD:
        # rounded first, as the eager ``linear(x) + a`` rounds its product
        y = y.to(odt).to(tl.float32) + tl.load(a_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, y.to(odt), mask=nmask)


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


_gemv_fixed = triton.heuristics(
    {"EVEN_K": _even_k, "K_PAD": lambda args: triton.next_power_of_2(args["K"])}
)(_gemv_kernel)
_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=nw, num_stages=ns)
    # the best of benchmarks/gpu_gemv_sweep.py (132 block shapes, timed inside CUDA graphs) at the
    # 7B shapes on an H200 (8x512/8 warps: gate/up; 2x2048/8: down; 16x512/8: lm head), and
    # shapes that suit smaller models
    for bn, bk, nw, ns in [
        (2, 2048, 8, 1), (4, 1024, 4, 1), (8, 512, 4, 1), (8, 512, 8, 1), (8, 1024, 8, 1),
        (8, 2048, 8, 1), (16, 256, 4, 1), (16, 512, 4, 1), (16, 512, 8, 1), (32, 256, 8, 1),
        (64, 256, 8, 1), (32, 128, 4, 3),
    ]
]


def _bench(fn, quantiles):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


_gemv_tuned = triton.autotune(
    configs=_GEMV_CONFIGS,
    key=["N", "K", "NORM", "GEMMA", "LAYER", "HAS_NB", "ACT", "OUT_ACT", "HAS_ADD", "HAS_BIAS", "HAS_SCALE"],
    do_bench=_bench,
    cache_results=True,
)(_gemv_fixed)


def gemv(
    x: torch.Tensor,  # [1, K]
    w: torch.Tensor,  # [N, K], or [2N, K] (gate rows, then up rows) with ``act``
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    gemma_norm: bool = False,
    layer_norm: bool = False,
    act: str | None = None,
    out_act: str | None = None,
    add: torch.Tensor | None = None,  # [1, N]
    w_scale: torch.Tensor | None = None,  # [N] (or [2N]) float32, for an int8 / fp8 ``w``
    block_n: int | None = None,
    block_k: int | None = None,
):
    """``linear(prologue(x), w, bias)`` then the epilogue, for one row.

    An int8 or float8 ``w`` comes with ``w_scale``, its per-row scales (``W = w * w_scale[:, None]``):
    the kernel reads the narrow weight, which is what makes quantized decode faster.
    With ``norm_weight``, x is first RMS-normalized (after adding ``residual`` if given; Gemma's
    offset weight with ``gemma_norm``; with ``layer_norm`` a LayerNorm instead, of weight
    ``norm_weight`` and bias ``norm_bias``), and the call returns ``(out, new_residual)``;
    otherwise ``out``. With ``act`` (a name of
    :data:`~tianxia.layers.triton_pointwise.ACTIVATIONS`) ``w`` holds gate and up rows and the
    output is ``act(gate) * up``; ``out_act`` applies an activation to each output instead
    (``act(x @ W.T + bias)``, GPT-2's and Falcon's MLP). ``add`` is added last
    (``linear(...) + add``, each rounded as eager torch rounds).
    """
    assert not (act and out_act) and not (gemma_norm and layer_norm)
    assert x.shape[0] == 1 and w.is_contiguous()
    K = x.shape[1]
    gated_act = 0 if act is None else ACTIVATIONS[act]
    N = w.shape[0] // (2 if gated_act else 1)
    x = x.contiguous()
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    norm = 0 if norm_weight is None else (2 if residual is not None else 1)
    rout = torch.empty_like(x) if norm == 2 else x
    args = (
        x, w, bias if bias is not None else w, out,
        residual.contiguous() if residual is not None else x, rout,
        norm_weight if norm_weight is not None else w, norm_bias if norm_bias is not None else w,
        w_scale if w_scale is not None else x, add.contiguous() if add is not None else x,
        float(eps), N, K,
    )
    flags = dict(HAS_BIAS=bias is not None, NORM=norm, GEMMA=gemma_norm, LAYER=layer_norm,
                 HAS_NB=norm_bias is not None, ACT=gated_act,
                 OUT_ACT=0 if out_act is None else ACTIVATIONS[out_act], HAS_ADD=add is not None,
                 HAS_SCALE=w_scale is not None)
    if block_n is not None or interpreting():
        # the interpreter runs each program in turn: few, wide ones
        bn, bk = block_n or (64 if interpreting() else 8), block_k or 128
        _gemv_fixed[(triton.cdiv(N, bn),)](*args, **flags, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    else:
        _gemv_tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, **flags)
    return out if norm == 0 else (out, rout)


# --- GEMM with an int8 / fp8 weight, dequantized in registers ----------------------------------------


@triton.jit
def _wq_matmul_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, M_BUCKET, HAS_BIAS: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped launch order: programs sharing weight columns run together, so W is read ~once from HBM
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    xdt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + ks[None, :],
                    mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + ks[:, None],
                    mask=(rn[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc = tl.dot(a, b.to(xdt), acc, input_precision=PRECISION)
    acc *= tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=omask)


_WQ_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=nw, num_stages=ns)
    for bm, bn, bk, nw, ns in [
        (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
        (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
    ]
]
_wq_matmul_tuned = triton.autotune(
    configs=_WQ_CONFIGS, key=["M_BUCKET", "N", "K", "HAS_BIAS", "PRECISION"], do_bench=_bench, cache_results=True,
)(_wq_matmul_kernel)


def wq_matmul(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (w * w_scale[:, None]).T + bias`` for ``x`` [M, K] in bf16/fp16/fp32 and ``w`` [N, K]
    int8 or float8, without materializing the dequantized weight."""
    assert w.is_contiguous() and x.shape[-1] == w.shape[1]
    x = x.contiguous()
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    args = (x, w, w_scale, bias if bias is not None else w_scale, out, M, N, K,
            min(triton.next_power_of_2(max(M, 1)), 1024))
    # float32 activations keep float32 products (torch's matmul default), not TF32's 10-bit mantissa
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    if interpreting():
        bm, bn, bk = 16, 32, 32
        _wq_matmul_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
            *args, HAS_BIAS=bias is not None, PRECISION=prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4)
    else:
        _wq_matmul_tuned[lambda m: (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),)](
            *args, HAS_BIAS=bias is not None, PRECISION=prec)
    return out


# --- per-row FP8 quantization of activations (W8A8 products) -----------------------------------------


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        ks = k0 + offs
        x = tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # div_rn: IEEE-rounded division, as the eager formula's (Triton's `/` is an approximate one)
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), QMAX)
    for k0 in range(0, K, BLOCK):
        ks = k0 + offs
        x = tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        tl.store(q_ptr + row * K + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)
    tl.store(s_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: each row of ``x`` [M, K] as float8 e4m3 with one float32 scale
    (``scale = max|row| / 448``, shape [M, 1]), in one launch; the eager form took five kernels
    per projection, which made a batched FP8 decode step slower than bf16."""
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    _fp8_rows_kernel[(M,)](x, q, scale, K, QMAX=448.0, BLOCK=1024, num_warps=4)
    return q, scale
