#!/usr/bin/env python
"""Decode throughput with LoRA adapters in the batch, against the base model, on CPU.

    python benchmarks/lora_cpu.py [--model PATH.gguf] [--streams 16] [--tokens 64] [--rank 16]
                                  [--rounds 3] [--threads 2] [--cpu-activations int8]

One engine (``enable_lora=True``) serves every setting, so they share weights, caches and the
process. Each round runs, in turn: ``--streams`` greedy requests on the base model; the same
with every request on one adapter; with the requests spread over 4 distinct adapters (a
quarter each); and the base again on an engine without ``enable_lora``. The adapters are random
PEFT adapters of ``--rank`` over all seven projections (q, k, v, o, gate, up, down), written as
PEFT files. Prompts are distinct (no prefix-cache hits) and the requests ignore EOS, so every
setting generates the same number of tokens. Prints output tokens per second (median over the
rounds, prompt time included) and each setting's ratio to the base model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_MODEL = "~/.cache/tianxia/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
PROJECTIONS = {  # checkpoint module -> (rows, columns) in units of (hidden, intermediate, kv) sizes
    "self_attn.q_proj": ("q", "h"), "self_attn.k_proj": ("kv", "h"), "self_attn.v_proj": ("kv", "h"),
    "self_attn.o_proj": ("h", "q"), "mlp.gate_proj": ("i", "h"), "mlp.up_proj": ("i", "h"),
    "mlp.down_proj": ("h", "i"),
}


def write_adapter(out: Path, config, rank: int, seed: int) -> Path:
    """A PEFT adapter directory with random A and B over every projection."""
    from safetensors.torch import save_file

    sizes = {"h": config.hidden_size, "i": config.intermediate_size, "q": config.num_attention_heads * config.head_dim,
             "kv": config.num_key_value_heads * config.head_dim}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (rows, cols) in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, sizes[cols], generator=g) / sizes[cols] ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[rows], rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": [m.split(".")[1] for m in PROJECTIONS],
    }))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-activations", default="int8")
    args = ap.parse_args()

    from tianxia import LLM, SamplingParams
    from tianxia.engine.lora_manager import LoRARequest

    model = str(Path(args.model).expanduser())
    common = dict(kv_cache_memory="512MiB", max_model_len=512, max_num_seqs=args.streams, threads=args.threads,
                  cpu_activations=args.cpu_activations)
    llm = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=args.rank, **common)
    plain = LLM(model, **common)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    config = llm.engine.model_config
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp / f"a{i}", config, args.rank, i))) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    settings = {
        "base": (llm, [None] * args.streams),
        "1 adapter": (llm, [adapters[0]] * args.streams),
        "4 adapters": (llm, [adapters[i % 4] for i in range(args.streams)]),
        "base, engine without LoRA": (plain, [None] * args.streams),
    }
    rates: dict[str, list[float]] = {name: [] for name in settings}
    counter = 0
    for _ in range(args.rounds + 1):  # the first round warms up (and loads the adapters)
        for name, (engine, loras) in settings.items():
            prompts = [f"Request {counter + i}: write a long story about the number {counter + i}."
                       for i in range(args.streams)]
            counter += args.streams
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params, use_tqdm=False, lora_request=loras if engine is llm else None)
            elapsed = time.perf_counter() - t0
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
            print(f"    round {len(rates[name]) - 1}: {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    print(f"model {Path(model).name}, {args.streams} streams x {args.tokens} tokens, rank {args.rank}, "
          f"{torch.get_num_threads()} threads, --cpu-activations {args.cpu_activations}, median of {args.rounds}")
    base = statistics.median(rates["base"][1:])
    for name, r in rates.items():
        med = statistics.median(r[1:])
        print(f"  {name:28s} {med:8.1f} tok/s  {med / base:6.2f}x base")
    print("routes:", dict(llm.engine.runner.route_counts))


if __name__ == "__main__":
    main()
