"""Linear and embedding layers over packed block-quantized weights (CPU), and float ones whose
product does not depend on the batch.

The packed ones replace ``nn.Linear`` / ``nn.Embedding`` at load time (see ``load_weights`` of
the model files) when a weight arrives as a :class:`~tianxia.quant.packed.PackedWeight`; the
weight stays packed in memory and the product runs in :mod:`tianxia.quant.cpu_kernels`.
:func:`use_row_invariant_linears` turns the float ones of a CPU model into :class:`DenseLinear`.
"""

from __future__ import annotations

import torch
from torch import nn

from tianxia.quant import cpu_kernels
from tianxia.quant.packed import PackedWeight


dense_linear = cpu_kernels.dense_linear


class DenseLinear(nn.Linear):
    """An ``nn.Linear`` whose float32 CPU product computes each row alone
    (:func:`~tianxia.quant.cpu_kernels.dense_linear`). BLAS blocks a product by its number of
    rows, so through ``F.linear`` a token's row would change with the batch and the prompt's
    chunking."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


def use_row_invariant_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`DenseLinear` (in place: the same
    module objects and parameters, only the forward changes); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DenseLinear
            count += 1
    return count


class _Packed(nn.Module):
    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.bits, self.group, self.source = weight.bits, weight.group, weight.source
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qs", weight.qs)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        # products round activations to 8 bits per 32 values (``--cpu-activations int8``)
        self.int8 = False
        # the weight's scales laid out per quad of rows (``packed_scale_table``), which products of
        # a few rows read instead of gathering them per call; set where a decode step's products
        # are many (the output head under the fused decode step)
        self.scale_table: torch.Tensor | None = None

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.qs, self.scales, self.mins, self.bits, self.group, self.source)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.source} as {self.bits}-bit groups of {self.group}"


class QuantizedLinear(_Packed):
    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        bias = None if self.bias is None else self.bias.float()
        y = cpu_kernels.packed_linear(x2, self.packed, bias, self.int8, self.scale_table)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class QuantizedEmbedding(_Packed):
    """An embedding table kept packed; ``linear`` multiplies by it (tied output heads)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.packed_rows(ids, self.packed).reshape(*ids.shape, self.in_features)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.packed_linear(x.float().reshape(-1, x.shape[-1]), self.packed, None, self.int8,
                                         self.scale_table)


class SplitQuantizedLinear(nn.Module):
    """A fused projection whose parts came in different encodings (a Q5_0 q/k with a Q8_0 v, as
    llama.cpp's mixes write them): one :class:`QuantizedLinear` per part, outputs side by side.
    Widening every part to the 8-bit layout would hold them all too, but larger, and off the
    integer GEMM that prompts take for 4- to 6-bit codes."""

    def __init__(self, parts: list[PackedWeight], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(QuantizedLinear(p) for p in parts)
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)
