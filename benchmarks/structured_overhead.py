"""Output tokens/s with and without a JSON-schema constraint, at batch 1 and batch 16 (offline LLM).

Both variants run in this process on the same prompts, interleaved run by run, with a fixed
number of output tokens: the free runs ignore EOS, and the schema (an array of at least 1,000
integers) cannot end before ``max_tokens`` either. Each figure is the median of ``--runs`` runs;
the overhead is 1 - constrained / free.

    python benchmarks/structured_overhead.py [--model smollm2-135m] [--threads 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "values": {"type": "array", "items": {"type": "integer"}, "minItems": 1000},
    },
    "required": ["values"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tianxia import LLM, SamplingParams
    from tianxia.loader.hub import resolve_model

    llm = LLM(
        str(resolve_model(args.model)),
        threads=args.threads,
        kv_cache_memory="256MiB",
        enable_prefix_caching=False,
        seed=0,
    )
    prompts = [f"List {n} numbers as JSON, item {i}:" for i, n in enumerate(range(10, 42, 2))]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA}
    )

    def rate(batch: int, params: SamplingParams) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == batch * args.max_tokens, tokens
        return tokens / elapsed

    rate(1, free), rate(1, constrained)  # warm-up: grammar compilation, first-step allocations
    load = os.getloadavg()
    print(
        f"# {datetime.date.today()}  {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {args.threads} threads, load average {load[0]:.2f} {load[1]:.2f}"
    )
    print(
        f"# {args.model}, {args.max_tokens} output tokens per sequence, median of {args.runs} runs"
    )
    print("| batch | free tok/s | JSON schema tok/s | overhead |")
    print("|---:|---:|---:|---:|")
    for batch in [int(b) for b in args.batches.split(",")]:
        a, b = [], []
        for _ in range(args.runs):
            a.append(rate(batch, free))
            b.append(rate(batch, constrained))
        fa, fb = statistics.median(a), statistics.median(b)
        print(f"| {batch} | {fa:.1f} | {fb:.1f} | {100 * (1 - fb / fa):.1f}% |", flush=True)


if __name__ == "__main__":
    main()
