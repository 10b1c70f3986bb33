"""``tianxia serve --api-server-count N``: N API server processes in front of the same engine cores.

The process that runs ``tianxia serve`` becomes a supervisor, as vLLM's does: it starts the engine
cores (:class:`EngineCores`, one output socket per API process), binds one listening socket per
API process on the same port (``SO_REUSEPORT``: the kernel spreads new connections over them by
their addresses, where one shared socket lets whichever process is awake take them all, one
after another) and starts N API server processes, each serving HTTP on its own socket and talking
to every core as client ``i``. Tokenization, chat templates,
detokenization, JSON and SSE then run on N processes instead of one.

Lifetimes: the API processes and the cores die with the supervisor (``PR_SET_PDEATHSIG``, even
when it is SIGKILLed; each listening socket dies with its process). An API process that exits
(it exits 1 when a core dies) takes the rest down and the supervisor exits 1. SIGTERM / SIGINT
drain: each API process stops accepting and finishes its requests, then the cores stop.

``/metrics``: the cores send their statistics (gauges, steps, per-request timings) to every API
process, so any of them answers for the whole server; only the few counters an API process keeps
itself (requests refused with 503 ``queue_full``, requests routed to each core) are its own.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import signal
import socket
from multiprocessing.connection import wait

from tianxia.engine.core_client import CoreEndpoints, EngineCores

logger = logging.getLogger(__name__)

_WAIT_S = 1.0


def default_api_server_count(device_type: str, cpus: int, data_parallel_size: int = 1) -> int:
    """``--api-server-count`` where it can be more than 1 and is not given: on a GPU, one API
    process per engine core and at least 2, while the machine has 4 CPUs for each; on a CPU, 1
    (its cores compute the steps).

    At saturation one API process (HTTP, JSON, tokenization, detokenization, streaming) is a full
    CPU core and the bottleneck of a GPU that steps in milliseconds: H100, Qwen2.5-0.5B shape, 256
    requests in flight, served output tok/s was 0.74-0.92 of offline with one and 1.01-1.06 with
    two, and the same at 16 req/s (TTFT p50 6.7 / 6.8 ms)."""
    if device_type != "cuda":
        return 1
    n = max(2, data_parallel_size)
    return n if cpus >= 4 * n else 1


def resolve_api_server_count(args: argparse.Namespace, several_models: bool) -> None:
    """Fill in ``args.api_server_count`` when not given (:func:`default_api_server_count`, for
    a setup that several API processes can serve; else 1)."""
    if args.api_server_count is not None:
        return
    args.api_server_count = 1
    if _one_api_server_only(args, several_models) is not None:
        return
    from tianxia.doctor import usable_cores
    from tianxia.engine.llm_engine import resolve_device

    args.api_server_count = default_api_server_count(
        resolve_device(args.device).type, usable_cores(), args.data_parallel_size)
    if args.api_server_count > 1:
        logger.info("%d API server processes (--api-server-count)", args.api_server_count)


def _one_api_server_only(args: argparse.Namespace, several_models: bool) -> str | None:
    """Why this setup takes a single API process (the error for ``--api-server-count`` > 1), or
    None: several API processes serve one model in engine core processes, its LoRA adapters given
    at start (every API process reads them from the cores' start-up facts)."""
    if several_models:
        return ("--api-server-count serves one model; it does not combine with --model "
                "NAME=... or --models-dir")
    if args.engine_core == "thread":
        return "--api-server-count needs --engine-core process"
    if args.tensor_parallel_size > 1:
        return ("--api-server-count does not combine with --tensor-parallel-size (its engine "
                "runs on a thread of the server)")
    if args.allow_runtime_lora_updating:
        # as vLLM: each API process keeps its own list of the adapters served, and a load or
        # unload reaches one of them only
        return ("--allow-runtime-lora-updating does not combine with --api-server-count (an "
                "adapter loaded at run time would be known to one API process only); give the "
                "adapters at start with --lora-modules")
    return None


def check_api_server_args(args: argparse.Namespace, several_models: bool) -> None:
    """What ``--api-server-count`` combines with (:func:`_one_api_server_only`)."""
    if args.api_server_count < 1:
        raise ValueError("--api-server-count must be at least 1")
    if args.api_server_count > 1 and (reason := _one_api_server_only(args, several_models)):
        raise ValueError(reason)


def _listening_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` sockets listening on one port (port 0: the first one's), or one shared socket where the
    platform has no ``SO_REUSEPORT``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reuse_port = hasattr(socket, "SO_REUSEPORT")
    socks: list[socket.socket] = []
    try:
        for _ in range(n if reuse_port else 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, socks[0].getsockname()[1] if len(socks) > 1 else port))
            sock.listen(2048)  # uvicorn's backlog
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def _api_server_main(args: argparse.Namespace, default_model: str, config, endpoints: CoreEndpoints,
                     index: int, sock: socket.socket, parent_pid: int) -> None:
    from tianxia.engine.core_proc import die_with_parent
    from tianxia.server.launcher import run_server

    die_with_parent(parent_pid)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(levelname)s [api {index}] %(name)s: %(message)s")
    try:
        # the cores' config as the supervisor made it: sizing the KV cache again here would
        # count the memory the cores already hold as taken
        code = run_server(args, default_model, attach=(endpoints, index, config), sock=sock)
    except Exception as e:  # noqa: BLE001 - one line, as the CLI prints it
        logger.error("%s", e)
        code = 1
    os._exit(code)


def run_api_servers(args: argparse.Namespace, default_model: str, model: str, config) -> int:
    """Supervise the cores and ``args.api_server_count`` API processes until they are done."""
    n = args.api_server_count
    cores = EngineCores(config, data_parallel_size=args.data_parallel_size, num_clients=n,
                        request_timeout=args.request_timeout,
                        log_stats_interval=None if args.disable_log_stats else 10.0,
                        log_level=args.log_level.upper())
    socks = _listening_sockets(args.host, args.port, n)
    spawn = multiprocessing.get_context("spawn")
    servers = []
    try:
        for i in range(n):
            proc = spawn.Process(target=_api_server_main, name=f"tianxia-api-server-{i}",
                                 args=(args, default_model, config, cores.endpoints, i, socks[i % len(socks)],
                                       os.getpid()))
            proc.start()
            servers.append(proc)
            logger.info("API server %d: process %d", i, proc.pid)
        for sock in socks:
            sock.close()  # the API processes hold them now
        logger.info("serving %s on http://%s:%d with %d API server processes", model, args.host,
                    args.port, n)
        return _supervise(servers, cores)
    finally:
        for proc in servers:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        if any(p.is_alive() for p in cores.procs):
            asyncio.run(cores.shutdown(timeout=10.0))
        else:
            cores.kill()


def _supervise(servers: list, cores: EngineCores) -> int:
    draining = False

    def drain(signum, frame) -> None:
        nonlocal draining
        if not draining:
            logger.info("shutting down: the API servers drain their requests")
        draining = True
        for proc in servers:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    while True:
        wait([p.sentinel for p in servers] + [p.sentinel for p in cores.procs], _WAIT_S)
        for i, proc in enumerate(servers):
            if proc.exitcode is not None and (proc.exitcode != 0 or not draining):
                logger.error("API server %d exited (exit code %s); stopping the server", i,
                             proc.exitcode)
                return 1
        if all(p.exitcode == 0 for p in servers):
            return 0
        for i, proc in enumerate(cores.procs):
            if proc.exitcode is not None and not draining:
                # the API processes see it too and exit 1; give them a moment to fail their
                # requests with an error, then stop
                wait([p.sentinel for p in servers], 5.0)
                logger.error("engine core %d exited (exit code %s); stopping the server", i,
                             proc.exitcode)
                return 1
