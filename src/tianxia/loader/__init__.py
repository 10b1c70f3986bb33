"""Find a model (pulled name, GGUF file or Hugging Face directory) and load it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from tianxia.config import ModelConfig
from tianxia.layers.attention import AttentionBackend
from tianxia.loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "load_model_config"]


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    path: Path
    chat_template: str | None


def _open(spec: str) -> tuple[Path, object | None]:
    from tianxia.loader.gguf import GGUFFile
    from tianxia.loader.hub import resolve_model

    path = resolve_model(spec)
    if path.is_dir():
        return path, None
    return path, GGUFFile(path)


def load_model_config(spec: str) -> ModelConfig:
    from tianxia.loader.safetensors import hf_model_config

    path, gguf_file = _open(spec)
    return gguf_file.model_config() if gguf_file is not None else hf_model_config(path)


def load_model(
    spec: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
) -> LoadedModel:
    """Build the model on the ``meta`` device, then materialize it and copy each weight in once."""
    from tianxia.loader import safetensors as st
    from tianxia.loader.tokenizer import load_tokenizer
    from tianxia.models.registry import get_model_class

    t0 = time.perf_counter()
    path, gguf_file = _open(spec)
    if gguf_file is not None:
        config = gguf_file.model_config()
        weights = gguf_file.hf_weights(config)
    else:
        config = st.hf_model_config(path)
        weights = st.hf_weights(path)

    with torch.device("meta"):
        model = get_model_class(config)(config, backend)
    model.to_empty(device=device)
    model.to(dtype)
    missing = model.load_weights(weights)
    if missing:
        if gguf_file is not None:
            missing = [gguf_file.hf_to_gguf_name(n) for n in missing]
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: missing tensor(s): {shown}")
    model.init_buffers(device)
    model.eval()

    tokenizer = load_tokenizer(path, is_gguf=gguf_file is not None)
    template = gguf_file.chat_template() if gguf_file is not None else None
    template = template or getattr(tokenizer, "chat_template", None)
    logger.info("loaded %s (%s) in %.1fs", path, config.architecture, time.perf_counter() - t0)
    return LoadedModel(model, config, tokenizer, path, template)
