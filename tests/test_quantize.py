"""``tianxia quantize``: encoders within llama.cpp's error bounds, llama.cpp's type mixes, files that load."""

from __future__ import annotations

import itertools
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_model_families import make_tiny_tokenizer

from tianxia.quant.gguf_codecs import dequantize
from tianxia.quant.quantize import choose_type, quantize_array, quantize_gguf, resolve_ftype

TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tiny_tokenizer(out)
    return out


def roundtrip(x: np.ndarray, qt: QT) -> np.ndarray:
    raw = quantize_array(x, qt)
    return dequantize(raw, qt, x.shape).numpy()


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_error_within_llama_cpp_bounds(qt):
    """llama.cpp's tests/test-quantize-fns.cpp: data 0.1 + 2 cos(i), error sqrt(sum d^2) / n."""
    n = 32 * 128
    x = (0.1 + 2 * np.cos(np.arange(n, dtype=np.float32))).astype(np.float32).reshape(1, n)
    err = float(np.sqrt(((roundtrip(x, qt) - x).astype(np.float64) ** 2).sum()) / n)
    bound = {QT.Q2_K: 0.0075, QT.Q3_K: 0.0040}.get(qt, 0.002)
    assert err < bound, f"{qt.name}: {err:.5f} >= {bound}"


def test_rmse_order():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 1024)) * 0.02).astype(np.float32)
    rmse = {qt.name: float(np.sqrt(((roundtrip(x, qt) - x) ** 2).mean())) for qt in
            (QT.Q8_0, QT.Q6_K, QT.Q5_K, QT.Q4_K, QT.Q3_K, QT.Q2_K)}
    names = list(rmse)
    assert all(rmse[a] < rmse[b] for a, b in itertools.pairwise(names)), rmse


@pytest.mark.parametrize("qt", [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda t: t.name)
def test_kquant_bytes_decode_the_same_in_gguf_py(qt):
    """Our k-quant blocks are valid GGUF: gguf-py's reference decoder reads what ours reads."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x[0, :256] = 0  # an all-zero block
    x[1, :7] = 40.0  # outliers
    raw = quantize_array(x, qt)
    ref = gguf.quants.dequantize(raw, qt)
    assert np.array_equal(dequantize(raw, qt, x.shape).numpy(), ref)
    assert np.all(ref[0, :256] == 0)


def _types_of(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory, tiny_tokenizer_dir):
    """An 8-layer llama with rows divisible by 256 (k-quants apply) and GQA 4, as f16 GGUF."""
    import transformers

    from tianxia.tools.convert import convert

    root = tmp_path_factory.mktemp("quant")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(root / "hf"))
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, root / "hf" / f.name)
    convert(root / "hf", root / "f16.gguf", "f16", progress=False)
    return root / "f16.gguf"


@pytest.fixture(scope="module")
def tiny_q4_k_m(tiny_f16):
    out = tiny_f16.parent / "q4km.gguf"
    report = quantize_gguf(tiny_f16, out, "Q4_K_M", progress=False)
    return out, report


def test_q4_k_m_mix_matches_llama_cpp_rules(tiny_q4_k_m):
    out, report = tiny_q4_k_m
    types = _types_of(out)
    # use_more_bits(i, 8): layers 0 (i < n/8), 7 (i >= 7n/8), and (i - 1) % 3 == 2 -> 3, 6
    more = {0, 3, 6, 7}
    for i in range(8):
        expected = "Q6_K" if i in more else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == expected
        assert types[f"blk.{i}.ffn_down.weight"] == expected
        assert types[f"blk.{i}.attn_q.weight"] == "Q4_K"
        assert types[f"blk.{i}.ffn_gate.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == "Q6_K"  # tied embeddings are quantized as the output
    assert report.ratio > 2.3  # f16 -> mostly 4.5 bits, with the (large, tied) embedding at Q6_K
    assert gguf.GGUFReader(str(out)).fields["general.file_type"].contents() == 15  # MOSTLY_Q4_K_M


@pytest.mark.parametrize("name,attn_v,ffn_down,attn_output", [
    ("Q4_K_S", ["Q5_K"] * 4 + ["Q4_K"] * 4, ["Q5_K"] + ["Q4_K"] * 7, "Q4_K"),
    ("Q5_K_M", ["Q6_K", "Q5_K", "Q5_K", "Q6_K", "Q5_K", "Q5_K", "Q6_K", "Q6_K"],
     ["Q6_K", "Q5_K", "Q5_K", "Q6_K", "Q5_K", "Q5_K", "Q6_K", "Q6_K"], "Q5_K"),
    ("Q3_K_M", ["Q5_K", "Q5_K"] + ["Q4_K"] * 6, ["Q4_K"] * 8, "Q4_K"),
    ("Q2_K", ["Q3_K"] * 8, ["Q3_K"] * 8, "Q3_K"),
])
def test_other_mixes(name, attn_v, ffn_down, attn_output):
    """Per-tensor types of the mixes, straight from the rules (8 layers, GQA 4, k-quant rows)."""
    from tianxia.quant.quantize import _State

    _, ftype, base = resolve_ftype(name)
    st = _State(n_attention_wv=8, n_layer=8, n_gqa=4 if name != "Q2_K" else 3, has_output=False, arch="llama")
    got_v, got_down = [], []
    for i in range(8):
        got_v.append(choose_type(f"blk.{i}.attn_v.weight", 256, ftype, base, st).name)
        got_down.append(choose_type(f"blk.{i}.ffn_down.weight", 512, ftype, base, st).name)
    assert got_v == attn_v
    assert got_down == ffn_down
    assert choose_type("blk.0.attn_output.weight", 256, ftype, base, st).name == attn_output
    assert choose_type("token_embd.weight", 256, ftype, base, st).name == "Q6_K"


def test_fallback_for_rows_not_divisible_by_256():
    _, ftype, base = resolve_ftype("Q4_K_M")
    from tianxia.quant.quantize import _State

    st = _State(n_attention_wv=30, n_layer=30, n_gqa=3, has_output=False, arch="llama")
    assert choose_type("blk.5.attn_q.weight", 576, ftype, base, st).name == "Q5_0"  # SmolLM2's rows
    assert choose_type("blk.0.attn_v.weight", 576, ftype, base, st).name == "Q8_0"  # Q6_K -> Q8_0
    assert choose_type("token_embd.weight", 576, ftype, base, st).name == "Q8_0"
    assert choose_type("blk.0.attn_q.weight", 100, ftype, base, st).name == "F16"


def test_quantized_file_runs_close_to_the_original(tiny_f16, tiny_q4_k_m):
    from tianxia import LLM

    ids = list(range(100, 140))
    ref = LLM(str(tiny_f16.parent / "hf"), num_kv_blocks=16).engine.score(ids)
    got = LLM(str(tiny_q4_k_m[0]), num_kv_blocks=16).engine.score(ids)
    # a random-init model's logits are small and noisy, so this is loose; SmolLM2's perplexity
    # per type (BENCHMARKS.md) is the quality measure
    assert float((got - ref).norm() / ref.norm()) < 0.4


def test_cli_prints_a_summary(tiny_f16, tmp_path, capsys):
    from tianxia.cli import main

    assert main(["quantize", str(tiny_f16), str(tmp_path / "o.gguf"), "q4_k", "-q"]) == 0
    out = capsys.readouterr().out
    assert "Q4_K_M:" in out and "ratio" in out and "bits/weight" in out
