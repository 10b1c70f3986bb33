"""Frozen configuration objects shared by the loader, the engine and the front ends."""

from __future__ import annotations

import argparse

import json
import re
from dataclasses import dataclass, field, fields
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


# more draft tokens than this per step only adds rejected rows: every published setting is below
MAX_SPECULATIVE_TOKENS = 32
# past a few sequences a decode step is no longer bound by reading the weights once, so the k
# extra rows a sequence verifies cost real time, which rejected proposals waste: large batches
# decode normally unless the config says otherwise (vLLM has no default; published gains fall
# with batch size and turn into slow-downs under load)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA options: ``max_loras`` distinct adapters in one batch, ``max_lora_rank`` the
    largest rank accepted, ``max_cpu_loras`` adapters kept in memory (LRU; None: ``max_loras``).
    ``modules``: (name, path) of the adapters the engine registers as it starts (``--lora-modules``),
    so that an engine in another process starts with them, or fails naming the bad file."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("--max-cpu-loras must be at least --max-loras")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``ngram`` (prompt lookup) or ``draft_model`` (a smaller model with the same
    tokenizer, ``model``). ``num_speculative_tokens``: the most tokens proposed per sequence and
    step. ``prompt_lookup_min/max``: the n-gram lengths matched (ngram). ``draft_min``: proposals
    shorter than this are dropped (llama.cpp's ``--draft-min``). ``disable_by_batch_size``: with
    more running sequences than this, no sequence speculates (None: never disabled by size)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    draft_min: int = 0
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # a sequence whose drafts are accepted at less than this rate (a running average) stops
    # proposing for a while: rejected rows cost forward time and give nothing; and no sequence
    # proposes while failed verifications' measured cost exceeds a share of the engine's time
    # (spec_decode/speculator.py TIME_BUDGET). 0 turns both off
    min_acceptance_rate: float = 0.2

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"speculative config: {msg}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if self.method not in METHODS:
            fail(f"method must be one of {', '.join(METHODS)} (or give \"model\" for a draft model), "
                 f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            fail(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "draft_model" and not self.model:
            fail("method draft_model needs \"model\": a path or pulled name of a draft model "
                 "that shares the target's tokenizer")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (is_int(lo) and is_int(hi)) or not 1 <= lo <= hi <= 64:
                fail(f"prompt_lookup_min and prompt_lookup_max must be integers with "
                     f"1 <= min <= max <= 64, got {lo!r} and {hi!r}")
        if not is_int(self.draft_min) or not 0 <= self.draft_min <= k:
            fail(f"draft_min must be an integer in [0, num_speculative_tokens={k}], got {self.draft_min!r}")
        b = self.disable_by_batch_size
        if b is not None and (not is_int(b) or b < 1):
            fail(f"disable_by_batch_size must be a positive integer or null, got {b!r}")
        r = self.min_acceptance_rate
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 <= r < 1.0:
            fail(f"min_acceptance_rate must be in [0, 1), got {r!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's keys: ``method`` is ``ngram`` or implied by ``model`` (a draft model); with one
        of ``prompt_lookup_min/max`` given, the other takes its value."""
        if not isinstance(values, dict):
            raise ValueError("speculative config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        values = dict(values)
        method = values.get("method")
        if method in (None, "draft_model", "draft") and values.get("model"):
            values["method"] = "draft_model"
        elif method is None:
            raise ValueError('speculative config: give "method": "ngram" or a draft "model"')
        if values["method"] == "ngram":
            lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            if lo is None and hi is not None:
                values["prompt_lookup_min"] = hi
            elif hi is None and lo is not None:
                values["prompt_lookup_max"] = lo
        return cls(**values)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A config from a JSON string (the CLI), a dict (the Python API) or a config."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON ({e}); e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        return cls.from_dict(value)


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
    # launch a step of decodes before the previous one's tokens are read (engine/overlap.py);
    # None: on where decode steps are CUDA graphs, with one rank and no speculative decoding
    async_scheduling: bool | None = None
    quantization: str = "auto"  # see QUANTIZATION_METHODS
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    # fp8 KV cache: per-layer K/V scales from a calibration prefill at start-up (None: on for an
    # fp8 cache on one rank; False: scales of 1.0)
    calculate_kv_scales: bool | None = None
    cpu_activations: str = "int8"  # see CPU_ACTIVATIONS
    # CUDA: batch-invariant kernels (layers/batch_invariant.py); CPU results are batch-invariant
    # by default
    batch_invariant: bool = False
    speculative: SpeculativeConfig | None = None  # speculative decoding; None: off
    # tensor parallelism (CPU: gloo; CUDA: NCCL, rank r on its node's cuda:r): ranks 1..N-1 are
    # worker processes, split evenly over ``nnodes`` nodes (node 0 holds rank 0, the engine);
    # their rendezvous address
    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)
    nnodes: int = 1
    node_rank: int = 0  # > 0: a node of worker ranks only (distributed/nodes.serve_node)
    lora: LoRAConfig | None = None  # LoRA adapters (--enable-lora); None: off
    # CUDA: GiB of decoder-layer weights kept in host memory and streamed to the GPU per forward
    cpu_offload_gb: float = 0.0
    # CUDA: only the last N decoder layers on the GPU, the others on the CPU (llama.cpp's -ngl);
    # None (or a negative N): every layer on the GPU
    n_gpu_layers: int | None = None

    @property
    def kv_scales_calibrated(self) -> bool:
        """Whether the fp8 cache's scales come from a calibration prefill: by default on one rank
        (a rank's cache would need its own calibration under tensor parallelism)."""
        if self.kv_cache_dtype not in FP8_KV_NAMES:
            return False
        return self.tensor_parallel_size == 1 if self.calculate_kv_scales is None else self.calculate_kv_scales

    def __post_init__(self) -> None:
        check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("cpu_activations", self.cpu_activations, CPU_ACTIVATIONS)
        if self.calculate_kv_scales and self.kv_cache_dtype not in FP8_KV_NAMES:
            raise ValueError(f"--calculate-kv-scales applies to --kv-cache-dtype fp8; got {self.kv_cache_dtype}")
        if self.calculate_kv_scales is True and self.tensor_parallel_size > 1:
            raise ValueError("--calculate-kv-scales is not supported with --tensor-parallel-size > 1 "
                             "(each rank's cache would need its own calibration)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1; got {self.tensor_parallel_size}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1; got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}); "
                             f"got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} does not divide evenly over "
                             f"--nnodes {self.nnodes} (each node runs tensor-parallel-size / nnodes ranks)")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("--nnodes > 1 needs --master-port (the same on every node, as --master-addr: "
                             "rank 0's address)")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("--async-scheduling cannot be combined with speculative decoding yet "
                             "(a step's proposals depend on the previous step's tokens)")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("--async-scheduling cannot be combined with --tensor-parallel-size > 1 yet")
        if self.cpu_offload_gb < 0:
            raise ValueError(f"--cpu-offload-gb must be at least 0; got {self.cpu_offload_gb}")
        if self.cpu_offload_gb and self.tensor_parallel_size > 1:
            raise ValueError("--cpu-offload-gb cannot be combined with --tensor-parallel-size > 1 yet")
        if self.n_gpu_layers is not None and self.n_gpu_layers >= 0:
            clash = ("--cpu-offload-gb" if self.cpu_offload_gb else
                     "--tensor-parallel-size > 1" if self.tensor_parallel_size > 1 else
                     "--enable-lora" if self.lora is not None else
                     "--kv-cache-dtype fp8" if self.kv_cache_dtype in FP8_KV_NAMES else
                     "speculative decoding" if self.speculative is not None else None)
            if clash:
                raise ValueError(f"--n-gpu-layers cannot be combined with {clash} yet")


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
    "q8_0": "CPU: llama.cpp's Q8_0 blocks (32 int8 values and a float16 scale, 34 bytes)",
    "q4_0": "CPU: llama.cpp's Q4_0 blocks (32 4-bit values and a float16 scale, 18 bytes)",
    "fp8": "CUDA, compute capability 8.9+: float8 e4m3 with one K and one V scale per layer (vLLM's fp8)",
    "fp8_e4m3": "the same as fp8",
}
FP8_KV_NAMES = ("fp8", "fp8_e4m3")
# llama.cpp's names for -ctk / -ctv, where they differ from ours
_LLAMA_CPP_KV_NAMES = {"f16": "fp16"}

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
    add_kv_cache_args(parser)
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


def add_offload_args(parser) -> None:
    """``--cpu-offload-gb`` (vLLM's meaning) and ``-ngl`` / ``--n-gpu-layers`` (llama.cpp's)."""
    parser.add_argument(
        "--cpu-offload-gb", type=float, default=0.0, metavar="GIB",
        help="CUDA: keep this many GiB of the decoder layers' weights in host memory and copy them to "
             "the GPU each forward (a model larger than the GPU runs, at the cost of the transfer)",
    )
    parser.add_argument(
        "--n-gpu-layers", "--gpu-layers", "-ngl", type=int, default=None, metavar="N",
        help="CUDA: run only the last N decoder layers on the GPU and the others on the CPU, the "
             "output layer counting as one more (llama.cpp's meaning; default: all on the GPU). "
             "Ignored, with a warning, without a GPU",
    )


def add_parallel_args(parser) -> None:
    """``--tensor-parallel-size`` / ``-tp`` and the rendezvous of its ranks."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over N ranks (processes; torch.distributed: gloo on CPU, NCCL on N GPUs)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="address of rank 0's rendezvous (node 0's address, reachable from every node)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="port of rank 0's rendezvous (default: a free one; needed with --nnodes > 1)")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="nodes the tensor-parallel ranks are split over, evenly (default: 1)")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this node's index: 0 runs the engine (and the server), others only "
                             "their worker ranks (default: 0)")


def add_kv_cache_args(parser) -> None:
    """``--kv-cache-dtype`` and llama.cpp's ``-ctk`` / ``-ctv`` (read by :func:`kv_cache_dtype_from_args`)."""
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="KV cache element type (default: auto, the model dtype): "
             + "; ".join(f"{k}: {v}" for k, v in KV_CACHE_DTYPES.items() if k != "auto"),
    )
    parser.add_argument(
        "--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=None,
        help="with --kv-cache-dtype fp8: each layer's K and V scales from a calibration prompt's "
             "absolute maxima at start-up (the default on one rank; --no-calculate-kv-scales: 1.0)",
    )
    parser.add_argument(
        "--cache-type-k", "-ctk", default=None, metavar="TYPE",
        help="llama.cpp's name for --kv-cache-dtype (f32, f16, bf16, q8_0, q4_0); K and V share one type",
    )
    parser.add_argument("--cache-type-v", "-ctv", default=None, metavar="TYPE", help="as -ctk")


def kv_cache_dtype_from_args(args) -> str:
    """The KV cache type from ``--kv-cache-dtype`` and llama.cpp's ``-ctk`` / ``-ctv``."""
    given = {}
    for flag, value in (("-ctk", args.cache_type_k), ("-ctv", args.cache_type_v)):
        if value is not None:
            name = _LLAMA_CPP_KV_NAMES.get(value.lower(), value.lower())
            if name not in KV_CACHE_DTYPES or name == "auto":
                raise ValueError(f"{flag} must be one of f32, f16, bf16, q8_0, q4_0; got {value!r}")
            given[flag] = name
    if len(set(given.values())) > 1:
        raise ValueError(f"-ctk {given['-ctk']} and -ctv {given['-ctv']} differ: tianxia keeps K and V in one "
                         "type; give the same type to both")
    if given and args.kv_cache_dtype != "auto" and args.kv_cache_dtype not in given.values():
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} and -ctk/-ctv {next(iter(given.values()))} differ")
    return next(iter(given.values()), args.kv_cache_dtype)


# llama.cpp's default --draft-max
DEFAULT_DRAFT_MAX = 16


def add_speculative_args(parser) -> None:
    """vLLM's ``--speculative-config`` and llama.cpp's ``-md/--draft-max/--draft-min``."""
    parser.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"model": DRAFT, '
             '"num_speculative_tokens": 5}\', plus "disable_by_batch_size"',
    )
    parser.add_argument("-md", "--model-draft", default=None,
                        help="draft model for speculative decoding (same tokenizer as the model)")
    parser.add_argument("--draft-max", "--draft", type=int, default=None,
                        help=f"most draft tokens per step (default: {DEFAULT_DRAFT_MAX} with -md)")
    parser.add_argument("--draft-min", type=int, default=None,
                        help="fewest draft tokens worth verifying; shorter proposals are dropped (default: 0)")


def add_lora_args(parser) -> None:
    """vLLM's LoRA serving flags."""
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the model")
    parser.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help='adapters served at start-up, each NAME=PATH (a PEFT directory) or vLLM\'s JSON '
             '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request picks one by its "model"',
    )
    parser.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch (default: 1)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default: 16)")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters kept in memory, least recently used evicted (default: --max-loras)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")


