"""RMSNorm, computed in float32 as the reference implementations do."""

from __future__ import annotations

import torch
from torch import nn

from tianxia.quant.cpu_kernels import fused_ops

_NONE = torch.empty(0)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalize ``x``; with ``residual``, add it first and also return the new residual.

        Fusing the residual add here keeps one pass over the hidden state per sub-layer.
        """
        ext = fused_ops(x)
        if ext is not None:
            out, total = ext.rms_norm(x, _NONE if residual is None else residual, self.weight, self.eps, 0.0)
            return out if residual is None else (out, total)
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(orig_dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32.

    Hugging Face checkpoints hold ``w`` and compute ``x * (1 + w)``; GGUF files store ``1 + w``
    (llama.cpp's converter adds the 1), and the GGUF loader subtracts it again.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ext = fused_ops(x)
        if ext is not None:
            out, total = ext.rms_norm(x, _NONE if residual is None else residual, self.weight, self.eps, 1.0)
            return out if residual is None else (out, total)
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)
