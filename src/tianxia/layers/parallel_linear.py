"""Tensor-parallel linears and embeddings (Megatron's split): each rank holds a slice of a weight.

A column-parallel projection (q/k/v heads, gate/up features) needs no module of its own: it is
the family's own projection built at the rank's size, its output the rank's share, with no
communication. The others:

- :class:`RowParallelLinear` keeps the matching slice of the input columns (o, down): each rank's
  product is a partial sum, made whole by one all-reduce.
- :class:`VocabParallelEmbedding` keeps a range of the vocabulary: a token outside the range
  looks up zeros, and the all-reduce puts every row together.
- :class:`ParallelLMHead` multiplies by a vocabulary range and gathers the logits.

On a GPU the collectives are NCCL's, run on the device and captured in the decode CUDA graphs like
any kernel. Packed (GGUF) weights are sliced by whole rows and whole 32-value blocks, so the codes, scales
and the 8-bit rounding of activations per 32 values are those of the unsharded model. The float32
products on CPU go through ``dense_linear`` (one fixed operation order per output, as
the unsharded model's), so a rank's partial sums do not depend on the batch either.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tianxia.layers.linear import QuantizedEmbedding
from tianxia.quant import cpu_kernels


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.device.type == "cpu" and weight.dtype == torch.float32:
        return cpu_kernels.dense_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(local(x_local)) + b``: ``local`` multiplies by this rank's input columns
    (a float or a packed slice); the bias is added once, after the sum."""

    def __init__(self, local: nn.Module, bias: torch.Tensor | None, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.local = local
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank's ``[start, end)`` of the vocabulary: equal shares of ``ceil(V / N)``, the last shorter
    (equal shares line the logits up by rank, so its table is padded with zero rows)."""
    share = -(-vocab_size // world_size)
    start = min(rank * share, vocab_size)
    return start, min(start + share, vocab_size)


class VocabParallelEmbedding(nn.Module):
    """``table`` holds this rank's vocabulary rows (an ``nn.Embedding`` or a packed
    :class:`QuantizedEmbedding`), from token ``start`` on."""

    def __init__(self, table: nn.Module, start: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.table, self.start, self.group = table, start, group
        self.rows = table.weight.shape[0] if isinstance(table, nn.Embedding) else table.out_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        rows = self.table(local.masked_fill(outside, 0))
        rows = rows.masked_fill(outside[:, None], 0.0)
        dist.all_reduce(rows, group=self.group)
        return rows


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary range (``proj``: a linear, or the tied embedding's table),
    gathered into ``[T, vocab_size]`` on every rank (the sampler runs on rank 0; the others drop
    theirs). The gather is an all-reduce of rows that are zero outside each rank's range, exact
    (x + 0 is x): the same collective as the rest of the step, which NCCL runs inside a CUDA
    graph; the rows are few (the sampled ones), so the N-fold bytes cost little."""

    def __init__(self, proj: nn.Module, vocab_size: int, rank: int, world_size: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.proj = proj
        self.vocab_size, self.rank, self.world_size, self.group = vocab_size, rank, world_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        proj = self.proj
        if isinstance(proj, QuantizedEmbedding):
            local = proj.linear(hidden)
        elif isinstance(proj, nn.Embedding):
            local = _linear(hidden, proj.weight, None)
        else:
            local = proj(hidden)
        share = local.shape[-1]
        logits = local.new_zeros(local.shape[0], share * self.world_size, dtype=torch.float32)
        logits[:, self.rank * share : (self.rank + 1) * share] = local
        dist.all_reduce(logits, group=self.group)
        return logits[:, : self.vocab_size]
