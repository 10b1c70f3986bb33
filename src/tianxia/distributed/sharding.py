"""Tensor parallelism's split of a model over N ranks: which heads, MLP features and vocabulary
each rank holds, what it reads of the checkpoint, and its modules' collectives.

The family declares how it splits (:class:`tianxia.models.base.TensorParallelPlan`); a rank
builds its model at its own size and reads only its part of each tensor from the file
(:class:`RankShard`, through the loader), then :func:`parallelize` sums the row-parallel products
over the ranks and splits the embedding and LM head by vocabulary.

Ranks split the KV heads, each keeping the query heads that read them. Where N does not divide
the KV heads, the first ranks take one more (SmolLM2-135M's 3 KV heads on 2 ranks: 2 and 1, with
6 and 3 query heads), so any N up to the KV head count works; above it, N must be a multiple of
the KV heads, and each KV head is replicated on N/KV ranks, each with its share of the query
heads, as vLLM does. The MLP splits its intermediate features the same way, the embedding and
LM head the vocabulary. Packed (GGUF) weights stay packed: a rank keeps whole rows and whole
32-value blocks of them.

A LoRA adapter follows its module's split (vLLM's ``ColumnParallelLinearWithLoRA`` /
``RowParallelLinearWithLoRA``): over a column-parallel module (q/k/v, gate/up) a rank keeps the
rows of ``B`` that its weight keeps and the whole ``A``, so its delta is its share of the output;
over a row-parallel one (o, down) it keeps the columns of ``A`` that its weight keeps and the
whole ``B``, so its delta is a partial sum that joins the product's before the all-reduce.
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist
from torch import nn

from tianxia.config import ModelConfig
from tianxia.layers.lora import LoRAAdapter, LoRAPart
from tianxia.layers.parallel_linear import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, vocab_range
from tianxia.loader.slicing import TensorSlice
from tianxia.models.base import TensorParallelPlan
from tianxia.models.registry import get_model_class


def tensor_parallel_plan(config: ModelConfig) -> TensorParallelPlan | None:
    return getattr(get_model_class(config), "tensor_parallel_plan", None)


def check_supported(config: ModelConfig, world_size: int) -> None:
    """A ValueError naming what does not split over ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1; got {world_size}")
    if tensor_parallel_plan(config) is None:
        raise ValueError(f"tensor parallelism is not available for {config.architecture} models; "
                         "the llama family (llama, mistral, qwen2, qwen3, phi3, glm4, gemma2, gemma3) has it")
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


class RankShard:
    """What one rank keeps of the checkpoint (a :class:`tianxia.loader.slicing.WeightShard`)."""

    def __init__(self, config: ModelConfig, rank: int, world_size: int) -> None:
        check_supported(config, world_size)
        plan = tensor_parallel_plan(config)
        assert plan is not None
        self.plan, self.rank, self.world_size = plan, rank, world_size
        self.vocab_size = config.vocab_size
        hd = config.head_dim
        q_heads, kv_heads = head_ranges(config, rank, world_size)
        q_size, kv_size = config.num_attention_heads * hd, config.num_key_value_heads * hd
        q = (q_heads.start * hd, q_heads.stop * hd)
        kv = (kv_heads.start * hd, kv_heads.stop * hd)
        inter = config.intermediate_size
        i = _split(inter, rank, world_size)
        vocab = vocab_range(config.vocab_size, rank, world_size)
        self.vocab_share = -(-config.vocab_size // world_size)
        # each split's rows (or columns) in the full tensor
        self.ranges: dict[str, tuple[tuple[int, int], ...]] = {
            "heads": (q,),
            "kv_heads": (kv,),
            "qkv": (q, (q_size + kv[0], q_size + kv[1]), (q_size + kv_size + kv[0], q_size + kv_size + kv[1])),
            "intermediate": ((i.start, i.stop),),
            "gate_up": ((i.start, i.stop), (inter + i.start, inter + i.stop)),
            "vocab": (vocab,),
        }
        self.build = replace(config, num_attention_heads=len(q_heads), num_key_value_heads=len(kv_heads),
                             intermediate_size=len(i), vocab_size=self.vocab_share)

    def model_config(self, config: ModelConfig) -> ModelConfig:
        return self.build

    def _split(self, module: str) -> tuple[str, int] | None:
        """How ``module``'s weight splits (the plan's split and dimension), or None: whole."""
        for suffix, split in self.plan.weights.items():
            if module == suffix or module.endswith("." + suffix):
                return split
        return None

    def slice(self, name: str, shape: tuple[int, ...]) -> TensorSlice | None:
        split = self._split(name.rpartition(".")[0])
        if split is None:
            return None  # norms: every rank holds them whole
        kind, dim = split
        if dim == 1 and len(shape) == 1:
            return None  # a row-parallel bias is added once, after the sum
        return TensorSlice(dim, self.ranges[kind], self.vocab_share if kind == "vocab" else None)

    def shard_adapter(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """This rank's part of an adapter read for the whole model: per fused module, the rows of
        each ``B`` its output keeps (column-parallel) or the columns of each ``A`` its input keeps
        (row-parallel), the rows renumbered as the rank's module lays them out."""
        weights = {}
        for module, parts in adapter.weights.items():
            split = self._split(module)
            if split is None:
                raise ValueError(f"tensor parallelism has no split for LoRA target {module!r}")
            kind, dim = split
            ranges = self.ranges[kind]
            weights[module] = [p for part in parts for p in _shard_part(part, ranges, dim)]
        return LoRAAdapter(adapter.name, adapter.path, adapter.rank, weights)


def _shard_part(part: LoRAPart, ranges: tuple[tuple[int, int], ...], dim: int) -> list[LoRAPart]:
    if dim == 1:  # row-parallel: the rank's input columns of A; the output rows are all there
        (c0, c1), = ranges
        return [LoRAPart(part.row0, part.a[:, c0:c1].contiguous(), part.b)]
    # column-parallel: the rank's output is its ranges of the fused rows, one after the other;
    # the part's rows that fall in each, at the place they take there
    out, local = [], 0
    end = part.row0 + part.b.shape[0]
    for lo, hi in ranges:
        start, stop = max(lo, part.row0), min(hi, end)
        if start < stop:
            out.append(LoRAPart(local + start - lo, part.a,
                                part.b[start - part.row0 : stop - part.row0].contiguous()))
        local += hi - lo
    return out


def parallelize(model: nn.Module, shard: RankShard, group: dist.ProcessGroup | None = None) -> None:
    """Make a model built and loaded at the rank's size (``shard``) compute as its part of the
    whole: the row-parallel products summed over the ranks, the embedding and LM head split by
    vocabulary. In place."""
    plan = shard.plan
    for name, module in list(model.named_modules()):
        if any(name == s or name.endswith("." + s) for s in plan.row_parallel):
            parent_name, _, attr = name.rpartition(".")
            bias = getattr(module, "bias", None)
            module.bias = None
            setattr(model.get_submodule(parent_name), attr, RowParallelLinear(module, bias, group))
    parent_name, _, attr = plan.embedding.rpartition(".")
    parent = model.get_submodule(parent_name)
    table = getattr(parent, attr)
    start, _ = vocab_range(shard.vocab_size, shard.rank, shard.world_size)
    setattr(parent, attr, VocabParallelEmbedding(table, start, group))
    head = getattr(model, plan.lm_head)
    # tied: the head multiplies by the embedding's own slice
    setattr(model, plan.lm_head, ParallelLMHead(table if head is None else head, shard.vocab_size, shard.rank,
                                                shard.world_size, group))
