"""Batched sampling: one pass over the logits of every sequence that samples this step.

Truncation (top-k, top-p) and temperature are applied to the whole batch with per-row tensors;
the draw uses the exponential-race trick (``argmax(p / q)`` with ``q ~ Exp(1)``), which equals a
categorical draw and lets seeded rows take their noise from their own generator while the rest
share one. A batch that is entirely greedy is a single ``argmax``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32; 0 for greedy rows
    top_k: torch.Tensor  # [S] int64; 0 = disabled
    top_p: torch.Tensor  # [S] float32; 1 = disabled
    generators: list[torch.Generator | None]  # per row; None = the shared generator
    banned: list[list[int]]  # per row: token ids that must not be sampled this step
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      use_k: bool, use_p: bool) -> torch.Tensor:
    """Set every logit outside each row's top-k and top-p nucleus to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if use_k:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    if use_p:
        probs = sorted_logits.softmax(dim=-1)
        # a token is kept while the mass strictly before it is below p; the top token always stays
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Return one token id per row (int64, on the CPU)."""
        logits = logits.float()
        for row, ids in enumerate(batch.banned):
            if ids:
                logits[row, ids] = float("-inf")
        if batch.all_greedy:
            return logits.argmax(dim=-1).cpu()
        greedy_rows = batch.temperature == 0
        temp = torch.where(greedy_rows, torch.ones_like(batch.temperature), batch.temperature)
        scaled = logits / temp[:, None].to(logits.device)
        if batch.any_top_k or batch.any_top_p:
            scaled = apply_top_k_top_p(
                scaled, batch.top_k.to(logits.device), batch.top_p.to(logits.device),
                batch.any_top_k, batch.any_top_p,
            )
        probs = scaled.softmax(dim=-1).cpu()
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(batch.generators) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_(generator=self.generator)
        for i, g in enumerate(batch.generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy_rows.cpu(), logits.argmax(dim=-1).cpu(), sampled)
