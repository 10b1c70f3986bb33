"""Single-stream prompt and generation speed of tianxia vs transformers on the same GGUF (CPU).

Both run in this process, one after the other, with the same thread count; each figure is the
median of several runs, and the report gives the ratio (tianxia / transformers).

    python benchmarks/engine_vs_transformers.py [--model smollm2-135m] [--threads 2] [--runs 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from tianxia import LLM, SamplingParams
    from tianxia.loader.hub import resolve_model

    path = resolve_model(args.model)
    llm = LLM(str(path), threads=args.threads, kv_cache_memory="256MiB", enable_prefix_caching=False)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    torch.manual_seed(0)
    prompt = torch.randint(100, 10000, (args.prompt_tokens,)).tolist()

    def ours_prefill() -> float:
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        return time.perf_counter() - t

    def ours_generate() -> float:
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt},
                     SamplingParams(temperature=0, max_tokens=args.gen_tokens + 1, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    @torch.inference_mode()
    def ref_prefill() -> float:
        t = time.perf_counter()
        ref.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    @torch.inference_mode()
    def ref_generate() -> float:
        t = time.perf_counter()
        ref.generate(torch.tensor([prompt]), max_new_tokens=args.gen_tokens + 1, min_new_tokens=args.gen_tokens + 1,
                     do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    results = {}
    for name, prefill, generate in (("tianxia", ours_prefill, ours_generate), ("transformers", ref_prefill, ref_generate)):
        prefill(), generate()  # warm-up
        p = statistics.median(prefill() for _ in range(args.runs))
        g = statistics.median(generate() for _ in range(args.runs))
        results[name] = (args.prompt_tokens / p, args.gen_tokens / max(g - p, 1e-9))

    print(f"model {args.model}, {args.threads} threads, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, medians of {args.runs}")
    print("| engine | prompt tokens/s | generation tokens/s |")
    print("|---|---|---|")
    for name, (pp, tg) in results.items():
        print(f"| {name} | {pp:.1f} | {tg:.1f} |")
    (pp0, tg0), (pp1, tg1) = results["tianxia"], results["transformers"]
    print(f"| ratio tianxia / transformers | {pp0 / pp1:.2f}x | {tg0 / tg1:.2f}x |")


if __name__ == "__main__":
    main()
