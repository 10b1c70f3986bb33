"""tianxia's CPU path against llama.cpp (llama-cpp-python), same GGUF file, same threads, one run.

    PYTHONPATH=$PWD/src:/work/llamacpp/llama_cpp_python-0.3.36:/work/llamacpp/pydeps \\
    LLAMA_CPP_LIB_PATH=/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin \\
    python benchmarks/cpu_vs_llamacpp.py --threads 2 --runs 5      # -> benchmarks/results/cpu/<date>/

Each engine runs in its own process (so resident memory is its own), one after the other:

- prompt processing: a 128-token prompt, no prefix cache, one forward pass -> tokens/s;
- generation: a short prompt, then greedy tokens one at a time; tokens/s = 64 / (time of 65
  tokens - time of 1), so the prompt is not counted;
- memory: resident set after load, against the GGUF size plus the KV cache of the context
  (``--ctx``); the Python process itself (torch, tokenizers) is reported as the base;
- greedy agreement: 20 prompts x 32 tokens, fed as the same token ids, from tianxia (packed
  weights, 8-bit activations; with ``--float32`` also float32 activations), llama.cpp and
  transformers (float32, ``gguf_file=``); per pair, prompts whose 32 tokens are all equal and the
  mean length of the common prefix;
- distance from the float reference, as llama.cpp's ``llama-perplexity --kl-divergence`` reports
  it: each prompt followed by transformers' 32 greedy tokens is scored by every engine (teacher
  forcing, 640 positions), and against transformers' distributions there the mean KL divergence
  and the share of positions with the same top token. Unlike the greedy counts, where one
  near-tie early in a prompt decides all its 32 tokens, these average over every position;
- a control for the greedy counts: llama.cpp again with flash attention, which changes nothing
  but the rounding of the attention, against llama.cpp and transformers.

Medians over ``--runs`` x ``--rounds`` (speed runs of the engines repeated in alternating
order). Outputs ``results.json`` and ``cpu_vs_llamacpp.md``.

``--base-src DIR`` adds a third engine to every round: tianxia from another checkout's ``src``
(say, the main branch before a kernel change), with its own kernel build, so that a change's
cost is measured side by side, round by round, as ``tianxia / base``. ``--isa`` and ``--base-isa``
set ``TIANXIA_CPU_ISA`` for the two (the base then runs this checkout unless ``--base-src`` is
given): ``--no-llamacpp --base-isa avx2`` is the A/B of the AVX-512 kernels against AVX2.
``--prompt-tokens`` sets the prompt's length (128 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

MODELS = {
    "SmolLM2-135M Q4_1": "~/.cache/tianxia/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
    "Qwen2.5-Coder-0.5B (Q5_0/Q4_K/Q6_K/Q8_0)":
        "~/.cache/tianxia/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct.gguf",
}
PROMPTS = [
    "The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
    "List three primary colors:", "The theory of relativity was developed by",
    "Water boils at", "import numpy as np\n\ndef mean(xs):\n", "The largest planet in the solar system is",
    "Translate to French: good morning", "A haiku about the sea:\n", "SELECT name FROM users WHERE",
    "The three laws of motion are", "class Stack:\n    def __init__(self):\n", "My favourite book is",
    "To make a cup of tea, first", "The opposite of hot is", "for i in range(10):\n",
    "Photosynthesis is the process", "The year 1969 is remembered for", "Q: What is 7 times 8?\nA:",
]
GEN_TOKENS, PROMPT_TOKENS, AGREE_TOKENS = 64, 128, 32


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def prompt_ids(tokenizer) -> tuple[list[int], list[int], list[list[int]]]:
    text = " ".join(PROMPTS) * 4
    long = tokenizer.encode(text * 4)[:PROMPT_TOKENS]
    assert len(long) == PROMPT_TOKENS
    return long, tokenizer.encode("Tell me a story about a dragon."), [tokenizer.encode(p) for p in PROMPTS]


def forced_sequences(agree: list[list[int]], ref: dict) -> list[tuple[list[int], int]]:
    """(prompt + transformers' greedy tokens, index of the first scored position) per prompt."""
    return [(ids + toks, len(ids) - 1) for ids, toks in zip(agree, ref["tokens"])]


def distance(logits: list, ref: dict) -> dict:
    """Mean KL(reference || engine) and the share of equal top tokens over the scored positions."""
    import torch

    lp = torch.cat([torch.as_tensor(x, dtype=torch.float32) for x in logits]).log_softmax(-1)
    ref_lp = ref["logprobs"]
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
    return {"kld": float(kl.mean()), "same_top": float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean()),
            "positions": len(kl)}


