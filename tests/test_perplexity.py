"""``tianxia perplexity``: llama-perplexity's chunking and scoring, against transformers' logits."""

from __future__ import annotations

import math

import pytest
import torch
from test_model_families import make_model, make_tiny_tokenizer

from tianxia.tools.perplexity import perplexity_of_tokens, run_perplexity

TEXT = " ".join(
    f"Line {i}: the {w} fox jumps over {i % 7} lazy dogs near the {w2} river."
    for i, (w, w2) in enumerate(zip(["quick", "brown", "red", "slow"] * 40, ["wide", "cold", "old"] * 60))
)


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tiny_tokenizer(out)
    return out


def test_perplexity_matches_the_reference_method(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_model("llama", tmp_path / "m", tiny_tokenizer_dir)
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    ctx, chunks = 64, 3
    res = run_perplexity(str(model_dir), text_file, ctx=ctx, batch=32, chunks=chunks, progress=False)

    tokens = AutoTokenizer.from_pretrained(str(model_dir)).encode(TEXT)
    assert len(tokens) // ctx > chunks and res.n_tokens == len(tokens)
    assert (res.n_chunks, res.count) == (chunks, chunks * (ctx - 1 - ctx // 2))
    # llama-perplexity, written out: each chunk from scratch, second half scored
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for i in range(chunks):
        ids = tokens[i * ctx : (i + 1) * ctx]
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].double(), dim=-1)
        for p in range(ctx // 2, ctx - 1):
            nll -= float(lp[p, ids[p + 1]])
            count += 1
    assert math.isclose(res.ppl, math.exp(nll / count), rel_tol=1e-5)
    assert res.stderr > 0


def test_bos_replaces_the_first_token_of_each_chunk():
    seen = []

    def score(ids):
        seen.append(list(ids))
        return torch.zeros(len(ids), 10)

    ppl, _, n_chunk, count, _ = perplexity_of_tokens(score, list(range(1, 9)) * 3, 8, bos_id=0, add_bos=True)
    assert n_chunk == 3 and count == 3 * 3 and all(s[0] == 0 for s in seen)
    assert math.isclose(ppl, 10.0)  # uniform logits over 10 tokens


def test_cli(tmp_path, tiny_tokenizer_dir, capsys):
    from tianxia.cli import main

    model_dir = make_model("qwen3", tmp_path / "m", tiny_tokenizer_dir)
    (tmp_path / "t.txt").write_text(TEXT)
    assert main(["perplexity", "-m", str(model_dir), "-f", str(tmp_path / "t.txt"), "-c", "64", "--chunks", "2", "-q"]) == 0
    out = capsys.readouterr().out
    assert "Final estimate: PPL = " in out and "2 chunks of 64 tokens" in out


def test_cpu_activations_choose_the_path_measured(tmp_path, smollm2_path):
    """``--cpu-activations`` reaches the engine: the 8-bit path's perplexity differs from the exact
    float32 path's (the products differ), and by little (the 8-bit path's error is small)."""
    (tmp_path / "t.txt").write_text(TEXT * 4)
    ppl = {}
    for acts in ("int8", "float32"):
        res = run_perplexity(str(smollm2_path), tmp_path / "t.txt", ctx=64, chunks=2, progress=False,
                             cpu_activations=acts)
        ppl[acts] = res.ppl
    assert ppl["int8"] != ppl["float32"]
    assert abs(ppl["int8"] / ppl["float32"] - 1) < 0.05
