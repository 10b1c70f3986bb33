"""``tianxia convert``: HF directory -> GGUF, read back by our loader with the same logits."""

from __future__ import annotations

import gguf
import pytest
from test_model_families import (
    PROMPT,
    ROPE_SCALINGS,
    make_model,
    make_tiny_tokenizer,
    reference_logits,
    rel_err,
)

from tianxia import LLM
from tianxia.tools.convert import convert

ARCHS = ["llama", "qwen2", "mistral-swa", "qwen3", "phi3", "glm4", "gemma2", "gemma3", "gpt2", "falcon",
         "falcon-mq", "linear", "yarn", "llama3"]


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_gguf_gives_the_same_logits(arch, root, tiny_tokenizer_dir):
    model_dir = make_model(arch, root / arch, tiny_tokenizer_dir)
    out = root / f"{arch}.gguf"
    info = convert(model_dir, out, "f32", progress=False)
    llm = LLM(str(out), num_kv_blocks=64, max_num_batched_tokens=8, block_size=4, max_model_len=256)
    assert llm.engine.model_config.architecture == {"mistral-swa": "llama"}.get(
        arch, "llama" if arch in ROPE_SCALINGS else arch.split("-")[0]
    ) or info["architecture"] == "llama"
    ids = llm.get_tokenizer().encode(PROMPT + " " + PROMPT)
    err = rel_err(llm.engine.score(ids), reference_logits(model_dir, ids))
    assert err < 1e-4, err


def test_metadata_tokenizer_and_template(root, smollm2_tokenizer_dir):
    """SmolLM2's real tokenizer: llama.cpp's pre-tokenizer name, all merges, the chat template."""
    model_dir = make_model("qwen3", root / "meta", smollm2_tokenizer_dir, vocab_size=49152)
    out = root / "meta.gguf"
    convert(model_dir, out, "q8_0", progress=False)
    r = gguf.GGUFReader(str(out))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.token") and
         k != "tokenizer.ggml.merges"}
    assert f["general.architecture"] == "qwen3"
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "smollm"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert len(r.fields["tokenizer.ggml.merges"].contents()) > 40000
    assert "<|im_start|>" in f["tokenizer.chat_template"]
    assert f["qwen3.attention.key_length"] == 24
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_q_norm.weight"] == "F32"
    llm = LLM(str(out), num_kv_blocks=32)
    ids = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in llm.get_tokenizer().decode(ids)
    ref = reference_logits(model_dir, ids)
    assert rel_err(llm.engine.score(ids), ref) < 0.02  # q8_0 weights


def test_cli_convert_f16(root, tiny_tokenizer_dir, capsys):
    from tianxia.cli import main

    model_dir = make_model("gemma3", root / "cli", tiny_tokenizer_dir)
    assert main(["convert", str(model_dir), str(root / "cli.gguf"), "--outtype", "f16", "-q"]) == 0
    assert "gemma3" in capsys.readouterr().out
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(root / "cli.gguf")).tensors}
    assert types["blk.0.ffn_up.weight"] == "F16" and types["blk.0.post_ffw_norm.weight"] == "F32"
