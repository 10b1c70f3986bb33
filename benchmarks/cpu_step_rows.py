"""What a CPU decode step costs by its number of one-token rows, and what its attention costs.

    PYTHONPATH=src python benchmarks/cpu_step_rows.py --rows 1,4,8,9,16
    PYTHONPATH=src python benchmarks/cpu_step_rows.py --attention

Rows: for each count M, M requests with random ``--prompt-len``-token prompts decode together
(greedy, ``ignore_eos``); the median of the last 16 steps, i.e. decode steps of M rows through the
fused C++ step. A speculative verification of k proposals is a step of k + 1 such rows, so this is
the cost that decides what speculation gains (``spec_decode_cpu.py``), and M = 16 is the batched
decode of ``serving_vs_llamacpp.py`` at concurrency 16.

Attention (``--attention``): ``paged_decode`` alone, one call per layer on per-layer caches with
scattered blocks (so the keys and values come from memory as in a step): the rows of one
sequence's verification (Qwen2.5-0.5B's heads), one decode, and 16 decodes of different sequences
(SmolLM2-135M's heads), medians of 7.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import torch

QWEN = "~/.cache/tianxia/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct.gguf"


def step_rows(model: str, rows: list[int], prompt_len: int, threads: int) -> None:
    from tianxia import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory="1GiB", max_model_len=2048, threads=threads, seed=0,
              enable_prefix_caching=False, max_num_seqs=max(rows))
    engine, rng = llm.engine, random.Random(0)
    for m in rows:
        for i in range(m):
            engine.add_request(f"r{m}-{i}", {"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(prompt_len)]},
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        ms = statistics.median(times[-16:]) * 1e3
        print(f"| {m} | {ms:.2f} | {ms / m:.2f} |", flush=True)


def attention(threads: int) -> None:
    from tianxia.quant import cpu_kernels

    torch.set_num_threads(threads)
    ext = cpu_kernels.extension()
    gen = torch.Generator().manual_seed(0)

    def case(name: str, rows: int, hq: int, hk: int, ctx: int, one_sequence: bool, layers: int,
             dtype: torch.dtype = torch.float32) -> None:
        bs, d = 16, 64
        per_seq = -(-ctx // bs)
        seqs = 1 if one_sequence else rows
        blocks = per_seq * seqs + 1
        kc = [torch.randn(blocks, bs, hk, d, generator=gen).to(dtype) for _ in range(layers)]
        vc = [torch.randn(blocks, bs, hk, d, generator=gen).to(dtype) for _ in range(layers)]
        tables = torch.randperm(blocks - 1, generator=gen)[:per_seq * seqs].reshape(seqs, per_seq)
        q = torch.randn(rows, hq, d, generator=gen)
        if one_sequence:  # consecutive positions, as a verification's rows
            lens, seq_of = torch.arange(ctx - rows + 1, ctx + 1), torch.zeros(rows, dtype=torch.long)
        else:
            lens, seq_of = torch.full((rows,), ctx), torch.empty(0, dtype=torch.long)

        def run() -> float:
            t = time.perf_counter()
            for i in range(layers):
                ext.paged_decode(q, kc[i], vc[i], tables, lens, 1 / math.sqrt(d), 0, 0.0, seq_of)
            return (time.perf_counter() - t) * 1e3

        run()
        print(f"| {name} | {statistics.median(run() for _ in range(7)):.2f} |", flush=True)

    print("| case | ms per step |\n|---|---|")
    case("Qwen2.5-0.5B heads (14/2), 8 rows of one sequence, context 1000, 24 layers", 8, 14, 2, 1000, True, 24)
    case("Qwen2.5-0.5B heads, 1 decode, context 1000, 24 layers", 1, 14, 2, 1000, True, 24)
    case("SmolLM2 heads (9/3), 16 decodes, context 200, 30 layers", 16, 9, 3, 200, False, 30)
    case("SmolLM2 heads, 16 decodes, context 800, 30 layers", 16, 9, 3, 800, False, 30)
    case("SmolLM2 heads, 16 decodes, context 800, float16 cache", 16, 9, 3, 800, False, 30, torch.float16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=QWEN)
    ap.add_argument("--rows", default="1,4,8,9,16")
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention", action="store_true", help="time paged_decode alone instead")
    args = ap.parse_args()
    if args.attention:
        attention(args.threads)
        return
    print("| rows | decode step, ms | per row, ms |\n|---|---|---|")
    step_rows(str(Path(args.model).expanduser()), [int(r) for r in args.rows.split(",")], args.prompt_len,
              args.threads)


if __name__ == "__main__":
    main()
