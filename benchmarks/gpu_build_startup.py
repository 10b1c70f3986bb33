"""``tianxia build`` cold and warm: engine start-up of a Qwen2.5-0.5B-shaped model on a GPU.

Saves a random-weight Qwen2.5-0.5B-shaped model (and a word-level tokenizer of its vocabulary)
as a Hugging Face directory, then runs ``tianxia build`` on it twice, each in a fresh process with
the same (initially empty) ``$TIANXIA_HOME``: the first compiles and autotunes every kernel (cold),
the second finds them in the build cache (warm). Prints and writes ``build_startup.json``.

    PYTHONPATH=src python benchmarks/gpu_build_startup.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def make_model_dir(root: Path, shape: str = "qwen2.5-0.5b", tokenizer_dir: Path | None = None) -> Path:
    """A random-weight model of ``shape`` saved as a Hugging Face directory, with the tokenizer of
    ``tokenizer_dir`` (e.g. Qwen2.5's, saved with ``save_pretrained``) or else one of
    :func:`word_tokenizer`'s, the size of its vocabulary."""
    import gpu_bench as gb

    d = root / f"{shape}-random"
    hf = gb.build_hf(shape, "cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16)
    hf.save_pretrained(d)
    vocab = hf.config.vocab_size
    del hf
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            shutil.copy(f, d / f.name)
        return d
    # the end-of-sequence token is an added one past the model's vocabulary, as before: the
    # engine ignores it, and no id of the model is special
    word_tokenizer(vocab).save_pretrained(d)
    return d


LETTERS = "abcdefghij"


def word(i: int) -> str:
    """Word ``i`` (0-99) of the random-weight models' own tokenizer: one token."""
    return "t" + "".join(LETTERS[int(c)] for c in str(i))


def word_tokenizer(vocab: int):
    """A byte-level BPE of ``vocab`` ids whose 100 words (:func:`word`) are one token each, with
    or without the space before them, and whose other ids decode to plain ASCII words. A
    word-level model would be simpler, but transformers 5 loads a qwen2 directory's tokenizer as
    Qwen2Tokenizer, which rebuilds it from vocab and merges (and splits digits off letters): a
    word-level one then encodes every text to nothing."""
    import gpu_bench as gb
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = list(LETTERS)
    pieces = ["t", "Ġ", *letters, "Ġt"]
    merges = [("Ġ", "t")]
    for lead in ("t", "Ġt"):
        for d in letters:
            pieces.append(lead + d)
            merges.append((lead, d))
        for d in letters:
            for e in letters:
                pieces.append(lead + d + e)
                merges.append((lead + d, e))
    pieces += [f"Ġw{i}" for i in range(vocab - len(pieces))]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{gb.EOS}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--max-num-seqs", default="256")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tx-build-"))
    t0 = time.perf_counter()
    model_dir = make_model_dir(root)
    print(f"model saved in {time.perf_counter() - t0:.1f}s", flush=True)
    env = dict(os.environ, TIANXIA_HOME=str(root / "home"))
    env.pop("TRITON_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "tianxia.cli", "build", str(model_dir), "--max-num-seqs", args.max_num_seqs,
           "--max-model-len", "2048", "--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.85"]
    results = {}
    for run in ("cold", "warm"):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-5000:])
            results[run] = {"error": r.stderr[-2000:]}
            break
        manifest = json.loads(r.stdout[r.stdout.index("{"):])
        results[run] = {"process_s": round(wall, 2), **manifest}
        print(f"{run}: process {wall:.1f}s, engine start-up {manifest['startup_s']}s, "
              f"build {manifest['build_s']}s", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "build_startup.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0 if all("error" not in v for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
