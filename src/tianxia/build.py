"""``tianxia build``: prepare a model for fast GPU start-up (TensorRT-LLM's engine build, loosely).

A build does what a cold ``serve`` does at start-up, once, and keeps what can be kept:

- Triton's kernel cache (compiled kernels) and its autotuning results (the GEMV block shapes
  measured per weight shape) go to ``$TIANXIA_HOME/cache/gpu/<key>/triton``, keyed by the GPU
  (name, compute capability) and the PyTorch / Triton / CUDA versions (kernels are specialized by
  dtype and shapes inside it; the build's manifest records the model, dtype and shapes). Every
  CUDA engine uses that directory (:func:`configure_gpu_caches`, called when a CUDA engine
  starts) unless ``TRITON_CACHE_DIR`` is set, so the next ``serve`` / ``run`` of the same model
  and settings compiles and autotunes nothing. (``TORCHINDUCTOR_CACHE_DIR`` is pointed beside it;
  tianxia itself does not use ``torch.compile``.)
- the build warms up: it loads the model, plans memory, captures the decode CUDA graphs (which
  compiles and autotunes every decode kernel) and runs a short generation at a few prompt lengths
  (the prefill kernels), then writes a manifest (``build.json``) with the shapes and the cold
  start-up time. Run it twice to see the warm start-up (a later ``serve`` starts the same way).

CUDA graphs themselves cannot be saved to disk (they hold device pointers); capturing from warm
kernels takes about a second.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time

from tianxia.engine.kernel_cache import configure_gpu_caches

logger = logging.getLogger(__name__)


def add_build_parser(sub) -> None:
    p = sub.add_parser(
        "build",
        help="compile, autotune and cache the GPU kernels of a model so the next serve starts fast",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("model", metavar="MODEL", help="pulled model name, .gguf path or HF directory")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA), bfloat16, float16")
    p.add_argument("--device", default="cuda", help="cuda (default)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="build without CUDA graphs")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_build)


def _engine_config(args):
    from tianxia.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device,
        cache=CacheConfig(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len or 0,
        ),
        enforce_eager=args.enforce_eager,
    )


def _start(args) -> tuple[object, float]:
    from tianxia.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(_engine_config(args))
    return engine, time.perf_counter() - t0


def _warm_up(engine) -> None:
    from tianxia.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    lens = sorted({min(n, engine.max_model_len - 8) for n in (7, 100, 1000)})
    for i, n in enumerate(lens):
        ids = [(17 * j + 3) % vocab for j in range(max(1, n))]
        engine.add_request(f"build-{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()


def cmd_build(args: argparse.Namespace) -> int:
    import torch

    if not args.device.startswith("cuda"):
        raise ValueError("tianxia build prepares GPU kernels: use --device cuda")
    if not torch.cuda.is_available():
        raise ValueError("tianxia build needs a CUDA GPU, and none is available")
    root = configure_gpu_caches()
    t0 = time.perf_counter()
    engine, startup = _start(args)
    _warm_up(engine)
    total = time.perf_counter() - t0
    gr = engine.runner.graph_runner
    manifest = {
        "model": str(engine.model_path),
        "architecture": engine.model_config.architecture,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "gpu": torch.cuda.get_device_name(),
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": engine.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_tokens": engine.runner.num_blocks * engine.runner.block_size,
        "cuda_graph_batch_sizes": gr.ladder if gr is not None else [],
        "startup_s": round(startup, 2),
        "build_s": round(total, 2),
        "triton_cache": os.environ.get("TRITON_CACHE_DIR"),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    del engine, gr
    if root is not None:
        name = hashlib.sha256(json.dumps([manifest["model"], manifest["dtype"], args.max_num_seqs,
                                          manifest["max_model_len"]]).encode()).hexdigest()[:12]
        path = root / "builds" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest, indent=1))
        manifest["manifest"] = str(path)
    print(json.dumps(manifest, indent=1))
    return 0
