"""The CPU kernels' AVX-512 variant against AVX2, in one process on one loaded model: the variant
is switched between timed calls (the extension's ``set_cpu_isa``, what ``TIANXIA_CPU_ISA`` does at
load), in alternating order, so that a busy spell of a shared machine falls on both. Whole-model
runs minutes apart (``cpu_vs_llamacpp.py --base-isa avx2``) do not resolve 10% on a shared 2-core
machine.

    PYTHONPATH=src python benchmarks/cpu_isa_ab.py --rounds 7

Per model (8-bit activations): prompts of 128 and 512 tokens (tokens/s of one forward pass),
single-stream generation (64 tokens after the first) with the default split (one row stays on
AVX2) and with AVX-512 forced for single rows too, and 8 streams decoding together.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from tianxia import LLM, SamplingParams
from tianxia.quant import cpu_kernels

MODELS = {
    "SmolLM2-135M Q4_1": "~/.cache/tianxia/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
    "Qwen2.5-Coder-0.5B": "~/.cache/tianxia/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct.gguf",
}
TEXT = "The theory of relativity was developed by Albert Einstein in the early twentieth century. " * 80


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    ext = cpu_kernels.extension()
    assert ext is not None and ext.best_cpu_isa() >= 1, "needs a CPU with AVX-512 VNNI"
    default_rows = ext.avx512_min_rows()
    print(f"load average {os.getloadavg()[0]:.2f}; AVX-512 from {default_rows} rows by default; "
          f"medians of {args.rounds} alternating rounds\n")
    print("| model | case | AVX2 | AVX-512 | AVX-512 / AVX2 [per round] |\n|---|---|---|---|---|")
    for name in args.models.split(","):
        llm = LLM(os.path.expanduser(MODELS[name]), threads=args.threads, num_kv_blocks=128, max_model_len=1024,
                  enable_prefix_caching=False)
        ids = llm.get_tokenizer().encode(TEXT)
        short = ids[:8]

        def run(prompts, n):
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - t

        cases = {
            "prompt 128, tokens/s": (lambda: 128 / run([ids[:128]], 1), default_rows),
            "prompt 512, tokens/s": (lambda: 512 / run([ids[:512]], 1), default_rows),
            "generation 1 stream, tokens/s": (lambda: 64 / (run([short], 65) - run([short], 1)), default_rows),
            "generation 1 stream, AVX-512 for 1 row, tokens/s": (lambda: 64 / (run([short], 65) - run([short], 1)), 1),
            "generation 8 streams, tokens/s": (lambda: 8 * 32 / (run([short] * 8, 33) - run([short] * 8, 1)),
                                               default_rows),
        }
        for case, (fn, rows) in cases.items():
            got = {0: [], 1: []}
            for r in range(args.rounds + 1):
                for level in ((0, 1) if r % 2 else (1, 0)):
                    ext.set_cpu_isa(level, rows)
                    v = fn()
                    if r:  # the first round warms up
                        got[level].append(v)
            a, b = statistics.median(got[0]), statistics.median(got[1])
            per = ", ".join(f"{y / x:.2f}" for x, y in zip(got[0], got[1]))
            print(f"| {name} | {case} | {a:.1f} | {b:.1f} | {b / a:.3f}x [{per}] |", flush=True)
        ext.set_cpu_isa(1, default_rows)
        del llm
    print(f"\nload average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
