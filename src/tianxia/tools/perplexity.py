"""``tianxia perplexity -m MODEL -f TEXT [-c CTX]``, computed as llama.cpp's ``llama-perplexity``.

The method of ``perplexity()`` in llama.cpp's ``tools/perplexity/perplexity.cpp``: tokenize the
whole text (with BOS when the vocabulary adds one), cut it into ``n_chunk = len // ctx`` chunks
of ``ctx`` tokens, run each chunk from an empty cache with its first token replaced by BOS (when
BOS is added), and score only the second half: the logits at positions ``ctx/2 .. ctx-2`` against
the next tokens. The estimate is ``exp(mean NLL)`` over all scored tokens, with llama.cpp's
standard error ``sqrt(var(NLL) / (count - 1)) * PPL``.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class PerplexityResult:
    ppl: float
    stderr: float
    n_tokens: int
    n_chunks: int
    ctx: int
    count: int
    seconds: float
    chunk_ppl: list[float] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"perplexity over {self.n_chunks} chunks of {self.ctx} tokens ({self.count} scored, "
            f"{self.n_tokens} in the text), {self.seconds:.1f}s\n"
            f"Final estimate: PPL = {self.ppl:.4f} +/- {self.stderr:.5f}"
        )


def chunk_nll(logits: torch.Tensor, tokens: list[int], first: int) -> torch.Tensor:
    """Negative log-likelihoods of ``tokens[first+1:]`` given the logits at ``first .. n-2``."""
    lp = torch.log_softmax(logits[first:-1].double(), dim=-1)
    target = torch.tensor(tokens[first + 1 :], dtype=torch.int64)
    return -lp.gather(1, target[:, None]).squeeze(1)


def perplexity_of_tokens(score, tokens: list[int], ctx: int, bos_id: int | None, add_bos: bool,
                         chunks: int = -1, progress: bool = False, out=sys.stderr):
    """Run llama-perplexity's loop with ``score(ids) -> logits [len, vocab]``."""
    if len(tokens) < 2 * ctx:
        raise ValueError(f"need at least {2 * ctx} tokens for a context of {ctx}; the text has {len(tokens)}")
    n_chunk = len(tokens) // ctx
    if chunks >= 0:
        n_chunk = min(n_chunk, chunks)
    first = ctx // 2
    nll = nll2 = 0.0
    count = 0
    history = []
    for i in range(n_chunk):
        ids = list(tokens[i * ctx : (i + 1) * ctx])
        if add_bos and bos_id is not None:
            ids[0] = bos_id
        # the targets are the original tokens (only position 0 was replaced, and it is never a target)
        values = chunk_nll(score(ids), ids, first)
        nll += float(values.sum())
        nll2 += float((values * values).sum())
        count += len(values)
        history.append(math.exp(nll / count))
        if progress:
            print(f"[{i + 1}]{history[-1]:.4f},", end="", file=out, flush=True)
    if progress:
        print(file=out)
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    stderr = math.sqrt(var / (count - 1)) * ppl if var > 0 else float("nan")
    return ppl, stderr, n_chunk, count, history


def run_perplexity(model: str, text_file: str | Path, *, ctx: int = 512, chunks: int = -1, batch: int = 2048,
                   threads: int | None = None, dtype: str = "float32", progress: bool = True,
                   kv_cache_dtype: str = "auto", cpu_activations: str = "int8",
                   calculate_kv_scales: bool | None = None) -> PerplexityResult:
    from tianxia import LLM

    t0 = time.perf_counter()
    text = Path(text_file).read_text(encoding="utf-8")
    llm = LLM(model, max_model_len=ctx, max_num_batched_tokens=min(batch, ctx), dtype=dtype,
              threads=threads, enable_prefix_caching=False, num_kv_blocks=ctx // 16 + 2, max_num_seqs=1,
              kv_cache_dtype=kv_cache_dtype, cpu_activations=cpu_activations,
              calculate_kv_scales=calculate_kv_scales)
    tok = llm.get_tokenizer()
    tokens = tok.encode(text, add_special_tokens=True)
    bos = tok.bos_token_id
    add_bos = bool(tokens) and bos is not None and tokens[0] == bos
    ppl, stderr, n_chunk, count, history = perplexity_of_tokens(
        llm.engine.score, tokens, ctx, bos, add_bos, chunks, progress
    )
    return PerplexityResult(ppl, stderr, len(tokens), n_chunk, ctx, count, time.perf_counter() - t0, history)
