"""Batched sampling: one pass over the logits of every sequence that samples this step.

Order, as in vLLM: log-probabilities are taken from the raw logits; then allowed/banned tokens,
``logit_bias``, and the repetition, frequency and presence penalties; greedy rows take the argmax
there; the others get temperature, min-p, top-k and top-p, then a draw by the exponential race
(``argmax(p / q)`` with ``q ~ Exp(1)``), which equals a categorical draw and lets each seeded row
take its noise from its own generator, so a seeded request's tokens do not depend on the batch.
Everything is a tensor op over the batch; Python loops only touch rows that use a rare feature
(logit_bias, allowed_token_ids, bad_words, a seed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tianxia.engine.sequence import Sequence


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32; 0 for greedy rows
    top_k: torch.Tensor  # [S] int64; 0 = disabled
    top_p: torch.Tensor  # [S] float32; 1 = disabled
    min_p: torch.Tensor  # [S] float32; 0 = disabled
    presence: torch.Tensor  # [S]
    frequency: torch.Tensor  # [S]
    repetition: torch.Tensor  # [S]
    output_ids: torch.Tensor | None  # [S, max_out] padded with -1, when penalties are used
    prompt_ids: torch.Tensor | None  # [S, max_prompt] padded with -1, for the repetition penalty
    generators: list[torch.Generator | None]
    banned: list[list[int]]  # per row: token ids that must not be sampled this step
    allowed: list[list[int] | None]  # per row: the only token ids that may be sampled
    bias: list[dict[int, float] | None]
    num_logprobs: list[int | None]
    grammars: list[Any]  # per row: an xgrammar matcher, or None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> SamplingBatch:
        params = [s.params for s in seqs]
        temps = [0.0 if p.greedy else p.temperature for p in params]
        penalized = [p.needs_penalties for p in params]
        output_ids = prompt_ids = None
        if any(penalized):
            output_ids = _pad([s.output_token_ids if pen else [] for s, pen in zip(seqs, penalized)])
            rep = [s.prompt_token_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, params)]
            prompt_ids = _pad(rep)
        banned = []
        for s in seqs:
            ids: list[int] = []
            if s.num_output_tokens < s.params.min_tokens:
                ids.extend((*eos_ids, *s.params.stop_token_ids))
            if s.bad_words_ids:
                ids.extend(_bad_word_bans(s.output_token_ids, s.bad_words_ids))
            banned.append(ids)
        sampled = [not p.greedy for p in params]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            output_ids=output_ids,
            prompt_ids=prompt_ids,
            generators=[s.generator for s in seqs],
            banned=banned,
            allowed=[p.allowed_token_ids for p in params],
            bias=[p.logit_bias for p in params],
            num_logprobs=[p.logprobs for p in params],
            grammars=[s.grammar for s in seqs],
            all_greedy=not any(sampled),
            any_top_k=any(p.top_k > 0 for p, s in zip(params, sampled) if s),
            any_top_p=any(p.top_p < 1.0 for p, s in zip(params, sampled) if s),
            any_min_p=any(p.min_p > 0.0 for p, s in zip(params, sampled) if s),
        )


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out


def _bad_word_bans(output: list[int], bad_words_ids: list[list[int]]) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    bans = []
    for word in bad_words_ids:
        prefix = word[:-1]
        if not prefix or output[-len(prefix):] == prefix:
            bans.append(word[-1])
    return bans


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] occurrence counts of the (padded with -1) token ids of each row."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32)
    idx = torch.where(ids < 0, vocab, ids)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[-1]
    out_counts = _counts(batch.output_ids, vocab).to(logits.device)
    seen = out_counts > 0
    if batch.prompt_ids is not None:
        seen_any = seen | (_counts(batch.prompt_ids, vocab).to(logits.device) > 0)
    else:
        seen_any = seen
    rep = batch.repetition.to(logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen_any, penalized, logits)
    logits = logits - batch.frequency.to(logits.device)[:, None] * out_counts
    logits = logits - batch.presence.to(logits.device)[:, None] * seen.float()
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool, use_p: bool
) -> torch.Tensor:
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


@dataclass
class SamplerOutput:
    tokens: list[int]
    # per row: None, or (top ids, top logprobs, chosen logprob, chosen rank)
    logprobs: list[tuple[list[int], list[float], float, int] | None]
    # rows whose constraints (grammar, allowed ids, bans) left no token to sample
    dead_rows: list[int] = field(default_factory=list)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar_backend = None  # set by the engine when a request is constrained

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if any(k is not None for k in batch.num_logprobs):
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = self._process(logits, batch)
        dead_rows: list[int] = []
        constrained = (any(g is not None for g in batch.grammars) or any(batch.banned)
                       or any(a is not None for a in batch.allowed))
        if constrained:
            dead = torch.isneginf(logits).all(dim=-1)
            if bool(dead.any()):
                dead_rows = dead.nonzero().flatten().tolist()
                logits[dead] = 0.0  # sample something harmless; the caller discards these rows
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1).cpu()
        else:
            tokens = self._sample(logits, batch)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, token_list, batch), dead_rows)

    def _process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        neg_inf = float("-inf")
        constrained = [i for i, g in enumerate(batch.grammars) if g is not None]
        if constrained:
            self.grammar_backend.apply(logits, constrained, [batch.grammars[i] for i in constrained])
        for row, allowed in enumerate(batch.allowed):
            if allowed is not None:
                keep = torch.full_like(logits[row], neg_inf)
                keep[allowed] = 0.0
                logits[row] += keep
        for row, bias in enumerate(batch.bias):
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
                logits[row, ids] += torch.tensor(list(bias.values()), device=logits.device)
        if batch.output_ids is not None:
            logits = apply_penalties(logits, batch)
        for row, ids in enumerate(batch.banned):
            if ids:
                logits[row, ids] = neg_inf
        return logits

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_rows = (batch.temperature == 0).to(logits.device)
        greedy_tokens = logits.argmax(dim=-1)
        temp = torch.where(batch.temperature == 0, torch.ones_like(batch.temperature), batch.temperature)
        scaled = logits / temp.to(logits.device)[:, None]
        if batch.any_min_p:
            probs = scaled.softmax(dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p.to(logits.device)[:, None]
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))
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
        return torch.where(greedy_rows.cpu(), greedy_tokens.cpu(), sampled)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], batch: SamplingBatch):
        if raw is None:
            return [None] * len(tokens)
        rows = [i for i, k in enumerate(batch.num_logprobs) if k is not None]
        k_max = max(batch.num_logprobs[i] for i in rows)
        sub = raw[rows]
        top_vals, top_ids = sub.topk(max(k_max, 1), dim=-1)
        chosen_ids = torch.tensor([tokens[i] for i in rows], device=raw.device)
        chosen = sub.gather(1, chosen_ids[:, None]).squeeze(1)
        ranks = (sub > chosen[:, None]).sum(dim=-1) + 1
        out: list = [None] * len(tokens)
        top_vals, top_ids = top_vals.cpu().tolist(), top_ids.cpu().tolist()
        chosen, ranks = chosen.cpu().tolist(), ranks.cpu().tolist()
        for j, i in enumerate(rows):
            k = batch.num_logprobs[i]
            out[i] = (top_ids[j][:k], top_vals[j][:k], chosen[j], ranks[j])
        return out
