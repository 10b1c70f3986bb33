"""Prefix-aware routing against Ray's default power-of-two choices, 2 tianxia replicas on Ray.

A multi-turn workload: several conversations, each with its own long system prompt, each turn
sending the whole history plus a new question (so it extends the last turn's prompt). The
conversations run concurrently; the turns of one run in order. Reports the prefix cache hit rate
(cached prompt tokens / prompt tokens, from the replies' usage) and output tok/s per router.

    PYTHONPATH=src python benchmarks/ray_prefix_routing.py --model smollm2-135m --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import ray
from ray import serve

from tianxia.loader.hub import pull
from tianxia.ray import app
from tianxia.server.testing import free_port


def system_prompt(i: int) -> str:
    return (f"You are assistant number {i} of a shop that sells tools. " * 12).strip()


async def conversation(client: httpx.AsyncClient, url: str, model: str, i: int, turns: int,
                       max_tokens: int) -> dict[str, int]:
    messages = [{"role": "system", "content": system_prompt(i)}]
    totals = {"prompt": 0, "cached": 0, "completion": 0}
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t}: which tool cuts wood?"})
        r = await client.post(url, json={
            "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True,
        })
        r.raise_for_status()
        body = r.json()
        usage = body["usage"]
        totals["prompt"] += usage["prompt_tokens"]
        totals["cached"] += usage["prompt_tokens_details"]["cached_tokens"]
        totals["completion"] += usage["completion_tokens"]
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return totals


async def workload(base: str, conversations: int, turns: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        results = await asyncio.gather(*(
            conversation(client, base + "/v1/chat/completions", model, i, turns, max_tokens)
            for i in range(conversations)
        ))
        elapsed = time.perf_counter() - start
    total = {k: sum(r[k] for r in results) for k in results[0]}
    return {
        "hit_rate": total["cached"] / total["prompt"],
        "output_tok_s": total["completion"] / elapsed,
        "seconds": elapsed,
        **total,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per replica")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per replica")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--serve-args", default="--kv-cache-memory 256MiB --max-model-len 2048")
    a = p.parse_args()
    model = str(pull(a.model, quiet=True))
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    try:
        for router in ("prefix", "pow2"):
            started = time.monotonic()
            serve.run(app({
                "model": model, "num_replicas": a.replicas, "threads": a.threads,
                "num_gpus": a.num_gpus, "router": router, "serve_args": a.serve_args,
            }), name="bench", route_prefix="/")
            startup = time.monotonic() - started
            print(f"{router}: {a.replicas} replicas up in {startup:.1f}s", flush=True)
            r = workload(f"http://127.0.0.1:{port}", a.conversations, a.turns, a.max_tokens)
            rows.append((router, startup, asyncio.run(r)))
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{a.replicas} replicas of {a.model}, {a.conversations} conversations x {a.turns} "
          f"turns, {a.max_tokens} tokens a turn")
    print("| router | start-up s | prompt tokens | cached | hit rate | output tok/s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for router, startup, m in rows:
        print(f"| {router} | {startup:.1f} | {m['prompt']} | {m['cached']} | "
              f"{m['hit_rate']:.1%} | {m['output_tok_s']:.1f} | {m['seconds']:.1f} |")


if __name__ == "__main__":
    main()
