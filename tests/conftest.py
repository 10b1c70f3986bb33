"""Shared fixtures: real models (pulled once into $TIANXIA_HOME) and tiny random HF models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# transformers' tiny random models, one per architecture of the llama family
TINY_ARCHS = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from tianxia.loader.hub import pull

    return pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    from tianxia.loader.hub import pull

    return pull("qwen2.5-coder-0.5b", quiet=True)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    from tianxia import LLM

    return LLM(str(smollm2_path), kv_cache_memory="512MiB", max_model_len=2048, seed=0)


@pytest.fixture(scope="session")
def qwen_llm(qwen_path):
    from tianxia import LLM

    return LLM(str(qwen_path), kv_cache_memory="256MiB", max_model_len=1024, seed=0)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2's real tokenizer as a Hugging Face tokenizer directory (vocab 49152)."""
    from tianxia.loader.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_tokenizer(smollm2_path, is_gguf=True).save_pretrained(str(out))
    return out


def make_tiny_hf_model(
    arch: str, out: Path, tokenizer_dir: Path, max_shard_size: str = "5GB", **overrides
) -> Path:
    """Save a randomly initialised transformers model of ``arch`` with a real tokenizer."""
    import shutil

    import transformers

    cls_cfg = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    kwargs = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=arch == "qwen2", bos_token_id=1, eos_token_id=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(hash(arch) % 1000)
    model = cls_cfg[1](cls_cfg[0](**kwargs)).eval()
    with torch.no_grad():  # random biases, so the qwen2 bias path is exercised for real
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_hf_model(a, root / a, smollm2_tokenizer_dir) for a in TINY_ARCHS}


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' own float32 model from the same GGUF file: the reference for our outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()
