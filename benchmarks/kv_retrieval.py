"""Long-context retrieval with each KV cache type: a key planted at several depths of a long prompt.

A pass phrase ("The secret key is NNNNNN.") sits at depth d (a fraction of the filler: the GPL-3
paragraphs of benchmarks/data, repeated) of a prompt of about --length tokens, which ends by
asking for it; the model answers greedily and the answer is scored by whether it contains the key.
Every KV type sees the same prompts. Issue #30's bar: a quantized cache is no worse than the
float one by more than one depth.

    PYTHONPATH=src python benchmarks/kv_retrieval.py --model qwen2.5-coder-0.5b --length 8192 \\
        --depths 0 0.25 0.5 0.75 1 --kv auto q8_0 q4_0

With ``--llama-server PATH`` the same prompts go to llama.cpp's server on the same GGUF file, with
``-ctk/-ctv`` of each ``--llama-kv`` type (flash attention on, which its quantized V cache needs),
as the peer for the same check.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
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


def llama_cpp_answers(binary: str, model: Path, kv: str, prompts: list[str], ctx: int, threads: int) -> list[str]:
    """Greedy 8-token answers of llama.cpp's server for ``prompts``, its cache of type ``kv``."""
    import httpx

    port = 18000 + random.Random(kv).randrange(1000)
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen([binary, "-m", str(model), "--port", str(port), "-c", str(ctx), "-t", str(threads),
                             "-tb", str(threads), "-np", "1", "-fa", "on", "-ctk", kv, "-ctv", kv],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.5)
        answers = []
        for prompt in prompts:
            r = httpx.post(base + "/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0,
                                                       "cache_prompt": False}, timeout=1800)
            r.raise_for_status()
            answers.append(r.json()["content"])
        return answers
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--length", type=int, default=8192, help="filler tokens (about)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--kv", nargs="*", default=["auto", "q8_0", "q4_0"], help="tianxia's KV types (none: llama.cpp only)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--llama-server", default=None, help="also ask llama.cpp's server (path to the binary)")
    ap.add_argument("--llama-kv", nargs="+", default=["f16", "q8_0", "q4_0"], help="its -ctk/-ctv types")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
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
    labels = list(args.kv)
    if args.llama_server:
        from tianxia.loader.hub import resolve_model

        llm_tok = LLM(args.model, kv_cache_memory="64MiB", max_model_len=args.length + 512).get_tokenizer()
        prompts = [build_prompt(llm_tok, args.length, depth, key) for depth, key in zip(args.depths, keys)]
        for kv in args.llama_kv:
            t0 = time.perf_counter()
            answers = llama_cpp_answers(args.llama_server, resolve_model(args.model), kv, prompts,
                                        args.length + 1024, args.threads)
            label = f"llama.cpp {kv}"
            labels.append(label)
            for depth, key, answer in zip(args.depths, keys, answers):
                row = {"kv": label, "depth": depth, "key": key, "answer": answer.strip(), "found": key in answer,
                       "seconds": round((time.perf_counter() - t0) / len(prompts), 1)}
                results.append(row)
                print(json.dumps(row), flush=True)
    print("\nkv               " + " ".join(f"{d:>5}" for d in args.depths))
    for kv in labels:
        marks = ["  yes" if r["found"] else "   no" for r in results if r["kv"] == kv]
        print(f"{kv:<17}" + " ".join(marks))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
