"""Tensor parallelism on two GPUs: TP=2 against TP=1 on the same random weights, in one run.

For each shape (``--shapes``, default the Qwen2.5-0.5B and 7B shapes of ``gpu_bench.py``): random
weights are built on the GPU with ``transformers`` and saved as a safetensors directory (each
TP=2 rank reads only its half of it), then the engine runs at TP=1 and at TP=2:

- ``check``: 8 prompts, 32 greedy tokens, top-5 logprobs. TP=2 must give TP=1's tokens; where
  they part, TP=1's logprob gap between the two tokens must be under ``--tie-gap`` (a near-tie
  that the other summation order of the all-reduce may flip); over the tokens before that, the
  chosen tokens' logprobs must agree within ``--tol``.
- ``decode``: batch 1 and batch 64 (32-token prompts, 64 output tokens, EOS ignored): the median
  time of a decode step (the engine's whole step: CUDA-graph replay, with the NCCL all-reduces
  inside, and the sampler), and output tokens/s.

Prints a table; writes ``gpu_tensor_parallel.json`` under ``--out`` (default ``$OUT``). Exit
status 1 if a check failed.

    PYTHONPATH=src python benchmarks/gpu_tensor_parallel.py --out $OUT

A dry run on a CPU (gloo, a tiny shape, float32):

    PYTHONPATH=src python benchmarks/gpu_tensor_parallel.py --device cpu --shapes tiny --dtype float32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import SHAPES, build_hf  # noqa: E402

RESULTS: dict = {"shapes": {}}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_model(shape: str, device: str, dtype: torch.dtype, out: Path) -> None:
    """Random weights of ``shape`` and a small tokenizer (prompts are token ids), as a Hugging
    Face directory."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    hf = build_hf(shape, device, dtype)
    hf.save_pretrained(str(out))
    del hf
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i + 2 for i in range(62)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  unk_token="<unk>", eos_token="<eos>")
    tok.save_pretrained(str(out))


def make_engine(path: Path, tp: int, args):
    from tianxia.config import CacheConfig, EngineConfig, SchedulerConfig
    from tianxia.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=str(path), dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
        cache=CacheConfig(block_size=16, kv_cache_memory=args.kv_cache_gib << 30),
        scheduler=SchedulerConfig(max_num_seqs=64, max_model_len=1024, max_num_batched_tokens=4096),
        enforce_eager=args.enforce_eager,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    return engine, time.perf_counter() - t0


def close_engine(engine) -> None:
    close = getattr(engine.runner.model, "close", None)  # a tensor-parallel engine stops its workers
    if close is not None:
        close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(engine, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None,
        step_times: list[float] | None = None) -> list:
    """Greedy outputs (token ids, per-token logprob dicts) in prompt order."""
    from tianxia.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            logprobs=logprobs)
    ids = []
    for i, p in enumerate(prompts):
        rid = f"r{i}-{time.monotonic_ns()}"
        engine.add_request(rid, {"prompt_token_ids": p}, params)
        ids.append(rid)
    outs = {}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
        if step_times is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - t0)
    return [outs[r] for r in ids]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def check(one: list, two: list, tol: float, tie_gap: float) -> dict:
    """TP=2's greedy tokens and logprobs against TP=1's (see the module docstring)."""
    worst, ties, failures = 0.0, [], []
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        for j, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            la, lb = a.logprobs[j], b.logprobs[j]
            if ta != tb:
                gap = abs(la[ta].logprob - la[tb].logprob) if tb in la else float("inf")
                (ties if gap < tie_gap else failures).append({"prompt": i, "pos": j, "gap": gap})
                break
            worst = max(worst, abs(la[ta].logprob - lb[tb].logprob))
    if worst > tol:
        failures.append({"max_logprob_diff": worst})
    return {"ok": not failures, "max_logprob_diff": worst, "near_ties": ties, "failures": failures,
            "tokens_equal": sum(a.token_ids == b.token_ids for a, b in zip(one, two))}


def decode_time(engine, batch: int, vocab: int) -> dict:
    """Median decode-step time over a batch of ``batch`` sequences (the prefill step and the
    first decode steps left out)."""
    times: list[float] = []
    run(engine, prompts(batch, 32, vocab, seed=1), 64, step_times=times)
    steady = times[4:]
    step = statistics.median(steady)
    return {"batch": batch, "step_ms": step * 1e3, "tok_s": batch / step, "steps": len(steady)}


