"""llama.cpp's LoRA adapter files (``general.type = adapter``, ``adapter.type = lora``), as
``convert_lora_to_gguf.py`` writes them: ``blk.N.<tensor>.weight.lora_a`` ``[rank, in]`` and
``.lora_b`` ``[out, rank]`` (PyTorch shapes), ``adapter.lora.alpha``; for ``llama`` models the
q/k rows of ``lora_b`` are permuted as the base's q/k weights are, and are put back here."""

from __future__ import annotations

from pathlib import Path

import torch

from tianxia.config import ModelConfig
from tianxia.layers.lora import LoRAAdapter, LoRAError, LoRATarget, build_adapter
from tianxia.loader.errors import ModelLoadError
from tianxia.loader.gguf import GGUFFile, gguf_to_hf_name, unpermute_rope_rows


def load_gguf_adapter(name: str, path: str | Path, config: ModelConfig, targets: dict[str, LoRATarget],
                      max_rank: int, scale: float = 1.0) -> LoRAAdapter:
    """Read a GGUF LoRA adapter for a base of ``config``; problems are :class:`LoRAError`."""
    try:
        f = GGUFFile(path)
    except (ModelLoadError, OSError) as e:
        raise LoRAError(str(e)) from None
    kind = (str(f.metadata("general.type", "")), str(f.metadata("adapter.type", "")))
    if kind != ("adapter", "lora"):
        raise LoRAError(f"{path}: not a GGUF LoRA adapter (general.type {kind[0]!r}, adapter.type {kind[1]!r})")
    if f.architecture != config.architecture:
        raise LoRAError(f"{path}: an adapter for {f.architecture!r} models, the base is {config.architecture!r}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name in f.tensors:
        base, _, kind = tensor_name.rpartition(".")
        hf = gguf_to_hf_name(base, f.architecture) if kind in ("lora_a", "lora_b") else None
        if hf is None or not hf.endswith(".weight"):
            raise LoRAError(f"{path}: unexpected tensor {tensor_name!r}")
        try:
            tensor = f.read_tensor(tensor_name)
        except ModelLoadError as e:
            raise LoRAError(str(e)) from None
        module = hf.removesuffix(".weight")
        if kind == "lora_b" and f.architecture == "llama" and module.endswith((".q_proj", ".k_proj")):
            heads = config.num_attention_heads if module.endswith(".q_proj") else config.num_key_value_heads
            if tensor.shape[0] % (2 * heads):
                raise LoRAError(f"{path}: {tensor_name} has {tensor.shape[0]} rows, not {heads} heads' worth")
            tensor = unpermute_rope_rows(tensor, heads)
        pairs.setdefault(module, {})["A" if kind == "lora_a" else "B"] = tensor
    ranks = {ab["A"].shape[0] for ab in pairs.values() if "A" in ab}
    if len(ranks) != 1:
        why = "no LoRA tensors" if not ranks else f"modules of different ranks {sorted(ranks)}"
        raise LoRAError(f"{path}: {why}")
    rank = ranks.pop()
    alpha = float(f.metadata("adapter.lora.alpha", 0.0))
    # llama.cpp: scale * alpha / rank, or scale alone when the file has no alpha
    scaling = scale * (alpha / rank if alpha else 1.0)
    return build_adapter(name, path, pairs, rank, scaling, targets, max_rank)
