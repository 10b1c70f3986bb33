"""``tianxia serve``: load the model, then run the API under uvicorn until SIGTERM / SIGINT.

On the first SIGTERM or SIGINT the server stops accepting (the listening socket closes, ``/health``
and new generation requests answer 503), lets requests in flight finish for up to
``--shutdown-timeout`` seconds, aborts what is left, and exits 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator

from tianxia.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    add_lora_args,
    add_offload_args,
    add_parallel_args,
    add_quantization_args,
    add_speculative_args,
    kv_cache_dtype_from_args,
    lora_from_args,
    parse_size,
    speculative_from_args,
)
from tianxia.engine.heap import freeze_startup_heap

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = "2GiB"


def add_serve_args(p: argparse.ArgumentParser, default_model: str) -> None:
    """``vllm serve``'s flags, where tianxia has the same meaning."""
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"pulled model name, .gguf path or Hugging Face directory (default: {default_model})",
    )
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="[NAME=]MODEL",
        help="the model, as a flag (same as MODEL); NAME=MODEL, or the flag given more than once, "
        "serves several models, each under its NAME (default: its file or directory name)",
    )
    p.add_argument(
        "--models-dir",
        default=None,
        metavar="DIR",
        help="serve every model in DIR: each .gguf file, and each directory with a config.json "
        "or one .gguf file, named after it",
    )
    p.add_argument(
        "--models-max",
        type=int,
        default=4,
        help="with several models: most loaded at once; the least recently used idle one is "
        "unloaded first (default: %(default)s)",
    )
    p.add_argument(
        "--models-autoload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with several models: load a model on its first request (default: on; otherwise "
        "POST /models/load first)",
    )
    p.add_argument(
        "--models-memory",
        default=None,
        metavar="SIZE",
        help="with several models: what the loaded models may hold together (weights, KV caches "
        "and overheads), e.g. 8GiB (default: the memory available at start)",
    )
    p.add_argument(
        "--models-load-timeout",
        type=float,
        default=600.0,
        help="with several models: seconds a request waits for its model to load "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients use in the `model` field; the first is reported in responses "
        "(default: MODEL)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health, /version and "
        "/metrics (default: $TIANXIA_API_KEY)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's, capped by the KV cache)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="most sequences in one step (default: %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step (default: %(default)s)",
    )
    mem = p.add_mutually_exclusive_group()
    mem.add_argument(
        "--kv-cache-memory",
        default=None,
        help=f"KV cache size, e.g. 2GiB (default: {DEFAULT_KV_CACHE_MEMORY})",
    )
    mem.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of the device's memory (GPU; on CPU, RAM) for weights plus KV "
        "cache; the KV cache gets what the weights leave",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="KV block size in tokens (default: %(default)s)"
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of equal prompt prefixes (default: on)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of unseeded sampling (default: %(default)s)"
    )
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU intra-op threads (default: the physical cores)")
    add_quantization_args(p)
    add_speculative_args(p)
    add_parallel_args(p)
    add_offload_args(p)
    add_lora_args(p)
    p.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: run decode steps without CUDA graphs"
    )
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="launch each step of decodes before the previous one's tokens are read, so the host's "
             "work overlaps the GPU's (default: on where decode steps are CUDA graphs)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template (a file or the template itself) overriding the model's",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "llama3_json"],
        default="auto",
        help="how tool calls are read from the output with tool_choice 'auto' (default: chosen "
        "from the chat template: <tool_call> tags are hermes, JSON 'parameters' is llama3_json)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted as in vLLM; tool_choice 'auto' is on whenever a tool-call parser is known",
    )
    p.add_argument(
        "--pooler-config",
        default=None,
        metavar="JSON",
        help='/v1/embeddings pooling, as vLLM: {"pooling_type": "LAST" or "MEAN", "normalize": '
        "true or false} (default: LAST, normalized)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="past this many queued requests, answer 503 with Retry-After (default: no limit)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="abort a request still running this many seconds after it arrived; the client "
        "gets a 504 (default: no limit)",
    )
    p.add_argument(
        "--engine-core",
        choices=("thread", "process"),
        default=None,
        help="where the engine runs: a process of its own that the server talks to over ZeroMQ "
        "(the HTTP side then never holds up a step), or a thread of the server process "
        "(default: process for one model; several models run on threads)",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine core processes behind the server, each a copy of the model on its own GPU "
        "or CPU cores (--threads each); requests go to the core holding their prompt's prefix, "
        "else the least loaded (implies --engine-core process; default: %(default)s)",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="API server processes sharing the port in front of the same engine core(s): HTTP, "
        "tokenization, detokenization and streaming spread over them (default: on a GPU one per "
        "engine core and at least 2, where there are 4 CPUs for each; else 1)",
    )
    p.add_argument(
        "--max-request-bytes",
        default="4MiB",
        help="largest request body accepted; larger ones get a 413 (default: %(default)s)",
    )
    p.add_argument(
        "--metrics-require-auth",
        action="store_true",
        help="with an API key, /metrics needs it too (default: /metrics is open)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        help="seconds to let requests in flight finish after SIGTERM (default: %(default)s)",
    )
    p.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic throughput log lines"
    )
    p.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    p.add_argument(
        "--webui",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the web chat page at / (default: on; --no-webui turns it off)",
    )
    p.add_argument("--root-path", default=None, help="ASGI root_path, behind a path-based proxy")
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "headers")):
        p.add_argument(
            f"--allowed-{name}",
            nargs="+",
            type=_name_list,
            default=None,
            metavar=name.upper()[:-1],
            help=f"CORS: {what} a browser may use (names, comma-separated or a JSON list; "
            "default: *)",
        )
    p.add_argument(
        "--allowed-credentials", action="store_true", help="CORS: allow credentials (cookies)"
    )
    p.add_argument(
        "--log-level", default="info", help="debug, info, warning, error (default: %(default)s)"
    )


