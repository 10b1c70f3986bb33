"""Tensor parallelism on CPU: TP=2 (two processes, one core's worth of threads each, gloo
all-reduces) against TP=1 (one process, all the threads), on SmolLM2-135M as its GGUF file
stores it (Q4_1, packed) or dequantized (``--quantization none``). Both engines live in one
process and the rounds alternate, so a busy spell of a shared machine falls on both.

    PYTHONPATH=src python benchmarks/tp_cpu.py --rounds 5 [--quantization none]

Cases: a 128-token prompt (tokens/s of one forward pass), one stream generating 32 tokens after
the first, 8 streams together. Each decode step of a TP=2 engine sends the step's inputs down a
pipe and makes 2 all-reduces per layer (61 for SmolLM2's 30 layers, with the embedding's) and one
more to gather the logits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from tianxia import LLM, SamplingParams

TEXT = "The theory of relativity was developed by Albert Einstein in the early twentieth century. " * 40


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="threads of the TP=1 engine; TP=N gets threads/N per rank")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--cpu-activations", default="int8")
    args = ap.parse_args()
    common = dict(threads=args.threads, kv_cache_memory="128MiB", max_model_len=1024,
                  quantization=args.quantization, cpu_activations=args.cpu_activations,
                  enable_prefix_caching=False)
    engines = {1: LLM(args.model, **common), 2: LLM(args.model, tensor_parallel_size=2, **common)}
    ids = engines[1].get_tokenizer().encode(TEXT)
    short = ids[:8]

    def run(llm, prompts, n):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    cases = {
        "prompt 128, tokens/s": lambda llm: 128 / run(llm, [ids[:128]], 1),
        "generation 1 stream, tokens/s": lambda llm: 32 / (run(llm, [short], 33) - run(llm, [short], 1)),
        "generation 8 streams, tokens/s": lambda llm: 8 * 16 / (run(llm, [short] * 8, 17) - run(llm, [short] * 8, 1)),
    }
    for llm in engines.values():  # warm-up
        run(llm, [short], 4)
    print(f"{args.model}, --quantization {args.quantization}, --cpu-activations {args.cpu_activations}; "
          f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; medians of {args.rounds} "
          "alternating rounds\n")
    print("| case | TP=1 | TP=2 | TP=2 / TP=1 [per round] |\n|---|---|---|---|")
    for name, fn in cases.items():
        ratios, one, two = [], [], []
        for r in range(args.rounds):
            order = (1, 2) if r % 2 == 0 else (2, 1)
            got = {tp: fn(engines[tp]) for tp in order}
            one.append(got[1])
            two.append(got[2])
            ratios.append(got[2] / got[1])
        print(f"| {name} | {statistics.median(one):.1f} | {statistics.median(two):.1f} | "
              f"{statistics.median(ratios):.2f} [{', '.join(f'{x:.2f}' for x in ratios)}] |")


if __name__ == "__main__":
    main()
