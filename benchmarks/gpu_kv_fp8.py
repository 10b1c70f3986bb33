"""The fp8 KV cache (``--kv-cache-dtype fp8``) against bf16 KV on one GPU.

- ``throughput``: Qwen2.5-7B shape, random weights (``gpu_bench.build_engine``), the throughput
  workload of ``gpu_fast_path.py`` (``--num-seqs`` sequences, input and output lengths uniform in
  [100, 1024], ignore EOS, greedy) at the same ``--gpu-memory-utilization``: output tokens/s and
  the KV cache's token capacity, bf16 KV against fp8 KV (scales 1.0).
- ``logits``: trained weights (``--gguf``, the SmolLM2 GGUF that ``gpu_test_model.py`` makes),
  bf16 model: the bf16-KV engine's greedy output for ``gpu_fast_path.PROMPTS``, then every position
  of prompt + output scored (prefill over the paged cache) by the fp8-KV engines, with scales 1.0
  and calibrated (``--calculate-kv-scales``): max / mean |logit difference| against bf16 KV, and
  greedy agreement of their own generations (tokens equal until the first divergence).

``--dry-run`` runs both at toy size on a CPU (a tiny random model for both, Triton's interpreter
for the kernels) to check the script; there the model and its "bf16 KV" are float32, and that
engine's decode steps take the fused C++ step, so its tokens/s says nothing about the GPU. Results: ``--out``/gpu_kv_fp8.json and .md.

    PYTHONPATH=src python benchmarks/gpu_test_model.py /tmp/smollm2-gpu-test.gguf
    PYTHONPATH=src python benchmarks/gpu_kv_fp8.py --out /tmp/out --gguf /tmp/smollm2-gpu-test.gguf
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
if "--dry-run" in sys.argv and not torch.cuda.is_available():
    # the Triton kernels on CPU tensors, as the tests run them (before triton is imported)
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from helpers import use_triton_interpreter

    use_triton_interpreter()
    os.environ["TIANXIA_ATTENTION_BACKEND"] = "triton"

import gpu_bench as gb  # noqa: E402  (engine over HF weights, prompts, sync)

RESULTS: dict = {}
KV_TYPES = {"bf16 KV": dict(kv_cache_dtype="auto"),
            "fp8 KV, scales 1.0": dict(kv_cache_dtype="fp8", calculate_kv_scales=False),
            "fp8 KV calibrated (default)": dict(kv_cache_dtype="fp8")}


def _model_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.device == "cuda" else torch.float32


def _engine(hf, args, kv: dict, max_num_seqs: int):
    dtype = _model_dtype(args)
    engine, _ = gb.build_engine(
        hf, args.device, str(dtype).removeprefix("torch."), max_num_seqs=max_num_seqs, max_model_len=2048,
        max_num_batched_tokens=8192, gpu_util=args.gpu_util if args.device == "cuda" else None,
        kv_memory=None if args.device == "cuda" else 1 << 24, **kv)
    return engine


def section_throughput(args):
    shape = "tiny" if args.dry_run else "qwen2.5-7b"
    rng = random.Random(3)
    lo, hi = (8, 24) if args.dry_run else (100, 1024)
    lens = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(args.num_seqs)]
    vocab = gb.SHAPES[shape]["vocab_size"]
    prompts = [[rng.randrange(1, vocab) for _ in range(i)] for i, _ in lens]
    outs = [o for _, o in lens]
    hf = gb.build_hf(shape, args.device, _model_dtype(args))
    res = {}
    for name in ("bf16 KV", "fp8 KV calibrated (default)"):
        engine = _engine(hf, args, KV_TYPES[name], args.num_seqs)
        r = {"kv_cache_tokens": engine.runner.num_blocks * engine.runner.block_size,
             "kv_bytes_per_token": engine.stats()["kv_cache_bytes_per_token"]}
        gb.engine_generate(engine, prompts, [4] * len(prompts))  # compiles and autotunes every prompt shape
        gb.sync()
        t0 = time.perf_counter()
        gb.engine_generate(engine, prompts, outs)
        gb.sync()
        r["seconds"] = time.perf_counter() - t0
        r["tokens_per_s"] = sum(outs) / r["seconds"]
        gb.log(f"throughput {name}: {r['tokens_per_s']:.0f} tok/s, KV cache {r['kv_cache_tokens']} tokens")
        res[name] = r
        del engine
        gb.free_memory()
    res["shape"], res["num_seqs"], res["output_tokens"] = shape, args.num_seqs, sum(outs)
    RESULTS["throughput"] = res


def _logit_engines(args):
    """name -> engine over the same weights, and the prompts as token ids."""
    if args.dry_run:
        hf = gb.build_hf("tiny", args.device, _model_dtype(args))
        rng = random.Random(5)
        prompts = [[rng.randrange(1, 512) for _ in range(rng.randint(4, 12))] for _ in range(4)]
        return {name: _engine(hf, args, kv, 16) for name, kv in KV_TYPES.items()}, prompts
    from gpu_fast_path import PROMPTS

    from tianxia import LLM

    engines = {name: LLM(args.gguf, device=args.device, dtype="bfloat16", max_model_len=512, max_num_seqs=16,
                         seed=0, kv_cache_memory="1GiB", **kv).engine for name, kv in KV_TYPES.items()}
    tok = engines["bf16 KV"].tokenizer
    return engines, [tok.encode(p) for p in PROMPTS]


def section_logits(args):
    engines, prompts = _logit_engines(args)
    n = args.tokens
    ref_engine = engines.pop("bf16 KV")
    ref_out = gb.engine_generate(ref_engine, prompts, [n] * len(prompts))
    seqs = [p + o for p, o in zip(prompts, ref_out)]
    ref_logits = [ref_engine.score(s) for s in seqs]
    res = {"prompts": len(prompts), "tokens": n}
    for name, engine in engines.items():
        diffs = [(engine.score(s) - r).abs() for s, r in zip(seqs, ref_logits)]
        got = gb.engine_generate(engine, prompts, [n] * len(prompts))
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n) for x, y in zip(ref_out, got)]
        scales = engine.runner.kv_scales
        res[name] = {
            "max_abs_logit_diff": max(float(d.max()) for d in diffs),
            "mean_abs_logit_diff": sum(float(d.mean()) for d in diffs) / len(diffs),
            "greedy_equal_seqs": sum(s == n for s in same), "greedy_equal_tokens": sum(same),
            "k_scale_range": [float(scales[:, 0].min()), float(scales[:, 0].max())],
            "v_scale_range": [float(scales[:, 1].min()), float(scales[:, 1].max())],
        }
        gb.log(f"logits {name}: {res[name]}")
    RESULTS["logits"] = res


def report() -> str:
    lines = []
    tp = RESULTS.get("throughput")
    if tp:
        lines += [f"Throughput: {tp['shape']} shape, {tp['num_seqs']} sequences, {tp['output_tokens']} output tokens",
                  "", "| KV cache | bytes/token | KV capacity (tokens) | output tok/s |", "|---|---|---|---|"]
        for name in ("bf16 KV", "fp8 KV calibrated (default)"):
            r = tp[name]
            lines.append(f"| {name} | {r['kv_bytes_per_token']} | {r['kv_cache_tokens']} | {r['tokens_per_s']:.0f} |")
        lines.append("")
    lg = RESULTS.get("logits")
    if lg:
        lines += [f"Logits against bf16 KV: {lg['prompts']} prompts, {lg['tokens']} greedy tokens each", "",
                  "| KV cache | max abs logit diff | mean abs logit diff | greedy: equal sequences | "
                  "equal tokens before divergence | K scales | V scales |", "|---|---|---|---|---|---|---|"]
        for name in ("fp8 KV, scales 1.0", "fp8 KV calibrated (default)"):
            r = lg[name]
            lines.append(
                f"| {name} | {r['max_abs_logit_diff']:.4f} | {r['mean_abs_logit_diff']:.4f} | "
                f"{r['greedy_equal_seqs']}/{lg['prompts']} | "
                f"{r['greedy_equal_tokens']}/{lg['prompts'] * lg['tokens']} | "
                f"{r['k_scale_range'][0]:.3g}..{r['k_scale_range'][1]:.3g} | "
                f"{r['v_scale_range'][0]:.3g}..{r['v_scale_range'][1]:.3g} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sections", nargs="+", default=["throughput", "logits"])
    ap.add_argument("--gguf", default=str(Path(tempfile.gettempdir()) / "smollm2-gpu-test.gguf"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt in the logits section")
    ap.add_argument("--gpu-util", type=float, default=0.85)
    ap.add_argument("--dry-run", action="store_true", help="toy sizes, to check the script on a CPU")
    args = ap.parse_args()
    if args.dry_run:
        args.num_seqs, args.tokens = 6, 4
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_grad_enabled(False)
    failed = []
    for sec in args.sections:
        t0 = time.perf_counter()
        try:
            globals()[f"section_{sec}"](args)
        except Exception:
            traceback.print_exc()
            failed.append(sec)
            RESULTS[f"{sec}_error"] = traceback.format_exc()[-2000:]
        gb.log(f"section {sec}: {time.perf_counter() - t0:.1f}s")
        gb.free_memory()
        (out / "gpu_kv_fp8.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    table = report()
    (out / "gpu_kv_fp8.md").write_text(table + "\n")
    print("\n" + table)
    if failed:
        print(f"\nFAILED sections: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
