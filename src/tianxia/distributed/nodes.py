"""Tensor parallelism over several nodes (``--nnodes``, ``--node-rank``, as ``torchrun``).

The ranks split evenly over the nodes, node 0 holding rank 0 and its own workers (pipes, as
:mod:`tianxia.distributed.tensor_parallel` describes). Node r > 0 runs
:func:`serve_node`: it starts its ranks, which join torch.distributed's rendezvous at
``--master-addr:--master-port`` (rank 0's TCP store). A pipe reaches only a local child, so the
ranks of the other nodes receive the same messages by a ``broadcast_object_list`` from rank 0 over
a second, gloo process group of rank 0 and those ranks (the control group); their answers (ready,
errors) are keys in rank 0's store. The control group's timeout is years long, so an idle worker
waits in its broadcast without timing out; liveness goes through the store instead: each remote
rank adds to its heartbeat key every half second, and ends (code 1) when the store, which lives
in rank 0's process, is gone; rank 0's watchdog ends the engine, naming the rank, when a remote
rank's heartbeat stops for ``TIANXIA_TP_HEARTBEAT_TIMEOUT`` seconds (default 10) or its node
reports it exited. The collectives inside the model keep their timeout.
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
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from tianxia.config import EngineConfig

logger = logging.getLogger(__name__)

# the control group's timeout: an idle remote worker waits in a broadcast for its next message as
# long as the engine is idle; its liveness and rank 0's are the heartbeats' business (see above)
_CONTROL_TIMEOUT = timedelta(days=3650)
_BEAT_S = 0.5  # a remote rank's heartbeat period


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def heartbeat_timeout() -> float:
    return float(os.environ.get("TIANXIA_TP_HEARTBEAT_TIMEOUT", "10"))


def _key(kind: str, rank: int, n: int | None = None) -> str:
    """A key of rank 0's store: a remote rank's ``beat`` counter, its ``reply`` number n, its
    ``exit`` (written by its node's process)."""
    return f"tianxia/tp/{kind}/{rank}" + ("" if n is None else f"/{n}")


def _store_client(addr: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    """A connection of its own to rank 0's store (each thread that uses the store has one)."""
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def remote_ranks(world_size: int, nnodes: int) -> list[int]:
    """The ranks on nodes other than node 0 (node r holds ranks r*n .. r*n+n-1, n = world / nnodes)."""
    return list(range(world_size // nnodes, world_size)) if nnodes > 1 else []


class _Beats:
    """Which remote ranks are gone: their node reported an exit, or their heartbeat counter has
    not moved for ``heartbeat_timeout()`` seconds (of this clock: the nodes' clocks may differ)."""

    def __init__(self, ranks: list[int], store: dist.TCPStore) -> None:
        self.ranks, self.store = ranks, store
        now = time.monotonic()
        self.seen = {r: (-1, now) for r in ranks}

    def dead(self) -> list[tuple[int, str]]:
        out, now = [], time.monotonic()
        for rank in self.ranks:
            if self.store.check([_key("exit", rank)]):
                out.append((rank, self.store.get(_key("exit", rank)).decode()))
                continue
            count = self.store.add(_key("beat", rank), 0)
            last, since = self.seen[rank]
            if count != last:
                self.seen[rank] = (count, now)
            elif now - since > heartbeat_timeout():
                out.append((rank, f"sent no heartbeat for {now - since:.0f}s"))
        return out


class RemoteRanks:
    """Rank 0's view of the ranks on the other nodes: messages go by a broadcast over the control
    group; answers, heartbeats and exits are keys in rank 0's store."""

    def __init__(self, ranks: list[int], group, addr: str, port: int) -> None:
        self.ranks, self.group, self.addr, self.port = ranks, group, addr, port
        self.store = self.client()
        self.where: dict[int, str] = {}  # rank: "pid P on HOST", once ready
        self._n = dict.fromkeys(ranks, 0)

    def client(self) -> dist.TCPStore:
        return _store_client(self.addr, self.port)

    def send(self, msg: tuple) -> None:
        dist.broadcast_object_list([msg], src=0, group=self.group)

    def reply(self, rank: int, deadline: float) -> tuple:
        key = _key("reply", rank, self._n[rank])
        beats = _Beats([rank], self.store)
        while not self.store.check([key]):
            for _, reason in beats.dead():
                raise RuntimeError(f"tensor-parallel rank {rank} {reason} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} did not answer in time")
            time.sleep(0.1)
        self._n[rank] += 1
        msg = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return msg

    def find_dead(self, wait_s: float) -> list[tuple[int, str]]:
        beats, deadline = _Beats(self.ranks, self.client()), time.monotonic() + wait_s
        while True:
            dead = beats.dead()
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.2)

    def stop(self) -> None:
        """Tell the remote ranks to stop and wait (a few seconds) for them to say so."""
        try:
            self.send(("stop",))
        except Exception:
            return
        deadline = time.monotonic() + 5
        for rank in self.ranks:
            try:
                while not self.store.check([_key("reply", rank, self._n[rank])]) and time.monotonic() < deadline:
                    time.sleep(0.05)
            except Exception:
                return


class RankChannel:
    """A remote rank's end of rank 0's messages: what rank 0 sends arrives by a broadcast over the
    control group; its answers go into rank 0's store."""

    def __init__(self, rank: int, group, store: dist.TCPStore) -> None:
        self.rank, self.group, self.store, self._n = rank, group, store, 0
        self.stopping = threading.Event()

    def recv(self) -> tuple:
        obj = [None]
        dist.broadcast_object_list(obj, src=0, group=self.group)
        if obj[0][0] == "stop":
            self.stopping.set()
        return obj[0]

    def send(self, msg: tuple) -> None:
        self.store.set(_key("reply", self.rank, self._n), pickle.dumps(msg))
        self._n += 1


def _die(rank: int, why: str) -> None:
    print(f"error: tensor-parallel rank {rank}: {why}", file=sys.stderr, flush=True)
    os._exit(1)


def _heartbeat(rank: int, addr: str, port: int, stopping: threading.Event, parent: int) -> None:
    try:
        store = _store_client(addr, port, 5)
        while True:
            try:
                store.add(_key("beat", rank), 1)
            except Exception as e:
                if stopping.wait(2.0):
                    return
                _die(rank, f"rank 0's store at {addr}:{port} is gone ({_first_line(e)}): rank 0 has ended")
            if os.getppid() != parent:
                _die(rank, "its node's process is gone")
            if stopping.wait(_BEAT_S):
                return
    except Exception as e:
        _die(rank, f"heartbeat failed: {_first_line(e)}")


def _node_worker_main(rank: int, world: int, nnodes: int, addr: str, port: int, model: str, device_type: str,
                      cpus: list[int], threads: int, log_level: int, parent: int) -> None:
    """A rank on a node other than node 0: join, take rank 0's settings, load, serve."""
    # the worker's side of tensor_parallel (which imports this module for rank 0's side)
    from tianxia.distributed.tensor_parallel import (_init_group, _prepare_worker, _serve, collective_timeout,
                                                     peak_rss_bytes, rank_device, weight_bytes)

    logging.basicConfig(level=log_level, format=f"%(asctime)s tp rank {rank} %(levelname)s %(name)s: %(message)s")
    device = rank_device(torch.device(device_type), rank % (world // nnodes))
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
        try:
            group = _init_group(rank, world, f"tcp://{addr}:{port}", device, nnodes)
        except Exception as e:
            _die(rank, f"the rendezvous at {addr}:{port} did not complete in {collective_timeout().total_seconds():.0f}s "
                       f"(TIANXIA_TP_TIMEOUT): is node 0 running? ({_first_line(e)})")
        channel = RankChannel(rank, group, _store_client(addr, port))
        threading.Thread(target=_heartbeat, args=(rank, addr, port, channel.stopping, parent),
                         name="tp-heartbeat", daemon=True).start()
        kind, setup = channel.recv()
        assert kind == "setup", kind
        try:
            if setup["device"] != device.type:
                raise ValueError(f"rank 0 runs on {setup['device']}, this node on {device.type}")
            config = replace(setup["config"], model=model, node_rank=rank // (world // nnodes))
            loaded, runner = _prepare_worker(config, setup["cache"], rank, world, setup["dtype"],
                                             setup["kv_dtype"], device)
        except Exception as e:
            channel.send(("error", f"{type(e).__name__}: {e}"))
            _die(rank, f"{type(e).__name__}: {e}")
        channel.send(("ready", (runner.num_blocks, weight_bytes(loaded.model), peak_rss_bytes(), os.getpid(),
                                socket.gethostname())))
        _serve(loaded.model, runner, channel, rank)
    except Exception as e:
        if not channel.stopping.is_set():
            _die(rank, f"rank 0 is gone or out of step ({_first_line(e)})")
    channel.send(("stopped", None))
    os._exit(0)


def serve_node(config: EngineConfig) -> int:
    """Node ``config.node_rank`` > 0: start its ranks, which serve rank 0's steps until it stops
    them (0), or until one fails (1; it names itself). No engine, no server."""
    from tianxia.distributed.sharding import check_supported
    from tianxia.distributed.tensor_parallel import cpu_shares
    from tianxia.engine.llm_engine import default_threads, resolve_device
    from tianxia.loader import load_model_config

    world, nnodes, node = config.tensor_parallel_size, config.nnodes, config.node_rank
    per = world // nnodes
    device = resolve_device(config.device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--tensor-parallel-size runs on CPU (gloo) or CUDA GPUs (NCCL), not {device.type}")
    if device.type == "cuda" and torch.cuda.device_count() < per:
        raise ValueError(f"node {node} runs {per} ranks on {per} GPUs; this machine has {torch.cuda.device_count()}")
    check_supported(load_model_config(config.model), world)
    shares = cpu_shares(per) if device.type == "cpu" else [[] for _ in range(per)]
    threads = max(1, (config.threads or default_threads()) // per)
    ctx = mp.get_context("spawn")
    procs = {}
    for i, rank in enumerate(range(node * per, (node + 1) * per)):
        procs[rank] = ctx.Process(
            target=_node_worker_main, name=f"tianxia-tp-rank{rank}", daemon=True,
            args=(rank, world, nnodes, config.master_addr, config.master_port, config.model, device.type,
                  shares[i], threads, logging.getLogger().level, os.getpid()))
        procs[rank].start()
    logger.info("node %d: tensor-parallel ranks %s joining tcp://%s:%d", node, list(procs),
                config.master_addr, config.master_port)
    try:
        while True:
            for rank, proc in procs.items():
                if proc.exitcode not in (None, 0):
                    if proc.exitcode < 0:  # a signal: tell rank 0 which rank it was
                        why = f"(pid {proc.pid} on {socket.gethostname()}) exited with code {proc.exitcode}"
                        print(f"error: tensor-parallel rank {rank} {why}", file=sys.stderr, flush=True)
                        try:
                            _store_client(config.master_addr, config.master_port, 2).set(
                                _key("exit", rank), f"exited with code {proc.exitcode}")
                        except Exception:
                            pass
                    for other in procs.values():
                        if other.is_alive():
                            other.kill()
                    return 1
            if all(proc.exitcode == 0 for proc in procs.values()):
                return 0
            time.sleep(0.2)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
