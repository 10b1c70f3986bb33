"""Models and quantization against llama.cpp: quantize / perplexity / convert, side by side.

    # llama.cpp built from the sources vendored in llama-cpp-python's sdist (any build works):
    #   LLAMA_BIN=.../build/bin (llama-perplexity, llama-quantize, libllama.so)
    #   PYTHONPATH=<llama_cpp_python sdist>:<diskcache> LLAMA_CPP_LIB_PATH=$LLAMA_BIN
    python benchmarks/models_quant.py --llama-bin $LLAMA_BIN [--chunks 4] [--types Q8_0,Q4_K_M]

What it measures (SmolLM2-135M, starting from an F16 GGUF of the pulled Q4_1 file's dequantized
weights, so every type is quantized from the same numbers):

1. ``tianxia quantize`` for each type: size, bits/weight, and perplexity on a fixed text
   (``benchmarks/data/gpl-3.0-paragraphs.txt``, ctx 512) with ``tianxia perplexity`` and with
   llama.cpp's ``llama-perplexity`` on the *same* file.
2. Q4_K_M: the per-tensor types against ``llama-quantize`` on the same F16 file, and the share of
   bit-identical blocks.
3. Our Q4_K_M in llama.cpp (llama-cpp-python): greedy tokens against ours on 3 prompts.
4. ``tianxia convert`` of tiny random models of every architecture: llama.cpp loads each GGUF
   and its logits are compared with ours.

Results go to ``benchmarks/results/models_quant.json``; the markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "benchmarks" / "data" / "gpl-3.0-paragraphs.txt"
TYPES = ["F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "Q3_K_M", "Q2_K"]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]


def llama_perplexity(bin_dir: Path, model: Path, ctx: int, chunks: int) -> float | None:
    exe = bin_dir / "llama-perplexity"
    if not exe.exists():
        return None
    out = subprocess.run(
        [str(exe), "-m", str(model), "-f", str(TEXT), "-c", str(ctx), "--chunks", str(chunks), "-t",
         str(os.cpu_count() or 1)], capture_output=True, text=True, check=True,
    )
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    return float(m.group(1)) if m else None


def compare_quantize(bin_dir: Path, f16: Path, ours: Path, tmp: Path) -> dict:
    import gguf
    import numpy as np

    exe = bin_dir / "llama-quantize"
    if not exe.exists():
        return {}
    theirs = tmp / "llamacpp-q4_k_m.gguf"
    subprocess.run([str(exe), str(f16), str(theirs), "Q4_K_M"], capture_output=True, check=True)
    a = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    mismatched = [n for n in a if a[n].tensor_type != b[n].tensor_type]
    same: dict[str, list[int]] = {}
    for n, t in a.items():
        if t.tensor_type.name in ("F32", "F16") or n in mismatched:
            continue
        ts = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
        x, y = np.asarray(t.data).reshape(-1, ts), np.asarray(b[n].data).reshape(-1, ts)
        s = same.setdefault(t.tensor_type.name, [0, 0])
        s[0] += int((x == y).all(1).sum())
        s[1] += len(x)
    return {
        "tensors": len(a), "type_mismatches": mismatched,
        "identical_blocks": {k: round(v[0] / v[1], 4) for k, v in same.items()},
        "bytes_llama_cpp": theirs.stat().st_size, "bytes_ours": ours.stat().st_size,
    }


def greedy_vs_llama_cpp(model: Path, n: int = 32) -> list[dict]:
    import llama_cpp
    import numpy as np

    from tianxia import LLM, SamplingParams

    llm = LLM(str(model), max_model_len=512, kv_cache_memory="128MiB")
    tok = llm.get_tokenizer()
    ref = llama_cpp.Llama(str(model), n_ctx=512, logits_all=True, verbose=False)
    rows = []
    for p in PROMPTS:
        ids = tok.encode(p)
        ours = llm.generate({"prompt_token_ids": ids},
                            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
        ref.reset()
        ref.eval(ids)
        theirs, gaps = [], []
        for _ in range(n):
            logits = np.array(ref.scores[ref.n_tokens - 1])
            top = np.sort(logits)[-2:]
            gaps.append(float(top[1] - top[0]))
            t = int(logits.argmax())
            theirs.append(t)
            ref.eval([t])
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        rows.append({"prompt": p, "equal": ours == theirs, "first_divergence": first,
                     "gap_at_divergence": None if first is None else gaps[first],
                     "text": tok.decode(ours)})
    return rows


def convert_in_llama_cpp(tmp: Path) -> list[dict]:
    import llama_cpp
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from test_model_families import PROMPT, make_model, make_tiny_tokenizer

    from tianxia import LLM
    from tianxia.tools.convert import convert

    tokdir = tmp / "tok"
    make_tiny_tokenizer(tokdir)
    rows = []
    for arch in ["llama", "qwen2", "qwen3", "phi3", "glm4", "gemma2", "gemma3", "gpt2", "falcon"]:
        # neutral directory names: llama.cpp special-cases vocabularies by general.name ("phi3")
        d = make_model(arch, tmp / f"tiny-{len(rows)}", tokdir)
        out = tmp / f"tiny-{len(rows)}.gguf"
        convert(d, out, "f32", progress=False)
        row = {"arch": arch}
        try:
            ref = llama_cpp.Llama(str(out), n_ctx=256, logits_all=True, verbose=False)
            ids = LLM(str(out), num_kv_blocks=32).get_tokenizer().encode(PROMPT)
            ours = LLM(str(out), num_kv_blocks=32).engine.score(ids).numpy()
            ref.eval(ids)
            theirs = np.array(ref.scores[: len(ids)])
            row.update(loads=True, rel_err=float(np.abs(ours - theirs).max() / np.abs(ours).max()),
                       same_argmax=float((ours.argmax(-1) == theirs.argmax(-1)).mean()))
        except Exception as e:  # noqa: BLE001  (a GGUF llama.cpp refuses is a result too)
            row.update(loads=False, error=f"{type(e).__name__}: {e}")
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--llama-bin", type=Path, default=Path(os.environ.get("LLAMA_BIN", "/nonexistent")))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--skip", default="", help="comma list of: ppl,quantize,greedy,convert")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "models_quant.json")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    from tianxia.loader.hub import resolve_model
    from tianxia.quant.quantize import quantize_gguf
    from tianxia.tools.perplexity import run_perplexity

    results: dict = {"model": args.model, "text": TEXT.name, "ctx": args.ctx, "chunks": args.chunks,
                     "machine": f"{os.cpu_count()} CPU cores", "types": []}
    tmp = Path(tempfile.mkdtemp(prefix="tianxia-mq-"))
    src = resolve_model(args.model)
    f16 = tmp / "f16.gguf"
    if args.types:
        quantize_gguf(src, f16, "F16", progress=False)
    files = {}
    for name in filter(None, args.types.split(",")):
        path = f16 if name == "F16" else tmp / f"{name}.gguf"
        if name != "F16":
            rep = quantize_gguf(f16, path, name, progress=False)
            secs = rep.seconds
        else:
            secs = 0.0
        files[name] = path
        row = {"type": name, "bytes": path.stat().st_size, "quantize_s": round(secs, 1)}
        if "ppl" not in skip:
            t0 = time.perf_counter()
            ours = run_perplexity(str(path), TEXT, ctx=args.ctx, chunks=args.chunks, progress=False)
            row.update(ppl=round(ours.ppl, 4), ppl_stderr=round(ours.stderr, 4), scored=ours.count,
                       ppl_s=round(time.perf_counter() - t0, 1))
            theirs = llama_perplexity(args.llama_bin, path, args.ctx, args.chunks)
            if theirs is not None:
                row.update(ppl_llama_cpp=theirs, ppl_diff_pct=round(100 * (ours.ppl - theirs) / theirs, 3))
        print(json.dumps(row), flush=True)
        results["types"].append(row)
    if "quantize" not in skip and "Q4_K_M" in files:
        results["q4_k_m_vs_llama_quantize"] = compare_quantize(args.llama_bin, f16, files["Q4_K_M"], tmp)
        print(json.dumps(results["q4_k_m_vs_llama_quantize"]), flush=True)
    if "greedy" not in skip and "Q4_K_M" in files:
        results["q4_k_m_greedy_vs_llama_cpp"] = greedy_vs_llama_cpp(files["Q4_K_M"])
        print(json.dumps(results["q4_k_m_greedy_vs_llama_cpp"]), flush=True)
    if "convert" not in skip:
        results["convert_in_llama_cpp"] = convert_in_llama_cpp(tmp)
        print(json.dumps(results["convert_in_llama_cpp"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))

    base = next((r for r in results["types"] if r["type"] == "F16"), None)
    print("\n| type | size (MiB) | bits/weight | PPL (tianxia) | PPL (llama.cpp) | diff |")
    print("|---|---|---|---|---|---|")
    n_params = None
    if base:
        n_params = base["bytes"] * 8 / 16  # F16: ~16 bits per weight (the f32 norms are negligible)
    for r in results["types"]:
        bpw = f"{8 * r['bytes'] / n_params:.2f}" if n_params else ""
        ppl = r.get("ppl", "")
        lc = r.get("ppl_llama_cpp", "")
        diff = f"{r['ppl_diff_pct']:+.2f}%" if "ppl_diff_pct" in r else ""
        print(f"| {r['type']} | {r['bytes'] / 2**20:.1f} | {bpw} | {ppl} | {lc} | {diff} |")
    return 0 if all(math.isfinite(r.get("ppl", 0.0)) for r in results["types"]) else 1


if __name__ == "__main__":
    sys.exit(main())
