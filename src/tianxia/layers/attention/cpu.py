"""Paged attention in plain PyTorch (``scaled_dot_product_attention``); runs on any device.

Decodes are gathered into one padded batch and computed by a single SDPA call; each prefill chunk
gets its own call, with a causal mask offset by the tokens already in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tianxia.layers.attention.backend import AttentionBackend, AttentionMetadata, register_backend


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(kv_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Context of one sequence, [length, Hk, D], from its blocks."""
    blocks = cache[block_table]  # [nb, bs, Hk, D]
    return blocks.flatten(0, 1)[:length]


@register_backend("torch")
class TorchAttention(AttentionBackend):
    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        gqa = num_heads != num_kv_heads
        k_cache, v_cache = kv_cache[0], kv_cache[1]

        nd = meta.num_decodes
        if nd:
            max_len = max(meta.seq_lens[:nd])
            nb = (max_len + meta.block_size - 1) // meta.block_size
            tables = meta.block_tables[:nd, :nb]
            keys = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, L, Hk, D]
            values = v_cache[tables].flatten(1, 2)[:, :max_len]
            pos = torch.arange(max_len, device=q.device)
            mask = (pos[None, :] < meta.seq_lens_tensor[:nd, None])[:, None, None, :]
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2).to(keys.dtype),  # [B, Hq, 1, D]
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )
            out[:nd] = o.squeeze(2).to(out.dtype)

        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            qlen, seq_len = end - start, meta.seq_lens[i]
            qi = q[start:end].transpose(0, 1)  # [Hq, qlen, D]
            if seq_len == qlen:
                # Nothing cached before this chunk: attend to the fresh K/V, plain causal.
                ki, vi = k[start:end], v[start:end]
                o = F.scaled_dot_product_attention(
                    qi, ki.transpose(0, 1).to(qi.dtype), vi.transpose(0, 1).to(qi.dtype),
                    is_causal=True, scale=scale, enable_gqa=gqa,
                )
            else:
                ki = _gather(k_cache, meta.block_tables[i], seq_len)
                vi = _gather(v_cache, meta.block_tables[i], seq_len)
                ctx = seq_len - qlen
                qpos = torch.arange(ctx, seq_len, device=q.device)
                kpos = torch.arange(seq_len, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(
                    qi.to(ki.dtype), ki.transpose(0, 1), vi.transpose(0, 1),
                    attn_mask=mask, scale=scale, enable_gqa=gqa,
                )
            out[start:end] = o.transpose(0, 1).to(out.dtype)
        return out