def lora_from_args(args) -> LoRAConfig | None:
    if not getattr(args, "enable_lora", False):
        if getattr(args, "lora_modules", None):
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras,
                      tuple(parse_lora_modules(args.lora_modules)))


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules`` items as (name, path): ``NAME=PATH`` or vLLM's JSON object."""
    out = []
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
            except ValueError as e:
                raise ValueError(f"--lora-modules: {item!r} is not valid JSON ({e})") from None
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("path"), str)):
                raise ValueError(f'--lora-modules: {item!r} needs "name" and "path" strings')
            out.append((obj["name"], obj["path"]))
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is not NAME=PATH")
            out.append((name, path))
    return out


def speculative_from_args(args) -> SpeculativeConfig | None:
    """The speculative config of a command line (None: speculation off)."""
    from dataclasses import replace

    spec = SpeculativeConfig.parse(args.speculative_config)
    if args.model_draft is not None:
        if spec is not None:
            raise ValueError("give either --speculative-config or -md/--model-draft, not both")
        spec = SpeculativeConfig.from_dict({
            "model": args.model_draft,
            "num_speculative_tokens": args.draft_max if args.draft_max is not None else DEFAULT_DRAFT_MAX,
            "draft_min": args.draft_min or 0,
        })
    elif spec is not None and (args.draft_max is not None or args.draft_min is not None):
        spec = replace(spec, num_speculative_tokens=args.draft_max or spec.num_speculative_tokens,
                       draft_min=spec.draft_min if args.draft_min is None else args.draft_min)
    elif args.draft_max is not None or args.draft_min is not None:
        raise ValueError("--draft-max/--draft-min need -md/--model-draft or --speculative-config")
    return spec
