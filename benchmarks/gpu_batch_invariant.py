"""The batch-invariant GPU mode (``--batch-invariant``) against the default kernels, on one GPU.

    PYTHONPATH=src python3 benchmarks/gpu_batch_invariant.py --out DIR

Random weights of the Qwen2.5-0.5B shape in bf16, built with ``transformers`` as
``gpu_bench.py`` builds them (no files, no tokenizer). For each mode, the default (cuBLAS, the
split-K decode kernel, CUDA graphs) and the batch-invariant one (a persistent Triton matmul of
fixed tiles, per-row RMSNorm, every query through the paged prefill kernel; eager):

- speed: batch 1 (one 128-token prompt, 256 new tokens) and batch 256 (256 prompts of 128
  tokens, 128 new tokens each): output tokens/s, the median decode step, and the prompt phase
  (tokens/s over the steps until every prompt is computed);
- invariance: a 100-token probe prompt's 32 greedy tokens and their logprobs, computed alone, in
  a batch with 63 other prompts (16-400 tokens), alone in chunks of 64 tokens, and again in chunks
  after its prefix is in the cache; for each, whether tokens and logprobs equal the first run's
  bit for bit, else the first position that differs and the largest logprob difference.

Needs only torch, triton, numpy and transformers. Writes ``DIR/gpu_batch_invariant.json`` and
``DIR/gpu_batch_invariant.md`` (also printed). ``--shape tiny --device cpu`` dry-runs the script
(the mode is a no-op on CPU, whose kernels are batch-invariant anyway).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import gpu_bench  # noqa: E402  (the model builder and the engine without a loader)


def generate(engine, prompts: list[list[int]], max_tokens: int, logprobs: bool = False):
    """Greedy outputs (tokens, chosen-token logprobs) of every prompt, in order, and the wall time
    of each engine step."""
    from tianxia.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            logprobs=1 if logprobs else None)
    ids = []
    for p in prompts:
        ids.append(f"r{len(ids)}-{time.monotonic_ns()}")
        engine.add_request(ids[-1], {"prompt_token_ids": p}, params)
    outs, steps = {}, []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                lps = [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)] if logprobs else []
                outs[o.request_id] = (list(c.token_ids), lps)
        gpu_bench.sync()
        steps.append(time.perf_counter() - t0)
    return [outs[i] for i in ids], steps


def speed(engine, vocab: int, batch: int, prompt_len: int, new_tokens: int, budget: int) -> dict:
    rng = random.Random(batch)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    generate(engine, prompts[:2], 4)  # warm-up: compiles and autotunes at these shapes
    generate(engine, prompts, 2)
    t0 = time.perf_counter()
    _, steps = generate(engine, prompts, new_tokens)
    total = time.perf_counter() - t0
    # the steps that computed the prompts (``budget`` tokens a step)
    prompt_steps = max(1, -(-batch * prompt_len // budget))
    decode = steps[prompt_steps:]
    return {
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "output_tokens_per_s": batch * new_tokens / total,
        "decode_step_ms_median": 1e3 * statistics.median(decode) if decode else None,
        "prompt_tokens_per_s": batch * prompt_len / sum(steps[:prompt_steps]),
    }


def compare(ref, got) -> dict:
    (rt, rl), (gt, gl) = ref, got
    if rt == gt and rl == gl:
        return {"identical": True}
    first = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), None)
    same = first if first is not None else len(rt)
    diff = max((abs(a - b) for a, b in zip(rl[:same], gl[:same])), default=0.0)
    return {"identical": False, "same_tokens": rt == gt, "first_token_difference": first,
            "max_logprob_difference_before_it": diff}


def invariance(make_engine, vocab: int) -> dict:
    rng = random.Random(7)
    probe = [rng.randrange(1, vocab) for _ in range(100)]
    others = [[rng.randrange(1, vocab) for _ in range(rng.randrange(16, 400))] for _ in range(63)]
    engine = make_engine(prefix_caching=False, budget=8192)
    (alone,), _ = generate(engine, [probe], 32, logprobs=True)
    batch, _ = generate(engine, others[:31] + [probe] + others[31:], 32, logprobs=True)
    result = {"in_a_batch_of_64": compare(alone, batch[31])}
    del engine
    gpu_bench.free_memory()
    engine = make_engine(prefix_caching=True, budget=64)
    (chunked,), _ = generate(engine, [probe], 32, logprobs=True)
    (cached,), _ = generate(engine, [probe], 32, logprobs=True)
    result["chunks_of_64"] = compare(alone, chunked)
    result["chunks_after_prefix_cache_hit"] = compare(alone, cached)
    result["prefix_hit_tokens"] = engine.block_manager.prefix_hits
    del engine
    gpu_bench.free_memory()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=list(gpu_bench.SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu-util", type=float, default=0.3)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = gpu_bench.build_hf(args.shape, args.device, dtype)
    vocab = hf.config.vocab_size
    results = {"shape": args.shape, "device": torch.cuda.get_device_name() if cuda else "cpu",
               "torch": torch.__version__, "modes": {}}
    for mode in ("default", "batch_invariant"):

        def make_engine(prefix_caching: bool, budget: int, mode=mode):
            engine, _ = gpu_bench.build_engine(
                hf, args.device, "bfloat16" if cuda else "float32", max_num_seqs=256, max_model_len=2048,
                max_num_batched_tokens=budget, gpu_util=args.gpu_util if cuda else None,
                kv_memory=None if cuda else 256 << 20, batch_invariant=mode == "batch_invariant",
                enable_prefix_caching=prefix_caching,
            )
            return engine

        r = {}
        engine = make_engine(prefix_caching=False, budget=8192)
        r["batch_1"] = speed(engine, vocab, 1, 128, 256 if cuda else 16, 8192)
        r["batch_256"] = speed(engine, vocab, 256 if cuda else 8, 128, 128 if cuda else 8, 8192)
        del engine
        gpu_bench.free_memory()
        r["invariance"] = invariance(make_engine, vocab)
        results["modes"][mode] = r
        print(json.dumps({mode: r}), flush=True)
    (out / "gpu_batch_invariant.json").write_text(json.dumps(results, indent=1))
    md = report(results)
    (out / "gpu_batch_invariant.md").write_text(md)
    print(md)
    return 0


def report(results: dict) -> str:
    d, b = results["modes"]["default"], results["modes"]["batch_invariant"]
    lines = [f"{results['shape']} (random weights, bf16) on {results['device']}, torch {results['torch']}", "",
             "| | default | batch-invariant | invariant / default |", "|---|---|---|---|"]
    for key in ("batch_1", "batch_256"):
        for metric, label in (("output_tokens_per_s", "output tokens/s"), ("decode_step_ms_median", "decode step, ms"),
                              ("prompt_tokens_per_s", "prompt tokens/s")):
            x, y = d[key][metric], b[key][metric]
            ratio = f"{y / x:.2f}x" if x and y else ""
            lines.append(f"| {key.replace('_', ' ')}: {label} | {x:.1f} | {y:.1f} | {ratio} |")
    lines += ["", "The probe's 32 greedy tokens and logprobs against its first run alone:", "",
              "| | default | batch-invariant |", "|---|---|---|"]
    for case in ("in_a_batch_of_64", "chunks_of_64", "chunks_after_prefix_cache_hit"):
        cells = []
        for r in (d, b):
            c = r["invariance"][case]
            cells.append("identical" if c["identical"] else
                         f"differs: tokens {'same' if c['same_tokens'] else 'from ' + str(c['first_token_difference'])}, "
                         f"logprobs up to {c['max_logprob_difference_before_it']:.2e}")
        lines.append(f"| {case.replace('_', ' ')} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
