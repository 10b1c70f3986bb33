"""Tensor parallelism as a transform of a loaded Llama-family model (gpt-fast's way): every rank
builds and loads the whole model, then keeps its slice of each projection.

Ranks split the KV heads, each keeping the query heads that read them. Where N does not divide
the KV heads, the first ranks take one more (SmolLM2-135M's 3 KV heads on 2 ranks: 2 and 1, with
6 and 3 query heads), so any N up to the KV head count works; above it, N must be a multiple of
the KV heads, and each KV head is replicated on N/KV ranks, each with its share of the query
heads, as vLLM does. The MLP splits its intermediate features the same way, the embedding and
LM head the vocabulary.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from tianxia.config import ModelConfig
from tianxia.layers.parallel_linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_range,
)


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


@torch.no_grad()
def shard_llama(model: nn.Module, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> None:
    """Replace the projections, embedding and LM head of a loaded Llama-family model (float
    weights) by this rank's slices, in place."""
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
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not hasattr(module, "weight") or module.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError("tensor parallelism shards float weights; load with --quantization none")
        qkv = attn.qkv_proj
        attn.qkv_proj = ColumnParallelLinear(_rows(qkv.weight, [q_rows, k_rows, v_rows]),
                                             _rows(qkv.bias, [q_rows, k_rows, v_rows]))
        attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, q_rows[0]:q_rows[1]], attn.o_proj.bias, group)
        attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
        attn.q_size, attn.kv_size = len(q_heads) * hd, len(kv_heads) * hd
        gate_up = mlp.gate_up_proj
        up_rows = (inter + i_rows[0], inter + i_rows[1])
        mlp.gate_up_proj = ColumnParallelLinear(_rows(gate_up.weight, [i_rows, up_rows]),
                                                _rows(gate_up.bias, [i_rows, up_rows]))
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, i_rows[0]:i_rows[1]], mlp.down_proj.bias, group)
    embed = model.model.embed_tokens
    vocab = config.vocab_size
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight, vocab, rank, world_size, group)
    if model.lm_head is None:  # tied: the head is the embedding's own slice
        head_weight = model.model.embed_tokens.weight
    else:
        start, end = vocab_range(vocab, rank, world_size)
        head_weight = model.lm_head.weight[start:end]
    model.lm_head = ParallelLMHead(head_weight, vocab, world_size, group)
