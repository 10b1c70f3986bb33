"""Speculative decoding on the GPU: what it costs when every proposal is rejected, and its ceiling.

Random weights of the Qwen2.5-7B shape as the target; proposers: n-gram (prompt lookup), a draft of
the Qwen2.5-0.5B shape (random weights of its own, so its proposals are almost never accepted),
and the target itself as its own draft (every proposal accepted: the upper bound of a draft
model; it runs with both switch-offs off). Each at batch 1 and 64, with the default automatic
switch-offs (no speculation above 8 running sequences; the time budget that stops proposals which
cost more than they gain) and, at 64, without the batch-size one. Greedy decoding, output tokens/s
after the first token, the same engine without speculation in the same run. A proposer that is
always rejected should cost at most 5% with the switch-offs.

    python3 benchmarks/gpu_spec_decode.py --out $OUT
    python3 benchmarks/gpu_spec_decode.py --dry-run      # toy shapes on a CPU, to check the script
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # noqa: E402


def decode_rate(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, dict]:
    """Output tokens/s from the step after every prompt is done to the end, and the step's
    speculation counters."""
    from tianxia.sampling_params import SamplingParams

    before = dict(engine.stats())
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False))
    seqs = [s for group in engine.requests.values() for s in group]
    t0 = None
    start_tokens = 0
    while engine.has_unfinished_requests():
        engine.step()
        if t0 is None and all(s.num_output_tokens for s in seqs):
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            t0, start_tokens = time.perf_counter(), sum(s.num_output_tokens for s in seqs)
    dt = time.perf_counter() - t0
    after = engine.stats()
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in
                ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}
    return (len(seqs) * max_tokens - start_tokens) / dt, counters


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="spec_decode")
    ap.add_argument("--target", default="qwen2.5-7b")
    ap.add_argument("--draft", default="qwen2.5-0.5b")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.dry_run:
        args.target = args.draft = "tiny"
        args.max_tokens, args.prompt_len = 16, 16
    vocab = gb.SHAPES[args.target]["vocab_size"]
    target = gb.build_hf(args.target, device, dtype)
    # the 0.5B shape's vocabulary padded to the 7B's (152,064 vs 151,936): a draft must share it
    draft = gb.build_hf(args.draft, device, dtype, vocab_size=vocab)
    torch.manual_seed(1)
    for p in draft.parameters():  # weights of its own, not the target's seed
        p.data.normal_(0, 0.02)
    drafts = {"draft": draft, "self": target}
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(max(args.batches))]
    k = args.k
    cases = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        "draft 0.5B shape": {"model": "draft", "num_speculative_tokens": k},
        "draft = target": {"model": "self", "num_speculative_tokens": k},
    }
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "k": k, "cases": {}}
    for name, spec in cases.items():
        for no_switch_off in ((False, True) if spec and name != "draft = target" else (False,)):
            label = name + (", no switch-off" if no_switch_off else "")
            cfg = None if spec is None else {**spec, **({"disable_by_batch_size": None} if no_switch_off else {})}
            if name == "draft = target":
                # the upper bound: with the switch-off and the time budget on, a draft that costs
                # what the target costs stops after its first verification
                label += ", no switch-off, no time budget"
                cfg.update(disable_by_batch_size=None, min_acceptance_rate=0.0)
            engine, startup = gb.build_engine(
                target, device, str(dtype).removeprefix("torch."), max_num_seqs=max(args.batches),
                max_model_len=args.prompt_len + args.max_tokens + 16, max_num_batched_tokens=8192,
                gpu_util=None, kv_memory=(8 << 30) if device == "cuda" else (64 << 20),
                speculative=cfg, drafts=drafts)
            row = {}
            for b in args.batches:
                if no_switch_off and b == 1:
                    continue  # the switch-off only acts above 8 sequences
                decode_rate(engine, prompts[:b], 8)  # warm-up of this batch size
                rate, counters = decode_rate(engine, prompts[:b], args.max_tokens)
                drafted = counters["spec_decode_num_draft_tokens"]
                row[b] = {"tok_s": rate, **counters,
                          "acceptance": counters["spec_decode_num_accepted_tokens"] / drafted if drafted else None}
                print(f"{label}, batch {b}: {rate:.1f} tok/s {counters}", flush=True)
            results["cases"][label] = row
            del engine
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    plain = results["cases"]["plain"]
    lines = [f"GPU {results['device']}, k = {k}, prompt {args.prompt_len} tokens, {args.max_tokens} output tokens",
             "", "| proposer | batch | output tok/s | vs plain | acceptance |", "|---|---|---|---|---|"]
    for label, row in results["cases"].items():
        for b, r in row.items():
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
            lines.append(f"| {label} | {b} | {r['tok_s']:.1f} | {r['tok_s'] / plain[b]['tok_s']:.3f} | {acc} |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(results, indent=1))
    (out / f"{args.tag}.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
