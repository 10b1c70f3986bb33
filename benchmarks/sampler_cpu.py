#!/usr/bin/env python
"""The sampler's cost per decode step on real logits, against a full sort and a noise race.

    python benchmarks/sampler_cpu.py [--model PATH.gguf] [--rows 16] [--threads 2] [--random-prompts]

Greedy decoding of 16 prompts with the model records the logits of each step: real, peaked
distributions of text prompts, or with ``--random-prompts`` the flat ones that prompts of 128
random token ids give (the serving benchmarks' workload). Each sampling setting then draws a
token for every row of every step, alternating calls between:

- tianxia's ``Sampler`` (top-k / top-p among the largest logits found by ``topk``, a wider
  nucleus by its floor, the race run over the candidates where they hold the kept tokens), and
- the peer: the same order of operations with a full descending sort of every row for top-k /
  top-p and a race of exponential noises over the whole vocabulary (``argmax(p / q)``), as
  vLLM's torch fallback samples.

Prints milliseconds per step (median over the steps) and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULT_MODEL = "~/.cache/tianxia/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
SETTINGS = {
    "temperature 1.0": {"temperature": 1.0},
    "temperature 0.8, top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top-k 40, top-p 0.9": {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
    "min-p 0.05": {"temperature": 1.0, "min_p": 0.05},
    # llama.cpp's defaults (llama-server, llama-cli)
    "top-k 40, top-p 0.95, min-p 0.05": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
}


def peer_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    scaled = logits / temperature
    if min_p > 0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < probs.max(-1, keepdim=True).values * min_p, float("-inf"))
    if top_k or top_p < 1:
        values, order = scaled.sort(-1, descending=True)
        if top_k:
            values[:, top_k:] = float("-inf")
        probs = values.softmax(-1)
        values = values.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter_(-1, order, values)
    probs = scaled.softmax(-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


def batch_for(rows: int, **params):
    """A step of ``rows`` engine sequences of one request's parameters, as the engine builds it."""
    from tianxia import SamplingParams
    from tianxia.engine.sequence import Sequence
    from tianxia.layers.sampler import SamplingBatch

    shared = SamplingParams(**params)
    return SamplingBatch.from_sequences([Sequence(str(i), None, [0], shared) for i in range(rows)], eos_ids=())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=16, help="sequences per decode step")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--random-prompts", action="store_true",
                    help="prompts of 128 random token ids instead of text")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_vs_llamacpp import PROMPTS

    from tianxia import LLM, SamplingParams
    from tianxia.layers.sampler import Sampler

    llm = LLM(os.path.expanduser(args.model), threads=args.threads, kv_cache_memory="256MiB", max_model_len=1024)
    model = llm.engine.runner.model
    steps: list[torch.Tensor] = []
    compute = model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        steps.append(out.clone())
        return out

    model.compute_logits = recorded
    prompts: list = PROMPTS[: args.rows]
    if args.random_prompts:
        gen = torch.Generator().manual_seed(0)
        vocab = llm.get_tokenizer().vocab_size
        prompts = [{"prompt_token_ids": torch.randint(vocab, (128,), generator=gen).tolist()}
                   for _ in range(args.rows)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True),
                 use_tqdm=False)
    steps = [s for s in steps if s.shape[0] == args.rows]
    print(f"{len(steps)} steps of {args.rows} rows x {steps[0].shape[1]} logits, {torch.get_num_threads()} threads")
    print("| setting | tianxia ms/step | peer ms/step | peer / tianxia |\n|---|---|---|---|")
    sampler = Sampler(0)
    for name, kw in SETTINGS.items():
        opts = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw}
        batch = batch_for(args.rows, **opts)
        ours, peer = [], []
        for logits in steps:
            x = logits.clone()  # the sampler works in place on the step's logits, as in the engine
            t = time.perf_counter()
            sampler(x, batch)
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            peer_sample(logits, **opts)
            peer.append(time.perf_counter() - t)
        a, b = statistics.median(ours) * 1e3, statistics.median(peer) * 1e3
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.1f}x |")


if __name__ == "__main__":
    with torch.inference_mode():  # as the engine runs the model and the sampler
        main()
