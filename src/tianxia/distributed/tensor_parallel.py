"""Tensor parallelism over ``torch.distributed``: rank 0 is the engine's own process, ranks
1..N-1 are worker processes it spawns, each holding its shard of the model and of the KV cache.
On CPU the ranks share the cores and talk through gloo; on CUDA rank r runs on ``cuda:r`` and the
collectives are NCCL's, on the device.

The scheduler runs once, on rank 0. Each batch the runner builds goes to the workers first, as
the same plain-data ``StepInput`` (token ids, positions, slot mapping, block tables, the block
copies to make; not what only rank 0 samples with), then each forward pass the rows to keep, so
every rank runs the same step on its shard; the collectives
inside the model (an all-reduce after o and down, after the embedding, an all-gather of the
logits) keep them in lockstep. Every rank's cache has the same blocks, so the block tables of
rank 0 index all of them. Pipes rather than a broadcast carry the inputs (host copies, which
each rank moves to its device): an idle worker waits on its pipe without a collective that would
time out, and sees its end close when rank 0 is gone.

On CUDA every rank captures the same decode CUDA graphs of its module forward, the NCCL
all-reduces inside them, in the same order; a decode step then tells the workers to replay
theirs beside rank 0's.

LoRA adapters are read and checked on rank 0, against the whole model; each adapter placed in a
slot is cut into every rank's shard and each worker is sent its own, so a slot holds the same
adapter on every rank, and the step's adapter slot per sequence travels in its ``StepInput``.
Every rank adds its shard's deltas with the grouped product of the module forward (the fused
steps, which hold no collectives, do not run here).

A collective that waits longer than ``TIANXIA_TP_TIMEOUT`` seconds (default 60) raises, and a
watchdog on rank 0 ends the process within a second of a worker dying, naming the rank.

Several nodes: :mod:`tianxia.distributed.nodes`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import socket
import sys
import threading
import time
import weakref
from dataclasses import fields, is_dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from tianxia.config import CacheConfig, EngineConfig, ModelConfig
from tianxia.distributed.nodes import (_CONTROL_TIMEOUT, RemoteRanks, _Beats, _first_line, heartbeat_timeout,
                                      remote_ranks)
from tianxia.distributed.sharding import RankShard, check_supported, parallelize, rank_config
from tianxia.engine.model_runner import ModelRunner, kv_bytes_per_token
from tianxia.engine.step_io import StepInput
from tianxia.layers.attention import AttentionMetadata
from tianxia.layers.lora import LoRAAdapter, LoRAState, LoRATarget
from tianxia.loader import LoadedModel, load_model_config
from tianxia.loader import load_model as load_rank_model

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0  # a worker loads its shard (and on CUDA captures its graphs)


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


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: ``cuda:i`` for the node's i-th rank on a GPU machine, the CPU otherwise."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else torch.device("cpu")


def _init_group(rank: int, world_size: int, init_method: str, device: torch.device, nnodes: int = 1):
    """Join the process group; with several nodes, also the control group (returned; every rank
    makes it, members or not)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # device_id: the communicator is made now, not inside the first collective
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=collective_timeout(), device_id=device)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=collective_timeout())
    if nnodes == 1:
        return None
    return dist.new_group([0, *remote_ranks(world_size, nnodes)], timeout=_CONTROL_TIMEOUT, backend="gloo")