def _name_list(value: str) -> list[str]:
    """``a,b``, ``a`` or vLLM's JSON spelling ``["a", "b"]``."""
    if value.lstrip().startswith("["):
        try:
            names = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return names
    return [n.strip() for n in value.split(",") if n.strip()]


def _cors(args: argparse.Namespace):
    from tianxia.server.api import CORSConfig

    def flat(values: list[list[str]] | None) -> list[str]:
        return ["*"] if values is None else [n for names in values for n in names]

    return CORSConfig(
        flat(args.allowed_origins),
        args.allowed_credentials,
        flat(args.allowed_methods),
        flat(args.allowed_headers),
    )


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _estimate_weight_bytes(model: str, dtype_bytes: int) -> int:
    """Weights once loaded (dequantized), from the model's shape."""
    from tianxia.loader import load_model_config

    c = load_model_config(model)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = (
        c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    )
    per_layer += 2 * c.hidden_size + (q + 2 * kv if c.attention_bias else 0)
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return (embed + c.num_hidden_layers * per_layer + c.hidden_size) * dtype_bytes


def _kv_cache_bytes(args: argparse.Namespace, model: str) -> int:
    if args.gpu_memory_utilization is None:
        return parse_size(args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
    frac = args.gpu_memory_utilization
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {frac}")
    import torch

    from tianxia.engine.llm_engine import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = total
        with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    weights = _estimate_weight_bytes(model, torch.tensor([], dtype=dtype).element_size())
    reserve = 256 << 20  # activations, logits, allocator slack
    kv = int(frac * total) - (total - free) - weights - reserve
    if kv <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {frac} leaves no room for the KV cache: {frac} x "
            f"{total / 2**30:.1f} GiB, minus {(total - free) / 2**30:.1f} GiB already in use and "
            f"{weights / 2**30:.2f} GiB of weights; raise it or use --kv-cache-memory"
        )
    logger.info("--gpu-memory-utilization %.2f: %.2f GiB for the KV cache", frac, kv / 2**30)
    return kv


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError("--max-model-len must be at least 2")
    return EngineConfig(
        model=model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        seed=args.seed,
        chat_template=_read_chat_template(args.chat_template),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=_kv_cache_bytes(args, model),
            enable_prefix_caching=args.enable_prefix_caching,
            # on CUDA the engine profiles the model and sizes the KV cache itself
            gpu_memory_utilization=_cuda_memory_fraction(args),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len or 0,
        ),
        enforce_eager=getattr(args, "enforce_eager", False),
        async_scheduling=getattr(args, "async_scheduling", None),
        quantization=args.quantization,
        kv_cache_dtype=kv_cache_dtype_from_args(args),
        calculate_kv_scales=args.calculate_kv_scales,
        cpu_activations=args.cpu_activations,
        batch_invariant=args.batch_invariant,
        speculative=speculative_from_args(args),
        tensor_parallel_size=args.tensor_parallel_size,
        cpu_offload_gb=args.cpu_offload_gb,
        n_gpu_layers=args.n_gpu_layers,
        master_addr=args.master_addr,
        master_port=args.master_port,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        lora=lora_from_args(args),
    )


