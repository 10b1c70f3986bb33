"""The CPU kernels of this tree against those of another git revision, interleaved in one process.

    python benchmarks/kernels_ab.py --base HEAD~1 [--model PATH.gguf] [--rows 128] [--int8|--float32]
    python benchmarks/kernels_ab.py --base HEAD~1 --whole-model [--rounds 8]

Both builds of ``quant/csrc`` are loaded side by side (the base under another module name), and
every packed projection shape of the model (one per type and shape) is multiplied by each in
turn, calls alternating, so that both see the same machine load. On a shared or noisy machine
this resolves differences of a few percent that runs of the whole model, minutes apart, do not.
Prints multiply-adds per second (the 25th percentile of the calls: the fast end, less exposed
to interruptions) and the ratio, and checks that both give the same result.

Alone, a product reads its weight from cache; in the model the weights stream from memory, and
a kernel that wins in cache can lose there. ``--whole-model`` loads the model once and alternates
the two builds under it, round by round: greedy generation (64 tokens after a short prompt) and
a 128-token prompt, as ``cpu_vs_llamacpp.py`` times them, with the median ratio of the rounds.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from tianxia.quant import cpu_kernels
from tianxia.quant.cpu_kernels import _SOURCES, CFLAGS

CSRC = Path(cpu_kernels.__file__).parent / "csrc"
DEFAULT_MODEL = "~/.cache/tianxia/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct.gguf"


def build(name: str, csrc: Path, flags: list[str], defines: list[str]):
    sources = [str(csrc / f) for f in _SOURCES if (csrc / f).exists()]
    return load(name=name, sources=sources, extra_include_paths=[str(csrc)], extra_cflags=flags + defines,
                extra_ldflags=["-fopenmp"])


def revision_flags(rev: str) -> list[str]:
    """The compiler flags that revision ``rev`` builds its kernels with (its cpu_kernels.py)."""
    import ast

    path = Path(cpu_kernels.__file__)
    top = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=CSRC, text=True).strip())
    text = subprocess.check_output(["git", "show", f"{rev}:{path.relative_to(top)}"], cwd=top, text=True)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.List) and any(isinstance(e, ast.Constant) and e.value == "-O3" for e in node.elts):
            return [e.value for e in node.elts]
    raise SystemExit(f"no compiler flags found in {rev}'s {path.name}")


def checkout_csrc(rev: str) -> Path:
    """``rev``'s kernel sources, in a directory named by its commit (kept: a later run with the
    same base finds them, and torch's build of them, unchanged)."""
    top = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=CSRC, text=True).strip())
    sha = subprocess.check_output(["git", "rev-parse", rev], cwd=top, text=True).strip()
    into = Path(tempfile.gettempdir()) / f"tianxia-kernels-{sha[:12]}"
    if (into / CSRC.relative_to(top)).is_dir():
        return into / CSRC.relative_to(top)
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev, str(CSRC.relative_to(top))], cwd=top, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / CSRC.relative_to(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=128, help="activation rows (a prompt's tokens)")
    ap.add_argument("--float32", action="store_true", help="float32 activations instead of 8-bit")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stream", type=int, default=0, metavar="MB",
                    help="cycle through copies of each weight, this many MB in all (more than the L3 cache: "
                         "weights stream from memory, as in the model)")
    ap.add_argument("--whole-model", action="store_true", help="time the model's decode and prompt steps")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of --whole-model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    from tianxia.loader.gguf import GGUFFile
    from tianxia.quant.packed import PACKABLE_TYPES, from_gguf

    new = build("tx_kernels_new", CSRC, CFLAGS, [])
    # another C++ name for the base's pybind class, which both modules register
    base = build("tx_kernels_base", checkout_csrc(args.base), revision_flags(args.base), ["-DDecoder=DecoderBase"])
    if args.whole_model:
        return whole_model(args, new, base)
    shapes = {}
    for t in GGUFFile(os.path.expanduser(args.model)).reader.tensors:
        if t.tensor_type in PACKABLE_TYPES and len(t.shape) == 2 and "blk." in t.name:
            k, n = (int(d) for d in t.shape)
            shapes.setdefault((t.tensor_type.name, n, k), t)
    int8 = not args.float32
    print(f"{args.rows} rows, {'8-bit' if int8 else 'float32'} activations, {args.threads} threads; "
          f"new = working tree, base = {args.base}")
    for (kind, n, k), t in sorted(shapes.items()):
        w = from_gguf(torch.from_numpy(t.data.reshape(-1).view("uint8").copy()), t.tensor_type, (n, k))
        x = torch.randn(args.rows, k)
        mins = w.mins if w.mins is not None else torch.empty(0)
        size = w.qs.numel() + w.scales.numel() * w.scales.element_size() * (2 if w.mins is not None else 1)
        copies = [(w.qs.clone(), w.scales.clone(), mins.clone())
                  for _ in range(max(1, (args.stream << 20) // size))]
        # the two builds take turns half the copies apart: neither reads what the other just did
        turn = {new: 0, base: len(copies) // 2}

        def call(e, copies=copies, turn=turn, x=x, w=w):
            qs, scales, m = copies[turn[e] % len(copies)]
            turn[e] += 1
            return e.packed_linear(x, qs, scales, m, None, w.bits, w.group, int8)

        calls = {e: functools.partial(call, e) for e in (new, base)}
        same = torch.equal(calls[new](), calls[base]())
        times = {new: [], base: []}
        for _ in range(args.calls):
            for e in (new, base):
                t0 = time.perf_counter()
                calls[e]()
                times[e].append(time.perf_counter() - t0)
        rate = {e: args.rows * n * k / sorted(ts)[len(ts) // 4] / 1e9 for e, ts in times.items()}
        print(f"{kind:5s} {n:6d} x {k:5d}: new {rate[new]:6.1f}, base {rate[base]:6.1f} G multiply-adds/s, "
              f"new / base {rate[new] / rate[base]:.3f}, {'identical' if same else 'results differ'}")


def whole_model(args, new, base) -> None:
    import statistics

    from cpu_vs_llamacpp import GEN_TOKENS, PROMPT_TOKENS, prompt_ids

    from tianxia import LLM, SamplingParams

    llm = LLM(os.path.expanduser(args.model), threads=args.threads, num_kv_blocks=64, max_model_len=1024,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    long, short, _ = prompt_ids(llm.get_tokenizer())

    def use(ext) -> None:
        cpu_kernels.extension = lambda: ext
        # the fused decode step keeps the build that made it
        runner.decode_step = runner.model.fast_decode_step(runner.kv_caches, llm.engine.max_model_len)

    def timed(ids: list[int], n: int) -> float:
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t

    rates = {new: {"tg": [], "pp": []}, base: {"tg": [], "pp": []}}
    for e in (new, base):  # warm-up
        use(e)
        timed(long, 1), timed(short, 8)
    print(f"{os.path.basename(args.model)}, {args.threads} threads; new = working tree, base = {args.base}")
    for r in range(args.rounds):
        for e in (new, base) if r % 2 == 0 else (base, new):
            use(e)
            one = timed(short, 1)
            rates[e]["tg"].append(GEN_TOKENS / (timed(short, GEN_TOKENS + 1) - one))
            rates[e]["pp"].append(PROMPT_TOKENS / timed(long, 1))
        print(f"round {r + 1}: generation {rates[new]['tg'][-1]:.1f} / {rates[base]['tg'][-1]:.1f}, "
              f"prompt {rates[new]['pp'][-1]:.1f} / {rates[base]['pp'][-1]:.1f} tokens/s (new / base)", flush=True)
    for what, label in (("tg", "generation"), ("pp", "prompt")):
        ratios = [a / b for a, b in zip(rates[new][what], rates[base][what])]
        print(f"{label}: new {statistics.median(rates[new][what]):.1f}, base {statistics.median(rates[base][what]):.1f}"
              f" tokens/s; new / base per round: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
