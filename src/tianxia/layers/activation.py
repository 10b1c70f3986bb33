"""Activations: gated ones over a fused gate/up projection, and plain ones by config name."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tianxia.quant.cpu_kernels import fused_ops


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation, written out as Hugging Face's ``NewGELUActivation`` does."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": gelu_new,
    "gelu_fast": gelu_new,
    "relu": F.relu,
}


def get_activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}") from None


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input is ``[gate | up]`` along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one pass with a vector exp: 2-3x faster than torch's two ops, for prompts as for decodes,
        # and the fused decode step's own numbers
        ext = fused_ops(x) if x.dim() == 2 else None
        if ext is not None:
            return ext.gated_act(x, False)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class ActAndMul(nn.Module):
    """``act(gate) * up`` for any named activation (GeGLU for Gemma: ``gelu_pytorch_tanh``)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = get_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh-GELU on CPU: the fused decode step's kernel, so prompts and decode steps agree
        ext = fused_ops(x) if x.dim() == 2 and self.name == "gelu_pytorch_tanh" else None
        if ext is not None:
            return ext.gated_act(x, True)
        gate, up = x.chunk(2, dim=-1)
        return self.fn(gate) * up