def _load_shard(config: EngineConfig, rank: int, world_size: int, dtype: torch.dtype,
                device: torch.device) -> LoadedModel:
    """The rank's model, built at its size from its part of the file alone."""
    from tianxia.layers.attention import get_backend

    full = load_model_config(config.model)
    shard = RankShard(full, rank, world_size)
    loaded = load_rank_model(config.model, dtype=dtype, device=device, backend=get_backend(device),
                             quantization=config.quantization, shard=shard)
    parallelize(loaded.model, shard)
    loaded.model.int8_activations = config.cpu_activations == "int8"
    loaded.config = rank_config(full, rank, world_size)
    return loaded


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors a rank holds (its parameters and buffers)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def to_host(value):
    """A step's inputs as the pipe carries them: tensors (also inside the attention metadata) on
    the CPU, since a CUDA tensor would cross as a handle to rank 0's device."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if is_dataclass(value):
        return replace(value, **{f.name: to_host(getattr(value, f.name)) for f in fields(value)
                                 if isinstance(getattr(value, f.name), torch.Tensor)})
    return value


def to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if is_dataclass(value):
        return replace(value, **{f.name: getattr(value, f.name).to(device) for f in fields(value)
                                 if isinstance(getattr(value, f.name), torch.Tensor)})
    return value


# --- workers ----------------------------------------------------------------------------------------


def _worker_main(rank: int, world_size: int, init_method: str, config: EngineConfig, cache: CacheConfig,
                 dtype: torch.dtype, kv_dtype: torch.dtype | str, device_type: str, cpus: list[int],
                 threads: int, conn: Connection, log_level: int) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s tp rank {rank} %(levelname)s %(name)s: %(message)s")
    device = rank_device(torch.device(device_type), rank)
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
        conn.send(("started", None))
        _init_group(rank, world_size, init_method, device, config.nnodes)
        loaded, runner = _prepare_worker(config, cache, rank, world_size, dtype, kv_dtype, device)
        conn.send(("ready", (runner.num_blocks, weight_bytes(loaded.model), peak_rss_bytes())))
    except Exception as e:  # rank 0 reports it and stops
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    _serve(loaded.model, runner, conn, rank)


def _prepare_worker(config: EngineConfig, cache: CacheConfig, rank: int, world_size: int, dtype: torch.dtype,
                    kv_dtype: torch.dtype | str, device: torch.device) -> tuple[LoadedModel, ModelRunner]:
    loaded = _load_shard(config, rank, world_size, dtype, device)
    if device.type == "cpu":  # as rank 0's engine does: a row's products do not depend on its batch
        from tianxia.layers.linear import use_row_invariant_linears

        use_row_invariant_linears(loaded.model)
    runner = ModelRunner(loaded.model, loaded.config, cache, device, kv_dtype)
    if config.lora is not None:  # rank 0 sends each adapter's shard (lora_put)
        runner.lora = LoRAState(loaded.model, loaded.model.lora_targets())
    if device.type == "cpu":
        from tianxia.quant import cpu_kernels

        cpu_kernels.extension()
    return loaded, runner


@torch.inference_mode()
def _serve(model: torch.nn.Module, runner: ModelRunner, conn, rank: int) -> None:
    """Run whatever rank 0 runs, until it says stop or its end of the pipe closes (``conn``: a
    pipe, or on another node a :class:`RankChannel`)."""
    device = runner.device
    step, batch = None, None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "step":
            step = msg[1]
            runner.copy_blocks(step.copies)
            batch = runner.tensors(step)
        elif kind == "forward":
            ids, pos, meta = batch
            keep = msg[1]
            row_slots = runner.lora_rows(step)
            if row_slots:  # the same runs of adapter rows as rank 0's
                runner.lora.begin_step(row_slots, None if keep is None else keep.tolist())
            try:
                model(ids, pos, runner.kv_caches, meta, to_device(keep, device))
            finally:
                if row_slots:
                    runner.lora.end_step()
        elif kind == "logits":
            model.compute_logits(to_device(msg[1], device))
        elif kind == "decode":  # rank 0 replays its graph of this batch: the workers theirs
            runner.graph_runner.run(*batch)
        elif kind == "setup_decode":
            try:
                runner.setup_decode(*msg[1:], fused_step=False)
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
                sys.exit(1)
            conn.send(("decode_ready", runner.graph_runner is not None))
        elif kind == "lora_put":  # a remote rank finds its shard among the others'
            shard = msg[2][rank] if isinstance(msg[2], dict) else msg[2]
            runner.lora.put(msg[1], pickle.loads(shard).to(device))
        elif kind == "lora_drop":
            runner.lora.drop(msg[1])
        elif kind == "stop":
            return


class WorkerGroup:
    """Ranks 1..N-1: their processes and pipes, and the watchdog that stops rank 0 when one dies."""

    def __init__(self, procs: list, conns: list[Connection], remote: RemoteRanks | None = None) -> None:
        self.procs, self.conns, self.remote = procs, conns, remote
        self.ready: list[tuple[int, int, int]] = []  # each worker's KV blocks, weight bytes, peak RSS
        self._closing = threading.Event()
        self._finalizer = weakref.finalize(self, _stop_workers, procs, conns, self._closing, remote)

    def attach_remote(self, remote: RemoteRanks) -> None:
        """The ranks of the other nodes, once the process group holds them."""
        self._finalizer.detach()
        self.remote = remote
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._closing, remote)

    def send(self, msg: tuple) -> None:
        for conn in self.conns:
            conn.send(msg)
        if self.remote is not None:
            self.remote.send(msg)

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
        if self.remote is not None and expected != "started":
            for rank in self.remote.ranks:
                try:
                    kind, value = self.remote.reply(rank, deadline)
                except RuntimeError:
                    self.close()
                    raise
                if kind == "error":
                    self.close()
                    raise ValueError(f"tensor-parallel rank {rank}: {value}")
                assert kind == expected, (kind, expected)
                values.append(value)
        return values

    def wait_ready(self, num_blocks: int) -> None:
        """Wait for every worker's shard and KV cache; keeps each one's weight bytes and peak
        resident memory (``self.ready``)."""
        ready = self.wait_for("ready", _READY_TIMEOUT_S)
        ranks = list(range(1, len(self.procs) + 1)) + (self.remote.ranks if self.remote else [])
        self.ready = [r[:3] for r in ready]
        for rank, (blocks, weights, rss, *where) in zip(ranks, ready):
            if blocks != num_blocks:
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} has {blocks} KV blocks, rank 0 {num_blocks}")
            if where:  # a remote rank: its pid and host
                self.remote.where[rank] = f"pid {where[0]} on {where[1]}"
                logger.info("tensor parallel: rank %d ready (host %s, pid %d); weights %.1f MiB, peak resident "
                            "memory %.1f MiB", rank, where[1], where[0], weights / 2**20, rss / 2**20)
            else:
                logger.info("tensor parallel: rank %d ready (pid %d); weights %.1f MiB, peak resident memory "
                            "%.1f MiB", rank, self.procs[rank - 1].pid, weights / 2**20, rss / 2**20)

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
        if self.remote is not None:  # a collective failed: wait for the heartbeats to say which rank
            dead = dict(self.remote.find_dead(heartbeat_timeout() + 1))
            states += [f"rank {r} ({self.remote.where.get(r, 'remote')}) {dead.get(r, 'running')}"
                       for r in self.remote.ranks]
        return ", ".join(states)

    def start_watchdog(self) -> None:
        # the thread holds the processes, not the group, so a dropped engine still finalizes it
        threading.Thread(target=_watch, args=(self.procs, self.conns, self._closing, self.remote),
                         name="tp-watchdog", daemon=True).start()

    def close(self) -> None:
        self._finalizer()


def _watch(procs: list, conns: list[Connection], closing: threading.Event, remote: RemoteRanks | None) -> None:
    beats = _Beats(remote.ranks, remote.client()) if remote is not None else None
    while not closing.wait(0.2):
        for rank, reason in beats.dead() if beats is not None else []:
            if closing.is_set():
                break
            msg = (f"error: tensor-parallel rank {rank} ({remote.where.get(rank, 'remote')}) {reason}; "
                   "the engine stops")
            logger.error(msg)
            print(msg, file=sys.stderr, flush=True)
            # not the remote ranks' stop broadcast: the engine's thread may be in one; they end
            # when rank 0's store goes
            _stop_workers(procs, conns, closing, None)
            os._exit(1)
        for rank, proc in enumerate(procs, start=1):
            if proc.is_alive() or closing.is_set():
                continue
            msg = (f"error: tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                   f"{proc.exitcode}; the engine stops")
            logger.error(msg)
            print(msg, file=sys.stderr, flush=True)
            _stop_workers(procs, conns, closing, None)
            os._exit(1)


def _stop_workers(procs: list, conns: list[Connection], closing: threading.Event,
                  remote: RemoteRanks | None) -> None:
    first = not closing.is_set()
    closing.set()
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    if remote is not None and first:
        remote.stop()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    if dist.is_initialized():
        dist.destroy_process_group()


# --- rank 0 -----------------------------------------------------------------------------------------


class TensorParallelLoRAState(LoRAState):
    """Rank 0's adapters: every adapter put in a slot is cut into each rank's shard; rank 0 keeps
    its own and each worker is sent its, so a slot holds the same adapter on every rank. Its
    ``targets`` are the whole model's, which the adapters are read and checked against."""

    def __init__(self, model: torch.nn.Module, targets: dict[str, LoRATarget], shards: list[RankShard],
                 workers: WorkerGroup) -> None:
        super().__init__(model, targets)
        self.shards, self.workers = shards, workers

    def put(self, slot: int, adapter: LoRAAdapter) -> None:
        host = adapter.to(torch.device("cpu"))  # a CUDA tensor would cross as a handle to cuda:0
        remote = self.workers.remote
        if remote is not None:
            remote.send(("lora_put", slot, {r: pickle.dumps(self.shards[r].shard_adapter(host))
                                            for r in remote.ranks}))
        for shard, conn in zip(self.shards[1:], self.workers.conns):
            # by value: a tensor sent as it is crosses through shared memory, which keeps a file
            # descriptor open on both sides per tensor for as long as the adapter lives
            conn.send(("lora_put", slot, pickle.dumps(shard.shard_adapter(host))))
        super().put(slot, self.shards[0].shard_adapter(adapter))

    def drop(self, slot: int) -> None:
        self.workers.send(("lora_drop", slot))
        super().drop(slot)


