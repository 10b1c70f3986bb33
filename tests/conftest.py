"""Shared fixtures: real models (pulled once into $TIANXIA_HOME) and tiny random HF models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers import TINY_ARCHS, make_tiny_hf_model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from tianxia.loader.hub import pull

    return pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    from tianxia.loader.hub import pull

    return pull("qwen2.5-coder-0.5b", quiet=True)


# The shared engines multiply with exact products (float32 activations): the tests compare them
# with transformers and with themselves at float-rounding tolerance. The default 8-bit activations
# (llama.cpp's numerics) have their own tests in test_quant_linear.py and test_engine.py, and the
# server tests run the default.
@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    from tianxia import LLM

    return LLM(str(smollm2_path), kv_cache_memory="512MiB", max_model_len=2048, seed=0,
               cpu_activations="float32")


@pytest.fixture(scope="session")
def qwen_llm(qwen_path):
    from tianxia import LLM

    return LLM(str(qwen_path), kv_cache_memory="256MiB", max_model_len=1024, seed=0,
               cpu_activations="float32")


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2's real tokenizer as a Hugging Face tokenizer directory (vocab 49152)."""
    from tianxia.loader.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_tokenizer(smollm2_path, is_gguf=True).save_pretrained(str(out))
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
