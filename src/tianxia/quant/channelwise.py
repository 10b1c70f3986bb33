"""Per-output-channel FP8 (e4m3) and INT8 weights for the GPU path (``--quantization fp8|int8``).

Each row of a weight gets one float32 scale, ``W ~= q * scale[:, None]`` with ``scale =
max|W_row| / qmax`` (448 for e4m3, 127 for int8), so every row uses the full range of the narrow
type. Decode is memory-bound, so halving the bytes read is what pays:

- batch 1: the Triton GEMV of :mod:`tianxia.layers.triton_linear` reads the narrow weight
  and applies the row scale once after its reduction (the CUDA-graph decode path uses it too);
- larger batches, fp8 on Hopper/Ada: ``torch._scaled_mm`` on FP8 tensor cores, activations
  quantized per token on the fly (W8A8, rowwise scales), as vLLM's dynamic FP8 does;
- larger batches otherwise (int8, or shapes ``_scaled_mm`` refuses): a Triton GEMM that
  dequantizes the weight tile in registers (weight-only).

Only the decoder layers' projections are quantized; embeddings and the LM head stay in the
compute dtype, where quantization costs the most accuracy for the least memory.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

METHODS = ("fp8", "int8")
_QMAX = {"fp8": 448.0, "int8": 127.0}
_QTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_rows(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``q`` of the method's type and ``scale`` float32 [rows]."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-12) / _QMAX[method]
    q = wf / scale[:, None]
    if method == "int8":
        q = q.round()
    return q.clamp(-_QMAX[method], _QMAX[method]).to(_QTYPE[method]).contiguous(), scale.contiguous()


def fp8_supported(device: torch.device) -> str | None:
    """Why FP8 weights cannot run on ``device`` (None: they can)."""
    if device.type != "cuda":
        return "fp8 weights need a CUDA GPU (compute capability 8.9 or newer)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"fp8 weights need compute capability 8.9 or newer; this GPU has {major}.{minor}"
    return None


class ChannelwiseLinear(nn.Module):
    """A linear layer whose weight is stored as FP8 or INT8 with per-output-channel scales."""

    def __init__(self, linear: nn.Linear, method: str) -> None:
        super().__init__()
        self.method = method
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight.data, method)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias
        # _scaled_mm wants both GEMM dims in multiples of 16
        self._scaled_mm_ok = method == "fp8" and self.in_features % 16 == 0 and self.out_features % 16 == 0

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not x.is_cuda:
            # reference path: the quantized values, dequantized (what the kernels must equal)
            out = F.linear(x2, self.dequantized(x.dtype), self.bias)
        elif x2.shape[0] == 1:
            from tianxia.layers.triton_linear import gemv

            out = gemv(x2, self.weight, self.bias, w_scale=self.weight_scale)
        elif self._scaled_mm_ok:
            xq, xs = _quantize_tokens_fp8(x2)
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale[None, :],
                                   out_dtype=x.dtype)
            if self.bias is not None:
                out = out + self.bias
        else:
            from tianxia.layers.triton_linear import wq_matmul

            out = wq_matmul(x2, self.weight, self.weight_scale, self.bias)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}"


def _quantize_tokens_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        from tianxia.layers.triton_linear import quantize_rows_fp8

        return quantize_rows_fp8(x)
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / _QMAX["fp8"]
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def quantize_model(model: nn.Module, method: str) -> dict[str, int]:
    """Replace the decoder projections of ``model`` in place; returns bytes before and after.
    An unknown ``method`` raises (from :func:`quantize_rows`) before the first replacement."""
    before = after = 0
    for parent in list(model.modules()):
        for name in _PROJECTIONS:
            child = getattr(parent, name, None)
            if isinstance(child, nn.Linear):
                before += child.weight.numel() * child.weight.element_size()
                q = ChannelwiseLinear(child, method)
                after += q.weight.numel() * q.weight.element_size() + q.weight_scale.numel() * 4
                setattr(parent, name, q)
    if before == 0:
        raise ValueError(f"{type(model).__name__} has no projections that {method} quantization covers")
    logger.info("%s weights: decoder projections %.1f MiB -> %.1f MiB", method, before / 2**20, after / 2**20)
    return {"bytes_before": before, "bytes_after": after}
