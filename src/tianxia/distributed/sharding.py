"""Tensor parallelism as a transform of a loaded Llama-family model (gpt-fast's way): every rank
builds and loads the whole model, then keeps its slice of each projection.

Ranks split the KV heads, each keeping the query heads that read them. Where N does not divide
the KV heads, the first ranks take one more (SmolLM2-135M's 3 KV heads on 2 ranks: 2 and 1, with
6 and 3 query heads), so any N up to the KV head count works; above it, N must be a multiple of
the KV heads, and each KV head is replicated on N/KV ranks, each with its share of the query
heads, as vLLM does. The MLP splits its intermediate features the same way, the embedding and
LM head the vocabulary. Packed (GGUF) weights stay packed: a rank keeps whole rows and whole
32-value blocks of them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from tianxia.config import ModelConfig
from tianxia.layers.linear import QuantizedEmbedding, QuantizedLinear, SplitQuantizedLinear
from tianxia.layers.parallel_linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_range,
)
from tianxia.quant.packed import PackedWeight


def check_supported(config: ModelConfig, world_size: int) -> None:
    """A ValueError naming what does not split over ``world_size`` ranks."""
    from tianxia.models.llama import FAMILIES

    if world_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1; got {world_size}")
    if config.architecture not in FAMILIES:
        raise ValueError(f"tensor parallelism covers the llama family ({', '.join(FAMILIES)}); "
                         f"this model is {config.architecture}")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if world_size > kv and (world_size % kv or heads % world_size):
        raise ValueError(f"--tensor-parallel-size {world_size} does not divide this model's {heads} "
                         f"attention heads and {kv} KV heads: above the KV head count it must be a "
                         "multiple of it that divides the attention heads; choose such a size or at "
                         f"most {kv}")


def _split(n: int, rank: int, world_size: int) -> range:
    """Rank's contiguous share of ``n`` items, the first ranks one larger where N does not divide
    ``n`` (so rank 0 holds the largest share)."""
    return range(-(-rank * n // world_size), -(-(rank + 1) * n // world_size))


def head_ranges(config: ModelConfig, rank: int, world_size: int) -> tuple[range, range]:
    """The query heads and the KV heads of ``rank``."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if world_size <= kv:
        kv_heads = _split(kv, rank, world_size)
        group = heads // kv
        return range(kv_heads.start * group, kv_heads.stop * group), kv_heads
    per = heads // world_size
    head = rank // (world_size // kv)
    return range(rank * per, (rank + 1) * per), range(head, head + 1)


def rank_config(config: ModelConfig, rank: int, world_size: int) -> ModelConfig:
    """The per-rank view: its head counts shape the rank's KV cache."""
    q_heads, kv_heads = head_ranges(config, rank, world_size)
    return replace(config, num_attention_heads=len(q_heads), num_key_value_heads=len(kv_heads))


