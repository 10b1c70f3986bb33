"""Mixed steps offline: the 128-in / 64-out workload through ``LLMEngine.step``, all requests at
once (prefill steps, then decode steps) against requests arriving a few per step, as a server
admits them at saturation (most steps then carry a few prompts beside ~256 decodes).

For a random-weight model of a real shape (``--shape``; ``--tokenizer-dir`` as for
``gpu_serving.py``), prints and writes one JSON row per run: output tokens/s, the median time of
a step of 250+ decodes and of a mixed step (200+ sequences, some of them prompts), the steps
launched ahead, and how many steps each route of the model runner took (``graph``: replayed
decode graphs, ``fused``: the family's fused step called directly, ``eager``: the module
forward). The runs:

- ``offline``: every request at once; ``offline_cached``: the same prompts again (prefix hits);
- ``trickle_new`` / ``trickle_new8``: new prompts, 4 / 8 added before each step;
- ``trickle_cached``: the first run's prompts again, 4 added before each step.

With ``--profile`` the last run is also profiled for 20 of its mixed steps (torch profiler tables,
by CUDA time and by host time).

    PYTHONPATH=src python benchmarks/gpu_mixed_steps.py --tokenizer-dir TOK --out /tmp/out
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


def main() -> int:
    from gpu_build_startup import make_model_dir

    from tianxia import LLM, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = make_model_dir(Path(tempfile.mkdtemp()), args.shape, args.tokenizer_dir)
    kw = {"gpu_memory_utilization": 0.85} if torch.cuda.is_available() else {}
    llm = LLM(str(model), max_num_seqs=256, max_model_len=2048, **kw)
    engine = llm.engine
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        lo, hi = (1000, vocab - 1000) if vocab > 4000 else (1, vocab - 1)  # whole words of a real vocabulary
        return [[rng.randrange(lo, hi) for _ in range(128)] for _ in range(n)]

    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": p} for p in prompts(16)], params, use_tqdm=False)  # warm-up
    count = 0

    def run(name: str, batch: list[list[int]], per_step: int | None = None, profile: bool = False) -> dict:
        nonlocal count
        todo, timeline, tokens, prof = list(batch), [], 0, None
        engine.runner.route_counts.clear()
        ahead0 = engine.num_steps_ahead
        t0 = time.perf_counter()
        k = 0
        while todo or engine.has_unfinished_requests():
            take = len(todo) if per_step is None else per_step
            for p in todo[:take]:
                engine.add_request(f"r{count}", {"prompt_token_ids": p}, params)
                count += 1
            del todo[:take]
            k += 1
            if profile and k == 150:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            t = time.perf_counter()
            outs = engine.step()
            took = time.perf_counter() - t
            if prof is not None and k == 170:
                prof.__exit__(None, None, None)
                for key in ("self_cuda_time_total", "self_cpu_time_total"):
                    table = prof.key_averages().table(sort_by=key, row_limit=30)
                    (args.out / f"profile_{name}_{key.split('_')[1]}.txt").write_text(table)
                prof = None
            sched = engine.last_applied
            if sched is not None:
                timeline.append((round(took * 1000, 2), len(sched.scheduled), sum(n for _, n in sched.scheduled)))
            tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        wall = time.perf_counter() - t0

        def median(xs: list[float]) -> float | None:
            return sorted(xs)[len(xs) // 2] if xs else None

        pure = [t for t, seqs, n in timeline if seqs == n and seqs >= 250]
        mixed = [t for t, seqs, n in timeline if seqs != n and seqs >= 200]
        row = {"name": name, "output_tok_s": round(tokens / wall), "steps": len(timeline),
               "decode_step_ms": median(pure), "mixed_step_ms": median(mixed), "mixed_steps": len(mixed),
               "steps_ahead": engine.num_steps_ahead - ahead0, "routes": dict(engine.runner.route_counts)}
        print(json.dumps(row), flush=True)
        return row

    first = prompts(args.requests)
    rows = [run("offline", first), run("offline_cached", first),
            run("trickle_cached", first, per_step=4), run("trickle_new", prompts(args.requests), per_step=4),
            run("trickle_new8", prompts(args.requests), per_step=8, profile=args.profile)]
    (args.out / "gpu_mixed_steps.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
