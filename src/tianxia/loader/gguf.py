"""Read a GGUF file: hyper-parameters from its metadata, tensors dequantized to torch.

``gguf.GGUFReader`` parses the container (memory-mapped, nothing copied until a tensor is read);
dequantization is :mod:`tianxia.quant.gguf_codecs`. Tensor names are mapped to Hugging Face names so
the model code has one naming scheme for both formats.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tianxia.config import ModelConfig
from tianxia.loader.errors import ModelLoadError
from tianxia.loader.slicing import TensorSlice, WeightShard, packed_cols, pad_packed_rows, pad_rows
from tianxia.quant.packed import PackedWeight

# GGUF tensor names (llama.cpp's, as gguf-py's TensorNameMap writes them) <-> Hugging Face names,
# per architecture. Block entries map the part between "blk.N." and ".weight"/".bias".
_LLAMA_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GPT2_BLOCK = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_FALCON_BLOCK = {
    "attn_norm": "input_layernorm",  # see name_tables for Falcon-40B's two norms
    "attn_norm_2": "ln_attn",
    "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}
# arch -> (global names, block names, HF block prefix)
TENSOR_NAMES: dict[str, tuple[dict[str, str], dict[str, str], str]] = {
    "llama": (_LLAMA_GLOBAL, _LLAMA_BLOCK, "model.layers"),
    "mistral": (_LLAMA_GLOBAL, _LLAMA_BLOCK, "model.layers"),
    "qwen2": (_LLAMA_GLOBAL, _LLAMA_BLOCK, "model.layers"),
    "qwen3": (_LLAMA_GLOBAL, _LLAMA_BLOCK, "model.layers"),
    "gemma2": (_LLAMA_GLOBAL, _GEMMA_BLOCK, "model.layers"),
    "gemma3": (_LLAMA_GLOBAL, _GEMMA_BLOCK, "model.layers"),
    "phi3": (_LLAMA_GLOBAL, {**_LLAMA_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
             "model.layers"),
    "glm4": (_LLAMA_GLOBAL, {
        **_LLAMA_BLOCK,
        "ffn_up": "mlp.gate_up_proj",
        "post_attention_norm": "post_self_attn_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_mlp_layernorm",
    }, "model.layers"),
    "gpt2": ({"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
              "output_norm": "transformer.ln_f", "output": "lm_head"}, _GPT2_BLOCK, "transformer.h"),
    "falcon": ({"token_embd": "transformer.word_embeddings", "output_norm": "transformer.ln_f",
                "output": "lm_head"}, _FALCON_BLOCK, "transformer.h"),
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

# GGUF architectures this loader knows how to map, and the HF model type they become
_ARCHITECTURES = {a: a for a in TENSOR_NAMES}
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# HF Conv1D weights ([in, out]); GGUF stores them transposed, as nn.Linear does
GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def name_tables(arch: str, two_ln: bool = False) -> tuple[dict[str, str], dict[str, str], str]:
    glob, block, prefix = TENSOR_NAMES.get(arch, TENSOR_NAMES["llama"])
    if arch == "falcon" and two_ln:
        # llama.cpp's names for Falcon-40B blocks: attn_norm is ln_mlp, attn_norm_2 is ln_attn
        # (its graph runs attention on attn_norm_2 and the MLP on attn_norm)
        block = {**block, "attn_norm": "ln_mlp", "attn_norm_2": "ln_attn"}
    return glob, block, prefix


def gguf_to_hf_name(name: str, arch: str = "llama", two_ln: bool = False) -> str | None:
    glob, block, prefix = name_tables(arch, two_ln)
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in glob:
        return f"{glob[m.group(1)]}.{m.group(2)}"
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in block:
        return f"{prefix}.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    return None


def hf_to_gguf_name(hf_name: str, arch: str = "llama", two_ln: bool = False) -> str | None:
    glob, block, prefix = name_tables(arch, two_ln)
    base, _, suffix = hf_name.rpartition(".")
    for g, h in glob.items():
        if h == base:
            return f"{g}.{suffix}"
    if base.startswith(prefix + "."):
        idx, _, module = base[len(prefix) + 1 :].partition(".")
        for g, h in block.items():
            if h == module:
                return f"blk.{idx}.{g}.{suffix}"
    return None


class _NumpyWithPlainMmap:
    """``numpy`` as gguf-py's reader sees it, except that ``memmap`` is a plain read-only array.

    ``GGUFReader`` parses the header through hundreds of thousands of small slices of its
    ``np.memmap``; the memmap subclass's Python-level ``__array_finalize__`` / ``__getitem__``
    made that take seconds for a 50K-token vocabulary. ``np.frombuffer`` over an ``mmap`` is
    just as lazy (nothing is read until touched) without the per-slice overhead. Read-only
    opening (``mode='r'``, the default) is the only mode used by tianxia or transformers.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def memmap(path, mode: str = "r", **kwargs):
        if mode != "r" or kwargs:
            return np.memmap(path, mode=mode, **kwargs)
        import mmap

        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return np.empty(0, dtype=np.uint8)
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(mm, dtype=np.uint8)


