"""The server's host work per token: a tiny random model, served and offline, same workload.

With a model this small (2 layers, hidden 64) the forward pass costs almost nothing, so output
tokens/s measures what the engine loop, the HTTP layer and the streaming cost per token. The
script runs, each in its own process:

- offline: ``LLM.generate`` of N prompts of 128 random token ids, 64 tokens each (``ignore_eos``);
- served: ``tianxia serve`` on the same model, the same N requests sent at once to
  ``/v1/completions`` (prompts as token ids), without and with streaming;

then a burst of N requests with text prompts of 128 words asking one token each (the API
process's cost of admitting a request: parsing, encoding the prompt, handing it over);

and reports tokens/s of each, with the server's step-size histogram from ``/metrics`` (many tiny
steps mean that requests reached the engine one by one), and, for the streamed run, the CPU time
the API process and the engine core spent per output token and the SSE chunks per token (a
stream that falls behind sends one chunk for several tokens). On a machine with few cores the load
generator competes with the server for them, which the figures include.

    python benchmarks/server_overhead.py --device cpu --requests 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

OFFLINE = """
import json, random, sys, time
from tianxia import LLM, SamplingParams
model, device, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model, device=device, max_num_seqs=256, max_num_batched_tokens=8192)
r = random.Random(0)
prompts = [{"prompt_token_ids": [r.randrange(1, 500) for _ in range(128)]} for _ in range(n)]
sp = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
llm.generate(prompts[:8], sp, use_tqdm=False)
t = time.perf_counter()
outs = llm.generate(prompts, sp, use_tqdm=False)
dt = time.perf_counter() - t
print(json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": dt}))
"""


async def load(port: int, n: int, stream: bool) -> dict:
    r = random.Random(0)
    prompts = [[r.randrange(1, 500) for _ in range(128)] for _ in range(n)]
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def one(c: httpx.AsyncClient, ids: list[int]) -> int:
        body = {"model": "m", "prompt": ids, "max_tokens": 64, "ignore_eos": True,
                "temperature": 0, "stream": stream}
        if not stream:
            resp = await c.post(url, json=body)
            return resp.json()["usage"]["completion_tokens"]
        chunks = 0
        async with c.stream("POST", url, json=body) as resp:
            async for line in resp.aiter_lines():
                chunks += line.startswith("data: {")
        return chunks

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as c:
        t = time.perf_counter()
        counts = await asyncio.gather(*[one(c, p) for p in prompts])
        dt = time.perf_counter() - t
    return {"tokens": 64 * n, "chunks_or_tokens": sum(counts), "seconds": dt}


async def admit(port: int, n: int) -> float:
    """Seconds for ``n`` requests with text prompts of 128 random words, all sent at once, each
    asking one token: what the API process spends admitting a burst (parse, encode, hand over)."""
    from gpu_build_startup import word

    r = random.Random(1)
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as c:
        t = time.perf_counter()
        replies = await asyncio.gather(*[c.post(url, json={
            "model": "m", "prompt": " ".join(word(r.randrange(100)) for _ in range(128)),
            "max_tokens": 1, "temperature": 0}) for _ in range(n)])
        seconds = time.perf_counter() - t
    failed = [resp for resp in replies if resp.status_code != 200]
    if failed:
        raise SystemExit(f"{len(failed)} of {n} requests failed: {failed[0].status_code} {failed[0].text}")
    return seconds


def step_histogram(port: int) -> dict[str, float]:
    """Cumulative counts of steps by tokens scheduled (``vllm:iteration_tokens_total``)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {sample.labels["le"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "vllm:iteration_tokens_total_bucket"}


def cpu_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU microseconds per output token of the API process and of the engine core process(es)
    between two :func:`process_cpu_seconds` snapshots."""
    out: dict[str, float] = {}
    for key, t in after.items():
        if key not in before:
            continue
        kind = ("api_process" if "tianxia.cli serve" in key
                else "engine_core" if "multiprocessing" in key else None)
        if kind is not None:
            out[kind] = out.get(kind, 0.0) + 1e6 * (t - before[key]) / tokens
    return out


def main() -> int:
    from gpu_build_startup import make_model_dir
    from gpu_serving import process_cpu_seconds
    from serving_vs_llamacpp import free_port, server

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--stream-rounds", type=int, default=3,
                    help="streamed runs; the one with the median API-process CPU per token is reported")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--http-stack", choices=["c", "python"], default="c",
                    help="python: serve as an install without uvloop and httptools would (uvicorn "
                         "then takes asyncio's event loop and h11)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tx-overhead-"))
    model = str(make_model_dir(root, "tiny"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                      os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", OFFLINE, model, args.device, str(args.requests)],
                       capture_output=True, text=True, env=env, check=True)
    res = {"offline": json.loads(r.stdout.strip().splitlines()[-1])}
    port = free_port()
    cmd = [sys.executable, "-m", "tianxia.cli", "serve", model, "--device", args.device, "--port", str(port),
           "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--served-model-name", "m",
           "--disable-log-stats", "--disable-access-log"]
    if args.http_stack == "python":
        hide = root / "hide"
        hide.mkdir()
        for name in ("uvloop", "httptools"):
            (hide / f"{name}.py").write_text("raise ImportError('not installed')\n")
        cmd = ["env", f"PYTHONPATH={hide}{os.pathsep}{env['PYTHONPATH']}", *cmd]
    res["http_stack"] = args.http_stack
    with server(cmd, port, root / "server.log"):
        asyncio.run(load(port, 8, stream=False))  # warm-up, before the step counts are taken
        before = step_histogram(port)
        res["served"] = asyncio.run(load(port, args.requests, stream=False))
        res["served_steps_by_tokens"] = {k: v - before.get(k, 0.0) for k, v in step_histogram(port).items()}
        rounds = []
        for _ in range(args.stream_rounds):
            before_cpu = process_cpu_seconds()
            r = asyncio.run(load(port, args.requests, stream=True))
            r["cpu_us_per_token"] = cpu_per_token(before_cpu, process_cpu_seconds(), r["tokens"])
            rounds.append(r)
        # the round with the median API-process CPU per token
        rounds.sort(key=lambda r: r["cpu_us_per_token"].get("api_process", 0.0))
        res["served_stream"] = dict(rounds[len(rounds) // 2], rounds=rounds)
        before_cpu = process_cpu_seconds()
        seconds = asyncio.run(admit(port, args.requests))
        per = cpu_per_token(before_cpu, process_cpu_seconds(), args.requests)
        res["admit"] = {"seconds": seconds, "cpu_us_per_request": per}
    for k in ("offline", "served", "served_stream"):
        v = res[k]
        print(f"{k:>14}: {v['tokens'] / v['seconds']:8.0f} output tokens/s ({v['seconds']:.2f} s)")
    v = res["served_stream"]
    print(f"streaming (median of {len(v['rounds'])} rounds): {v['chunks_or_tokens'] / v['tokens']:.2f} chunks per token; "
          "CPU per output token: "
          + ", ".join(f"{k} {us:.1f} us" for k, us in v["cpu_us_per_token"].items()))
    v = res["admit"]
    print(f"a burst of {args.requests} text prompts (one token each): {v['seconds']:.2f} s; CPU per "
          "request: " + ", ".join(f"{k} {us:.0f} us" for k, us in v["cpu_us_per_request"].items()))
    hist = res["served_steps_by_tokens"]
    total = hist.get("+Inf", 0.0)
    print(f"served (no streaming): {total:.0f} steps, {hist.get('8.0', 0.0):.0f} of them with 8 tokens or fewer")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
