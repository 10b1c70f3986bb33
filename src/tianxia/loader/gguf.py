"""Read a GGUF file: hyper-parameters from its metadata, tensors dequantized to torch.

``gguf.GGUFReader`` parses the container (memory-mapped, nothing copied until a tensor is read);
dequantization is :mod:`tianxia.quant.gguf_codecs`. Tensor names are mapped to Hugging Face names so
the model code has one naming scheme for both formats.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tianxia.config import ModelConfig
from tianxia.loader.errors import ModelLoadError

# GGUF tensor name (per block or global) -> Hugging Face name
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# GGUF architectures this loader knows how to map, and the HF model type they become
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return default if value is None else value


class GGUFFile:
    """An opened GGUF file. Raises :class:`ModelLoadError` for anything that is not a sound GGUF."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError/IndexError/struct.error on damage
            raise ModelLoadError(
                f"{self.path}: not a valid GGUF file ({type(e).__name__}: {e}); "
                "the file may be truncated or corrupt, pull or download it again"
            ) from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.architecture = str(_field(self.reader, "general.architecture", ""))
        self._check_extent()

    def _check_extent(self) -> None:
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name!r} ends at byte {end} but the file has {size} "
                    "bytes; the file is truncated, pull or download it again"
                )

    def metadata(self, key: str, default: Any = None) -> Any:
        return _field(self.reader, key, default)

    def model_config(self) -> ModelConfig:
        arch = self.architecture
        if arch not in _ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; "
                f"supported: {', '.join(sorted(_ARCHITECTURES))}"
            )

        def req(key: str) -> Any:
            value = self.metadata(f"{arch}.{key}")
            if value is None:
                raise ModelLoadError(f"{self.path}: metadata key '{arch}.{key}' is missing")
            return value

        hidden = int(req("embedding_length"))
        heads = int(req("attention.head_count"))
        kv_heads = int(self.metadata(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(self.metadata(f"{arch}.attention.key_length", hidden // heads))
        tokens = self.metadata("tokenizer.ggml.tokens")
        vocab = int(self.metadata(f"{arch}.vocab_size", len(tokens) if tokens else 0))
        if "token_embd.weight" in self.tensors:
            vocab = int(self.tensors["token_embd.weight"].shape[1])
        rope_scaling = None
        scaling_type = self.metadata(f"{arch}.rope.scaling.type")
        if scaling_type and scaling_type != "none":
            rope_scaling = {
                "rope_type": scaling_type,
                "factor": float(self.metadata(f"{arch}.rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(
                    self.metadata(f"{arch}.rope.scaling.original_context_length", 0)
                ),
            }
        eos = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            tid = self.metadata(key)
            if tid is not None and int(tid) not in eos:
                eos.append(int(tid))
        bos = self.metadata("tokenizer.ggml.bos_token_id")
        window = self.metadata(f"{arch}.attention.sliding_window")
        return ModelConfig(
            architecture=_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(req("feed_forward_length")),
            num_hidden_layers=int(req("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(self.metadata(f"{arch}.context_length", 4096)),
            rms_norm_eps=float(self.metadata(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.metadata(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            tie_word_embeddings="output.weight" not in self.tensors,
            sliding_window=int(window) if window else None,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos),
        )

    def chat_template(self) -> str | None:
        return self.metadata("tokenizer.chat_template")

    def read_tensor(self, name: str) -> torch.Tensor:
        """Dequantize one tensor to float32 in PyTorch (row-major, HF) shape."""
        from tianxia.quant.gguf_codecs import UnsupportedQuantTypeError, dequantize

        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            return dequantize(np.asarray(t.data), t.tensor_type, shape)
        except UnsupportedQuantTypeError as e:
            raise ModelLoadError(f"{self.path}: tensor {name!r}: {e}") from e
        except Exception as e:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} ({t.tensor_type.name}, shape {shape}) cannot be "
                f"decoded: {e}"
            ) from e

    def hf_weights(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, float32 tensor)`` for every tensor the model uses."""
        for name in self.tensors:
            hf_name = gguf_to_hf_name(name)
            if hf_name is None:
                continue
            tensor = self.read_tensor(name)
            if self.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
                heads = config.num_attention_heads
                if ".k_proj." in hf_name:
                    heads = config.num_key_value_heads
                tensor = unpermute_rope_rows(tensor, heads)
            yield hf_name, tensor

    def hf_to_gguf_name(self, hf_name: str) -> str:
        for name in self.tensors:
            if gguf_to_hf_name(name) == hf_name:
                return name
        for g, h in _GLOBAL_NAMES.items():
            if h == hf_name:
                return g
        m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf_name)
        if m:
            inverse = {v: k for k, v in _BLOCK_NAMES.items()}
            if m.group(2) in inverse:
                return f"blk.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}"
        return hf_name


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE) back to the rotate-half layout."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )
