"""Where an offline GPU step's host time goes: ``LLM.generate`` of N sequences (the Qwen2.5-0.5B
shape, random weights, 128 random prompt ids, 64 output tokens) timed, then once more under
cProfile, greedy and sampled. At this size a decode step of 256 rows is bound by host work, so the
profile's self times name what to cut.

    python3 benchmarks/gpu_host_profile.py --out $OUT [--shape qwen2.5-0.5b] [--seqs 256]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    from gpu_build_startup import make_model_dir

    from tianxia import LLM, SamplingParams

    model = make_model_dir(Path(tempfile.mkdtemp(prefix="tx-prof-")), args.shape)
    llm = LLM(str(model), max_num_seqs=args.seqs, max_num_batched_tokens=8192, max_model_len=2048,
              enable_prefix_caching=False)
    r = random.Random(0)
    prompts = [{"prompt_token_ids": [r.randrange(1, 30000) for _ in range(128)]} for _ in range(args.seqs)]
    out = Path(args.out)
    summary = {}
    for name, sp in (("greedy", SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)),
                     ("sampled", SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.8,
                                                top_p=0.95, seed=None))):
        llm.generate(prompts[:16], sp, use_tqdm=False)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        plain = time.perf_counter() - t
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        llm.generate(prompts, sp, use_tqdm=False)
        prof.disable()
        profiled = time.perf_counter() - t
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumtime").print_stats(args.top)
        (out / f"host_profile_{name}.txt").write_text(text.getvalue())
        summary[name] = {"seconds": round(plain, 3), "output_tok_s": round(args.seqs * args.tokens / plain, 1),
                         "profiled_seconds": round(profiled, 3)}
        print(name, summary[name], flush=True)
    (out / "host_profile.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