def _cuda_memory_fraction(args: argparse.Namespace) -> float | None:
    if args.gpu_memory_utilization is None:
        return None
    from tianxia.engine.llm_engine import resolve_device

    return args.gpu_memory_utilization if resolve_device(args.device).type == "cuda" else None


def _graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, except that a handled SIGTERM / SIGINT ends in exit code 0: uvicorn
        re-raises the signal after its graceful shutdown, which would kill the process."""

        on_signal: Callable[[], None] | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.on_signal is not None and not self.should_exit:
                self.on_signal()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _server_models(args: argparse.Namespace, default_model: str) -> list[tuple[str, str]] | None:
    """``(name, model)`` of each model of a server with several (``--model NAME=MODEL``, the flag
    given more than once, ``--models-dir``); None for a single-model server."""
    from tianxia.server.model_specs import name_of, scan_models_dir, split_model_arg

    given = ([args.model_tag] if args.model_tag else []) + list(args.model or [])
    if len(given) == 2 and not args.models_dir and given[0] == given[1]:
        given = given[:1]  # `serve M --model M`: one model, as before
    split = [split_model_arg(v) for v in given]
    if not args.models_dir and len(split) <= 1 and all(name is None for name, _ in split):
        return None
    models = [(name or name_of(spec), spec) for name, spec in split]
    if args.models_dir:
        models += scan_models_dir(args.models_dir)
    seen: set[str] = set()
    for name, _ in models:
        if name in seen:
            raise ValueError(f"two models are named {name!r}; name them with --model NAME=MODEL")
        seen.add(name)
    return models


def _async_engine(args: argparse.Namespace, engine, on_dead: Callable[[BaseException], None]):
    from tianxia.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine(
        engine,
        max_waiting_requests=args.max_waiting_requests,
        log_stats_interval=None if args.disable_log_stats else 10.0,
        request_timeout=args.request_timeout,
        on_dead=on_dead,
    )


def _engine_client(args: argparse.Namespace, config: EngineConfig, on_dead, attach=None):
    """The engine behind a single-model server: on a thread here, or in core processes (started
    here, or, for one of several API processes, ``attach``: the cores' endpoints, its index and
    their config)."""
    if args.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be at least 1")
    if args.engine_core == "thread" and args.data_parallel_size > 1:
        raise ValueError("--data-parallel-size needs --engine-core process")
    tensor_parallel = config.tensor_parallel_size > 1
    if tensor_parallel and args.data_parallel_size > 1:
        raise ValueError("--tensor-parallel-size does not combine with --data-parallel-size yet")
    if args.engine_core == "thread" or tensor_parallel:
        from tianxia.engine.async_engine import build_off_main_thread
        from tianxia.engine.llm_engine import LLMEngine

        if args.engine_core == "process":
            # the engine starts its tensor-parallel worker ranks, which a daemonic core process
            # may not
            logger.info("--tensor-parallel-size: the engine runs on a thread of the server "
                        "(--engine-core thread)")
        engine = build_off_main_thread(lambda: LLMEngine(config))
        return _async_engine(args, engine, on_dead)
    from tianxia.engine.core_client import EngineCoreClient

    # started from the main thread: a core's PR_SET_PDEATHSIG follows the thread that made it
    return EngineCoreClient(
        config,
        data_parallel_size=args.data_parallel_size,
        endpoints=None if attach is None else attach[0],
        client=0 if attach is None else attach[1],
        max_waiting_requests=args.max_waiting_requests,
        request_timeout=args.request_timeout,
        log_stats_interval=None if args.disable_log_stats else 10.0,
        on_dead=on_dead,
        log_level=args.log_level.upper(),
    )


def _single_model(args: argparse.Namespace, model: str, state, on_dead, attach=None):
    """The one model of a plain server, loaded before the server starts."""
    from tianxia.server.api import build_servings
    from tianxia.server.metrics import ServerMetrics
    from tianxia.server.model_registry import ModelRegistry
    from tianxia.server.serving_embeddings import PoolerConfig

    pooler = PoolerConfig.parse(args.pooler_config)
    config = engine_config(args, model) if attach is None else attach[2]
    async_engine = _engine_client(args, config, on_dead, attach)
    state.allow_runtime_lora_updating = args.allow_runtime_lora_updating
    names = args.served_model_name or [model]
    metrics = ServerMetrics(
        names[0],
        async_engine.info.max_model_len,
        async_engine.stats,
        lambda: async_engine.max_step_seqs,
        async_engine.info.cache_info(),
    )
    async_engine.listener = metrics
    if args.data_parallel_size > 1:
        metrics.add_engine_cores(names[0], async_engine.per_core)
    state.metrics = metrics
    servings = build_servings(
        async_engine,
        names,
        metrics=metrics,
        tool_call_parser=args.tool_call_parser,
        pooler=pooler,
        state=state,
    )
    logger.info("serving %s as %s (max_model_len=%d)", model, ", ".join(names),
                async_engine.info.max_model_len)
    return ModelRegistry.single(servings), metrics


def _several_models(args: argparse.Namespace, models: list[tuple[str, str]], state):
    """A registry of named models that load on demand, with their memory plan."""
    from tianxia.engine.llm_engine import LLMEngine
    from tianxia.loader import load_model_config
    from tianxia.server.api import build_servings
    from tianxia.server.metrics import ServerMetrics
    from tianxia.server.model_registry import MemoryPlan, ModelEntry, ModelRegistry
    from tianxia.server.model_specs import available_memory, weights_on_disk
    from tianxia.server.serving_embeddings import PoolerConfig

    if args.served_model_name:
        raise ValueError(
            "--served-model-name names the model of a single-model server; with several, name "
            "each one: --model NAME=MODEL"
        )
    if args.gpu_memory_utilization is not None:
        raise ValueError(
            "--gpu-memory-utilization sizes one model's KV cache from the whole device; with "
            "several models give each its KV cache with --kv-cache-memory and all of them a "
            "budget with --models-memory"
        )
    if args.engine_core == "process" or args.data_parallel_size != 1:
        raise ValueError(
            "--engine-core process and --data-parallel-size serve a single model; with several "
            "models each runs on a thread of the server"
        )
    if args.enable_lora:
        raise ValueError("--enable-lora serves adapters over the one model of a single-model server")
    if args.models_max < 1:
        raise ValueError("--models-max must be at least 1")
    if not args.models_load_timeout > 0:
        raise ValueError("--models-load-timeout must be > 0")
    pooler = PoolerConfig.parse(args.pooler_config)
    kv_bytes = parse_size(args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
    budget = (
        parse_size(args.models_memory) if args.models_memory else available_memory(args.device)
    )
    # the server's own series (HTTP requests, draining) carry this name; each model's, its own
    metrics = ServerMetrics("tianxia", args.max_model_len or 32768)
    state.metrics = metrics
    registry: ModelRegistry

    def build(entry: ModelEntry):  # on the load thread
        engine = LLMEngine(engine_config(args, entry.spec))
        loop = registry.loop
        assert loop is not None
        async_engine = _async_engine(
            args,
            engine,
            lambda exc: loop.call_soon_threadsafe(registry.engine_died, entry, exc),
        )
        async_engine.listener = metrics.add_model(
            entry.name, async_engine.stats, lambda: async_engine.max_step_seqs, async_engine.info.cache_info()
        )
        return build_servings(
            async_engine,
            list(entry.names),
            metrics=metrics,
            tool_call_parser=args.tool_call_parser,
            pooler=pooler,
            state=state,
        )

    registry = ModelRegistry(
        [ModelEntry(name, spec, kv_bytes=kv_bytes) for name, spec in models],
        build,
        max_loaded=args.models_max,
        autoload=args.models_autoload,
        plan=MemoryPlan(budget, weights_on_disk),
        load_timeout=args.models_load_timeout,
        on_unload=lambda entry: metrics.remove_model(entry.name),
        check=lambda entry: load_model_config(entry.spec),
    )
    logger.info(
        "serving %d models: %s; at most %d loaded at once, within %.0f MiB (--models-memory), "
        "KV cache %.0f MiB each; %s",
        len(models),
        ", ".join(f"{n} ({s})" for n, s in models),
        args.models_max,
        budget / 2**20,
        kv_bytes / 2**20,
        "each loads on its first request" if args.models_autoload else "POST /models/load loads",
    )
    return registry, metrics


def run_server(args: argparse.Namespace, default_model: str, *, attach=None, sock=None) -> int:
    """Serve until SIGTERM / SIGINT. With ``--api-server-count`` N > 1 this process supervises N
    API processes (:mod:`tianxia.server.api_servers`), each of which runs this function with
    ``attach`` (the engine cores' endpoints, its index and their config) and ``sock`` (its own
    listening socket on the shared port)."""
    import uvicorn

    from tianxia.server.api import build_app
    from tianxia.server.api_servers import (
        check_api_server_args,
        resolve_api_server_count,
        run_api_servers,
    )
    from tianxia.server.serving_base import ServerState

    models = _server_models(args, default_model)
    if attach is None:
        resolve_api_server_count(args, models is not None)
    check_api_server_args(args, models is not None)
    api_key = (
        args.api_key if args.api_key is not None else os.environ.get("TIANXIA_API_KEY") or None
    )
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError("--max-waiting-requests must be at least 1")
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError("--request-timeout must be > 0")
    max_request_bytes = parse_size(args.max_request_bytes)
    if max_request_bytes < 1024:
        raise ValueError("--max-request-bytes must be at least 1KiB")

    import prometheus_client

    prometheus_client.disable_created_metrics()  # no `_created` series (as vLLM)
    state = ServerState()
    if models is None:
        model = args.model_tag or (args.model[0] if args.model else default_model)
        if args.api_server_count > 1 and attach is None:
            return run_api_servers(args, default_model, model, engine_config(args, model))
        registry, metrics = _single_model(args, model, state, lambda exc: on_engine_dead(exc),
                                          attach)
    else:
        registry, metrics = _several_models(args, models, state)
    app = build_app(
        registry,
        state=state,
        metrics=metrics,
        api_key=api_key,
        root_path=args.root_path,
        max_request_bytes=max_request_bytes,
        metrics_require_auth=args.metrics_require_auth,
        cors=_cors(args),
        webui=args.webui,
    )

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=not args.disable_access_log,
        # a backstop: the drain deadline below ends the requests still running first, cleanly
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
        timeout_keep_alive=5,
        # which of several API processes answered (--api-server-count)
        headers=[("x-tianxia-api-server-pid", str(os.getpid()))] if attach is not None else None,
    )
    # uvicorn takes these when they are installed ("auto"); without them the API process spends
    # about 15% more CPU per streamed token and 20% more per admitted request
    logger.info("HTTP server: %s event loop, %s parser",
                "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
                "httptools" if importlib.util.find_spec("httptools") else "h11")
    server = _graceful_server_class()(config)

    def engines():
        return [e.servings.engine for e in registry.loaded() if e.servings is not None]

    def on_signal() -> None:
        state.draining = True
        metrics.draining.set(1)
        loop = registry.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(
                lambda: drain_tasks.append(loop.create_task(drain_deadline()))
            )
        logger.info(
            "shutting down: no new requests; %d in flight get up to %ds to finish",
            sum(e.num_unfinished for e in engines()),
            args.shutdown_timeout,
        )

    drain_tasks: list[asyncio.Task] = []

    async def drain_deadline() -> None:
        await asyncio.sleep(args.shutdown_timeout)
        reason = "the server is shutting down (--shutdown-timeout reached)"
        n = sum(e.abort_all(reason) for e in engines())
        if n:
            logger.warning("shutdown timeout: aborted %d request(s) still running", n)

    engine_died: list[BaseException] = []

    def on_engine_dead(exc: BaseException) -> None:
        # a dead engine cannot recover in-process: exit non-zero so that a supervisor restarts us
        # (meanwhile /health answers 503 and requests in flight got an error); with several
        # models, the registry marks that one failed instead and the others keep serving
        engine_died.append(exc)
        logger.error("the engine loop died (%r); exiting with status 1", exc)
        server.should_exit = True

    server.on_signal = on_signal
    if attach is None:
        logger.info("listening on http://%s:%d%s", args.host, args.port,
                    ", API key required" if api_key else "")
        if args.webui:
            logger.info("web page: http://%s:%d/", args.host, args.port)
    freeze_startup_heap()
    server.run(sockets=None if sock is None else [sock])
    if engine_died or (server.started is False and not server.should_exit):
        return 1
    return 0
