"""The CPU kernels' AVX-512 variant against AVX2, in one process on one loaded model: the variant
is switched between timed calls (the extension's ``set_cpu_isa``, what ``TIANXIA_CPU_ISA`` does at
load), in alternating order, so that a busy spell of a shared machine falls on both. Whole-model
runs minutes apart (``cpu_vs_llamacpp.py --base-isa avx2``) do not resolve 10% on a shared 2-core
machine.

    PYTHONPATH=src python benchmarks/cpu_isa_ab.py --rounds 7
    PYTHONPATH=src python benchmarks/cpu_isa_ab.py --shapes [--rows 1,4,16,64,256,512]

Per model (8-bit activations): prompts of 128 and 512 tokens (tokens/s of one forward pass),
single-stream generation (64 tokens after the first) with the default split (one row stays on
AVX2) and with AVX-512 forced for single rows too, and 8 streams decoding together. ``--amx``:
AMX against AVX-512 instead (prompts, 8 and 16 streams).

``--shapes``: the integer product alone, per packed weight shape of the model (its layers' and
its output head's) and number of activation rows, under every variant the CPU has (AVX2,
AVX-512 VNNI, AMX-INT8), each forced for every row count, calls alternating between them: the
median milliseconds per call (activation rounding included) and whether every variant gave the
same bits. The table the AMX threshold (``TIANXIA_CPU_AMX_MIN_ROWS``) was chosen from.
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


def shapes(args, ext) -> None:
    import torch

    from tianxia.loader.gguf import GGUFFile
    from tianxia.quant.packed import PACKABLE_TYPES, from_gguf

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    levels = [lvl for lvl in (0, 1, 2) if lvl <= ext.best_cpu_isa()]
    names = {0: "AVX2", 1: "AVX-512", 2: "AMX"}
    before = (ext.cpu_isa(), ext.avx512_min_rows(), ext.amx_min_rows())
    rows = [int(r) for r in args.rows.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f}; {args.threads} threads; median ms per call of "
          f"{args.rounds} alternating rounds of {args.calls} calls; 8-bit activations\n")
    print("| model | weight | N x K | M | " + " | ".join(names[lvl] for lvl in levels) +
          " | " + " | ".join(f"{names[lvl]} / AMX" for lvl in levels if lvl < 2 and 2 in levels) + " | same bits |")
    print("|---" * (5 + len(levels) + (len(levels) - 1 if 2 in levels else 0)) + "|")
    for name in args.models.split(","):
        seen = {}
        for t in GGUFFile(os.path.expanduser(MODELS[name])).reader.tensors:
            if t.tensor_type in PACKABLE_TYPES and len(t.shape) == 2 and ("blk." in t.name or "token_embd" in t.name
                                                                          or t.name == "output.weight"):
                k, n = (int(d) for d in t.shape)
                seen.setdefault((t.tensor_type.name, n, k), t)
        for (kind, n, k), t in sorted(seen.items(), key=lambda kv: kv[0][1] * kv[0][2]):
            w = from_gguf(torch.from_numpy(t.data.reshape(-1).view("uint8").copy()), t.tensor_type, (n, k))
            for m in rows:
                if n * k * m > args.max_work:
                    continue
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                got, outs = {lvl: [] for lvl in levels}, {}
                for r in range(args.rounds + 1):
                    for lvl in (levels if r % 2 else levels[::-1]):
                        ext.set_cpu_isa(lvl, 1, 1)
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            y = cpu_kernels.packed_linear(x, w, None, True)
                        if r:  # the first round warms up
                            got[lvl].append((time.perf_counter() - t0) / args.calls * 1e3)
                        outs[lvl] = y
                med = {lvl: statistics.median(v) for lvl, v in got.items()}
                same = all(torch.equal(outs[levels[0]], outs[lvl]) for lvl in levels)
                ratios = [f"{med[lvl] / med[2]:.2f}x" for lvl in levels if lvl < 2 and 2 in levels]
                print(f"| {name} | {kind} {t.name if 'blk.' not in t.name else ''} | {n} x {k} | {m} | " +
                      " | ".join(f"{med[lvl]:.3f}" for lvl in levels) + " | " + " | ".join(ratios) +
                      f" | {'yes' if same else 'NO'} |", flush=True)
    ext.set_cpu_isa(*before)
    print(f"\nload average after {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--shapes", action="store_true", help="time the integer product per weight shape and row count")
    ap.add_argument("--rows", default="1,4,16,32,64,256,512", help="activation rows of --shapes")
    ap.add_argument("--calls", type=int, default=5, help="calls per round of --shapes")
    ap.add_argument("--max-work", type=float, default=2e9, help="skip --shapes cases of more multiply-adds")
    ap.add_argument("--amx", action="store_true", help="whole models: AMX against AVX-512 instead of AVX-512 "
                    "against AVX2")
    args = ap.parse_args()
    ext = cpu_kernels.extension()
    if args.shapes:
        return shapes(args, ext)
    base, new = (1, 2) if args.amx else (0, 1)
    names = {0: "AVX2", 1: "AVX-512", 2: "AMX"}
    assert ext is not None and ext.best_cpu_isa() >= new, f"needs a CPU with {names[new]}"
    default_rows = ext.avx512_min_rows()
    print(f"load average {os.getloadavg()[0]:.2f}; AVX-512 from {default_rows} rows, AMX from "
          f"{ext.amx_min_rows()} by default; medians of {args.rounds} alternating rounds\n")
    print(f"| model | case | {names[base]} | {names[new]} | {names[new]} / {names[base]} [per round] |\n"
          "|---|---|---|---|---|")
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
        if args.amx:  # decode steps of 10+ rows take AMX; single streams never do
            del cases["generation 1 stream, tokens/s"], cases["generation 1 stream, AVX-512 for 1 row, tokens/s"]
            cases["generation 16 streams, tokens/s"] = (
                lambda: 16 * 32 / (run([short] * 16, 33) - run([short] * 16, 1)), default_rows)
        for case, (fn, rows) in cases.items():
            got = {base: [], new: []}
            for r in range(args.rounds + 1):
                for level in ((base, new) if r % 2 else (new, base)):
                    ext.set_cpu_isa(level, rows)
                    v = fn()
                    if r:  # the first round warms up
                        got[level].append(v)
            a, b = statistics.median(got[base]), statistics.median(got[new])
            per = ", ".join(f"{y / x:.2f}" for x, y in zip(got[base], got[new]))
            print(f"| {name} | {case} | {a:.1f} | {b:.1f} | {b / a:.3f}x [{per}] |", flush=True)
        ext.set_cpu_isa(ext.best_cpu_isa(), default_rows)
        del llm
    print(f"\nload average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
