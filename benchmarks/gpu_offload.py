"""``--cpu-offload-gb`` on one GPU: batch-1 decode with none and half of the decoder weights in
host memory, for random-weight models of real shapes saved as Hugging Face directories and
loaded through tianxia's own loader.

For each shape: ms/token of batch-1 decode (128-token prompt, 128 new tokens, greedy), the GPU
memory the weights take, the decode route, and whether the greedy tokens equal those without
offload. The half-offloaded case moves (offloaded bytes) over PCIe every forward: its floor is
that many bytes at the host-to-device copy bandwidth, measured here too.

    PYTHONPATH=src python benchmarks/gpu_offload.py --out /tmp/out --shapes qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import decode_route  # noqa: E402  (the shared helpers)


def h2d_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a pinned host-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - t0)


def decode_ms(llm, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """ms per decoded token (a generate of n + 1 tokens minus one of 1 token), and the tokens."""
    from tianxia import SamplingParams

    def run(k: int):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=k,
                                                                          ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0, list(out[0].outputs[0].token_ids)

    run(n + 1)  # warm-up
    t_one, _ = run(1)
    t_all, tokens = run(n + 1)
    return (t_all - t_one) / n * 1e3, tokens


def main() -> int:
    from gpu_build_startup import make_model_dir

    from tianxia import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-7b"])
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tx-offload-"))
    bw = h2d_bandwidth()
    print(f"host-to-device copy: {bw / 1e9:.1f} GB/s", flush=True)
    results: dict = {"h2d_gb_s": bw / 1e9, "shapes": {}}
    lines = ["| shape | offloaded GiB | GPU weights GiB | route | ms/token | floor ms (copy) | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for shape in args.shapes:
        d = make_model_dir(root, shape)
        layer_bytes = sum(f.stat().st_size for f in d.glob("*.safetensors"))  # bf16 on disk: all weights
        prompt = [random.Random(0).randrange(1000, 100000) for _ in range(128)]
        ref = None
        for frac in (0.0, 0.5):
            gb = round(layer_bytes * frac / 2**30, 2)
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            llm = LLM(str(d), device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=2048,
                      gpu_memory_utilization=0.5, cpu_offload_gb=gb)
            runner = llm.engine.runner
            weights = sum(t.numel() * t.element_size() for t in runner.model.parameters() if t.is_cuda)
            route = decode_route(runner)
            ms, tokens = decode_ms(llm, prompt, args.tokens)
            offloaded = sum(t.numel() * t.element_size() for t in runner.model.parameters() if t.device.type == "cpu")
            same = None if ref is None else tokens == ref
            ref = ref or tokens
            r = dict(offload_gb=gb, offloaded_gib=offloaded / 2**30, gpu_weights_gib=weights / 2**30, route=route,
                     ms_per_token=ms, floor_ms=offloaded / bw * 1e3, same_tokens=same,
                     gpu_allocated_gib=(torch.cuda.memory_allocated() - base) / 2**30)
            results["shapes"].setdefault(shape, []).append(r)
            print(f"{shape} offload {gb} GiB: {r}", flush=True)
            lines.append(f"| {shape} | {offloaded / 2**30:.2f} | {weights / 2**30:.2f} | {route} | {ms:.2f} | "
                         f"{offloaded / bw * 1e3:.2f} | {'-' if same is None else same} |")
            del llm, runner
            torch.cuda.empty_cache()
        for f in d.iterdir():
            f.unlink()
    text = f"host-to-device copy {bw / 1e9:.1f} GB/s\n\n" + "\n".join(lines) + "\n"
    (out / "gpu_offload.md").write_text(text)
    (out / "gpu_offload.json").write_text(json.dumps(results, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
