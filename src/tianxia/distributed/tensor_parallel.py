"""Tensor parallelism over ``torch.distributed``: rank 0 is the engine's own process, ranks
1..N-1 are worker processes it spawns, each holding its shard of the model and of the KV cache.

The scheduler runs once, on rank 0. Each batch the runner builds goes to the workers first, as
the same plain-data ``StepInput`` (token ids, positions, slot mapping, block tables, the block
copies to make; not what only rank 0 samples with), then each forward pass the rows to keep, so
every rank runs the same step on its shard; the collectives
inside the model (an all-reduce after o and down, after the embedding, an all-gather of the
logits) keep them in lockstep. Every rank's cache has the same blocks, so the block tables of
rank 0 index all of them. Pipes rather than a broadcast carry the inputs: an idle worker waits on
its pipe without a collective that would time out, and sees its end close when rank 0 is gone.

A collective that waits longer than ``TIANXIA_TP_TIMEOUT`` seconds (default 60) raises, and a
watchdog on rank 0 ends the process within a second of a worker dying, naming the rank.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from tianxia.config import CacheConfig, EngineConfig
from tianxia.distributed.sharding import check_supported, rank_config, shard_llama
from tianxia.engine.model_runner import ModelRunner, kv_bytes_per_token
from tianxia.engine.step_io import StepInput
from tianxia.layers.attention import AttentionMetadata
from tianxia.loader import LoadedModel, release_freed_memory
from tianxia.loader import load_model as load_whole_model

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0  # a worker loads the whole model before sharding it


def collective_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("TIANXIA_TP_TIMEOUT", "60")))


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def check_port(addr: str, port: int) -> None:
    """A clear error for a rendezvous port that is taken, before any process starts."""
    with socket.socket() as s:
        try:
            s.bind((addr, port))
        except OSError as e:
            raise ValueError(f"--master-port {port} on {addr} is in use ({e.strerror}); choose another "
                             "port or leave --master-port out to pick a free one") from None


def cpu_shares(world_size: int) -> list[list[int]]:
    """Each rank's share of the cores this process may run on (empty lists when there are fewer
    cores than ranks: no binding)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < world_size:
        return [[] for _ in range(world_size)]
    per = len(cpus) // world_size
    return [cpus[r * per : (r + 1) * per] for r in range(world_size)]


def _load_shard(config: EngineConfig, rank: int, world_size: int, dtype: torch.dtype,
                device: torch.device) -> LoadedModel:
    from tianxia.layers.attention import get_backend

    loaded = load_whole_model(config.model, dtype=dtype, device=device, backend=get_backend(device),
                              quantization=config.quantization)
    check_supported(loaded.config, world_size)
    shard_llama(loaded.model, rank, world_size)
    # the sharded modules are new: they take the activation mode now
    loaded.model.int8_activations = config.cpu_activations == "int8"
    release_freed_memory()  # the other ranks' slices
    loaded.config = rank_config(loaded.config, rank, world_size)
    return loaded


# --- workers ----------------------------------------------------------------------------------------


def _worker_main(rank: int, world_size: int, init_method: str, config: EngineConfig, cache: CacheConfig,
                 dtype: torch.dtype, kv_dtype: torch.dtype | str, cpus: list[int], threads: int,
                 conn: Connection, log_level: int) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s tp rank {rank} %(levelname)s %(name)s: %(message)s")
    device = torch.device("cpu")
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
        conn.send(("started", None))
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=collective_timeout())
        loaded = _load_shard(config, rank, world_size, dtype, device)
        runner = ModelRunner(loaded.model, loaded.config, cache, device, kv_dtype)
        from tianxia.quant import cpu_kernels

        cpu_kernels.extension()
        conn.send(("ready", runner.num_blocks))
    except Exception as e:  # rank 0 reports it and stops
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    _serve(loaded.model, runner, conn)