def load_reference(path: str | None) -> dict | None:
    import torch

    return torch.load(path) if path else None


def worker_tianxia_f32(model: str, threads: int, runs: int, ctx: int, ref_file: str | None = None) -> dict:
    return worker_tianxia(model, threads, runs, ctx, ref_file, cpu_activations="float32")


def worker_tianxia(model: str, threads: int, runs: int, ctx: int, ref_file: str | None = None,
                   cpu_activations: str = "int8") -> dict:
    import torch

    from tianxia import LLM, SamplingParams
    from tianxia.engine.model_runner import kv_bytes_per_token

    base = rss()
    t0 = time.perf_counter()
    llm = LLM(model, threads=threads, num_kv_blocks=ctx // 16, max_model_len=ctx, enable_prefix_caching=False,
              cpu_activations=cpu_activations)
    load_s = time.perf_counter() - t0
    loaded = rss()
    long, short, agree = prompt_ids(llm.get_tokenizer())

    def timed(ids, n):
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t

    timed(long, 1), timed(short, 8)  # warm-up
    pp = [PROMPT_TOKENS / timed(long, 1) for _ in range(runs)]
    tg = []
    for _ in range(runs):
        one = timed(short, 1)
        tg.append(GEN_TOKENS / max(1e-9, timed(short, GEN_TOKENS + 1) - one))
    outs = llm.generate([{"prompt_token_ids": ids} for ids in agree],
                        SamplingParams(temperature=0, max_tokens=AGREE_TOKENS, ignore_eos=True), use_tqdm=False)
    cfg = llm.engine.model_config
    result = {
        "pp": pp, "tg": tg, "rss_base": base, "rss_loaded": loaded, "load_s": load_s,
        "kv_bytes": kv_bytes_per_token(cfg, llm.engine.kv_dtype) * ctx, "threads": torch.get_num_threads(),
        "tokens": [o.outputs[0].token_ids for o in outs],
    }
    if (ref := load_reference(ref_file)) is not None:
        seqs = forced_sequences(agree, ref)
        result["distance"] = distance([llm.engine.score(ids)[first:first + AGREE_TOKENS] for ids, first in seqs],
                                      ref)
    return result


def worker_llamacpp(model: str, threads: int, runs: int, ctx: int, ref_file: str | None = None) -> dict:
    import llama_cpp
    import numpy as np

    from tianxia.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(model), is_gguf=True)
    long, short, agree = prompt_ids(tok)
    base = rss()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512,
                          verbose=False)
    load_s = time.perf_counter() - t0
    loaded = rss()

    vocab = llm.n_vocab()

    def greedy(ids, n, engine=None):
        engine = llm if engine is None else engine
        engine.reset()
        engine.eval(ids)
        out = []
        for i in range(n):
            # the last position's logits (llama-cpp-python keeps no scores without logits_all)
            token = int(np.argmax(np.ctypeslib.as_array(engine._ctx.get_logits(), shape=(vocab,))))
            out.append(token)
            if i + 1 < n:
                engine.eval([token])
        return out

    def timed(ids, n):
        t = time.perf_counter()
        greedy(ids, n)
        return time.perf_counter() - t

    timed(long, 1), timed(short, 8)
    pp = [PROMPT_TOKENS / timed(long, 1) for _ in range(runs)]
    tg = []
    for _ in range(runs):
        one = timed(short, 1)
        tg.append(GEN_TOKENS / max(1e-9, timed(short, GEN_TOKENS + 1) - one))
    result = {"pp": pp, "tg": tg, "rss_base": base, "rss_loaded": loaded, "load_s": load_s,
              "tokens": [greedy(ids, AGREE_TOKENS) for ids in agree],
              "version": getattr(llama_cpp, "__version__", "?")}
    if ref_file is not None:
        # the same weights and products with another attention arithmetic (flash attention, f16
        # accumulation): how far the greedy counts move when nothing but rounding changes
        del llm
        fa = llama_cpp.Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512,
                             flash_attn=True, verbose=False)
        result["tokens_flash_attn"] = [greedy(ids, AGREE_TOKENS, fa) for ids in agree]
        del fa
    if (ref := load_reference(ref_file)) is not None:
        # a second instance that keeps every position's logits
        llm = llama_cpp.Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512,
                              logits_all=True, verbose=False)
        rows = []
        for ids, first in forced_sequences(agree, ref):
            llm.reset()
            llm.eval(ids)
            rows.append(np.array(llm.scores[first:first + AGREE_TOKENS]))
        result["distance"] = distance(rows, ref)
    return result


