"""``-ngl`` / ``--n-gpu-layers`` on one GPU: batch-1 decode with none, half and all of the decoder
layers on the GPU (llama.cpp's meaning: the last N layers; the output layer joins them only when N
exceeds the layer count), for random-weight models of real shapes saved as Hugging Face
directories and loaded through tianxia's loader.

For each shape and N: ms/token of batch-1 decode (128-token prompt, greedy; the faster of two
measurements), the GPU memory the
weights take, the decode route, and the greedy tokens against the whole model on the GPU (the CPU
layers compute in float32, the GPU ones in bf16: equal up to bf16's rounding).

    PYTHONPATH=src python benchmarks/gpu_layer_split.py --out /tmp/out --shapes qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def main() -> int:
    from gpu_build_startup import make_model_dir
    from gpu_bench import decode_route
    from gpu_offload import decode_ms

    from tianxia import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-7b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 16], help="new tokens per shape")
    ap.add_argument("--ngl", nargs="+", default=["all+1", "all", "half", "0"],
                    help="the -ngl values per shape: all+1 (every layer and the output), all, half, or a number")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tx-ngl-"))
    results: dict = {"cpu_threads": torch.get_num_threads(), "shapes": {}}
    lines = ["| shape | -ngl | layers on the GPU | GPU weights GiB | route | ms/token | equal tokens (of n) |",
             "|---|---|---|---|---|---|---|"]
    for shape, n_tokens in zip(args.shapes, args.tokens * len(args.shapes)):
        d = make_model_dir(root, shape)
        num_layers = json.loads((d / "config.json").read_text())["num_hidden_layers"]
        prompt = [random.Random(0).randrange(1000, 100000) for _ in range(128)]
        ref = None
        named = {"all+1": num_layers + 1, "all": num_layers, "half": num_layers // 2}
        for n in [named.get(v) or int(v) for v in args.ngl]:
            torch.cuda.empty_cache()
            llm = LLM(str(d), device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=2048,
                      max_num_batched_tokens=512, gpu_memory_utilization=0.5, n_gpu_layers=n)
            runner = llm.engine.runner
            weights = sum(t.numel() * t.element_size() for t in runner.model.parameters() if t.is_cuda)
            route = decode_route(runner)
            # twice: the host's share of a step is large here, and a lent host's speed drifts
            ms, tokens = min(decode_ms(llm, prompt, n_tokens), decode_ms(llm, prompt, n_tokens))
            ref = ref or tokens
            same = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), len(tokens))
            r = dict(n_gpu_layers=n, gpu_layers=min(n, num_layers), gpu_weights_gib=weights / 2**30, route=route,
                     ms_per_token=ms, equal_tokens=same, tokens=len(tokens))
            results["shapes"].setdefault(shape, []).append(r)
            print(f"{shape} -ngl {n}: {r}", flush=True)
            lines.append(f"| {shape} | {n} | {min(n, num_layers)} of {num_layers}"
                         f"{' + output' if n > num_layers else ''} | {weights / 2**30:.2f} | {route} | {ms:.2f} | "
                         f"{same} of {len(tokens)} |")
            del llm, runner
            torch.cuda.empty_cache()
        for f in d.iterdir():
            f.unlink()
    text = f"CPU threads: {results['cpu_threads']}\n\n" + "\n".join(lines) + "\n"
    (out / "gpu_layer_split.md").write_text(text)
    (out / "gpu_layer_split.json").write_text(json.dumps(results, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
