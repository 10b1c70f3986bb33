"""Read a Hugging Face model directory: ``config.json`` and single or sharded safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tianxia.config import ModelConfig
from tianxia.loader.errors import ModelLoadError

_MODEL_TYPES = {"llama", "mistral", "qwen2"}


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ModelLoadError(f"{model_dir}: no config.json; not a Hugging Face model directory") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e


def _eos_ids(model_dir: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [cfg]
    gen = model_dir / "generation_config.json"
    if gen.exists():
        sources.insert(0, json.loads(gen.read_text()))
    for src in sources:
        value = src.get("eos_token_id")
        for tid in value if isinstance(value, list) else [value]:
            if tid is not None and int(tid) not in ids:
                ids.append(int(tid))
    return tuple(ids)


def hf_model_config(model_dir: Path) -> ModelConfig:
    cfg = read_hf_config(model_dir)
    model_type = cfg.get("model_type", "")
    if model_type not in _MODEL_TYPES:
        raise ModelLoadError(
            f"{model_dir}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(_MODEL_TYPES))}"
        )
    # transformers >= 5 nests RoPE settings in rope_parameters; older configs keep them flat
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=int(window) if window else None,
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(model_dir, cfg),
    )


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index}: shard(s) missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files")
    return files


def hf_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot read safetensors ({e})") from e
