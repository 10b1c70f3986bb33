#!/usr/bin/env python
"""The engine core in its own process against the engine on the server's thread, and both against
the offline decode step: one script, one machine, one run.

- offline: ``LLM.generate`` of one 128-token prompt (random token ids), 1 token and then 65
  tokens (``ignore_eos``), ``--threads`` threads; the decode step is the difference over 64. It
  is measured again at the start of every round, and each round's served TPOT is compared with
  its own round's offline step: a machine whose speed drifts within the run then moves both;
- served, for ``--engine-core thread`` and ``process`` in turn (ABBA over ``--rounds``): at
  concurrency 1, sequential streamed requests of the same shape, TPOT =
  (last token - first token) / (tokens - 1), median over requests; at concurrency 16, 32 streamed
  requests (128 in / 64 out), output tokens/s over the wall time; then, idle, the share of a
  core that the server and its engine core use over 10 s;
- the CPU time (user + system, from ``/proc``) per streamed token over the concurrency-1
  requests, of the server's first process and of its children: the API process and the engine
  core with ``process``; with ``thread`` the one process holds both (the children's share is 0);
  with ``api2`` the first process only supervises, and both API processes count as children;
- ``--modes`` picks the served setups: ``thread``, ``process``, ``api2`` (``--engine-core
  process --api-server-count 2``: two API processes in front of the one core) and ``spin``
  (``process`` with libgomp's own wait, ``GOMP_SPINCOUNT=300000``, where the core's default is
  1,000 spins).

    python benchmarks/engine_core_cpu.py --threads 2 --out benchmarks/results/engine_core/cpu.json

The server runs the ``tianxia`` that ``PYTHONPATH`` names (else this tree's), so two trees can be
compared by alternating runs:

    for t in OLD NEW; do PYTHONPATH=$t/src python benchmarks/engine_core_cpu.py --modes process; done
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(REPO / "src"))
    os.environ["PYTHONPATH"] = str(REPO / "src")

from tianxia.server.testing import ServerProcess  # noqa: E402

OFFLINE = """
import json, random, statistics, sys, time
from tianxia import LLM, SamplingParams
model, threads = sys.argv[1], int(sys.argv[2])
llm = LLM(model, threads=threads, max_model_len=512, kv_cache_memory="256MiB")
r = random.Random(0)
prompt = {"prompt_token_ids": [r.randrange(1, 5000) for _ in range(128)]}

def timed(n):
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0),
                 use_tqdm=False)
    return time.perf_counter() - t

timed(65)
steps = [(timed(65) - timed(1)) / 64 for _ in range(5)]
print(json.dumps({"decode_step_ms": 1000 * statistics.median(steps)}))
"""


def cpu_split(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of ``pid`` and of its children still alive (the engine cores)."""
    ticks = os.sysconf("SC_CLK_TCK")

    def used(p: int) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks

    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    return used(pid), sum(used(c) for c in children)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its children still alive."""
    return sum(cpu_split(pid))


def idle_cpu(pid: int, seconds: float = 10.0) -> float:
    """The share of one core the server (and its cores) use while no request comes."""
    time.sleep(3.0)  # past the last step's OpenMP spinning
    c0 = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / seconds


def prompts(n: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(1, 5000) for _ in range(128)] for _ in range(n)]


async def one(client: httpx.AsyncClient, url: str, ids: list[int], out_len: int) -> tuple[int, float]:
    """Streams one request; returns (tokens, TPOT seconds)."""
    body = { "prompt": ids, "max_tokens": out_len, "ignore_eos": True,
            "temperature": 0, "stream": True}
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return len(times), (times[-1] - times[0]) / max(1, len(times) - 1)


async def served(url: str, pid: int, out_len: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        for ids in prompts(2, 1):  # warm-up
            await one(client, url, ids, out_len)
        api0, core0 = cpu_split(pid)
        sequential = [await one(client, url, ids, out_len) for ids in prompts(6, 2)]
        api1, core1 = cpu_split(pid)
        tpots = [tpot for _, tpot in sequential]
        tokens = sum(n for n, _ in sequential)
        sem = asyncio.Semaphore(16)

        async def limited(ids):
            async with sem:
                return await one(client, url, ids, out_len)

        t = time.perf_counter()
        results = await asyncio.gather(*(limited(ids) for ids in prompts(32, 3)))
        wall = time.perf_counter() - t
    return {"tpot_c1_ms": 1000 * statistics.median(tpots),
            "api_cpu_us_per_token": 1e6 * (api1 - api0) / tokens,
            "core_cpu_us_per_token": 1e6 * (core1 - core0) / tokens,
            "tok_s_c16": sum(n for n, _ in results) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default="thread,process", help="of thread, process, api2, spin")
    args = ap.parse_args()
    modes = args.modes.split(",")
    flags = {"thread": ["--engine-core", "thread"], "process": ["--engine-core", "process"],
             "api2": ["--engine-core", "process", "--api-server-count", "2"],
             "spin": ["--engine-core", "process"]}
    envs = {"spin": {"GOMP_SPINCOUNT": "300000"}}
    def offline_step_ms() -> float:
        out = subprocess.run([sys.executable, "-c", OFFLINE, args.model, str(args.threads)], check=True,
                             capture_output=True, text=True, cwd=REPO).stdout
        step = json.loads(out.strip().splitlines()[-1])["decode_step_ms"]
        print("offline decode step ms", round(step, 3), flush=True)
        return step

    order = []
    for i in range(args.rounds):
        order += [None] + (modes if i % 2 == 0 else modes[::-1])  # None: the round's offline step
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    offline_ms: list[float] = []
    for mode in order:
        if mode is None:
            offline_ms.append(offline_step_ms())
            continue
        srv = ServerProcess([args.model, "--threads", str(args.threads), *flags[mode],
                             "--max-model-len", "512", "--max-num-seqs", "16",
                             "--kv-cache-memory", "256MiB", "--disable-log-stats",
                             "--disable-access-log"], env=envs.get(mode))
        with srv:
            result = asyncio.run(served(srv.url, srv.proc.pid, 64))
            result["idle_cpu_share"] = idle_cpu(srv.proc.pid)
        result["tpot_vs_offline"] = result["tpot_c1_ms"] / offline_ms[-1]
        print(mode, result, flush=True)
        runs[mode].append(result)
    summary = {"offline_decode_step_ms": statistics.median(offline_ms), "offline_rounds_ms": offline_ms}
    for mode, results in runs.items():
        summary[mode] = {"tpot_c1_ms": statistics.median(r["tpot_c1_ms"] for r in results),
                         "tpot_vs_offline": statistics.median(r["tpot_vs_offline"] for r in results),
                         "tok_s_c16": statistics.median(r["tok_s_c16"] for r in results),
                         "api_cpu_us_per_token": statistics.median(r["api_cpu_us_per_token"] for r in results),
                         "core_cpu_us_per_token": statistics.median(r["core_cpu_us_per_token"] for r in results),
                         "idle_cpu_share": max(r["idle_cpu_share"] for r in results)}
    summary["runs"] = runs
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
