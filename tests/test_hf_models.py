"""Tiny random Hugging Face models: our logits against transformers in float32."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_ARCHS, make_tiny_hf_model
from transformers import AutoModelForCausalLM

from tianxia import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. 天下 is a word; 🙂 emoji too, and 12345 digits."


def _reference_logits(model_dir, ids: list[int]) -> torch.Tensor:
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_match_transformers(arch, tiny_models):
    llm = LLM(str(tiny_models[arch]), num_kv_blocks=64, max_num_batched_tokens=8)
    ids = llm.get_tokenizer().encode(PROMPT)
    assert len(ids) > 8  # so the prompt really is prefilled in several chunks
    ours = llm.engine.score(ids)
    ref = _reference_logits(tiny_models[arch], ids)
    assert _rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_generation_matches_transformers(arch, tiny_models):
    llm = LLM(str(tiny_models[arch]), num_kv_blocks=64)
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_models[arch]), dtype=torch.float32).eval()
    expected = ref.generate(
        torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(ids):].tolist()
    assert out[0].outputs[0].token_ids == expected


def test_sharded_safetensors(tmp_path, smollm2_tokenizer_dir):
    model_dir = make_tiny_hf_model("llama", tmp_path / "sharded", smollm2_tokenizer_dir, max_shard_size="2MB")
    assert (model_dir / "model.safetensors.index.json").exists()
    assert len(list(model_dir.glob("*.safetensors"))) > 1
    llm = LLM(str(model_dir), num_kv_blocks=32)
    ids = llm.get_tokenizer().encode(PROMPT)
    assert _rel_err(llm.engine.score(ids), _reference_logits(model_dir, ids)) < 1e-4


def test_missing_shard_is_a_clear_error(tmp_path, smollm2_tokenizer_dir):
    from tianxia.loader.errors import ModelLoadError

    model_dir = make_tiny_hf_model("llama", tmp_path / "broken", smollm2_tokenizer_dir, max_shard_size="2MB")
    victim = sorted(model_dir.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        LLM(str(model_dir), num_kv_blocks=32)


def test_chat_template_from_tokenizer_config(tiny_models):
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=32)
    ids = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    text = llm.get_tokenizer().decode(ids)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
