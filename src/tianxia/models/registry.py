"""Architecture name (GGUF ``general.architecture`` or HF ``model_type``) to model class."""

from __future__ import annotations

from torch import nn

from tianxia.config import ModelConfig

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "glm4", "gemma2", "gemma3")
SUPPORTED_ARCHITECTURES = (*_LLAMA_LIKE, "gpt2", "falcon")


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    arch = config.architecture
    if arch in _LLAMA_LIKE:
        from tianxia.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if arch == "gpt2":
        from tianxia.models.gpt2 import GPT2LMHeadModel

        return GPT2LMHeadModel
    if arch == "falcon":
        from tianxia.models.falcon import FalconForCausalLM

        return FalconForCausalLM
    raise ValueError(
        f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
