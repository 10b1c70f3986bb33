#!/usr/bin/env python
"""What one decode step's LoRA deltas cost on CPU, per way of storing an adapter.

    python benchmarks/lora_storage_cpu.py [--rows 4] [--rank 16] [--reps 30] [--threads 1]

SmolLM2-135M's shapes (30 layers; q, k, v, o, gate, up, down), one random adapter of ``--rank``
over all seven projections, ``--rows`` activation rows (16 streams over 4 adapters: 4 rows each).
Each way computes every delta of one step, ``(x @ A.T) @ B.T`` per fused module:

- ``float32 parts``: each targeted part's A and B on their own (what tianxia stores over a float
  base), through the row-invariant float kernel (``dense_linear``);
- ``float16 parts (dense_linear)``: the same in float16, which the kernel widens to float32 in
  registers (what tianxia stores over a packed base: half the bytes, each row computed alone);
- ``float32 block-diagonal``: per fused module A stacked and B block-diagonal with zero blocks
  (the earlier layout), same kernel;
- ``bfloat16 parts`` / ``float16 parts``: the parts in 16 bits through ``torch.nn.functional.linear``
  (torch's kernels: faster or not, their rows are not computed alone).

The ways run interleaved, ``--reps`` times; medians and each way's time relative to the first.
Everything runs under ``torch.no_grad()``: with autograd on, ``dense_linear`` is ``F.linear``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tianxia.quant.cpu_kernels import dense_linear

HIDDEN, INTER, KV, LAYERS = 576, 1536, 192, 30
# fused module -> (its input size, its parts' output rows)
MODULES = {"qkv": (HIDDEN, (HIDDEN, KV, KV)), "o": (HIDDEN, (HIDDEN,)), "gate_up": (HIDDEN, (INTER, INTER)),
           "down": (INTER, (HIDDEN,))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r = args.rank
    g = torch.Generator().manual_seed(0)
    layers = []  # per layer, per module: (x, [(row0, A, B)])
    for _ in range(LAYERS):
        layer = []
        for k, outs in MODULES.values():
            parts, row0 = [], 0
            for n in outs:
                parts.append((row0, torch.randn(r, k, generator=g), torch.randn(n, r, generator=g)))
                row0 += n
            layer.append((torch.randn(args.rows, k, generator=g), sum(outs), parts))
        layers.append(layer)

    def block_diagonal(out: int, parts) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.cat([p[1] for p in parts])
        b = torch.zeros(out, a.shape[0])
        for i, (row0, _, pb) in enumerate(parts):
            b[row0 : row0 + pb.shape[0], i * r : (i + 1) * r] = pb
        return a, b

    stacked = [[(x, out, block_diagonal(out, parts)) for x, out, parts in layer] for layer in layers]
    half = {dt: [[(x.to(dt), out, [(row0, a.to(dt), b.to(dt)) for row0, a, b in parts]) for x, out, parts in layer]
                 for layer in layers] for dt in (torch.bfloat16, torch.float16)}

    def parts_step(data, mm) -> None:
        for layer in data:
            for x, out, parts in layer:
                y = torch.zeros(x.shape[0], out, dtype=x.dtype)
                for row0, a, b in parts:
                    y[:, row0 : row0 + b.shape[0]] += mm(mm(x, a), b)

    def stacked_step() -> None:
        for layer in stacked:
            for x, out, (a, b) in layer:
                y = torch.zeros(x.shape[0], out)
                y += dense_linear(dense_linear(x, a), b)

    f16 = [[(x, out, [(row0, a.half(), b.half()) for row0, a, b in parts]) for x, out, parts in layer]
           for layer in layers]
    ways = {
        "float32 parts (dense_linear)": lambda: parts_step(layers, dense_linear),
        "float16 parts (dense_linear)": lambda: parts_step(f16, dense_linear),
        "float32 block-diagonal (dense_linear)": stacked_step,
        "bfloat16 parts (F.linear)": lambda: parts_step(half[torch.bfloat16], F.linear),
        "float16 parts (F.linear)": lambda: parts_step(half[torch.float16], F.linear),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(args.reps + 1):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            if rep:  # the first repetition warms up
                times[name].append(time.perf_counter() - t0)
    mib = {"float32 parts (dense_linear)": 4, "float16 parts (dense_linear)": 2,
           "float32 block-diagonal (dense_linear)": None,
           "bfloat16 parts (F.linear)": 2, "float16 parts (F.linear)": 2}
    part_values = sum(a.numel() + b.numel() for layer in layers for _, _, parts in layer for _, a, b in parts)
    stacked_values = sum(a.numel() + b.numel() for layer in stacked for _, _, (a, b) in layer)
    print(f"SmolLM2-135M shapes, rank {r}, all 7 projections, {args.rows} rows, {args.threads} thread(s), "
          f"median of {args.reps}")
    first = statistics.median(times["float32 parts (dense_linear)"])
    for name, t in times.items():
        size = (stacked_values * 4 if mib[name] is None else part_values * mib[name]) / 2**20
        med = statistics.median(t)
        print(f"  {name:40s} {size:6.1f} MiB  {med * 1e3:8.2f} ms  {med / first:5.2f}x")


if __name__ == "__main__":
    with torch.no_grad():
        main()