def _rows(weight: torch.Tensor | None, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
    if weight is None:
        return None
    return torch.cat([weight[a:b] for a, b in ranges])


def _packed_rows(w: PackedWeight, ranges: list[tuple[int, int]]) -> PackedWeight:
    return PackedWeight(_rows(w.qs, ranges), _rows(w.scales, ranges), _rows(w.mins, ranges),
                        w.bits, w.group, w.source)


def _packed_cols(w: PackedWeight, start: int, end: int) -> PackedWeight:
    """Columns ``[start, end)`` of a packed weight: whole blocks of 32 (4 * bits bytes each)."""
    if start % 32 or end % 32:
        raise ValueError(f"a {w.source} weight splits only at multiples of 32 columns, not {start}..{end}; "
                         "load with --quantization none")
    qs = w.qs[:, start // 32 * 4 * w.bits : end // 32 * 4 * w.bits]
    groups = slice(start // w.group, end // w.group)
    mins = None if w.mins is None else w.mins[:, groups].contiguous()
    return PackedWeight(qs.contiguous(), w.scales[:, groups].contiguous(), mins, w.bits, w.group, w.source)


def _pad_packed(w: PackedWeight, rows: int) -> PackedWeight:
    def pad(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])

    return w if w.shape[0] == rows else PackedWeight(pad(w.qs), pad(w.scales), pad(w.mins), w.bits, w.group, w.source)


def column_slice(module: nn.Module, ranges: list[tuple[int, int]]) -> nn.Module:
    """The output rows ``ranges`` of a float, packed or split-packed projection."""
    if isinstance(module, SplitQuantizedLinear):
        parts, offset = [], 0
        for part in module.parts:
            n = part.out_features
            mine = [(max(a, offset) - offset, min(b, offset + n) - offset) for a, b in ranges
                    if max(a, offset) < min(b, offset + n)]
            if mine:
                parts.append(_packed_rows(part.packed, mine))
            offset += n
        bias = _rows(module.bias, ranges)
        return QuantizedLinear(parts[0], bias) if len(parts) == 1 else SplitQuantizedLinear(parts, bias)
    if isinstance(module, QuantizedLinear):
        return QuantizedLinear(_packed_rows(module.packed, ranges), _rows(module.bias, ranges))
    return ColumnParallelLinear(_rows(module.weight, ranges), _rows(module.bias, ranges))


def row_slice(module: nn.Module, start: int, end: int, group: dist.ProcessGroup | None) -> RowParallelLinear:
    """Input columns ``[start, end)`` of a float or packed projection, summed over the ranks."""
    if isinstance(module, QuantizedLinear):
        local = QuantizedLinear(_packed_cols(module.packed, start, end))
    elif isinstance(module, SplitQuantizedLinear):
        raise ValueError("a projection split over encodings cannot be row-sharded; load with --quantization none")
    else:
        local = ColumnParallelLinear(module.weight[:, start:end], None)
    return RowParallelLinear(local, module.bias, group)


def vocab_slice(module: nn.Module, rank: int, world_size: int, vocab_size: int) -> nn.Module:
    """This rank's rows of an embedding table or LM head, zero-padded to ``ceil(V / N)``."""
    start, end = vocab_range(vocab_size, rank, world_size)
    share = -(-vocab_size // world_size)
    if isinstance(module, (QuantizedEmbedding, QuantizedLinear)):
        packed = _pad_packed(_packed_rows(module.packed, [(start, end)]), share)
        return QuantizedEmbedding(packed) if isinstance(module, QuantizedEmbedding) else QuantizedLinear(packed)
    rows = module.weight[start:end]
    rows = torch.cat([rows, rows.new_zeros(share - rows.shape[0], rows.shape[1])])
    if isinstance(module, nn.Embedding):
        table = nn.Embedding(share, rows.shape[1], device="meta")
        table.weight = nn.Parameter(rows, requires_grad=False)
        return table
    return ColumnParallelLinear(rows, None)


@torch.no_grad()
def shard_llama(model: nn.Module, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> None:
    """Replace the projections, embedding and LM head of a loaded Llama-family model (float or
    packed weights) by this rank's slices, in place."""
    config: ModelConfig = model.config
    check_supported(config, world_size)
    hd = config.head_dim
    q_heads, kv_heads = head_ranges(config, rank, world_size)
    q_rows = (q_heads.start * hd, q_heads.stop * hd)
    q_size = config.num_attention_heads * hd
    kv_size = config.num_key_value_heads * hd
    k_rows = (q_size + kv_heads.start * hd, q_size + kv_heads.stop * hd)
    v_rows = (k_rows[0] + kv_size, k_rows[1] + kv_size)
    inter = config.intermediate_size
    i_range = _split(inter, rank, world_size)
    i_rows = (i_range.start, i_range.stop)
    up_rows = (inter + i_rows[0], inter + i_rows[1])
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = column_slice(attn.qkv_proj, [q_rows, k_rows, v_rows])
        attn.o_proj = row_slice(attn.o_proj, *q_rows, group)
        attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
        attn.q_size, attn.kv_size = len(q_heads) * hd, len(kv_heads) * hd
        mlp.gate_up_proj = column_slice(mlp.gate_up_proj, [i_rows, up_rows])
        mlp.down_proj = row_slice(mlp.down_proj, *i_rows, group)
    vocab = config.vocab_size
    start, _ = vocab_range(vocab, rank, world_size)
    table = vocab_slice(model.model.embed_tokens, rank, world_size, vocab)
    model.model.embed_tokens = VocabParallelEmbedding(table, start, group)
    # tied: the head multiplies by the embedding's own slice
    head = table if model.lm_head is None else vocab_slice(model.lm_head, rank, world_size, vocab)
    model.lm_head = ParallelLMHead(head, vocab, world_size, group)