class TensorParallelModel:
    """Rank 0's model: each call sends the same call's inputs to the workers, then runs its own
    shard. It offers what the runner asks of a model (:class:`tianxia.models.base.CausalLM`);
    ``config`` is the whole model's."""

    keeps_rows = True

    def __init__(self, model: torch.nn.Module, workers: WorkerGroup, config: ModelConfig) -> None:
        self.model, self.workers, self.config = model, workers, config

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        # over the batch the runner sent with ``tensors``
        self.workers.send(("forward", to_host(keep)))
        try:
            return self.model(input_ids, positions, kv_caches, meta, keep)
        except RuntimeError as e:
            raise self._collective_failed(e) from e

    forward = __call__

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.workers.send(("logits", to_host(hidden)))
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
        return None  # the fused steps hold no collectives: the module forward runs

    def lora_targets(self) -> dict[str, LoRATarget]:
        """The whole model's: adapters are read and checked as for one rank."""
        return self.model.lora_targets(self.config)

    def lora_state(self) -> LoRAState:
        """The adapters over every rank (``--enable-lora``)."""
        world = dist.get_world_size()
        shards = [RankShard(self.config, rank, world) for rank in range(world)]
        return TensorParallelLoRAState(self.model, self.lora_targets(), shards, self.workers)

    def cuda_graph_unsafe_reason(self) -> str | None:
        return self.model.cuda_graph_unsafe_reason()

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