def worker_transformers(model: str, threads: int, runs: int, ctx: int, ref_file: str | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from tianxia.loader.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    path = Path(model)
    _, _, agree = prompt_ids(load_tokenizer(path, is_gguf=True))
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokens = []
    with torch.no_grad():
        for ids in agree:
            out = ref.generate(torch.tensor([ids]), max_new_tokens=AGREE_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            tokens.append(out[0, len(ids):].tolist())
        if ref_file:  # the reference distributions the other engines are measured against
            seqs = forced_sequences(agree, {"tokens": tokens})
            logits = [ref(torch.tensor([ids])).logits[0, first:first + AGREE_TOKENS] for ids, first in seqs]
            torch.save({"tokens": tokens, "logprobs": torch.cat(logits).float().log_softmax(-1)}, ref_file)
    return {"tokens": tokens}


def run_worker(engine: str, model: str, args, ref_file: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--model", model, "--threads", str(args.threads),
           "--runs", str(args.runs), "--ctx", str(args.ctx)] + (["--ref-file", ref_file] if ref_file else [])
    cmd += ["--prompt-tokens", str(PROMPT_TOKENS)]
    env = dict(os.environ)
    if engine.startswith("tianxia_base") and args.base_src:  # the other checkout first, its kernels apart
        base = str(Path(args.base_src).resolve())
        env.update({"PYTHONPATH": os.pathsep.join([base, os.environ.get("PYTHONPATH", "")]),
                    "TORCH_EXTENSIONS_DIR": os.path.join(tempfile.gettempdir(), "tianxia-base-" + base.replace("/", "_"))})
    isa = args.base_isa if engine.startswith("tianxia_base") else args.isa if engine.startswith("tianxia") else None
    if isa:
        env["TIANXIA_CPU_ISA"] = isa
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    exact = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return f"{exact}/{len(a)} exact, common prefix {statistics.mean(prefix):.1f}/{AGREE_TOKENS}"


def kv_bytes_f16(model: str, ctx: int) -> int:
    from tianxia.loader.gguf import GGUFFile

    c = GGUFFile(model).model_config()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * ctx


WORKERS = {"tianxia": worker_tianxia, "tianxia_f32": worker_tianxia_f32, "tianxia_base": worker_tianxia,
           "tianxia_base_f32": worker_tianxia_f32, "llamacpp": worker_llamacpp, "transformers": worker_transformers}


def main() -> None:
    global PROMPT_TOKENS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=1024, help="context (KV cache) size of both engines")
    ap.add_argument("--rounds", type=int, default=1,
                    help="speed runs of llama.cpp and tianxia, in alternating order; medians over all")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated keys of MODELS")
    ap.add_argument("--no-agreement", action="store_true", help="skip the transformers reference")
    ap.add_argument("--float32", action="store_true",
                    help="also run tianxia with --cpu-activations float32 (exact products)")
    ap.add_argument("--base-src", default=None, metavar="DIR",
                    help="also run tianxia from this src directory in every round (the cost of a change)")
    ap.add_argument("--isa", default=None, help="TIANXIA_CPU_ISA for tianxia")
    ap.add_argument("--base-isa", default=None,
                    help="TIANXIA_CPU_ISA for the base (this checkout's src unless --base-src is given)")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="the timed prompt's length")
    ap.add_argument("--no-llamacpp", action="store_true",
                    help="with --base-src: only the two tianxia builds (no llama.cpp, no agreement pass)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--ref-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    PROMPT_TOKENS = args.prompt_tokens
    has_base = bool(args.base_src or args.base_isa)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.model, args.threads, args.runs, args.ctx, args.ref_file)))
        return

    stamp = datetime.now(timezone.utc)
    out_dir = Path(args.out or f"benchmarks/results/cpu/{stamp:%Y-%m-%d}")
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    results = {}
    for name in args.models.split(","):
        model = os.path.expanduser(MODELS[name])
        print(f"== {name}", file=sys.stderr)
        if args.no_llamacpp and not has_base:
            raise SystemExit("--no-llamacpp needs --base-src or --base-isa")
        if args.no_llamacpp:  # the two builds alone, with the activations asked for
            timed = ("tianxia_f32", "tianxia_base_f32") if args.float32 else ("tianxia", "tianxia_base")
            engines = timed
        else:
            timed = ("llamacpp", "tianxia") + (("tianxia_base",) if has_base else ())
            engines = timed + (("tianxia_f32",) if args.float32 else ())
        with tempfile.TemporaryDirectory() as tmp:
            ref_file = None
            r = {}
            if not (args.no_agreement or args.no_llamacpp):  # first: the others are measured against its distributions
                ref_file = os.path.join(tmp, "reference.pt")
                r["transformers"] = run_worker("transformers", model, args, ref_file)
            r.update({e: run_worker(e, model, args, ref_file) for e in engines})
        # more rounds of the two speed runs, in alternating order, so that a slow spell of the
        # shared machine falls on both engines
        r["rounds"] = [{e: {k: r[e][k] for k in ("pp", "tg")} for e in timed}]
        for i in range(1, args.rounds):
            order = timed[::-1] if i % 2 else timed
            again = {e: run_worker(e, model, args) for e in order}
            r["rounds"].append({e: {k: again[e][k] for k in ("pp", "tg")} for e in order})
            for e in order:
                for k in ("pp", "tg"):
                    r[e][k] = r[e][k] + again[e][k]
        r["gguf_bytes"] = os.path.getsize(model)
        if "llamacpp" in r:
            r["llamacpp"]["kv_bytes"] = kv_bytes_f16(model, args.ctx)
        results[name] = r
    load_after = os.getloadavg()
    (out_dir / "results.json").write_text(json.dumps(results))
    med = statistics.median
    if args.no_llamacpp:
        md = base_report(results, args, stamp, load_before, load_after)
        (out_dir / "cpu_vs_base.md").write_text(md)
        print(md)
        return

    mib = 2**20
    lines = [
        (f"Machine: {os.cpu_count()} CPUs ({_cpu_name()}), {args.threads} threads each; {stamp:%Y-%m-%d %H:%M} UTC; "
         f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; medians of {args.runs} runs x "
         f"{args.rounds} rounds (ratios per round in brackets); context {args.ctx} tokens."),
        "",
        "| model | metric | llama.cpp | tianxia | tianxia / llama.cpp |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lc, tx = r["llamacpp"], r["tianxia"]
        for label, key in (("generation, tokens/s", "tg"), (f"prompt processing ({PROMPT_TOKENS} tokens), tokens/s", "pp")):
            a, b = med(lc[key]), med(tx[key])
            per_round = ", ".join(f"{med(x['tianxia'][key]) / med(x['llamacpp'][key]):.2f}" for x in r["rounds"])
            lines.append(f"| {name} | {label} | {a:.1f} | {b:.1f} | {b / a:.2f}x [{per_round}] |")
            if "tianxia_f32" in r:
                b = med(r["tianxia_f32"][key])
                lines.append(f"| {name} | {label}, float32 activations | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
            if "tianxia_base" in r:
                new, old = med(tx[key]), med(r["tianxia_base"][key])
                per_round = ", ".join(f"{med(x['tianxia'][key]) / med(x['tianxia_base'][key]):.3f}"
                                      for x in r["rounds"])
                lines.append(f"| {name} | {label}: tianxia / base ({old:.1f}) | | {new:.1f} | "
                             f"{new / old:.3f}x [{per_round}] |")
        target = r["gguf_bytes"]
        lines.append(
            f"| {name} | RSS after load, MiB (process base) | {lc['rss_loaded'] / mib:.0f} ({lc['rss_base'] / mib:.0f}) "
            f"| {tx['rss_loaded'] / mib:.0f} ({tx['rss_base'] / mib:.0f}) | {tx['rss_loaded'] / lc['rss_loaded']:.2f}x |")
        lines.append(
            f"| {name} | load growth vs GGUF + KV, MiB | {(lc['rss_loaded'] - lc['rss_base']) / mib:.0f} vs "
            f"{(target + lc['kv_bytes']) / mib:.0f} (f16 KV) | {(tx['rss_loaded'] - tx['rss_base']) / mib:.0f} vs "
            f"{(target + tx['kv_bytes']) / mib:.0f} (f32 KV) | |")
    lines += ["", "Greedy agreement (20 prompts x 32 tokens, same token ids in):", ""]
    for name, r in results.items():
        if "transformers" not in r:
            continue
        tx, lc, hf = r["tianxia"]["tokens"], r["llamacpp"]["tokens"], r["transformers"]["tokens"]
        lines.append(f"- {name}: tianxia vs transformers {agreement(tx, hf)}; tianxia vs llama.cpp "
                     f"{agreement(tx, lc)}; llama.cpp vs transformers {agreement(lc, hf)}")
        if "tianxia_f32" in r:
            f32 = r["tianxia_f32"]["tokens"]
            lines.append(f"- {name}, float32 activations: tianxia vs transformers {agreement(f32, hf)}; "
                         f"tianxia vs llama.cpp {agreement(f32, lc)}")
        if "tokens_flash_attn" in r["llamacpp"]:
            fa = r["llamacpp"]["tokens_flash_attn"]
            lines.append(f"- {name}, control: llama.cpp with flash attention (only the attention's rounding "
                         f"differs) vs llama.cpp {agreement(fa, lc)}; vs transformers {agreement(fa, hf)}")
    lines += ["", ("Distance from transformers' distributions (teacher-forced on its greedy tokens; "
                   "llama-perplexity's KL-divergence statistics):"), "",
              "| model | engine | positions | mean KLD | same top token |", "|---|---|---|---|---|"]
    for name, r in results.items():
        for engine, label in (("llamacpp", "llama.cpp"), ("tianxia", "tianxia"),
                              ("tianxia_f32", "tianxia, float32 activations")):
            if "distance" in r.get(engine, {}):
                d = r[engine]["distance"]
                lines.append(f"| {name} | {label} | {d['positions']} | {d['kld']:.6f} | {100 * d['same_top']:.2f}% |")
    md = "\n".join(lines) + "\n"
    (out_dir / "cpu_vs_llamacpp.md").write_text(md)
    print(md)


def base_report(results: dict, args, stamp, load_before, load_after) -> str:
    """tianxia against the --base-src build alone: medians and per-round ratios."""
    med = statistics.median
    lines = [
        (f"Machine: {os.cpu_count()} CPUs ({_cpu_name()}), {args.threads} threads each; {stamp:%Y-%m-%d %H:%M} UTC; "
         f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; medians of {args.runs} runs x "
         f"{args.rounds} rounds, the two builds alternating; base = {args.base_src or 'this src'}"
         f"{f', TIANXIA_CPU_ISA={args.base_isa}' if args.base_isa else ''}"
         f"{f'; tianxia TIANXIA_CPU_ISA={args.isa}' if args.isa else ''}."),
        "", "| model | metric | base | tianxia | tianxia / base [per round] |", "|---|---|---|---|---|",
    ]
    new, old = ("tianxia_f32", "tianxia_base_f32") if args.float32 else ("tianxia", "tianxia_base")
    lines[0] += f" {'float32' if args.float32 else '8-bit'} activations."
    for name, r in results.items():
        for label, key in (("generation, tokens/s", "tg"), (f"prompt ({PROMPT_TOKENS} tokens), tokens/s", "pp")):
            a, b = med(r[old][key]), med(r[new][key])
            per_round = ", ".join(f"{med(x[new][key]) / med(x[old][key]):.3f}" for x in r["rounds"])
            lines.append(f"| {name} | {label} | {a:.1f} | {b:.1f} | {b / a:.3f}x [{per_round}] |")
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    main()