def section(shape: str, args) -> None:
    res: dict = {"shape": shape, **SHAPES[shape]}
    RESULTS["shapes"][shape] = res
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    with tempfile.TemporaryDirectory(prefix="tx-tp-") as tmp:
        path = Path(tmp)
        t0 = time.perf_counter()
        save_model(shape, args.device, dtype, path)
        res["save_s"] = time.perf_counter() - t0
        log(f"{shape}: random weights saved in {res['save_s']:.1f}s")
        vocab = SHAPES[shape]["vocab_size"]
        check_prompts = prompts(8, 24, vocab, seed=0)
        outs = {}
        for tp in (1, 2):
            engine, startup = make_engine(path, tp, args)
            gr = engine.runner.graph_runner
            r = res[f"tp{tp}"] = {"startup_s": startup, "route_graphs": gr is not None,
                                  "capture_s": gr.capture_seconds if gr is not None else None}
            log(f"{shape} TP={tp}: engine up in {startup:.1f}s (decode graphs: {r['route_graphs']})")
            try:
                outs[tp] = run(engine, check_prompts, 32, logprobs=5)
                for batch in (1, 64):
                    r[f"b{batch}"] = decode_time(engine, batch, vocab)
                    log(f"{shape} TP={tp} batch {batch}: {r[f'b{batch}']['step_ms']:.2f} ms/step, "
                        f"{r[f'b{batch}']['tok_s']:.0f} tok/s")
                r["route_counts"] = dict(engine.runner.route_counts)
            finally:
                close_engine(engine)
        res["check"] = check(outs[1], outs[2], args.tol, args.tie_gap)
        log(f"{shape}: check {res['check']}")


def report() -> str:
    lines = ["| shape | batch | TP=1 ms/step | TP=2 ms/step | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 |",
             "|---|---|---|---|---|---|---|"]
    for shape, res in RESULTS["shapes"].items():
        for batch in (1, 64):
            a, b = res.get("tp1", {}).get(f"b{batch}"), res.get("tp2", {}).get(f"b{batch}")
            if a and b:
                lines.append(f"| {shape} | {batch} | {a['step_ms']:.2f} | {b['step_ms']:.2f} | {a['tok_s']:.0f} | "
                             f"{b['tok_s']:.0f} | {b['tok_s'] / a['tok_s']:.2f}x |")
    lines.append("")
    for shape, res in RESULTS["shapes"].items():
        c = res.get("check")
        if c:
            lines.append(f"{shape}: TP=2 vs TP=1 {'ok' if c['ok'] else 'FAILED'}: {c['tokens_equal']}/8 prompts "
                         f"token-equal, near-ties {len(c['near_ties'])}, max logprob diff {c['max_logprob_diff']:.2e}")
        if "error" in res:
            lines.append(f"{shape}: error: {res['error']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-7b"], choices=list(SHAPES))
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--tol", type=float, default=None, help="logprob tolerance (default 0.05 bf16/f16, 1e-3 f32)")
    ap.add_argument("--tie-gap", type=float, default=None, help="near-tie gap (default 0.05 bf16/f16, 1e-3 f32)")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    default = 1e-3 if args.dtype == "float32" else 0.05
    args.tol = default if args.tol is None else args.tol
    args.tie_gap = default if args.tie_gap is None else args.tie_gap
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    RESULTS["env"] = {"torch": torch.__version__, "device": args.device, "dtype": args.dtype,
                      "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    t0 = time.perf_counter()
    for shape in args.shapes:
        try:
            section(shape, args)
        except Exception as e:
            traceback.print_exc()
            RESULTS["shapes"].setdefault(shape, {})["error"] = f"{type(e).__name__}: {e}"
    RESULTS["total_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_tensor_parallel.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    table = report()
    (out / "gpu_tensor_parallel.md").write_text(table + "\n")
    print(table)
    log(f"done in {RESULTS['total_s']:.0f}s; {out / 'gpu_tensor_parallel.json'}")
    shapes = [RESULTS["shapes"].get(s, {}) for s in args.shapes]
    return 0 if all(s.get("check", {}).get("ok") and "error" not in s for s in shapes) else 1


if __name__ == "__main__":
    sys.exit(main())
