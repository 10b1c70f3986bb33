"""The CPU kernels of this tree against those of another git revision, interleaved in one process.

    python benchmarks/kernels_ab.py --base HEAD~1 [--model PATH.gguf] [--rows 128] [--int8|--float32]

Both builds of ``quant/csrc`` are loaded side by side (the base under another module name), and
every packed projection shape of the model (one per type and shape) is multiplied by each in
turn, calls alternating, so that both see the same machine load. On a shared or noisy machine
this resolves differences of a few percent that runs of the whole model, minutes apart, do not.
Prints multiply-adds per second (the 25th percentile of the calls: the fast end, less exposed
to interruptions) and the ratio, and checks that both give the same result.
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
from tianxia.quant.cpu_kernels import _SOURCES

CSRC = Path(cpu_kernels.__file__).parent / "csrc"
DEFAULT_MODEL = "~/.cache/tianxia/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct.gguf"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


def build(name: str, csrc: Path, defines: list[str]):
    sources = [str(csrc / f) for f in _SOURCES if (csrc / f).exists()]
    return load(name=name, sources=sources, extra_include_paths=[str(csrc)], extra_cflags=FLAGS + defines,
                extra_ldflags=["-fopenmp"])


def checkout_csrc(rev: str, into: Path) -> Path:
    rel = CSRC.relative_to(Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()))
    archive = subprocess.run(["git", "archive", rev, str(rel)], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / rel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=128, help="activation rows (a prompt's tokens)")
    ap.add_argument("--float32", action="store_true", help="float32 activations instead of 8-bit")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    from tianxia.loader.gguf import GGUFFile
    from tianxia.quant.packed import PACKABLE_TYPES, from_gguf

    with tempfile.TemporaryDirectory() as tmp:
        new = build("tx_kernels_new", CSRC, [])
        # another C++ name for the base's pybind class, which both modules register
        base = build("tx_kernels_base", checkout_csrc(args.base, Path(tmp)), ["-DDecoder=DecoderBase"])
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
        calls = {e: functools.partial(e.packed_linear, x, w.qs, w.scales, mins, None, w.bits, w.group, int8)
                 for e in (new, base)}
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


if __name__ == "__main__":
    main()
