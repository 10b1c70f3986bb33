#!/usr/bin/env python
"""The engine core's host work that every step repeats, function by function, on the CPU.

A tiny random model (2 layers, vocabulary 512) generates 256 requests of 128 prompt tokens and
24 output tokens each (``temperature=0.8, top_p=0.95``, a seed per request: each request its own
``SamplingParams``, as served requests are), with a 2,048-token step budget; the steps the model
runner receives are kept. Then, best of 5 rounds:

- ``ModelRunner.tensors`` of the largest mixed step (2,048 rows) and of a step of 256 decodes:
  the step's ids, positions, slots, lengths and block tables packed and sent to the device;
- ``SamplingBatch.from_sequences`` for 256 sampled rows;
- the per-request deltas an engine core sends after a step of 256 decodes.

At the 0.5B shape on a GPU a step of 256 decodes takes a few milliseconds and the host's work
for the next one runs meanwhile, so these microseconds are what bounds a served step. Run it
with another tree first on ``PYTHONPATH`` to compare.

    PYTHONPATH=src python benchmarks/step_host_cpu.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def best_us(fn, n: int = 300, rounds: int = 5) -> float:
    for _ in range(5):
        fn()
    runs = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return min(runs)


def request_deltas(engine, prompts, params):
    """A call that makes the per-request deltas an engine core sends after a step of 256 decodes
    (each request one new token), by whichever path the tree on ``PYTHONPATH`` has: from the
    sequences (``request_delta``), or a cumulative ``RequestOutput`` and then a ``DeltaMaker``
    delta (before ``LLMEngine.step_deltas``)."""
    from tianxia.engine import output_processor as op

    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"d{i}", prompt, p)
    for _ in range(20):  # 16 steps of prompts at the 2,048-token budget, then decodes (24 at most)
        engine.step()
    rids = list(engine.requests)
    assert len(rids) == len(prompts)
    if hasattr(op, "request_delta"):
        def deltas() -> None:
            for rid in rids:
                seqs = engine.requests[rid]
                for seq in seqs:
                    seq.sent_tokens, seq.prompt_sent = seq.num_output_tokens - 1, True
                op.request_delta(rid, seqs, False)
        return deltas
    maker = op.DeltaMaker()
    for rid in rids:
        maker.delta(engine._output(rid))

    def old_deltas() -> None:
        for rid in rids:
            maker._sent[rid].tokens[0] = engine.requests[rid][0].num_output_tokens - 1
            maker.delta(engine._output(rid))
    return old_deltas


def main() -> int:
    import torch

    from gpu_build_startup import make_model_dir
    from tianxia import LLM, SamplingParams
    from tianxia.layers.sampler import SamplingBatch

    try:
        from tianxia.layers.sampler import sampling_terms
    except ImportError:  # an older tree, compared with this one
        sampling_terms = None

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = make_model_dir(Path(tempfile.mkdtemp(prefix="tx-step-host-")), "tiny")
    llm = LLM(str(model), device="cpu", max_num_seqs=256, max_num_batched_tokens=2048)
    runner = llm.engine.runner
    steps = []
    execute = runner.execute

    def keep(step):
        steps.append(step)
        return execute(step)

    runner.execute = keep
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(128)]} for _ in range(256)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.95, seed=i)
              for i in range(256)]
    llm.generate(prompts, params, use_tqdm=False)
    mixed = max(steps, key=lambda s: len(s.input_ids))
    decode = next(s for s in steps if len(s.input_ids) == s.num_seqs == 256)

    class Row:  # what the sampler reads of a sequence (SampledRow)
        def __init__(self, p: SamplingParams) -> None:
            self.params, self.output_token_ids, self.prompt_token_ids = p, [1] * 10, [1] * 128
            self.num_output_tokens, self.bad_words_ids, self.generator = 10, [], None
            self.sample_seed, self.grammar = p.seed, None
            if sampling_terms is not None:  # built when the sequence is made (trees since 2026-12-06)
                self.sampling_terms = sampling_terms(p)

    rows = [Row(p) for p in params]
    res = {
        f"tensors_mixed_{len(mixed.input_ids)}_rows_us": best_us(lambda: runner.tensors(mixed)),
        "tensors_decode_256_rows_us": best_us(lambda: runner.tensors(decode)),
        "sampling_batch_256_rows_us": best_us(lambda: SamplingBatch.from_sequences(rows, (0,))),
        "request_deltas_256_us": best_us(request_deltas(llm.engine, prompts, params), n=100),
    }
    for k, v in res.items():
        print(f"{k:>32}: {v:7.0f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
