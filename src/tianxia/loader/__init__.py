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
from tianxia.loader.slicing import WeightShard

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
    quantization: str = "auto",
    shard: WeightShard | None = None,
    cpu_offload_bytes: int = 0,
    n_gpu_layers: int | None = None,
) -> LoadedModel:
    """Build the model on the ``meta`` device, then materialize it and copy each weight in once.

    With ``shard`` (a tensor-parallel rank), the model is built at the rank's size and only the
    rank's part of each tensor is read from the file; the returned config is the rank's build
    config.

    On CPU, for models that take packed weights, GGUF block-quantized matrices stay packed
    (``quantization="auto"``) and float matrices can be quantized as they stream in (``q8_0``,
    ``q4_0``, ``int8``, ``int4``); ``"none"`` dequantizes everything. On CUDA, ``int8`` and ``fp8``
    store the decoder projections with per-channel scales (:mod:`tianxia.quant.channelwise`).

    ``cpu_offload_bytes``: the first decoder layers' weights, up to that many bytes, stay in host
    memory and are streamed to the device each time the layer runs (:mod:`tianxia.loader.offload`).

    ``n_gpu_layers`` (on CUDA): only the last that many decoder layers run on the GPU, the others
    on the CPU (llama.cpp's ``-ngl``; :mod:`tianxia.loader.layer_split`); None: all of them.
    """
    from tianxia.loader import safetensors as st
    from tianxia.loader.tokenizer import load_tokenizer
    from tianxia.models.registry import get_model_class

    t0 = time.perf_counter()
    path, gguf_file = _open(spec)
    full_config = gguf_file.model_config() if gguf_file is not None else st.hf_model_config(path)
    config = full_config if shard is None else shard.model_config(full_config)
    model_class = get_model_class(config)
    packed = device.type == "cpu" and quantization != "none" and getattr(model_class, "packed_weights", False)
    split = _layer_split(model_class, config, n_gpu_layers, device, dtype, quantization, cpu_offload_bytes, shard)
    # on a GPU, int8 / fp8 replace the decoder projections after load (per-channel scales)
    channelwise = device.type == "cuda" and quantization in ("int8", "fp8")
    if quantization == "fp8":
        from tianxia.quant.channelwise import fp8_supported

        reason = fp8_supported(device)
        if reason is not None:
            raise ValueError(f"--quantization fp8: {reason}")
    if quantization not in ("auto", "none") and not packed and not channelwise:
        where = "on CPU" if device.type != "cpu" else f"for {config.architecture} models"
        raise ValueError(f"--quantization {quantization} is not available {where}; use auto or none")
    if gguf_file is not None:
        # split: the CPU modules' block-quantized matrices stay packed for the CPU kernels
        on_cpu = (split.packed if split is not None and quantization != "none"
                  and getattr(model_class, "packed_weights", False) else packed)
        weights = gguf_file.hf_weights(full_config, packed=on_cpu, shard=shard)
    else:
        weights = st.hf_weights(path, shard)
    if quantization not in ("auto", "none") and not channelwise:
        weights = quantize_weights(weights, quantization)

    with torch.device("meta"):
        model = model_class(config, backend)
    offloaded = []
    if cpu_offload_bytes > 0:
        from tianxia.loader import offload

        if channelwise:
            raise ValueError(f"--cpu-offload-gb cannot be combined with --quantization {quantization} yet")
        layers = offload.decoder_layers(model, config.num_hidden_layers)
        if layers is None:
            raise ValueError(f"--cpu-offload-gb: no decoder layers found in {config.architecture}")
        offloaded = offload.layers_to_offload(layers, cpu_offload_bytes, dtype)
        offload.materialize(model, device, dtype, offloaded)
    elif split is not None:
        split.materialize(model)
    else:
        model.to_empty(device=device)
    if split is None:
        model.to(dtype)
    missing = model.load_weights(weights)
    if missing:
        if gguf_file is not None:
            missing = [gguf_file.hf_to_gguf_name(n) for n in missing]
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: missing tensor(s): {shown}")
    if channelwise:
        from tianxia.quant.channelwise import quantize_model

        quantize_model(model, quantization)
    model.init_buffers(device)
    model.eval()
    if split is not None:
        split.install(model)
        logger.info("-ngl %d: %s", n_gpu_layers, split.placement.describe())
    for layer in offloaded:
        offload.stream_to(layer, device)
    if offloaded:
        logger.info("--cpu-offload-gb: %d of %d decoder layers (%.2f GiB) stay in host memory", len(offloaded),
                    config.num_hidden_layers, offload.offloaded_bytes(offloaded) / 2**30)

    tokenizer = load_tokenizer(path, is_gguf=gguf_file is not None)
    template = gguf_file.chat_template() if gguf_file is not None else None
    template = template or getattr(tokenizer, "chat_template", None)
    del weights, gguf_file
    release_freed_memory()
    logger.info("loaded %s (%s) in %.1fs; weights %s", path, config.architecture,
                time.perf_counter() - t0, describe_weights(model))
    return LoadedModel(model, config, tokenizer, path, template)


def _layer_split(model_class, config: ModelConfig, n_gpu_layers: int | None, device: torch.device,
                 dtype: torch.dtype, quantization: str, cpu_offload_bytes: int, shard: WeightShard | None):
    """The split between CPU and GPU that ``n_gpu_layers`` asks for, or None for one device."""
    if n_gpu_layers is None or n_gpu_layers < 0 or device.type != "cuda":
        return None
    from tianxia.loader.layer_split import LayerPlacement, LayerSplit

    placement = LayerPlacement.from_n_gpu_layers(n_gpu_layers, config.num_hidden_layers)
    if not placement.split:
        return None
    plan = getattr(model_class, "layer_split_plan", None)
    if plan is None:
        raise ValueError(f"--n-gpu-layers: {config.architecture} models cannot be split between CPU and GPU yet")
    if shard is not None or cpu_offload_bytes or quantization not in ("auto", "none"):
        what = ("--tensor-parallel-size" if shard is not None else "--cpu-offload-gb" if cpu_offload_bytes
                else f"--quantization {quantization}")
        raise ValueError(f"--n-gpu-layers cannot be combined with {what}")
    return LayerSplit(plan, placement, device, dtype)


def quantize_weights(weights, method: str):
    """Quantize each float matrix of a weight stream as it passes (norms and 1-D tensors, and
    matrices whose rows do not split into the method's groups, stay float)."""
    from tianxia.quant.packed import quantize_float

    group = 16 if method == "int8" else 32
    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[1] % group == 0 \
                and name.endswith(".weight") and "norm" not in name:
            tensor = quantize_float(tensor, method)
        yield name, tensor


def describe_weights(model: nn.Module) -> str:
    """Bytes held by the weights, per storage kind (e.g. ``Q4_1 70.1 MiB, float32 0.3 MiB``)."""
    from tianxia.layers.linear import _Packed

    kinds: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, _Packed):
            kinds[module.source] = kinds.get(module.source, 0) + module.packed.nbytes
            seen.update(id(t) for t in (module.qs, module.scales, module.mins))
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            key = str(t.dtype).removeprefix("torch.")
            kinds[key] = kinds.get(key, 0) + t.numel() * t.element_size()
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))


def release_freed_memory() -> None:
    """Give memory freed during loading back to the OS: the GGUF mapping and its parsed metadata,
    float32 staging tensors. glibc keeps freed heap pages otherwise, and they would stay in the
    resident set for the life of the process."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
