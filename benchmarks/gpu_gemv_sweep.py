"""Batch-1 GEMV block shapes at the Qwen2.5-7B decode shapes, each timed inside a CUDA graph.

The decode step replays a CUDA graph, so launch gaps are not what limits a projection there; this
script captures a run of calls of one configuration in a graph (cycling through copies of the
weight, 800 MB in all, so no call is served from the 60 MB L2) and reports the weight bytes read
per second, against the device-to-device copy bandwidth and cuBLAS in the same run. It covers the
fused gate/up with its SiLU-mul epilogue, the same product unfused (one GEMV over both halves,
then ``silu_mul``), and the down, o and qkv projections and the output head.

    PYTHONPATH=src python benchmarks/gpu_gemv_sweep.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))

H, INTER, V = 3584, 18944, 152064


def graph_seconds(calls, reps: int = 5) -> float:
    """Median seconds per call of ``calls`` (a list of thunks) replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", nargs="+", default=["gate_up", "gate_up_unfused", "down"])
    ap.add_argument("--quick", action="store_true", help="a few configurations (a dry run)")
    args = ap.parse_args()
    import gpu_bench as gb

    from tianxia.layers import triton_linear as tlin
    from tianxia.layers import triton_pointwise as tpw

    dt = torch.bfloat16
    dev = "cuda"
    bw = gb.copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    x = torch.randn(1, H, device=dev, dtype=dt)
    r = torch.randn(1, H, device=dev, dtype=dt)
    nw = torch.rand(H, device=dev, dtype=dt) + 0.5
    cases = {  # name: (rows N of the weight, K, kind)
        "gate_up": (2 * INTER, H, "silu"), "gate_up_unfused": (2 * INTER, H, "norm"),
        "down": (H, INTER, "plain"), "o": (H, H, "plain"), "qkv": (4608, H, "norm"), "lm_head": (V, H, "norm"),
    }
    bns = [1, 2, 4, 8, 16, 32]
    bks = [256, 512, 1024, 2048]
    warps = [4, 8]
    stages = [1, 3]
    if args.quick:
        bns, bks, warps, stages = [4, 16], [512], [4], [1]
    results: dict = {"copy_TBs": bw / 1e12, "cases": {}}
    for name in args.cases:
        N, K, kind = cases[name]
        nbytes = N * K * 2
        copies = max(2, -(-800_000_000 // nbytes))
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        xin = torch.randn(1, K, device=dev, dtype=dt)
        ncalls = copies * max(1, 20 // copies)
        rows = []

        op_kind = {"silu": "gu", "norm": "lm", "plain": "plain"}[kind]  # gpu_bench's names
        t = graph_seconds([gb._op_pair(op_kind, [ws[i % copies]], None, x, r, nw, xin)[1]
                           for i in range(ncalls)])
        rows.append({"config": "cublas", "us": t * 1e6, "TBs": nbytes / t / 1e12})
        for bn, bk, nwp, ns in itertools.product(bns, bks, warps, stages):
            if not 4096 <= bn * bk <= 16384 or bk > triton.next_power_of_2(K):
                continue

            def call(w, bn=bn, bk=bk, nwp=nwp, ns=ns, N=N, K=K, kind=kind, xin=xin, name=name):
                kw = {"HAS_BIAS": False, "HAS_SCALE": False, "BLOCK_N": bn, "BLOCK_K": bk,
                      "num_warps": nwp, "num_stages": ns}
                n_out = N // 2 if kind == "silu" else N
                out = torch.empty(1, n_out, device=dev, dtype=dt)
                rout = torch.empty_like(x)
                grid = (triton.cdiv(n_out, bn),)
                if kind == "plain":
                    a = (xin, w, w, out, xin, xin, w, xin, 1e-6, n_out, K)
                    return lambda: tlin._gemv_fixed[grid](*a, NORM=0, SILU=False, **kw)
                a = (x, w, w, out, r, rout, nw, x, 1e-6, n_out, K)
                if kind == "silu":
                    return lambda: tlin._gemv_fixed[grid](*a, NORM=2, SILU=True, **kw)
                if name == "gate_up_unfused":
                    return lambda: (tlin._gemv_fixed[grid](*a, NORM=2, SILU=False, **kw), tpw.silu_mul(out))
                return lambda: tlin._gemv_fixed[grid](*a, NORM=2, SILU=False, **kw)

            try:
                t = graph_seconds([call(ws[i % copies]) for i in range(ncalls)])
            except Exception as e:  # a configuration that does not compile (registers, shared memory)
                rows.append({"config": f"bn{bn} bk{bk} w{nwp} s{ns}", "error": str(e)[:200]})
                continue
            rows.append({"config": f"bn{bn} bk{bk} w{nwp} s{ns}", "us": t * 1e6, "TBs": nbytes / t / 1e12})
        ok = sorted((x_ for x_ in rows if "us" in x_), key=lambda x_: x_["us"])
        results["cases"][name] = {"MB": nbytes / 1e6, "best": ok[:8], "cublas": rows[0], "all": rows}
        print(f"{name} ({nbytes / 1e6:.0f} MB): cublas {rows[0]['us']:.1f} us {rows[0]['TBs']:.2f} TB/s; best:",
              flush=True)
        for b in ok[:6]:
            print(f"   {b['config']:>20}: {b['us']:.1f} us, {b['TBs']:.2f} TB/s", flush=True)
        del ws
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "gemv_sweep.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"done in {time.perf_counter() - t0:.0f}s")
    sys.exit(rc)
