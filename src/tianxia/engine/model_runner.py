"""Turns a scheduled step into one flat forward pass, then samples.

The batch is the concatenation of every scheduled sequence's new tokens (no padding), with their
positions, the cache slot each new token's K/V goes to, and each sequence's block table.
"""

from __future__ import annotations

import logging

import torch

from tianxia.config import CacheConfig, ModelConfig
from tianxia.engine.sequence import Sequence
from tianxia.layers.attention import AttentionMetadata
from tianxia.layers.sampler import Sampler, SamplingBatch

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * _DTYPE_BYTES[dtype]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        kv_dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.config = model_config
        self.device = device
        self.block_size = cache_config.block_size
        per_block = kv_bytes_per_token(model_config, kv_dtype) * self.block_size
        self.num_blocks = cache_config.num_blocks or max(1, cache_config.kv_cache_memory // per_block)
        shape = (
            model_config.num_hidden_layers, 2, self.num_blocks, self.block_size,
            model_config.num_key_value_heads, model_config.head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler(seed)
        self.eos_ids: tuple[int, ...] = model_config.eos_token_ids

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _prepare(self, scheduled: list[tuple[Sequence, int]]):
        # decodes (one new token) first, so the attention backend can batch them densely
        order = sorted(scheduled, key=lambda x: x[1] != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens, query_lens, starts = [], [], [0]
        bs = self.block_size
        for seq, n in order:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            query_lens.append(n)
            starts.append(starts[-1] + n)
        max_blocks = max(len(seq.block_table) for seq, _ in order)
        tables = torch.zeros(len(order), max_blocks, dtype=torch.int64)
        for i, (seq, _) in enumerate(order):
            tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int64)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            seq_lens=seq_lens,
            query_lens=query_lens,
            query_start_loc=starts,
            num_decodes=sum(1 for n in query_lens if n == 1),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            block_size=bs,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return order, ids, pos, meta

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> dict[int, int]:
        """Run one step; returns ``{seq_id: new_token}`` for sequences whose prompt is now done."""
        order, ids, pos, meta = self._prepare(scheduled)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        samplers = [
            (i, seq) for i, (seq, n) in enumerate(order) if seq.num_computed_tokens + n == len(seq)
        ]
        if not samplers:
            return {}
        last = torch.tensor([meta.query_start_loc[i + 1] - 1 for i, _ in samplers], device=self.device)
        logits = self.model.compute_logits(hidden[last])
        seqs = [seq for _, seq in samplers]
        tokens = self.sampler(logits, self.sampling_batch(seqs, logits.shape[-1]))
        return {seq.seq_id: int(t) for seq, t in zip(seqs, tokens.tolist())}

    def sampling_batch(self, seqs: list[Sequence], vocab: int) -> SamplingBatch:
        temps = [0.0 if s.params.greedy else s.params.temperature for s in seqs]
        banned: list[list[int]] = []
        for s in seqs:
            p = s.params
            if s.num_output_tokens < p.min_tokens:
                banned.append([t for t in (*self.eos_ids, *p.stop_token_ids) if t < vocab])
            else:
                banned.append([])
        return SamplingBatch(
            temperature=torch.tensor(temps, dtype=torch.float32),
            top_k=torch.tensor([s.params.top_k for s in seqs], dtype=torch.int64),
            top_p=torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32),
            generators=[s.generator for s in seqs],
            banned=banned,
            all_greedy=all(t == 0.0 for t in temps),
            any_top_k=any(s.params.top_k > 0 and not s.params.greedy for s in seqs),
            any_top_p=any(s.params.top_p < 1.0 and not s.params.greedy for s in seqs),
        )

    @torch.inference_mode()
    def prompt_logits(self, seq: Sequence, chunk: int) -> torch.Tensor:
        """Logits at every position of an already-allocated sequence, computed in chunks."""
        rows = []
        while seq.num_computed_tokens < len(seq):
            n = min(chunk, len(seq) - seq.num_computed_tokens)
            _, ids, pos, meta = self._prepare([(seq, n)])
            hidden = self.model(ids, pos, self.kv_caches, meta)
            rows.append(self.model.compute_logits(hidden).cpu())
            seq.num_computed_tokens += n
        return torch.cat(rows)
