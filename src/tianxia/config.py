"""Frozen configuration objects shared by the loader, the engine and the front ends."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, in Hugging Face terms.

    Both loaders (GGUF metadata and HF ``config.json``) produce this object, so a model file never
    needs to know where its weights came from.
    """

    architecture: str  # "llama", "qwen2", "mistral", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # bias on q/k/v projections (qwen2)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-layer attention kind ("sliding_attention" / "full_attention"); None: every layer uses
    # ``sliding_window`` if it is set (Mistral), else full attention.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    partial_rotary_factor: float = 1.0  # fraction of head_dim that is rotated (Phi-3, GLM-4)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_logit_softcapping: float | None = None  # tanh soft-cap of attention scores (Gemma 2)
    final_logit_softcapping: float | None = None  # tanh soft-cap of the output logits (Gemma 2/3)
    qk_norm: bool = False  # RMSNorm over each q/k head before RoPE (Qwen3, Gemma 3)
    # Family-specific switches that only one model file reads (GPT-2, Falcon layouts, ...)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        if self.layer_types is None:
            return True
        return self.layer_types[layer] == "sliding_attention"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = 2 << 30  # bytes given to the KV cache on CPU
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # overrides kv_cache_memory when set (tests, tiny caches)
    # CUDA: fraction of the GPU's memory for weights, activations, CUDA graphs and the KV cache;
    # the KV cache gets what a profile run leaves (overrides kv_cache_memory when set)
    gpu_memory_utilization: float | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None
    seed: int = 0
    chat_template: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs
    quantization: str = "auto"  # see QUANTIZATION_METHODS
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    cpu_activations: str = "int8"  # see CPU_ACTIVATIONS
    # CUDA: batch-invariant kernels (layers/batch_invariant.py); CPU results are batch-invariant
    # by default
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("cpu_activations", self.cpu_activations, CPU_ACTIVATIONS)


# --quantization: what happens to the weights at load. Adding a method is one entry here plus its
# handling in the loader (``tianxia.loader.load_model``).
QUANTIZATION_METHODS: dict[str, str] = {
    "auto": "GGUF blocks stay packed on CPU (dequantized on GPU); float weights stay float",
    "none": "every weight dequantized to the model dtype",
    "q8_0": "float matrices quantized as llama.cpp's Q8_0 (int8, groups of 32, one scale)",
    "q4_0": "float matrices quantized as llama.cpp's Q4_0 (4-bit, groups of 32, one scale)",
    "int8": "float matrices quantized to int8 (CPU: packed groups; CUDA: one scale per output channel)",
    "int4": "float matrices quantized to 4 bits, groups of 32 with a scale and a min",
    "fp8": "CUDA, compute capability 8.9+: decoder projections in float8 e4m3, one scale per output channel",
}
# --kv-cache-dtype: the KV cache's element type; "auto" is the model dtype
KV_CACHE_DTYPES: dict[str, str] = {
    "auto": "the model dtype", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
}

# --cpu-activations: how decode steps on CPU multiply activations with packed (quantized) weights
CPU_ACTIVATIONS: dict[str, str] = {
    "int8": "rounded to 8 bits per 32 values for integer dot products, as llama.cpp does (fastest)",
    "float32": "kept in float32: the product equals dequantize-then-matmul up to float rounding",
}


def check_choice(option: str, value: str, choices: dict[str, str]) -> None:
    if value not in choices:
        flag = "--" + option.replace("_", "-")
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")


def parse_size(text: str | int) -> int:
    """Parse ``"2GiB"``, ``"512MB"``, ``"1.5G"`` or a plain byte count into bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}: use e.g. '2GiB', '512MiB' or a byte count")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if (binary or unit) else 1
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit]
    return int(number * base**power)


def add_quantization_args(parser) -> None:
    """``--quantization``, ``--kv-cache-dtype`` and ``--cpu-activations`` for every command that
    loads a model."""
    parser.add_argument(
        "--quantization", "-q", default="auto", choices=list(QUANTIZATION_METHODS),
        help="weights at load: " + "; ".join(f"{k}: {v}" for k, v in QUANTIZATION_METHODS.items()),
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="KV cache element type (default: auto, the model dtype)",
    )
    parser.add_argument(
        "--cpu-activations", default="int8", choices=list(CPU_ACTIVATIONS),
        help="CPU decode with packed weights: " + "; ".join(f"{k}: {v}" for k, v in CPU_ACTIVATIONS.items()),
    )
    parser.add_argument(
        "--batch-invariant", action="store_true",
        help="CUDA: kernels whose results for a request do not depend on the batch or the prefix cache "
             "(fixed-tile matmul, per-row RMSNorm, one attention kernel; no CUDA graphs). CPU results are "
             "batch-invariant by default",
    )
