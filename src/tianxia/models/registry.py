"""Architecture name (GGUF ``general.architecture`` or HF ``model_type``) to model class."""

from __future__ import annotations

from torch import nn

from tianxia.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    arch = config.architecture
    if arch in ("llama", "mistral", "qwen2"):
        from tianxia.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise ValueError(
        f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
