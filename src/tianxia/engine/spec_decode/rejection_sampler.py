"""Verification of proposed tokens by speculative sampling (Leviathan et al. 2023, Chen et al.
2023), so that every token is distributed exactly as the target model's non-speculative sample.

A sequence with k proposals d_1..d_k has k + 1 rows of target logits; row j is processed (bans,
penalties, temperature, min-p, top-k, top-p) as if d_1..d_j were already its output, giving the
target distribution p_j. Draft d_{j+1}, drawn from q_j, is accepted with probability
min(1, p_j(d_{j+1}) / q_j(d_{j+1})); at the first rejection the token is drawn from
max(0, p_j - q_j) renormalised, and when all k are accepted a bonus token is drawn from p_k.
Prompt lookup proposes deterministically: q_j is one-hot, so d is accepted with probability
p_j(d) and a rejection draws from p_j without d. Greedy rows accept d while it is the argmax, so
greedy output is the non-speculative output token for token.

Everything runs where the logits are; the host gets one copy of the acceptance flags and one of
the final tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tianxia.layers.sampler import Sampler, SamplingBatch, may_empty_rows


class DraftedView:
    """What the sampler reads of a sequence, as if its first ``drafts`` were already output (the
    penalties, bad words and min_tokens of the row after them)."""

    __slots__ = ("seq", "drafts")

    def __init__(self, seq, drafts: list[int]) -> None:
        self.seq = seq
        self.drafts = drafts

    @property
    def params(self):
        return self.seq.params

    @property
    def sampling_terms(self) -> tuple:
        return self.seq.sampling_terms

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)

    @property
    def bad_words_ids(self) -> list[list[int]]:
        return self.seq.bad_words_ids

    @property
    def generator(self):
        return self.seq.generator

    @property
    def sample_seed(self) -> int | None:
        return self.seq.sample_seed

    @property
    def grammar(self):
        return None  # the rows of a constrained sequence are masked by ``_mask_drafted``


@dataclass
class Group:
    """One sequence's rows: ``start`` and, after it, one row per draft token."""

    start: int
    drafts: list[int]
    draft_probs: torch.Tensor | None  # [k, vocab] q of each draft, None when proposals are one-hot
    matcher: Any = None  # the grammar matcher of a constrained sequence with drafts


@dataclass
class Verified:
    tokens: list[list[int]]  # per group: its accepted drafts, then the token drawn at its last row
    logprobs: list[list | None]  # per group: (top ids, top logprobs, chosen logprob, rank) per token
    dead: list[bool]  # per group: its constraints admit no token at its last row


def _mask_drafted(backend, logits: torch.Tensor, groups: list[Group]) -> None:
    """Grammar masks of constrained sequences' rows: row j as the matcher stands after drafts
    d_1..d_j (a draft the grammar refuses ends that sequence's masking: it cannot be accepted,
    being masked itself); the matchers are rolled back afterwards."""
    advanced = [0] * len(groups)
    active = list(range(len(groups)))
    depth = 0
    while active:
        backend.apply(logits, [groups[i].start + depth for i in active], [groups[i].matcher for i in active])
        still = []
        for i in active:
            g = groups[i]
            if depth < len(g.drafts) and g.matcher.accept_token(g.drafts[depth]):
                advanced[i] += 1
                still.append(i)
        active = still
        depth += 1
    for g, n in zip(groups, advanced):
        if n:
            g.matcher.rollback(n)


def verify(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, groups: list[Group]) -> Verified:
    logits = logits.float()
    raw = logits.log_softmax(dim=-1) if any(k is not None for k in batch.num_logprobs) else None
    logits = sampler.process(logits, batch)
    constrained_drafts = [g for g in groups if g.matcher is not None]
    if constrained_drafts:
        _mask_drafted(sampler.grammar_backend, logits, constrained_drafts)
    num_rows, device = logits.shape[0], logits.device
    dead = None
    if constrained_drafts or may_empty_rows(batch, logits.shape[1]):
        dead = torch.isneginf(logits).all(dim=-1)
        if bool(dead.any()):
            logits[dead] = 0.0
        else:
            dead = None
    argmax = logits.argmax(dim=-1)
    probs = None if batch.all_greedy else sampler.probs(logits, batch)

    # the draft each row verifies (a group's last row verifies none), and its probability under q
    draft_rows = [g.start + j for g in groups for j in range(len(g.drafts))]
    accept: list[bool] = []
    if draft_rows:
        rows_t = torch.tensor(draft_rows, device=device)
        ids_t = torch.tensor([d for g in groups for d in g.drafts], device=device)
        ok = argmax[rows_t] == ids_t
        if probs is not None:
            q = torch.cat([
                torch.ones(len(g.drafts), device=device) if g.draft_probs is None else
                g.draft_probs[torch.arange(len(g.drafts), device=device),
                              torch.tensor(g.drafts, device=device)].float()
                for g in groups if g.drafts
            ])
            u = sampler.uniform([batch.generators[r] for r in draft_rows], 1)[:, 0].to(device)
            greedy = (batch.temperature == 0).to(device)[rows_t]
            ok = torch.where(greedy, ok, u * q < probs[rows_t, ids_t])
        if dead is not None:
            ok &= ~dead[rows_t]
        accept = ok.tolist()

    # the last row of each group: where its first rejection is, or its bonus row
    finals, residual_of = [], []
    pos = 0
    for g in groups:
        a = 0
        while a < len(g.drafts) and accept[pos + a]:
            a += 1
        pos += len(g.drafts)
        finals.append(g.start + a)
        residual_of.append(a if a < len(g.drafts) else None)
    final_t = torch.tensor(finals, device=device)
    tokens_t = argmax[final_t]
    if probs is not None:
        p = probs[final_t].clone()
        for i, (g, a) in enumerate(zip(groups, residual_of)):
            if a is None:
                continue
            if g.draft_probs is None:
                p[i, g.drafts[a]] = 0.0
            else:
                p[i] = (p[i] - g.draft_probs[a].float()).clamp_(min=0.0)
        # p == q leaves nothing (the draft was then accepted surely, up to rounding): draw from p
        empty = p.sum(dim=-1) <= 0
        if bool(empty.any()):
            p[empty] = probs[final_t][empty]
        drawn = sampler.draw(p, [batch.generators[f] for f in finals])
        greedy_final = (batch.temperature == 0).to(device)[final_t]
        tokens_t = torch.where(greedy_final, tokens_t, drawn)
    final_tokens = tokens_t.tolist()

    out_tokens = []
    row_tokens = [0] * num_rows
    for g, f, t in zip(groups, finals, final_tokens):
        toks = g.drafts[: f - g.start] + [t]
        out_tokens.append(toks)
        row_tokens[g.start : f + 1] = toks
    per_row = sampler.logprobs(raw, row_tokens, batch)
    logprobs = [per_row[g.start : f + 1] if per_row[g.start] is not None else None
                for g, f in zip(groups, finals)]
    dead_groups = [False] * len(groups) if dead is None else dead[final_t].tolist()
    return Verified(out_tokens, logprobs, dead_groups)