def _install_fast_reader() -> None:
    import gguf.gguf_reader as gr

    if not isinstance(gr.np, _NumpyWithPlainMmap):
        gr.np = _NumpyWithPlainMmap()


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

        _install_fast_reader()
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

    @property
    def two_ln(self) -> bool:
        """Falcon-40B style blocks (separate attention and MLP input norms)."""
        return self.architecture == "falcon" and "blk.0.attn_norm_2.weight" in self.tensors

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

        def opt(key: str, default: Any = None) -> Any:
            return self.metadata(f"{arch}.{key}", default)

        hidden = int(req("embedding_length"))
        heads = int(req("attention.head_count"))
        kv_heads = int(opt("attention.head_count_kv", heads))
        head_dim = int(opt("attention.key_length", hidden // heads))
        layers = int(req("block_count"))
        tokens = self.metadata("tokenizer.ggml.tokens")
        vocab = int(opt("vocab_size", len(tokens) if tokens else 0))
        if "token_embd.weight" in self.tensors:
            vocab = int(self.tensors["token_embd.weight"].shape[1])
        rope_scaling = None
        scaling_type = opt("rope.scaling.type")
        if scaling_type and scaling_type != "none":
            factor = float(opt("rope.scaling.factor", 1.0))
            rope_scaling = {
                "rope_type": scaling_type,
                "factor": factor,
                "original_max_position_embeddings": int(opt("rope.scaling.original_context_length", 0)),
            }
            if scaling_type == "yarn":
                rope_scaling["attention_factor"] = opt("rope.scaling.attn_factor")
                rope_scaling["beta_fast"] = opt("rope.scaling.yarn_beta_fast")
                rope_scaling["beta_slow"] = opt("rope.scaling.yarn_beta_slow")
        if "rope_freqs.weight" in self.tensors:  # llama3-style scaling as per-frequency divisors
            factors = self.read_tensor("rope_freqs.weight").reshape(-1).tolist()
            rope_scaling = {"rope_type": "freq_factors", "factors": factors}
        eos = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            tid = self.metadata(key)
            if tid is not None and int(tid) not in eos:
                eos.append(int(tid))
        bos = self.metadata("tokenizer.ggml.bos_token_id")
        window = opt("attention.sliding_window")
        if arch == "gemma2" and window is None:
            window = 4096  # llama.cpp's default for Gemma 2
        layer_types = None
        if window and arch in _GEMMA_SWA_PATTERN:
            pattern = opt("attention.sliding_window_pattern", _GEMMA_SWA_PATTERN[arch])
            if isinstance(pattern, list):  # per-layer flags
                swa = [bool(p) for p in pattern]
            else:  # llama.cpp's set_swa_pattern: every n-th layer is global
                n = int(pattern)
                swa = [n == 0 or i % n < n - 1 for i in range(layers)]
            layer_types = tuple("sliding_attention" if f else "full_attention" for f in swa)
        gemma = arch in ("gemma2", "gemma3")
        scalar = None
        if gemma:  # llama.cpp: 1/sqrt(head_dim), except the 27B models' 1/sqrt(hidden/heads)
            scalar = float(hidden // heads if layers in (46, 62) else head_dim)
        rot_dims = opt("rope.dimension_count")
        eps = opt("attention.layer_norm_rms_epsilon", opt("attention.layer_norm_epsilon", 1e-6))
        extra: dict[str, Any] = {}
        if arch == "falcon":
            two_ln = self.two_ln
            extra = {"new_decoder_architecture": two_ln or kv_heads > 1, "parallel_attn": True,
                     "num_ln_in_parallel_attn": 2 if two_ln else 1, "qkv_layout": "standard"}
        intermediate = int(req("feed_forward_length"))
        ffn_down = self.tensors.get("blk.0.ffn_down.weight")
        if ffn_down is not None:  # the tensor is the truth (llama.cpp's falcon/gpt2 converters write 4*hidden)
            intermediate = int(ffn_down.shape[0])
        return ModelConfig(
            architecture=_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(opt("context_length", 4096)),
            rms_norm_eps=float(eps),
            rope_theta=float(opt("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            attention_bias="blk.0.attn_q.bias" in self.tensors or "blk.0.attn_qkv.bias" in self.tensors,
            tie_word_embeddings="output.weight" not in self.tensors,
            sliding_window=int(window) if window else None,
            hidden_act={"gpt2": "gelu_new", "falcon": "gelu"}.get(
                arch, "gelu_pytorch_tanh" if gemma else "silu"),
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos),
            layer_types=layer_types,
            rope_local_theta=float(opt("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
            partial_rotary_factor=int(rot_dims) / head_dim if rot_dims and arch in ("phi3", "glm4") else 1.0,
            query_pre_attn_scalar=scalar,
            attn_logit_softcapping=opt("attn_logit_softcapping") if arch == "gemma2" else None,
            final_logit_softcapping=opt("final_logit_softcapping") if gemma else None,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            extra=extra,
        )

    def chat_template(self) -> str | None:
        return self.metadata("tokenizer.chat_template")

    def _raw(self, name: str, part: TensorSlice | None) -> tuple[np.ndarray, tuple[int, ...], tuple[int, int] | None]:
        """The bytes of tensor ``name`` (or of ``part`` of it: its rows, or the blocks that cover its
        columns, copied out of the file mapping alone), their PyTorch-order shape, and the columns
        to cut once they are decoded."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        shape = tuple(int(d) for d in reversed(t.shape))
        data = t.data  # a view of the mapping: nothing is read until it is copied
        if part is None:
            return np.asarray(data), shape, None
        if part.dim == 0:
            raw = np.concatenate([data[a:b] for a, b in part.ranges])
            return raw, (sum(b - a for a, b in part.ranges), *shape[1:]), None
        import gguf

        (a, b), = part.ranges
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if block == 1:  # a float tensor: its numpy view is in elements
            return np.ascontiguousarray(data[:, a:b]), (shape[0], b - a), None
        lo, hi = a // block, -(-b // block)
        raw = np.ascontiguousarray(data[:, lo * size : hi * size])
        return raw, (shape[0], (hi - lo) * block), (a - lo * block, b - lo * block)

    def read_tensor(self, name: str, part: TensorSlice | None = None) -> torch.Tensor:
        """Dequantize one tensor (or ``part`` of it) to float32 in PyTorch (row-major, HF) shape."""
        from tianxia.quant.gguf_codecs import UnsupportedQuantTypeError, dequantize

        raw, shape, cut = self._raw(name, part)
        t = self.tensors[name]
        try:
            tensor = dequantize(raw, t.tensor_type, shape)
        except UnsupportedQuantTypeError as e:
            raise ModelLoadError(f"{self.path}: tensor {name!r}: {e}") from e
        except Exception as e:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} ({t.tensor_type.name}, shape {shape}) cannot be "
                f"decoded: {e}"
            ) from e
        if cut is not None:
            tensor = tensor[:, cut[0] : cut[1]].contiguous()
        return pad_rows(tensor, part.rows if part else None)

    def read_packed(self, name: str, part: TensorSlice | None = None) -> PackedWeight | None:
        """The matrix ``name`` (or ``part`` of it) repacked for the CPU kernels, or None if its type
        has no packed form."""
        from tianxia.quant.packed import PACKABLE_TYPES, from_gguf

        t = self.tensors[name]
        if len(t.shape) != 2 or t.tensor_type not in PACKABLE_TYPES:
            return None
        raw, shape, cut = self._raw(name, part)
        try:
            packed = from_gguf(raw, t.tensor_type, shape)
        except Exception as e:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} ({t.tensor_type.name}, shape {shape}) cannot be "
                f"decoded: {e}"
            ) from e
        if cut is not None:
            packed = packed_cols(packed, *cut)
        return pad_packed_rows(packed, part.rows if part else None)

    def hf_weights(
        self, config: ModelConfig, packed: bool | Callable[[str], bool] = False, shard: WeightShard | None = None
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        """Yield ``(hf_name, tensor)`` for every tensor the model uses, in HF layout: float32, or
        with ``packed`` a :class:`PackedWeight` for each block-quantized matrix (one tensor at a
        time, so the float32 model never exists in memory), or for those whose HF name ``packed``
        accepts; with ``shard``, only the part of each tensor that one tensor-parallel rank keeps
        is read."""
        arch, two_ln = self.architecture, self.two_ln
        for name, t in self.tensors.items():
            hf_name = gguf_to_hf_name(name, arch, two_ln)
            if hf_name is None:
                continue
            part = shard.slice(hf_name, tuple(int(d) for d in reversed(t.shape))) if shard else None
            keep_packed = packed(hf_name) if callable(packed) else packed
            tensor = self.read_packed(name, part) if keep_packed else None
            if tensor is None:
                tensor = self.read_tensor(name, part)
            if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
                heads = tensor.shape[0] // config.head_dim  # a rank's part holds whole heads
                if isinstance(tensor, torch.Tensor):
                    tensor = unpermute_rope_rows(tensor, heads)
                else:
                    rows = torch.arange(tensor.shape[0])[:, None]
                    tensor = tensor.select_rows(unpermute_rope_rows(rows, heads)[:, 0])
            elif arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
                tensor = tensor - 1  # llama.cpp stores Gemma's 1 + w (as transformers undoes it)
            elif arch == "gpt2" and hf_name.endswith(".weight") and any(c in hf_name for c in GPT2_CONV1D):
                tensor = tensor.t().contiguous()
            yield hf_name, tensor

    def hf_to_gguf_name(self, hf_name: str) -> str:
        return hf_to_gguf_name(hf_name, self.architecture, self.two_ln) or hf_name


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE) back to the rotate-half layout."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )
