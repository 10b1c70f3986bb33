"""Long-context retrieval with each KV cache type: a key planted at several depths of a long prompt.

A pass phrase ("The secret key is NNNNNN.") sits at depth d (a fraction of the filler: the GPL-3
paragraphs of benchmarks/data, repeated) of a prompt of about --length tokens, which ends by
asking for it; the model answers greedily and the answer is scored by whether it contains the key.
Every KV type sees the same prompts. Issue #30's bar: a quantized cache is no worse than the
float one by more than one depth.

    PYTHONPATH=src python benchmarks/kv_retrieval.py --model qwen2.5-coder-0.5b --length 8192 \\
        --depths 0 0.25 0.5 0.75 1 --kv auto q8_0 q4_0
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from tianxia import LLM, SamplingParams

FILLER = Path(__file__).parent / "data" / "gpl-3.0-paragraphs.txt"
QUESTION = "\n\nWhat is the secret key? Answer with the number only.\nThe secret key is"


def build_prompt(tokenizer, length: int, depth: float, key: str) -> str:
    """About ``length`` tokens of filler with the key sentence at ``depth`` (0: start, 1: end)."""
    paragraphs = FILLER.read_text(encoding="utf-8").split("\n")
    body, n = [], 0
    while n < length:
        for p in paragraphs:
            body.append(p)
            n += len(tokenizer.encode(p, add_special_tokens=False)) + 1
            if n >= length:
                break
    body.insert(round(depth * len(body)), f"The secret key is {key}. Remember it.")
    return "\n".join(body) + QUESTION


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--length", type=int, default=8192, help="filler tokens (about)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--kv", nargs="+", default=["auto", "q8_0", "q4_0"])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    rng = random.Random(0)
    keys = [f"{rng.randrange(10**5, 10**6)}" for _ in args.depths]
    results = []
    for kv in args.kv:
        llm = LLM(args.model, kv_cache_dtype=kv, max_model_len=args.length + 512, kv_cache_memory="1GiB",
                  enable_prefix_caching=False)
        tok = llm.get_tokenizer()
        for depth, key in zip(args.depths, keys):
            prompt = build_prompt(tok, args.length, depth, key)
            t0 = time.perf_counter()
            out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
            answer = out.outputs[0].text
            row = {"kv": kv, "depth": depth, "prompt_tokens": len(out.prompt_token_ids), "key": key,
                   "answer": answer.strip(), "found": key in answer, "seconds": round(time.perf_counter() - t0, 1)}
            results.append(row)
            print(json.dumps(row), flush=True)
        del llm
    print("\nkv      " + " ".join(f"{d:>5}" for d in args.depths))
    for kv in args.kv:
        marks = ["  yes" if r["found"] else "   no" for r in results if r["kv"] == kv]
        print(f"{kv:<8}" + " ".join(marks))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
