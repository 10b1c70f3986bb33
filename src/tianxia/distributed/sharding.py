"""Tensor parallelism as a transform of a loaded Llama-family model (gpt-fast's way): every rank
builds and loads the whole model, then keeps its slice of each projection.

Rank ``r`` of ``N`` keeps query heads ``[r H/N, (r+1) H/N)`` and the KV heads they read: ``KV/N``
of them when ``N`` divides the KV head count, else (``N`` a multiple of it) the one KV head its
query heads share, replicated on ``N/KV`` ranks as vLLM does. The MLP splits its intermediate
features, the embedding and LM head the vocabulary.
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
    problems = []
    if heads % world_size:
        problems.append(f"{heads} attention heads")
    if kv % world_size and world_size % kv:
        problems.append(f"{kv} KV heads (N must divide them or be a multiple of them)")
    if config.intermediate_size % world_size:
        problems.append(f"an intermediate size of {config.intermediate_size}")
    if problems:
        raise ValueError(f"--tensor-parallel-size {world_size} does not divide this model's "
                         f"{', '.join(problems)}; choose a size that does")


def kv_heads_of_rank(config: ModelConfig, rank: int, world_size: int) -> range:
    kv = config.num_key_value_heads
    if kv % world_size == 0:
        per = kv // world_size
        return range(rank * per, (rank + 1) * per)
    head = rank // (world_size // kv)
    return range(head, head + 1)


def rank_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The per-rank view: its head counts shape the rank's KV cache."""
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=max(1, config.num_key_value_heads // world_size),
    )


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
    q_per = config.num_attention_heads // world_size
    kv_heads = kv_heads_of_rank(config, rank, world_size)
    q_rows = (rank * q_per * hd, (rank + 1) * q_per * hd)
    q_size = config.num_attention_heads * hd
    kv_size = config.num_key_value_heads * hd
    k_rows = (q_size + kv_heads.start * hd, q_size + kv_heads.stop * hd)
    v_rows = (k_rows[0] + kv_size, k_rows[1] + kv_size)
    inter = config.intermediate_size
    i_per = inter // world_size
    i_rows = (rank * i_per, (rank + 1) * i_per)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not hasattr(module, "weight") or module.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError("tensor parallelism shards float weights; load with --quantization none")
        qkv = attn.qkv_proj
        attn.qkv_proj = ColumnParallelLinear(_rows(qkv.weight, [q_rows, k_rows, v_rows]),
                                             _rows(qkv.bias, [q_rows, k_rows, v_rows]))
        attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, q_rows[0]:q_rows[1]], attn.o_proj.bias, group)
        attn.num_heads, attn.num_kv_heads = q_per, len(kv_heads)
        attn.q_size, attn.kv_size = q_per * hd, len(kv_heads) * hd
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
