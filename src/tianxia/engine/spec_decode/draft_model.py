"""Proposals from a draft model: a smaller model with the target's tokenizer, run k times per
step on the sequences that speculate.

The draft has its own KV cache in the engine, indexed by the target's block tables (same block
ids and block size), so the block manager, prefix cache and preemption serve both; each sequence
records how many positions the draft's cache holds (``draft_num_computed``), and the draft's
first call of a step computes whatever it lags (the prompt, the token after a fully accepted
step) as a chunk. Greedy requests draft greedily; sampled ones draw each draft token from the
draft's distribution at the request's temperature, kept for the rejection rule.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from tianxia.engine.sequence import Sequence
from tianxia.engine.step_io import TokenRun, prepare_batch

logger = logging.getLogger(__name__)


def check_same_tokenizer(target, draft, target_vocab: int, draft_vocab: int, name: str) -> None:
    """A draft proposes token ids the target must read as the same text: same vocabulary."""
    advice = ("speculative decoding needs a draft model with the target's tokenizer (e.g. a smaller "
              "model of the same family)")
    if target_vocab != draft_vocab:
        raise ValueError(f"draft model {name!r} has {draft_vocab} logits per token, the target "
                         f"{target_vocab}: {advice}")
    a, b = target.get_vocab(), draft.get_vocab()
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
        example = f"; e.g. token {diff[0][0]!r}" if diff else ""
        raise ValueError(f"draft model {name!r} has a different tokenizer from the target "
                         f"({len(b)} tokens vs {len(a)}, {len(diff)} entries differ{example}): {advice}")


class DraftModelProposer:
    def __init__(self, runner, sampler) -> None:
        self.runner = runner  # a ModelRunner of the draft model over the target's block ids
        self.sampler = sampler  # the target's: one random stream for unseeded requests

    @classmethod
    def load(cls, spec: str, engine, target_loaded) -> DraftModelProposer:
        from tianxia.engine.llm_engine import make_runner, setup_decode
        from tianxia.layers.attention import get_backend
        from tianxia.layers.linear import use_row_invariant_linears
        from tianxia.loader import load_model

        if engine.block_manager.sliding_window is not None:
            raise ValueError("a draft model is not supported with a sliding-window target (its blocks "
                             "are given back outside the window); use method ngram")
        cfg = engine.config
        loaded = load_model(spec, dtype=engine.dtype, device=engine.device,
                            backend=get_backend(engine.device), quantization=cfg.quantization)
        check_same_tokenizer(engine.tokenizer, loaded.tokenizer, target_loaded.config.vocab_size,
                             loaded.config.vocab_size, spec)
        if hasattr(loaded.model, "int8_activations"):
            loaded.model.int8_activations = cfg.cpu_activations == "int8"
        if engine.device.type == "cpu":
            use_row_invariant_linears(loaded.model)
        cache = replace(cfg.cache, num_blocks=engine.runner.num_blocks, gpu_memory_utilization=None)
        runner = make_runner(loaded.model, loaded.config, cache, engine.device, engine.kv_dtype, cfg.seed)
        setup_decode(runner, cfg.scheduler.max_num_seqs, engine.max_model_len,
                     cfg.enforce_eager or cfg.batch_invariant)
        logger.info("draft model %s: %d layers, KV cache %.2f GiB", loaded.path,
                    loaded.config.num_hidden_layers, runner.kv_cache_bytes / 2**30)
        return cls(runner, engine.runner.sampler)

    @staticmethod
    def _restrict(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """A request's allowed token ids and logit bias apply to its drafts too: the target
        would refuse a draft outside them, so proposing one only wastes its row."""
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.allowed_token_ids is not None:
                keep = torch.full_like(logits[i], float("-inf"))
                keep[p.allowed_token_ids] = 0.0
                logits[i] += keep
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> None:
        """Replace each sequence's ``spec_token_ids`` (k placeholders, k fixed by the scheduler)
        with k draft tokens, and set ``draft_probs`` for sampled requests."""
        # the draft proposes without adapters (verification keeps it exact): TokenRun's lora_slot -1
        inputs = {s.seq_id: TokenRun(list(s.token_ids), min(s.draft_num_computed, len(s) - 1), s.block_table)
                  for s in seqs}
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        by_id = {s.seq_id: s for s in seqs}
        live = list(seqs)
        while live:
            items = [(inputs[s.seq_id], len(inputs[s.seq_id]) - inputs[s.seq_id].num_computed_tokens) for s in live]
            order, step = prepare_batch(items, self.runner.block_size)
            logits = self.runner.last_logits(step)
            rank = {id(x): i for i, (x, _) in enumerate(order)}
            rows = [rank[id(inputs[s.seq_id])] for s in live]
            logits = logits[torch.tensor(rows, device=logits.device)].float()
            self._restrict(logits, live)
            tokens = logits.argmax(dim=-1)
            temps = [s.params.temperature for s in live]
            sampled = [i for i, s in enumerate(live) if not s.params.greedy]
            if sampled:
                idx = torch.tensor(sampled, device=logits.device)
                t = torch.tensor([temps[i] for i in sampled], device=logits.device)[:, None]
                q = (logits[idx] / t).softmax(dim=-1)
                drawn = self.sampler.draw(q, [live[i].generator for i in sampled])
                tokens[idx] = drawn
                for j, i in enumerate(sampled):
                    probs[live[i].seq_id].append(q[j])
            for s, t in zip(live, tokens.tolist()):
                x = inputs[s.seq_id]
                x.num_computed_tokens = len(x)
                x.token_ids.append(t)
                drafts[s.seq_id].append(t)
            live = [s for s in live if len(drafts[s.seq_id]) < len(s.spec_token_ids)]
        for sid, d in drafts.items():
            seq = by_id[sid]
            seq.spec_token_ids = d
            seq.draft_probs = torch.stack(probs[sid]) if probs[sid] else None
            # the draft's cache now holds every position but its last draft's
            seq.draft_num_computed = inputs[sid].num_computed_tokens
