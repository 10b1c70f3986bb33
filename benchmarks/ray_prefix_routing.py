"""Prefix-aware routing against round-robin (and Ray's power of two choices), 2 tianxia replicas
on Ray Serve, measured with ``tianxia bench serve --workload multi-turn``.

One local Ray instance; each router in turn is deployed (``tianxia.ray:app``), then the same
multi-turn chat workload (conversations over a few shared system prompts, each turn carrying the
whole history) is sent through the ingress by ``tianxia bench serve``, and ``tianxia bench
compare`` tabulates the runs: cache hit rate (cached prompt tokens from the replies' usage /
prompt tokens) and output tok/s side by side.

    PYTHONPATH=src python benchmarks/ray_prefix_routing.py --threads 1
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ray
from ray import serve

from tianxia.loader.hub import pull
from tianxia.ray import app
from tianxia.server.testing import free_port

TIANXIA = [sys.executable, "-m", "tianxia.cli"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per replica")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per replica")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routers", default="prefix,round-robin,pow2")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256, help="system prompt tokens")
    p.add_argument("--turn-len", type=int, default=64, help="tokens of each user turn")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each reply")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--serve-args", default="--kv-cache-memory 256MiB --max-model-len 2048")
    p.add_argument("--result-dir", default=None, help="keep the result JSON files here")
    a = p.parse_args()
    model = str(pull(a.model, quiet=True))
    out = Path(a.result_dir or tempfile.mkdtemp(prefix="ray-routing-"))
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    files, startups = [], []
    try:
        for router in a.routers.split(","):
            started = time.monotonic()
            serve.run(app({
                "model": model, "num_replicas": a.replicas, "threads": a.threads,
                "num_gpus": a.num_gpus, "router": router, "serve_args": a.serve_args,
            }), name="bench", route_prefix="/")
            startups.append((router, time.monotonic() - started))
            served = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
            result = out / f"{router}.json"
            subprocess.run(TIANXIA + [
                "bench", "serve", "--base-url", base, "--model", served, "--tokenizer", model,
                "--endpoint", "chat", "--workload", "multi-turn",
                "--num-prompts", str(a.conversations * a.turns), "--num-turns", str(a.turns),
                "--num-prefixes", str(a.system_prompts), "--prefix-len", str(a.system_len),
                "--input-len", str(a.turn_len), "--output-len", str(a.output_len),
                "--max-concurrency", str(a.max_concurrency), "--label", router,
                "--save-result", str(result), "--no-progress",
            ], check=True)
            files.append(str(result))
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\n{a.replicas} replicas of {a.model}, {a.conversations} conversations x {a.turns} "
          f"turns over {a.system_prompts} system prompts of {a.system_len} tokens, "
          f"{a.turn_len}-token turns, {a.output_len}-token replies, "
          f"{a.max_concurrency} requests in flight")
    print("start-up (serve.run until all replicas are ready): " +
          ", ".join(f"{r} {s:.1f}s" for r, s in startups))
    subprocess.run(TIANXIA + ["bench", "compare", *files, "--baseline", "round-robin"]
                   if "round-robin" in a.routers else TIANXIA + ["bench", "compare", *files],
                   check=True)
    routing_cost(model, a)


def routing_cost(model: str, a: argparse.Namespace) -> None:
    """What routing on token ids costs the ingress per request: tokenizing the last turn of a
    conversation of this workload (chat template applied), the median of 50."""
    import json
    import random
    import statistics

    from tianxia.bench.workloads import LenSpec, multi_turn_workload, word_sampler
    from tianxia.ray.tokens import RoutingTokenizer

    rt = RoutingTokenizer(model)
    turns = multi_turn_workload(rt.tokenizer, a.turns, a.turns, a.system_len,
                                LenSpec(a.turn_len, a.turn_len),
                                LenSpec(a.output_len, a.output_len), seed=0)
    words, rng = word_sampler(rt.tokenizer), random.Random(0)
    history = [(t.prompt, words.text(a.output_len, rng)) for t in turns[:-1]]
    last = turns[-1]
    last.history = history
    body = json.dumps({"model": "m", "messages": last.chat_messages()}).encode()
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        ids = rt.prompt_tokens(body)
        times.append(time.perf_counter() - t0)
    print(f"ingress: token ids of a {len(ids)}-token chat prompt in "
          f"{statistics.median(times) * 1e3:.2f} ms (median of 50)")


if __name__ == "__main__":
    main()