class LockstepGraphs:
    """Rank 0's decode graphs: each replay first tells the workers to replay theirs, whose NCCL
    all-reduces meet rank 0's."""

    def __init__(self, graphs, workers: WorkerGroup) -> None:
        self.graphs, self.workers = graphs, workers
        self.max_batch = graphs.max_batch

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.workers.send(("decode",))  # of the batch the runner sent with ``tensors``
        return self.graphs.run(ids, pos, meta)

    def __getattr__(self, name: str):
        return getattr(self.graphs, name)  # what a report reads: ladder, capture_seconds, ...


class TensorParallelRunner(ModelRunner):
    """The model runner of rank 0: every batch it builds goes to the workers too, with its block
    copies (copy-on-write), made on every rank's cache; on CUDA every rank captures its decode
    graphs."""

    verifies_as_decodes = False

    def tensors(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        self.model.workers.send(("step", step.batch_only()))
        return super().tensors(step)

    def setup_decode(self, max_num_seqs: int, max_model_len: int, enforce_eager: bool = False,
                     fused_step: bool = True, max_rows: int | None = None) -> None:
        """Every rank sets up the same route at once (on CUDA: captures the same graphs of its
        module forward, whose warm-up steps run the collectives together). Rank 0 captures its own
        shard's forward, which sends the workers nothing. The graphs stop at decode batches
        (``max_rows`` is not taken): mixed steps run the module forward on every rank."""
        tp_model: TensorParallelModel = self.model
        workers = tp_model.workers
        workers.send(("setup_decode", max_num_seqs, max_model_len, enforce_eager))
        self.model = tp_model.model
        try:
            super().setup_decode(max_num_seqs, max_model_len, enforce_eager, fused_step=False)
        except torch.cuda.OutOfMemoryError:
            workers.close()
            raise  # the engine words it, with the numbers
        except RuntimeError as e:
            raise tp_model._collective_failed(e) from e
        finally:
            self.model = tp_model
        graphs = workers.wait_for("decode_ready", _READY_TIMEOUT_S)
        if any(g != (self.graph_runner is not None) for g in graphs):
            workers.close()
            raise RuntimeError(f"tensor parallel: the ranks chose different decode routes ({graphs})")
        if self.graph_runner is not None:
            self.graph_runner = LockstepGraphs(self.graph_runner, workers)


def load_model(config: EngineConfig, dtype: torch.dtype, device: torch.device,
               kv_dtype: torch.dtype | str) -> LoadedModel:
    """Start ranks 1..N-1, load and shard rank 0's model; the returned model drives the workers.

    Workers load while rank 0 does; the engine waits for them in :func:`wait_for_workers`.
    """
    world = config.tensor_parallel_size
    per = world // config.nnodes  # ranks on this node
    if config.node_rank != 0:
        raise ValueError("--node-rank > 0 runs worker ranks only, no engine (nodes.serve_node)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--tensor-parallel-size runs on CPU (gloo) or CUDA GPUs (NCCL), not {device.type}")
    if device.type == "cuda" and torch.cuda.device_count() < per:
        raise ValueError(f"--tensor-parallel-size {world} needs {world} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    if device.type == "cuda" and config.cache.gpu_memory_utilization is not None:
        raise ValueError("--gpu-memory-utilization is not available with --tensor-parallel-size yet; "
                         "size the KV cache with --kv-cache-memory")
    full = load_model_config(config.model)
    check_supported(full, world)
    addr = config.master_addr
    port = config.master_port
    if port is None:
        port = free_port(addr)
    else:
        check_port(addr, port)
    init_method = f"tcp://{addr}:{port}"
    # CPU ranks split the cores; GPU ranks keep them all (they mostly launch kernels)
    shares = cpu_shares(per) if device.type == "cpu" else [[] for _ in range(per)]
    # every rank's cache has the same blocks, sized by rank 0's, which holds the most KV heads
    per_block = kv_bytes_per_token(rank_config(full, 0, world), kv_dtype) * config.cache.block_size
    cache = replace(config.cache, num_blocks=config.cache.num_blocks
                    or max(1, config.cache.kv_cache_memory // per_block))
    from tianxia.engine.llm_engine import default_threads

    threads = max(1, (config.threads or default_threads()) // per)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(1, per):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker_main, name=f"tianxia-tp-rank{rank}", daemon=True,
            args=(rank, world, init_method, config, cache, dtype, kv_dtype, device.type, shares[rank], threads,
                  child, logging.getLogger().level),
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    workers = WorkerGroup(procs, conns)
    workers.wait_for("started", _READY_TIMEOUT_S)
    torch.set_num_threads(threads)
    device = rank_device(device, 0)
    try:
        group = _init_group(0, world, init_method, device, config.nnodes)
    except Exception as e:
        workers.close()
        raise RuntimeError(f"tensor parallel: the rendezvous at {init_method} did not complete in "
                           f"{collective_timeout().total_seconds():.0f}s (TIANXIA_TP_TIMEOUT): are the other "
                           f"nodes (--node-rank 1..{config.nnodes - 1}) running? ({_first_line(e)})") from None
    if config.nnodes > 1:
        workers.attach_remote(RemoteRanks(remote_ranks(world, config.nnodes), group, addr, port))
        workers.remote.send(("setup", dict(config=config, cache=cache, dtype=dtype, kv_dtype=kv_dtype,
                                           device=device.type)))
    loaded = _load_shard(config, 0, world, dtype, device)
    logger.info("tensor parallel: %d ranks (%s) on %s, %d threads each; rank 0 holds %d of %d KV heads; "
                "weights %.1f MiB", world, dist.get_backend(), init_method, threads,
                loaded.config.num_key_value_heads, full.num_key_value_heads, weight_bytes(loaded.model) / 2**20)
    loaded.model = TensorParallelModel(loaded.model, workers, full)
    return loaded


def wait_for_workers(runner: ModelRunner) -> None:
    """Block until every worker has its shard and its KV cache, then watch them."""
    workers: WorkerGroup = runner.model.workers
    workers.wait_ready(runner.num_blocks)
    workers.start_watchdog()


__all__ = ["TensorParallelModel", "TensorParallelRunner", "load_model", "wait_for_workers"]
