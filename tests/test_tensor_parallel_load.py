"""A tensor-parallel rank reads only its part of the checkpoint.

Each rank of TP=2 is loaded here as its worker loads it (``load_model`` with its
``RankShard``, no process group needed): its tensors are exactly the rows and 32-value column
blocks of the whole model's (packed GGUF blocks of SmolLM2's Q4_1/Q8_0; float safetensors), and
the bytes it holds are about half of the whole model's. Qwen2.5's K-quant tensors are cut
through their 256-value super-blocks.
"""

from __future__ import annotations

import pytest
import torch

from tianxia.distributed.sharding import RankShard
from tianxia.distributed.tensor_parallel import weight_bytes
from tianxia.layers.attention import get_backend
from tianxia.loader import load_model, load_model_config
from test_model_families import family_dirs, tiny_tokenizer_dir  # noqa: F401 (fixtures)

CPU = torch.device("cpu")


def _load(path, quantization: str, shard=None):
    return load_model(str(path), dtype=torch.float32, device=CPU, backend=get_backend(CPU),
                      quantization=quantization, shard=shard).model


def _dense(module) -> torch.Tensor:
    """A projection's weight as float32, whether float, packed or packed in parts."""
    if hasattr(module, "parts"):
        return torch.cat([_dense(p) for p in module.parts])
    if hasattr(module, "packed"):
        return module.packed.dequantize()
    return module.weight.float()


def _rows(w: torch.Tensor, ranges, rows: int | None = None) -> torch.Tensor:
    out = torch.cat([w[a:b] for a, b in ranges])
    return out if rows is None else torch.cat([out, out.new_zeros(rows - out.shape[0], out.shape[1])])


def _check_rank_parts(path, quantization: str, layers: list[int]) -> list[float]:
    """Each rank's projections and vocabulary rows equal the whole model's slices; returns each
    rank's weight bytes over the whole model's."""
    config = load_model_config(str(path))
    whole = _load(path, quantization)
    fractions = []
    for rank in range(2):
        shard = RankShard(config, rank, 2)
        part = _load(path, quantization, shard)
        r = shard.ranges
        for i in layers:
            mine, full = part.model.layers[i], whole.model.layers[i]
            expected = {
                "qkv": _rows(_dense(full.self_attn.qkv_proj), r["qkv"]),
                "o": _dense(full.self_attn.o_proj)[:, slice(*r["heads"][0])],
                "gate_up": _rows(_dense(full.mlp.gate_up_proj), r["gate_up"]),
                "down": _dense(full.mlp.down_proj)[:, slice(*r["intermediate"][0])],
            }
            got = {
                "qkv": _dense(mine.self_attn.qkv_proj), "o": _dense(mine.self_attn.o_proj),
                "gate_up": _dense(mine.mlp.gate_up_proj), "down": _dense(mine.mlp.down_proj),
            }
            for name in expected:
                assert torch.equal(got[name], expected[name]), (rank, i, name)
            if mine.self_attn.qkv_proj.bias is not None:
                assert torch.equal(mine.self_attn.qkv_proj.bias, _rows(full.self_attn.qkv_proj.bias[:, None],
                                                                        r["qkv"])[:, 0])
        table = _dense(whole.model.embed_tokens)
        assert torch.equal(_dense(part.model.embed_tokens), _rows(table, r["vocab"], shard.vocab_share))
        fractions.append(weight_bytes(part) / weight_bytes(whole))
        del part
    return fractions


def test_smollm2_gguf_ranks_hold_their_half(smollm2_path):
    """Packed Q4_1 projections, a Q8_0 tied embedding; 3 KV heads split 2 + 1."""
    fractions = _check_rank_parts(smollm2_path, "auto", layers=[0, 29])
    # rank 0 holds 2 of the 3 KV heads (and their 6 query heads), rank 1 the rest; the MLP and the
    # vocabulary split in halves; the norms and the RoPE tables (2% of this small model) are on both
    assert 0.5 < fractions[0] < 0.56 and 0.44 < fractions[1] < 0.5, fractions
    assert 1.0 <= sum(fractions) < 1.04, fractions


def test_qwen_kquant_columns_split_inside_super_blocks(qwen_path):
    """Qwen2.5-0.5B's o (Q5_0) and down (Q6_K) split at columns 448 and 2432, the latter inside a
    256-value super-block: a rank reads the blocks that cover its columns and keeps its 32-value
    groups, packed or dequantized, equal to the whole tensor's columns."""
    from tianxia.loader.gguf import GGUFFile
    from tianxia.loader.slicing import TensorSlice

    gguf = GGUFFile(qwen_path)
    for name, cut in (("blk.0.attn_output.weight", 448), ("blk.0.ffn_down.weight", 2432),
                      ("blk.1.ffn_down.weight", 2432)):
        kind = gguf.tensors[name].tensor_type.name
        full, packed = gguf.read_tensor(name), gguf.read_packed(name)
        for cols in ((0, cut), (cut, full.shape[1])):
            part = TensorSlice(1, (cols,))
            assert torch.equal(gguf.read_tensor(name, part), full[:, slice(*cols)]), (name, kind, cols)
            if packed is not None:
                got = gguf.read_packed(name, part).dequantize()
                assert torch.equal(got, packed.dequantize()[:, slice(*cols)]), (name, kind, cols)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_safetensors_ranks_read_slices(arch, family_dirs):
    """Float safetensors through ``get_slice``: q/k/v biases (Qwen2), q/k norms and Gemma's
    GeGLU (Gemma 3), a tied and an untied head."""
    fractions = _check_rank_parts(family_dirs(arch), "none", layers=[0, 1])
    assert all(0.4 < f < 0.6 for f in fractions), fractions


def test_a_family_without_a_plan_is_a_clear_error():
    """GPT-2 declares no tensor-parallel plan: the error names it before any process starts."""
    from tianxia.config import ModelConfig

    config = ModelConfig(architecture="gpt2", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64)
    with pytest.raises(ValueError, match="tensor parallelism is not available for gpt2 models"):
        RankShard(config, 0, 2)
