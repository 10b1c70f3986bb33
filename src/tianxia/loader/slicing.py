"""Reading part of a checkpoint tensor: a tensor-parallel rank's rows or columns, taken from the
memory-mapped file before anything is copied, so a rank reads only its share of the bytes.

A :class:`WeightShard` says which part of each tensor a rank keeps and at which size it builds
the model; the loader applies it to GGUF and safetensors files alike. Packed (GGUF) matrices are
cut at whole rows and whole 32-value blocks, so their codes and scales are the unsharded ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tianxia.config import ModelConfig
from tianxia.quant.packed import PackedWeight


@dataclass(frozen=True)
class TensorSlice:
    """Rows (``dim`` 0: one or more ranges, concatenated) or columns (``dim`` 1: one range) of a
    tensor; ``rows``: zero rows appended up to this many (a vocabulary's last share)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    rows: int | None = None

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or (self.dim == 1 and len(self.ranges) != 1):
            raise ValueError(f"a slice keeps row ranges or one column range, not {self}")


class WeightShard(Protocol):
    """What one rank keeps of a checkpoint."""

    def model_config(self, config: ModelConfig) -> ModelConfig:
        """The config the rank builds its model with (its head counts, sizes, vocabulary share)."""

    def slice(self, name: str, shape: tuple[int, ...]) -> TensorSlice | None:
        """The part of checkpoint tensor ``name`` (HF name, full ``shape``) the rank keeps, or
        None for the whole tensor."""


def pad_rows(t: torch.Tensor, rows: int | None) -> torch.Tensor:
    if rows is None or t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def packed_cols(w: PackedWeight, start: int, end: int) -> PackedWeight:
    """Columns ``[start, end)`` of a packed weight: whole blocks of 32 (4 * bits bytes each)."""
    if start % 32 or end % 32:
        raise ValueError(f"a {w.source} weight splits only at multiples of 32 columns, not {start}..{end}; "
                         "load with --quantization none")
    qs = w.qs[:, start // 32 * 4 * w.bits : end // 32 * 4 * w.bits]
    groups = slice(start // w.group, end // w.group)
    mins = None if w.mins is None else w.mins[:, groups].contiguous()
    return PackedWeight(qs.contiguous(), w.scales[:, groups].contiguous(), mins, w.bits, w.group, w.source)


def pad_packed_rows(w: PackedWeight, rows: int | None) -> PackedWeight:
    if rows is None or w.shape[0] == rows:
        return w
    return PackedWeight(pad_rows(w.qs, rows), pad_rows(w.scales, rows),
                        None if w.mins is None else pad_rows(w.mins, rows), w.bits, w.group, w.source)


def read_safetensors_slice(view, s: TensorSlice) -> torch.Tensor:
    """``s`` of a tensor through safetensors' ``get_slice``: only those bytes are copied out of the
    mapping."""
    if s.dim == 0:
        t = torch.cat([view[a:b] for a, b in s.ranges])
    else:
        (a, b), = s.ranges
        t = view[:, a:b]
    return pad_rows(t, s.rows)
