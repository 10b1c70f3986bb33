"""The API side's work per streamed token: ``OutputProcessor.process`` over 256 requests x 64
steps of one random token each (the engine's deltas as a server receives them), with the tokenizer
of ``--tokenizer-dir``; per token, median of five runs, through ``tokenizers``' ``DecodeStream``
and through the Python window (``--python-window``). Nothing reads the snapshots, so what a
stream that fell behind skips is not counted: each snapshot is built when a stream reads it.

    python benchmarks/detokenize_cpu.py --tokenizer-dir TOK
"""

from __future__ import annotations

import argparse
import random
import time

from transformers import AutoTokenizer

import tianxia.engine.output_processor as op_module
from tianxia.engine.output_processor import ChoiceDelta, OutputProcessor, RequestDelta
from tianxia.sampling_params import SamplingParams


def run(tok, requests: int, steps: int, python_window: bool) -> float:
    r = random.Random(0)
    processor = OutputProcessor(tok)
    if python_window:
        processor._backend = None
    params = SamplingParams(max_tokens=steps, temperature=0)
    prompts = [[r.randrange(1000, 30000) for _ in range(128)] for _ in range(requests)]
    for i in range(requests):
        processor.add(str(i), params)
    deltas = [[RequestDelta(str(i), [ChoiceDelta(0, [r.randrange(1000, 30000)], None, None,
                                                 "length" if t == steps - 1 else None, None)],
                            t == steps - 1, prompt_token_ids=prompts[i] if t == 0 else None)
               for i in range(requests)] for t in range(steps)]
    t0 = time.perf_counter()
    for step in deltas:
        for d in step:
            processor.process(d)
    return (time.perf_counter() - t0) / (requests * steps) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    assert op_module.rust_tokenizer(tok) is not None, "a fast tokenizer is needed for DecodeStream"
    for name, window in (("DecodeStream", False), ("Python window", True)):
        us = sorted(run(tok, args.requests, args.steps, window) for _ in range(5))[2]
        print(f"{name:>14}: {us:.1f} us per token")


if __name__ == "__main__":
    main()
