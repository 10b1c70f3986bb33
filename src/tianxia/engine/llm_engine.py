"""The engine: requests in, one scheduled forward pass per :meth:`LLMEngine.step`, outputs out."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from tianxia.config import FP8_KV_NAMES, EngineConfig
from tianxia.engine import faults
from tianxia.engine.block_manager import BlockManager
from tianxia.engine.cuda_graph import mixed_step_rows
from tianxia.engine.detokenizer import IncrementalDetokenizer, fast_decode, rust_tokenizer
from tianxia.engine.model_runner import ModelRunner, kv_bytes_per_token
from tianxia.engine.overlap import LaunchedStep, next_step
from tianxia.engine.step_io import RequestFailure, TokenLogprobs
from tianxia.quant.kv_blocks import KV_BLOCK_BYTES
from tianxia.engine.lora_manager import LoRARequest, LoRAUnknownError
from tianxia.engine.scheduler import Scheduler, SchedulerOutput
from tianxia.engine.output_processor import RequestDelta, request_delta
from tianxia.engine.sequence import Sequence, SequenceStatus
from tianxia.layers.attention import get_backend
from tianxia.layers.linear import use_row_invariant_linears
from tianxia.loader import load_model
from tianxia.loader.layer_split import layer_split_of
from tianxia.outputs import CompletionOutput, Logprob, RequestOutput
from tianxia.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


def resolve_device(device: str) -> torch.device:
    if device in ("auto", ""):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    table = {
        "float32": torch.float32, "f32": torch.float32, "float": torch.float32,
        "float16": torch.float16, "f16": torch.float16, "half": torch.float16,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    }
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def default_threads() -> int:
    """Physical cores this process may run on: one thread per core is fastest for the matmuls
    (a hyper-thread sibling shares the core's vector units and only adds contention)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
            cores.add(siblings.strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def rss_bytes() -> int:
    """Resident set size of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                           device: torch.device | None = None) -> torch.dtype | str:
    """The cache's torch dtype, or the name of a block format (``"q8_0"``, ``"q4_0"``: CPU only).
    ``fp8`` needs the Triton attention backend (CUDA; on CPU only the tests' interpreter)."""
    if kv_cache_dtype in FP8_KV_NAMES:
        reason = _fp8_kv_unsupported(torch.device(device or "cpu"))
        if reason is not None:
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: {reason}")
        return torch.float8_e4m3fn
    if kv_cache_dtype in KV_BLOCK_BYTES:
        if device is not None and device.type != "cpu":
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is a CPU cache format; on a GPU use auto, "
                             "bf16, fp16 or f32")
        return kv_cache_dtype
    table = {"f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    return model_dtype if kv_cache_dtype == "auto" else table[kv_cache_dtype]


def _fp8_kv_unsupported(device: torch.device) -> str | None:
    if get_backend(device).name not in ("triton", "triton_invariant"):
        if device.type == "cpu":
            return "fp8 is a CUDA cache format; on CPU use q8_0 (or q4_0, bf16, f32)"
        return "the fp8 cache needs the Triton attention backend (Triton is not installed)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"fp8 needs compute capability 8.9 or newer; this GPU has {major}.{minor} (use bf16 or fp16)"
    return None


def kv_type_name(kv_dtype: torch.dtype | str) -> str:
    """``q8_0``, ``float32``, ...: the KV cache type for logs and metrics."""
    return kv_dtype if isinstance(kv_dtype, str) else str(kv_dtype).removeprefix("torch.")


# --- GPU memory planning ----------------------------------------------------------------------------

_GIB = 2**30


def _oom_message(what: str, device: torch.device, err: Exception) -> str:
    free, total = torch.cuda.mem_get_info(device)
    return (
        f"out of GPU memory while {what}: {free / _GIB:.2f} GiB free of {total / _GIB:.2f} GiB, "
        f"{torch.cuda.memory_allocated(device) / _GIB:.2f} GiB allocated by tianxia; lower "
        f"--gpu-memory-utilization / --kv-cache-memory, --max-num-seqs or --max-model-len "
        f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    )


def make_runner(model, model_config, cache_config, device, dtype, seed,
                runner_class: type[ModelRunner] = ModelRunner) -> ModelRunner:
    """The model runner; on CUDA an out-of-memory KV cache is a message with the numbers."""
    if device.type != "cuda":
        return runner_class(model, model_config, cache_config, device, dtype, seed=seed)
    try:
        return runner_class(model, model_config, cache_config, device, dtype, seed=seed)
    except torch.cuda.OutOfMemoryError as e:
        per_block = kv_bytes_per_token(model_config, dtype) * cache_config.block_size
        want = (cache_config.num_blocks * per_block if cache_config.num_blocks
                else cache_config.kv_cache_memory)
        raise ValueError(_oom_message(f"allocating a {want / _GIB:.2f} GiB KV cache", device, e)) from None


def setup_decode(runner: ModelRunner, max_num_seqs: int, max_model_len: int, enforce_eager: bool,
                 fused_step: bool = True, max_rows: int | None = None) -> None:
    """The runner's decode route (fused step, CUDA graphs); out of GPU memory is a message."""
    try:
        runner.setup_decode(max_num_seqs, max_model_len, enforce_eager=enforce_eager, fused_step=fused_step,
                            max_rows=max_rows)
    except torch.cuda.OutOfMemoryError as e:
        raise ValueError(_oom_message("capturing the decode CUDA graphs", runner.device, e)) from None


@torch.inference_mode()
def plan_gpu_memory(model, model_config, config: EngineConfig, device: torch.device, dtype: torch.dtype):
    """Size the KV cache from ``gpu_memory_utilization``: what is left of that share of the GPU
    after the weights (measured), the peak activations of a full-budget prefill step (profiled)
    and the sampler's and CUDA graphs' buffers (estimated from max_num_seqs x vocab). Returns the
    cache config with ``num_blocks`` set; too little room is an error with the numbers."""
    from dataclasses import replace as _replace

    from tianxia.engine.step_io import TokenRun, prepare_batch

    frac = config.cache.gpu_memory_utilization
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {frac}")
    bs = config.cache.block_size
    sched = config.scheduler
    max_len = sched.max_model_len or model_config.max_position_embeddings
    n = max(1, min(sched.max_num_batched_tokens, max_len))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    # weights offloaded to the host (--cpu-offload-gb) take no GPU memory
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if t.is_cuda)
    probe = ModelRunner(model, model_config, _replace(config.cache, num_blocks=(n + bs - 1) // bs + 1),
                        device, dtype)
    run = TokenRun([0] * n, 0, list(range((n + bs - 1) // bs)))
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        ids, pos, meta = probe.tensors(prepare_batch([(run, n)], bs)[1])
        hidden = model(ids, pos, probe.kv_caches, meta)
        model.compute_logits(hidden[-1:])
        del hidden
        torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError as e:
        raise ValueError(_oom_message(f"profiling a {n}-token prefill step", device, e)) from None
    activations = torch.cuda.max_memory_allocated(device) - base
    del probe
    torch.cuda.empty_cache()
    vocab = model_config.vocab_size
    sampler = 4 * sched.max_num_seqs * vocab * 4  # float32 logits, probabilities, sort buffers
    graphs = (0 if config.enforce_eager or config.batch_invariant
              else mixed_step_rows(sched.max_num_seqs, sched.max_num_batched_tokens) * vocab * 6 + (256 << 20))
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # weights, the CUDA context, other processes
    kv = int(frac * total) - in_use - activations - sampler - graphs
    per_block = kv_bytes_per_token(model_config, dtype) * bs
    split = layer_split_of(model)
    host_blocks = None
    if split is not None:  # -ngl: only the GPU layers' caches take GPU memory; the CPU layers'
        # (float32) take host memory, up to --kv-cache-memory
        cpu_layers = model_config.num_hidden_layers - split.placement.gpu_layers
        per_block = per_block * split.placement.gpu_layers // model_config.num_hidden_layers
        host_per_block = kv_bytes_per_token(_replace(model_config, num_hidden_layers=cpu_layers), torch.float32) * bs
        host_blocks = config.cache.kv_cache_memory // host_per_block if cpu_layers else None
    need = (max_len + bs - 1) // bs
    numbers = (
        f"{frac} x {total / _GIB:.1f} GiB = {frac * total / _GIB:.2f} GiB; in use {in_use / _GIB:.2f} "
        f"GiB (weights {weights / _GIB:.2f} GiB), peak activations {activations / _GIB:.2f} GiB "
        f"({n} tokens), sampler {sampler / _GIB:.2f} GiB, CUDA graphs {graphs / _GIB:.2f} GiB"
    )
    if kv < per_block:
        raise ValueError(f"--gpu-memory-utilization leaves no room for the KV cache: {numbers}")
    num_blocks = kv // per_block if per_block else host_blocks
    if host_blocks is not None and host_blocks < num_blocks:
        logger.info("-ngl: the CPU layers' KV cache (--kv-cache-memory %.2f GiB) holds %d tokens",
                    config.cache.kv_cache_memory / _GIB, host_blocks * bs)
        num_blocks = host_blocks
    if num_blocks < need:
        logger.warning("the KV cache holds %d tokens, less than max_model_len %d", num_blocks * bs, max_len)
    logger.info("GPU memory plan: %s; KV cache %.2f GiB = %d tokens", numbers, num_blocks * per_block / _GIB,
                num_blocks * bs)
    return _replace(config.cache, num_blocks=int(num_blocks))


def _all_finished(seqs: list[Sequence]) -> bool:
    """Whether a request has ended: every sequence finished, and no sibling still to fork."""
    return all(s.status is SequenceStatus.FINISHED for s in seqs) and not seqs[0].pending_forks


def attention_window(model: torch.nn.Module) -> int | None:
    """The sliding window that every attention layer of ``model`` applies (the largest, if they
    differ), or None when any layer attends to the whole context.

    All layers share one block table, so a block can be given back only when no layer reads it:
    one global layer (Gemma 2/3) keeps every block. vLLM's hybrid allocator instead gives sliding
    and global layers separate block tables (KV cache groups), so the sliding layers' blocks are
    freed even next to global layers.
    """
    from tianxia.layers.attention import AttentionBackend

    windows = [
        getattr(m, "sliding_window", None)
        for m in model.modules()
        if isinstance(getattr(m, "backend", None), AttentionBackend)
    ]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if config.cpu_offload_gb and self.device.type != "cuda":
            raise ValueError("--cpu-offload-gb keeps weights in host memory for a GPU; on CPU they are there already")
        if config.n_gpu_layers is not None and config.n_gpu_layers >= 0 and self.device.type != "cuda":
            # as llama.cpp: the option means nothing without a GPU, and the model runs as it would
            logger.warning("--n-gpu-layers %d ignored: no GPU (device %s)", config.n_gpu_layers, self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads or default_threads())
        if self.device.type == "cuda":
            from tianxia.engine.kernel_cache import configure_gpu_caches

            configure_gpu_caches()  # Triton's kernel and autotuning caches: see ``tianxia build``
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        runner_class, tp = ModelRunner, None
        if config.tensor_parallel_size > 1:
            from tianxia.distributed import tensor_parallel as tp

            loaded = tp.load_model(config, self.dtype, self.device, self.kv_dtype)
            runner_class = tp.TensorParallelRunner
        else:
            loaded = load_model(config.model, dtype=self.dtype, device=self.device,
                                backend=get_backend(self.device), quantization=config.quantization,
                                cpu_offload_bytes=int(config.cpu_offload_gb * 2**30),
                                n_gpu_layers=config.n_gpu_layers)
        if hasattr(loaded.model, "int8_activations"):
            loaded.model.int8_activations = config.cpu_activations == "int8"
        if self.device.type == "cpu":  # float products that do not depend on the batch
            use_row_invariant_linears(loaded.model)
        elif config.batch_invariant and self.device.type == "cuda":
            from tianxia.layers.batch_invariant import make_batch_invariant

            make_batch_invariant(loaded.model)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self._decode = fast_decode(self.tokenizer)
        self._rust_tokenizer = rust_tokenizer(self.tokenizer)
        self.chat_template = config.chat_template or loaded.chat_template
        self.model_path = loaded.path
        eos = list(loaded.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        # an end-of-sequence id the model cannot produce (a config copied from another model)
        # would otherwise fail every min_tokens request where the sampler bans it
        vocab = loaded.config.vocab_size
        outside = [t for t in eos if not 0 <= t < vocab]
        if outside:
            logger.warning("end-of-sequence token id(s) %s are outside the model's vocabulary (%d); "
                           "ignored", outside, vocab)
        self.eos_ids = tuple(t for t in eos if t not in outside)

        kv_scales = None
        if config.kv_scales_calibrated:  # before the fp8 cache exists: the probe's float cache is freed first
            from tianxia.engine.kv_scales import CALIBRATION_TEXT, calibrate_kv_scales

            kv_scales = calibrate_kv_scales(loaded.model, loaded.config, self.tokenizer.encode(CALIBRATION_TEXT),
                                            self.device, self.dtype, config.cache.block_size)
        cache_config = config.cache
        if self.device.type == "cuda" and cache_config.gpu_memory_utilization is not None:
            cache_config = plan_gpu_memory(loaded.model, loaded.config, config, self.device, self.kv_dtype)
        self.runner = make_runner(loaded.model, loaded.config, cache_config, self.device, self.kv_dtype,
                                  config.seed, runner_class)
        if kv_scales is not None:
            self.runner.kv_scales.copy_(kv_scales)
        if tp is not None:
            tp.wait_for_workers(self.runner)
        sched = config.scheduler
        window = attention_window(loaded.model)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            sliding_window=window,
        )
        capacity = self.block_manager.num_usable_blocks * config.cache.block_size
        max_len = sched.max_model_len or loaded.config.max_position_embeddings
        per_seq = self.block_manager.max_blocks_per_seq(sched.max_num_batched_tokens)
        if per_seq is not None and per_seq <= self.block_manager.num_usable_blocks:
            # every layer slides: one sequence never holds more than its window (plus a step's
            # tokens), so any length fits the cache
            logger.info("sliding window %d on every layer: a sequence holds at most %d blocks",
                        window, per_seq)
        elif max_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it", max_len, capacity)
            max_len = capacity
        self.max_model_len = max_len
        # the most tokens' worth of blocks one sequence holds
        longest = max_len if per_seq is None else min(max_len, per_seq * config.cache.block_size)
        # the batch-invariant GPU mode runs every product through its fixed-tile kernels: no fused
        # decode step (it has kernels of its own) and no graphs
        gpu_invariant = self.device.type == "cuda" and config.batch_invariant
        self.lora_manager = None
        if config.lora is not None:
            from tianxia.engine.lora_manager import LoRAManager

            # before the decode graphs: on a GPU the adapters' hooks are captured with the step
            self.lora_manager = LoRAManager(loaded.model, config.lora, max_rows=sched.max_num_seqs)
            self.runner.lora = self.lora_manager.state
        setup_decode(self.runner, sched.max_num_seqs, max_len, config.enforce_eager or gpu_invariant,
                     fused_step=not gpu_invariant,
                     max_rows=mixed_step_rows(sched.max_num_seqs, sched.max_num_batched_tokens))
        from dataclasses import replace

        self.scheduler = Scheduler(replace(sched, max_model_len=max_len), self.block_manager,
                                   max_loras=config.lora.max_loras if config.lora else 0, eos_ids=self.eos_ids)
        for name, path in config.lora.modules if config.lora else ():
            self.add_lora(name, path)  # a bad adapter stops the start-up with a message naming it
        self.requests: dict[str, list[Sequence]] = {}
        # request id -> why, for the requests failed in the last step
        self.failed: dict[str, RequestFailure] = {}
        self._grammar_backend = None
        self.speculator = None
        if config.speculative is not None:
            self.speculator = self._make_speculator(config.speculative, loaded)
            self.scheduler.speculator = self.speculator
        # by default where steps are CUDA graphs: there the host's work between two steps is the
        # GPU's idle time, unless the next step is launched first
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.graph_runner is not None and tp is None
                                 and self.speculator is None)
        self._launched: LaunchedStep | None = None  # the step launched ahead (async scheduling)
        self.num_steps_ahead = 0  # steps launched before their predecessor was applied
        # the scheduler output the last step() applied (None when it ran nothing): per-step
        # statistics read it, whichever path (schedule() or launched ahead) produced the step
        self.last_applied: SchedulerOutput | None = None
        if self.async_scheduling:
            logger.info("async scheduling: each step launches the next before its tokens are read")
        logger.info(
            "KV cache (%s): %d blocks x %d tokens = %d tokens (%.2f GiB, %d bytes/token); "
            "max concurrency at max_model_len=%d: %.1f",
            kv_type_name(self.kv_dtype), self.runner.num_blocks, config.cache.block_size, capacity,
            self.runner.kv_cache_bytes / 2**30, kv_bytes_per_token(loaded.config, self.kv_dtype),
            max_len, capacity / longest,
        )
        if self.device.type == "cpu":
            # the C++ kernels compile on first use (a minute or two, once per machine and torch
            # version): here, before the server says it is healthy, not inside the first request
            from tianxia.quant import cpu_kernels

            cpu_kernels.extension()
            logger.info("CPU: %d threads; resident memory after load %.1f MiB (weights and KV cache)",
                        torch.get_num_threads(), rss_bytes() / 2**20)

    def _make_speculator(self, spec, loaded):
        from tianxia.engine.spec_decode import Speculator

        draft = None
        if spec.method == "draft_model":
            from tianxia.engine.spec_decode.draft_model import DraftModelProposer

            draft = DraftModelProposer.load(spec.model, self, loaded)
        logger.info("speculative decoding: %s, up to %d tokens per step%s", spec.method,
                    spec.num_speculative_tokens,
                    f", off above {spec.disable_by_batch_size} sequences" if spec.disable_by_batch_size else "")
        return Speculator(spec, self.max_model_len, draft)

    # --- requests -----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, list(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora_slot = self._lora_slot(lora_request) if lora_request is not None else -1
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but this model's maximum context length is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token); "
                "shorten the prompt or raise --max-model-len"
            )
        params.check_vocab(vocab)
        compiled = None
        if params.structured_outputs is not None:
            compiled = self.grammar_backend().compile(params.structured_outputs)
        seq = Sequence(request_id, text, ids, params)
        if lora_request is not None:
            seq.lora_name, seq.lora_slot = lora_request.lora_name, lora_slot
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None:
            if not isinstance(salt, str) or not salt:
                raise ValueError("cache_salt must be a non-empty string")
            seq.cache_salt = salt.encode()
        if isinstance(prompt, dict) and prompt.get("prompt_logprobs_start") and seq.prompt_logprobs is not None:
            # prompt logprobs only from this position on (None before it), so that the tokens
            # before it can come from the prefix cache (tianxia.lang's select scores choices so)
            seq.prompt_logprobs = [None] * max(1, min(int(prompt["prompt_logprobs_start"]), len(ids)))
        if compiled is not None:
            seq.compiled_grammar = compiled
            seq.grammar = self._grammar_backend.matcher(compiled)
        seq.bad_words_ids = self._bad_words_ids(params.bad_words or [])
        seq.detok = self._detokenizer(seq)
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)

    # --- LoRA adapters ------------------------------------------------------------------------

    def _lora_slot(self, req: LoRARequest) -> int:
        """The slot of a request's adapter; one with a path that is not registered yet is
        registered first (vLLM's offline ``LoRARequest(name, id, path)``)."""
        manager = self.lora_manager
        if manager is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)")
        if req.lora_name not in manager.paths:
            if not req.lora_path:
                raise LoRAUnknownError(f"no LoRA adapter named {req.lora_name!r} is loaded")
            manager.add(req.lora_name, req.lora_path, self.scheduler.lora_slots_in_use())
        elif req.lora_path and req.lora_path != manager.paths[req.lora_name]:
            raise ValueError(f"LoRA adapter {req.lora_name!r} is already loaded from {manager.paths[req.lora_name]}")
        return manager.acquire(req.lora_name, self.scheduler.lora_slots_in_use())

    def add_lora(self, name: str, path: str | list[tuple[str, float]]) -> None:
        """Register an adapter (vLLM's ``/v1/load_lora_adapter``): a path, or (path, scale) pairs
        whose deltas are summed (llama.cpp's ``--lora`` / ``--lora-scaled``); a bad one raises
        LoRAError."""
        if self.lora_manager is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)")
        self.lora_manager.add(name, path, self.scheduler.lora_slots_in_use())

    def remove_lora(self, name: str) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove(name)

    def list_loras(self) -> list[str]:
        return [] if self.lora_manager is None else self.lora_manager.names

    def grammar_backend(self):
        """The xgrammar backend, built on first use (it indexes the whole vocabulary)."""
        if self._grammar_backend is None:
            from tianxia.structured import GrammarBackend

            self._grammar_backend = GrammarBackend(
                self.tokenizer, self.model_config.vocab_size, self.eos_ids
            )
            self.runner.sampler.grammar_backend = self._grammar_backend
        return self._grammar_backend

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        p = seq.params
        return IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, p.stop_strings, p.include_stop_str_in_output,
            p.skip_special_tokens, enabled=p.detokenize, decode=self._decode,
            backend=self._rust_tokenizer,
        )

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, with and without a leading space (as vLLM does)."""
        out: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def stop_choice(self, request_id: str, index: int) -> None:
        """Finish one choice of an ``n > 1`` request with ``finish_reason="stop"`` (the API side
        met a stop string in its text) and free its blocks; its siblings run on."""
        for seq in self.requests.get(request_id, []):
            if seq.index == index and not seq.is_finished and not seq.pending_forks:
                seq.finish_reason = "stop"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (vLLM's and SGLang's flush); False while requests run."""
        if self.has_unfinished_requests():
            return False
        self.block_manager.reset_prefix_cache()
        return True

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass; the cumulative output of each request it touched. A request that
        fails in it (NaN logits, a detokenizer or grammar error) ends with
        ``finish_reason="abort"``, its error in ``stop_reason`` and in :attr:`failed` until the
        next step.

        With async scheduling the step applied may have been launched by the previous call, and
        this call launches its successor before applying it (``engine/overlap.py``)."""
        return [self._output(rid) for rid in self._advance() if rid in self.requests]

    def step_deltas(self) -> list[RequestDelta]:
        """:meth:`step` for a server: what each request it touched gained in it (new token ids,
        finish reasons; the prompt with a request's first delta), made from the sequences without
        a cumulative output first."""
        deltas = []
        requests = self.requests
        for rid in self._advance():
            seqs = requests.get(rid)
            if seqs is None:
                continue
            finished = _all_finished(seqs)
            deltas.append(request_delta(rid, seqs, finished))
            if finished:
                del requests[rid]
        return deltas

    def _advance(self) -> list[str]:
        """Run (or launch and apply) one step; the ids of the requests it touched."""
        self.failed.clear()
        self.last_applied = None
        touched: dict[str, None] = {}
        decodes = False
        launched, self._launched = self._launched, None
        if launched is not None and not launched.live():
            launched = None  # every sequence of it ended meanwhile (aborts): nothing to apply
        spec = self.speculator
        if launched is None:
            started = time.perf_counter()
            if spec is not None:
                spec.propose(self.scheduler.running)
            out = self.scheduler.schedule()
            for seq in out.rejected:
                seq.finish_reason = "abort"
                seq.stop_reason = "the request does not fit in the KV cache"
                self.scheduler.finish(seq)
                touched[seq.request_id] = None
            if not out.scheduled:
                return list(touched)
            if spec is not None:
                spec.fill(out.scheduled)
                # a step of decodes (each one token, or one plus its proposals) counts in the time budget
                decodes = all(n == 1 + len(seq.spec_token_ids) and seq.num_output_tokens for seq, n in out.scheduled)
                drafts, accepted = spec.num_drafts, spec.num_accepted_tokens
            out.forks = self._fork(out.scheduled)
            step = self.scheduler.step_input(out)
            launched = LaunchedStep(out, step, self.runner.execute(step))
        if self.async_scheduling:
            nxt = next_step(self.scheduler, launched)
            if nxt is not None:
                self._launched = LaunchedStep(*nxt, self.runner.execute(nxt[1]))
                self.num_steps_ahead += 1
        self.last_applied = launched.out
        touched.update(dict.fromkeys(self.scheduler.update(launched.out, launched.result, self)))
        if spec is not None and decodes:
            spec.observe(time.perf_counter() - started, len(launched.out.scheduled), spec.num_drafts > drafts,
                         spec.num_accepted_tokens - accepted)
        return list(touched)

    # what the scheduler's update leaves to the engine (StepHandler): a token's text and logprobs,
    # and ending a failed request

    def on_prompt_logprobs(self, seq: Sequence, logprobs: list[TokenLogprobs]) -> None:
        base = len(seq.prompt_logprobs)
        seq.prompt_logprobs.extend(
            self._logprob_dict(lp, seq.token_ids[base + i], seq.params.detokenize)
            for i, lp in enumerate(logprobs)
        )

    def on_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> str | None:
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_dict(logprobs, token, seq.params.detokenize))
            seq.cumulative_logprob += logprobs[2]
        if faults.ACTIVE and seq.params.detokenize and faults.hits("detokenize", seq.prompt):
            raise faults.InjectedFault("the detokenizer failed (TIANXIA_FAULT_INJECT)")
        return seq.detok.append(token)

    def on_finished(self, seq: Sequence, stop_str: str | None) -> None:
        if stop_str is None:
            seq.detok.flush()

    def on_failed(self, request_id: str, failure: RequestFailure) -> None:
        """End every sequence of a request whose processing raised; the others run on."""
        self.failed[request_id] = failure
        for seq in self.requests.get(request_id, []):
            if not seq.is_finished:
                seq.finish_reason, seq.stop_reason = "abort", failure.message
                self.scheduler.finish(seq)

    def _fork(self, scheduled: list[tuple[Sequence, int]]) -> dict[int, list[Sequence]]:
        """Fork the n - 1 siblings of requests whose prompt finishes in this step.

        They share every block of the prompt (the last partial one is copied on the first write),
        so the prompt is computed once however large n is.
        """
        forks: dict[int, list[Sequence]] = {}
        for seq, n in scheduled:
            if seq.pending_forks and seq.num_computed_tokens + n == len(seq):
                children = []
                for index in range(1, seq.pending_forks + 1):
                    child = seq.fork(index)
                    child.detok = self._detokenizer(child)
                    if child.compiled_grammar is not None:
                        child.grammar = self._grammar_backend.matcher(child.compiled_grammar)
                    self.block_manager.share(child)
                    children.append(child)
                seq.pending_forks = 0
                self.requests[seq.request_id].extend(children)
                forks[seq.seq_id] = children
        return forks

    def _logprob_dict(self, lp, chosen: int, detokenize: bool = True) -> dict[int, Logprob]:
        """Top logprobs of one position; their tokens' text only where the engine makes text
        (served requests leave it to the API side, see ``output_processor``)."""
        top_ids, top_vals, chosen_lp, rank = lp
        decode = (lambda ids: self._decode(ids, False)) if detokenize else (lambda ids: None)
        out = {t: Logprob(v, r + 1, decode([t])) for r, (t, v) in enumerate(zip(top_ids, top_vals))}
        if chosen not in out:
            out[chosen] = Logprob(chosen_lp, rank, decode([chosen]))
        return out

    def _output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        first = seqs[0]
        finished = _all_finished(seqs)
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detok.text,
                token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                stable_len=s.detok.stable_len(s.is_finished),
            )
            for s in seqs
        ]
        result = RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            num_cached_tokens=first.num_cached_tokens,
        )
        if finished:
            del self.requests[request_id]
        return result

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits [len, vocab] of the model at every position of ``token_ids``.

        Runs through the same paged-attention path as generation, outside the scheduler.
        """
        return self._prompt_pass("score", token_ids, self.runner.prompt_logits)

    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 final hidden states [len, hidden_size] (after the model's last norm) at every
        position of ``token_ids``, as :meth:`score` runs them: what ``/v1/embeddings`` pools."""
        return self._prompt_pass("embed", token_ids, self.runner.prompt_hidden_states).float().cpu()

    def embed(self, inputs: list[list[int]], pooling_type: str, normalize: bool) -> list[list[float]]:
        """One vector per input, pooled from :meth:`hidden_states` (``LAST`` token or ``MEAN``) and
        L2-normalized if asked: ``/v1/embeddings``. Plain lists, so they can cross processes."""
        vectors = []
        for ids in inputs:
            hidden = self.hidden_states(ids)
            vec = hidden[-1] if pooling_type == "LAST" else hidden.mean(dim=0)
            vectors.append((torch.nn.functional.normalize(vec, dim=0) if normalize else vec).tolist())
        return vectors

    def _prompt_pass(self, what: str, token_ids: list[int], run) -> torch.Tensor:
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens exceed max_model_len={self.max_model_len}")
        seq = Sequence(what, None, token_ids, SamplingParams(max_tokens=1))
        if not self.block_manager.can_allocate(seq, len(seq)):
            raise RuntimeError(f"not enough free KV blocks to {what} this sequence now")
        self.block_manager.allocate(seq, len(seq))
        try:
            return run(seq.token_ids, seq.block_table, self.scheduler.config.max_num_batched_tokens)
        finally:
            self.block_manager.free_seq(seq)

    # --- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "num_free_blocks": bm.num_free_blocks,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            # what --kv-cache-dtype buys at --kv-cache-memory
            "kv_cache_bytes_per_token": kv_bytes_per_token(self.model_config, self.kv_dtype),
            "kv_cache_capacity_tokens": bm.num_usable_blocks * bm.block_size,
            "prompt_tokens": self.scheduler.num_prompt_tokens,
            "generation_tokens": self.scheduler.num_generation_tokens,
            **(self.speculator.stats() if self.speculator is not None else {}),
            **(self._lora_stats() if self.lora_manager is not None else {}),
        }

    def _lora_stats(self) -> dict:
        """vLLM's ``lora_requests_info`` labels (adapters of running and waiting requests) and
        requests per adapter."""
        def names(seqs) -> str:
            return ",".join(sorted({s.lora_name for s in seqs if s.lora_name is not None}))

        return {
            "lora_running": names(self.scheduler.running),
            "lora_waiting": names(self.scheduler.waiting),
            "max_lora": self.lora_manager.config.max_loras,
            "lora_requests_total": dict(self.lora_manager.requests_total),
        }
