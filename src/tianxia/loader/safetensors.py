"""Read a Hugging Face model directory: ``config.json`` and single or sharded safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tianxia.config import ModelConfig
from tianxia.loader.errors import ModelLoadError
from tianxia.loader.slicing import WeightShard, read_safetensors_slice

# HF model_type -> our architecture name
_MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
    "glm4": "glm4", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3",
    "gpt2": "gpt2", "falcon": "falcon",
}
# sliding-window layer pattern when a config predates ``layer_types``: every Nth layer is global
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}


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


def _rope(cfg: dict[str, Any], layer_type: str | None = None) -> tuple[float, dict | None, dict]:
    """(theta, scaling or None, raw parameters) from flat (<= 4.x) or nested (>= 5) RoPE settings."""
    rope = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = dict(rope[layer_type])
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") if layer_type != "sliding_attention" else None
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling is not None:
        scaling = dict(scaling)
        if "rope_type" not in scaling and "type" in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return theta, scaling, rope


def _gpt2_config(model_dir: Path, cfg: dict[str, Any]) -> ModelConfig:
    hidden, heads = int(cfg["n_embd"]), int(cfg["n_head"])
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
        raise ModelLoadError(f"{model_dir}: GPT-2 attention variants are not supported")
    return ModelConfig(
        architecture="gpt2",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("n_inner") or 4 * hidden),
        num_hidden_layers=int(cfg["n_layer"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=int(cfg.get("n_positions", 1024)),
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        attention_bias=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        hidden_act=cfg.get("activation_function", "gelu_new"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(model_dir, cfg),
        extra={"scale_attn_weights": bool(cfg.get("scale_attn_weights", True))},
    )


def _falcon_config(model_dir: Path, cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("alibi"):
        raise ModelLoadError(f"{model_dir}: Falcon with ALiBi positions is not supported")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    if new_arch:
        kv_heads = int(cfg.get("num_kv_heads") or heads)
    else:
        kv_heads = 1 if cfg.get("multi_query", True) else heads
    theta, scaling, _ = _rope(cfg)
    num_ln = cfg.get("num_ln_in_parallel_attn")
    if num_ln is None and new_arch:
        num_ln = 2
    return ModelConfig(
        architecture="falcon",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("ffn_hidden_size") or 4 * hidden),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        hidden_act=cfg.get("activation", "gelu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(model_dir, cfg),
        extra={
            "new_decoder_architecture": new_arch,
            "parallel_attn": bool(cfg.get("parallel_attn", True)),
            "num_ln_in_parallel_attn": int(num_ln or 1),
        },
    )


def hf_model_config(model_dir: Path) -> ModelConfig:
    cfg = read_hf_config(model_dir)
    model_type = cfg.get("model_type", "")
    if model_type == "gemma3" and "text_config" in cfg:  # the multimodal wrapper: its text half
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type not in _MODEL_TYPES:
        raise ModelLoadError(
            f"{model_dir}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(_MODEL_TYPES))}"
        )
    arch = _MODEL_TYPES[model_type]
    if arch == "gpt2":
        return _gpt2_config(model_dir, cfg)
    if arch == "falcon":
        return _falcon_config(model_dir, cfg)
    gemma = arch in ("gemma2", "gemma3")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types is None and arch in _SWA_PATTERN:
        n = int(cfg.get("sliding_window_pattern") or _SWA_PATTERN[arch])
        layer_types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    local_theta = None
    if arch == "gemma3":
        theta, scaling, rope = _rope(cfg, "full_attention")
        local_theta, _, _ = _rope(cfg, "sliding_attention")
        if not isinstance((cfg.get("rope_parameters") or {}).get("sliding_attention"), dict):
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    else:
        theta, scaling, rope = _rope(cfg)
    if scaling and scaling.get("rope_type") in ("dynamic", "yarn", "linear", "llama3"):
        scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if arch == "glm4" and "partial_rotary_factor" not in rope and "partial_rotary_factor" not in cfg:
        partial = 0.5
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if layer_types is not None and all(t == "full_attention" for t in layer_types):
        layer_types, window = None, None
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window, layer_types = None, None
    bias = arch == "qwen2" or bool(cfg.get("attention_bias", arch == "glm4"))
    act = cfg.get("hidden_activation") if gemma else None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        sliding_window=int(window) if window else None,
        hidden_act=act or cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(model_dir, cfg),
        layer_types=tuple(layer_types) if layer_types and window else None,
        rope_local_theta=local_theta,
        partial_rotary_factor=partial,
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if arch == "gemma2" else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
        qk_norm=arch in ("qwen3", "gemma3"),
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


def hf_weights(model_dir: Path, shard: WeightShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint; with ``shard``, only the part one tensor-parallel rank
    keeps is copied out of the file mapping."""
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if shard is None:
                        yield name, f.get_tensor(name)
                        continue
                    view = f.get_slice(name)
                    part = shard.slice(name, tuple(view.get_shape()))
                    yield name, f.get_tensor(name) if part is None else read_safetensors_slice(view, part)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot read safetensors ({e})") from e
