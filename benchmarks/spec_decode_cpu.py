"""Speculative decoding on CPU against the same engine without it, side by side in one process.

    PYTHONPATH=$PWD/src python benchmarks/spec_decode_cpu.py --threads 2 --rounds 2

The workload (``--workload edit``) is editing: each prompt (chat template) holds a 40-70 line Python function and asks
for it back with one change (``benchmarks/data/spec_edit_prompts.json``), the case prompt lookup
is for; ``--workload free`` asks for new code instead, where proposals are rare and mostly
refused (the case speculation must not slow down). Greedy, so both engines must produce the same
tokens (checked).

- batch 1: each prompt alone; generation tokens/s = (tokens - 1) / (time after the first token),
  as ``tianxia run`` reports it, summed over the prompts;
- ``--streams`` concurrent requests (the prompts repeated): output tokens / wall time of the
  whole batch, with speculation as configured (``disable_by_batch_size`` default) and, with
  ``--forced``, with speculation at every batch size.

Medians over ``--rounds`` alternating rounds (plain, speculative, plain, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tianxia import LLM, SamplingParams

HERE = Path(__file__).parent
QWEN = "~/.cache/tianxia/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct.gguf"


# new code, little to copy from the prompt: proposals are rare and mostly refused
FREE = [
    "Write a Python class for a least-recently-used cache with get, put and a capacity, with docstrings.",
    "Write a Python function that parses an INI file into a dict of dicts, handling comments.",
    "Write a Python command line tool with argparse that counts words, lines and characters of files.",
    "Write a Python function that merges overlapping intervals, and unit tests for it with pytest.",
]


def prompts(llm: LLM, workload: str) -> list[list[int]]:
    if workload == "free":
        return [llm.apply_chat_template([{"role": "user", "content": text}]) for text in FREE]
    items = json.loads((HERE / "data" / "spec_edit_prompts.json").read_text())
    return [llm.apply_chat_template([{"role": "user", "content":
            f"```python\n{it['function']}\n```\n\n{it['change']} Reply with the whole function, changed, "
            "in one code block, and nothing else."}]) for it in items]


def batch1(llm: LLM, ids: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Generation tokens/s after each request's first token, over all prompts one at a time."""
    engine = llm.engine
    tokens, seconds, outs = 0, 0.0, []
    for i, p in enumerate(ids):
        rid = f"b1-{time.monotonic_ns()}-{i}"
        engine.add_request(rid, {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=max_tokens))
        seq = engine.requests[rid][0]
        t_first = None
        while engine.has_unfinished_requests():
            engine.step()
            if t_first is None and seq.num_output_tokens:
                t_first = time.perf_counter()
        seconds += time.perf_counter() - t_first
        tokens += seq.num_output_tokens - 1
        outs.append(seq.output_token_ids)
    return tokens / seconds, outs


def streams(llm: LLM, ids: list[list[int]], n: int, max_tokens: int) -> float:
    prompts_n = [{"prompt_token_ids": ids[i % len(ids)]} for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts_n, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=QWEN)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=96)
    ap.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 7, '
                                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    ap.add_argument("--forced", action="store_true", help="also speculate at every batch size")
    ap.add_argument("--workload", choices=["edit", "free"], default="edit",
                    help="edit: functions asked back with one change; free: new code")
    args = ap.parse_args()
    model = str(Path(args.model).expanduser())
    spec = json.loads(args.spec)
    common = dict(kv_cache_memory="1GiB", max_model_len=2048, threads=args.threads, seed=0)
    engines = {"plain": LLM(model, **common), "spec": LLM(model, speculative_config=spec, **common)}
    if args.forced:
        engines["spec, every batch size"] = LLM(model, speculative_config={**spec, "disable_by_batch_size": None},
                                                **common)
    ids = prompts(engines["plain"], args.workload)
    print(f"{len(ids)} prompts of {[len(p) for p in ids]} tokens; speculative config {spec}", flush=True)
    b1: dict[str, list[float]] = {k: [] for k in engines}
    many: dict[str, list[float]] = {k: [] for k in engines}
    outputs = {}
    for r in range(args.rounds):
        for name, llm in engines.items():
            before = llm.engine.speculator.stats() if llm.engine.speculator else None
            tps, outs = batch1(llm, ids, args.max_tokens)
            b1[name].append(tps)
            outputs.setdefault(name, outs)
            line = f"round {r + 1} {name:>24}: batch 1 {tps:6.2f} tok/s"
            if before is not None:
                after = llm.engine.speculator.stats()
                drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
                acc = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                steps = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
                line += (f" (acceptance {acc / max(drafted, 1):.3f}: {acc}/{drafted} proposed tokens, "
                         f"{(acc + steps) / max(steps, 1):.2f} tokens per verification)")
            many[name].append(streams(llm, ids, args.streams, args.stream_tokens))
            line += f"; {args.streams} streams {many[name][-1]:6.2f} tok/s"
            print(line, flush=True)
    same = all(outputs[k] == outputs["plain"] for k in outputs)
    print(f"\ngreedy outputs identical to plain: {same}")
    print(f"| engine | batch 1, generation tok/s | vs plain | {args.streams} streams, output tok/s | vs plain |")
    print("|---|---|---|---|---|")
    for name in engines:
        m1, mm = statistics.median(b1[name]), statistics.median(many[name])
        print(f"| {name} | {m1:.2f} | {m1 / statistics.median(b1['plain']):.2f}x | {mm:.2f} | "
              f"{mm / statistics.median(many['plain']):.2f}x |")


if __name__ == "__main__":
    main()