@torch.inference_mode()
def _serve(model: torch.nn.Module, runner: ModelRunner, conn: Connection) -> None:
    """Run whatever rank 0 runs, until it says stop or its end of the pipe closes."""
    batch = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "step":
            step: StepInput = msg[1]
            for src, dst in step.copies:
                runner.kv_cache[:, :, dst].copy_(runner.kv_cache[:, :, src])
            batch = runner.tensors(step)
        elif kind == "forward":
            ids, pos, meta = batch
            model(ids, pos, runner.kv_caches, meta, msg[1])
        elif kind == "logits":
            model.compute_logits(msg[1])
        elif kind == "stop":
            return


class WorkerGroup:
    """Ranks 1..N-1: their processes and pipes, and the watchdog that stops rank 0 when one dies."""

    def __init__(self, procs: list, conns: list[Connection]) -> None:
        self.procs, self.conns = procs, conns
        self._closing = threading.Event()
        self._finalizer = weakref.finalize(self, _stop_workers, procs, conns, self._closing)

    def send(self, msg: tuple) -> None:
        for conn in self.conns:
            conn.send(msg)

    def wait_for(self, expected: str, timeout_s: float) -> list:
        """Each worker's next message, which must be ``expected``; a worker that dies first, or
        reports an error, or takes longer than ``timeout_s`` is an error naming its rank."""
        deadline = time.monotonic() + timeout_s
        values = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    self.close()
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} "
                                       "while starting")
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start in {timeout_s:.0f}s")
            kind, value = conn.recv()
            if kind == "error":
                self.close()
                raise ValueError(f"tensor-parallel rank {rank}: {value}")
            assert kind == expected, (kind, expected)
            values.append(value)
        return values

    def wait_ready(self, num_blocks: int) -> None:
        blocks = self.wait_for("ready", _READY_TIMEOUT_S)
        for rank, (value, proc) in enumerate(zip(blocks, self.procs), start=1):
            if value != num_blocks:
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} has {value} KV blocks, rank 0 {num_blocks}")
            logger.info("tensor parallel: rank %d ready (pid %d)", rank, proc.pid)

    def describe(self) -> str:
        """Each worker's state, for an error: running, stopped (a signal), or exited."""
        states = []
        for rank, proc in enumerate(self.procs, start=1):
            state = "running"
            if not proc.is_alive():
                state = f"exited with code {proc.exitcode}"
            else:
                try:
                    with open(f"/proc/{proc.pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                            state = "stopped"
                except OSError:
                    pass
            states.append(f"rank {rank} (pid {proc.pid}) {state}")
        return ", ".join(states)

    def start_watchdog(self) -> None:
        # the thread holds the processes, not the group, so a dropped engine still finalizes it
        threading.Thread(target=_watch, args=(self.procs, self.conns, self._closing),
                         name="tp-watchdog", daemon=True).start()

    def close(self) -> None:
        self._finalizer()


def _watch(procs: list, conns: list[Connection], closing: threading.Event) -> None:
    while not closing.wait(0.2):
        for rank, proc in enumerate(procs, start=1):
            if proc.is_alive() or closing.is_set():
                continue
            msg = (f"error: tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                   f"{proc.exitcode}; the engine stops")
            logger.error(msg)
            print(msg, file=sys.stderr, flush=True)
            _stop_workers(procs, conns, closing)
            os._exit(1)


def _stop_workers(procs: list, conns: list[Connection], closing: threading.Event) -> None:
    closing.set()
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    if dist.is_initialized():
        dist.destroy_process_group()


# --- rank 0 -----------------------------------------------------------------------------------------


class TensorParallelModel:
    """Rank 0's model: each call sends the same call's inputs to the workers, then runs its own
    shard. It offers what the runner asks of a model (:class:`tianxia.models.base.CausalLM`)."""

    keeps_rows = True

    def __init__(self, model: torch.nn.Module, workers: WorkerGroup) -> None:
        self.model, self.workers = model, workers

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        self.workers.send(("forward", keep))  # over the batch the runner sent with ``tensors``
        try:
            return self.model(input_ids, positions, kv_caches, meta, keep)
        except RuntimeError as e:
            raise self._collective_failed(e) from e

    forward = __call__

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.workers.send(("logits", hidden))
        try:
            return self.model.compute_logits(hidden)
        except RuntimeError as e:
            raise self._collective_failed(e) from e

    def _collective_failed(self, e: RuntimeError) -> RuntimeError:
        """The ranks are out of step now: the error names their states, and the workers stop."""
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        states = self.workers.describe()
        self.workers.close()
        return RuntimeError(f"tensor parallel: a collective failed ({first}); {states}; "
                            f"collectives time out after {collective_timeout().total_seconds():.0f}s "
                            "(TIANXIA_TP_TIMEOUT); the engine cannot go on")

    def fast_decode_step(self, kv_caches: list[torch.Tensor], max_model_len: int) -> None:
        logger.info("tensor parallel: decode steps run the module forward (no fused step)")
        return None

    def cuda_graph_unsafe_reason(self) -> str | None:
        return "tensor parallelism runs eagerly"

    # rank 0's own modules and tensors (its share of the weights), for the engine's and the
    # server's accounting
    def modules(self):
        return self.model.modules()

    def parameters(self):
        return self.model.parameters()

    def buffers(self):
        return self.model.buffers()

    def close(self) -> None:
        self.workers.close()


class TensorParallelRunner(ModelRunner):
    """The model runner of rank 0: every batch it builds goes to the workers too, with its block
    copies (copy-on-write), made on every rank's cache."""

    def tensors(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        self.model.workers.send(("step", step.batch_only()))
        return super().tensors(step)


def load_model(config: EngineConfig, dtype: torch.dtype, device: torch.device,
               kv_dtype: torch.dtype | str) -> LoadedModel:
    """Start ranks 1..N-1, load and shard rank 0's model; the returned model drives the workers.

    Workers load while rank 0 does; the engine waits for them in :func:`wait_for_workers`.
    """
    from tianxia.loader import load_model_config

    world = config.tensor_parallel_size
    if device.type != "cpu":
        raise ValueError("--tensor-parallel-size runs on CPU (gloo) so far; use --device cpu")
    if getattr(config, "lora", None) is not None:
        raise ValueError("--enable-lora is not available with --tensor-parallel-size yet")
    full = load_model_config(config.model)
    check_supported(full, world)
    addr = config.master_addr
    port = config.master_port
    if port is None:
        port = free_port(addr)
    else:
        check_port(addr, port)
    init_method = f"tcp://{addr}:{port}"
    shares = cpu_shares(world)
    # every rank's cache has the same blocks, sized by rank 0's, which holds the most KV heads
    per_block = kv_bytes_per_token(rank_config(full, 0, world), kv_dtype) * config.cache.block_size
    cache = replace(config.cache, num_blocks=config.cache.num_blocks
                    or max(1, config.cache.kv_cache_memory // per_block))
    from tianxia.engine.llm_engine import default_threads

    threads = max(1, (config.threads or default_threads()) // world)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(1, world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker_main, name=f"tianxia-tp-rank{rank}", daemon=True,
            args=(rank, world, init_method, config, cache, dtype, kv_dtype, shares[rank], threads, child,
                  logging.getLogger().level),
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    workers = WorkerGroup(procs, conns)
    workers.wait_for("started", _READY_TIMEOUT_S)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=world,
                            timeout=collective_timeout())
    loaded = _load_shard(config, 0, world, dtype, device)
    logger.info("tensor parallel: %d ranks on %s, %d threads each; rank 0 holds %d of %d KV heads",
                world, init_method, threads, loaded.config.num_key_value_heads,
                full.num_key_value_heads)
    loaded.model = TensorParallelModel(loaded.model, workers)
    return loaded


def wait_for_workers(runner: ModelRunner) -> None:
    """Block until every worker has its shard and its KV cache, then watch them."""
    workers: WorkerGroup = runner.model.workers
    workers.wait_ready(runner.num_blocks)
    workers.start_watchdog()


__all__ = ["TensorParallelModel", "TensorParallelRunner", "load_model", "wait_for_workers"]
