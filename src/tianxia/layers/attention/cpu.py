"""Paged attention on CPU, and in plain PyTorch (``scaled_dot_product_attention``) on any device.

On CPU with the kernels built and a float32, float16 or Q8_0/Q4_0 (``quant/kv_blocks.py``) cache, every query token of the step (the
decodes and each prompt chunk's tokens) goes through one paged-attention call over the cache,
one position at a time: a query's result then depends on its position and the cached K/V alone,
so a token's attention is the same in a prompt, in a chunk of it, after a prefix-cache hit and
in a decode step (SDPA blocks a prompt's attention by its length and reads the fresh K/V, not
the cache's). Otherwise decodes are gathered into one padded batch and computed by a single SDPA
call, and each prefill chunk gets its own call, with a causal mask offset by the tokens already
in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tianxia.layers.attention.backend import AttentionBackend, AttentionMetadata, register_backend
from tianxia.quant.cpu_kernels import CACHE_DTYPES, fused_ops
from tianxia.quant.kv_blocks import kv_row_bytes, quantize_kv

_NONE = torch.empty(0, dtype=torch.long)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if kv_cache.dtype == torch.uint8:  # Q8_0/Q4_0 block rows, each K/V head row quantized alone
        fmt = "q8_0" if kv_cache.shape[-1] == kv_row_bytes("q8_0", head_dim) else "q4_0"
        k, v = quantize_kv(k, fmt), quantize_kv(v, fmt)
    row = kv_cache.shape[-1]
    kv_cache[0].view(-1, num_kv_heads, row).index_copy_(0, slots, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, row).index_copy_(0, slots, v.to(kv_cache.dtype))


def _query_rows(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query token of the flat batch: its sequence's index and its context length (its
    position + 1)."""
    qlens = torch.tensor(meta.query_lens, device=device)
    seq_of = torch.repeat_interleave(torch.arange(len(meta.query_lens), device=device), qlens)
    ends = torch.tensor(meta.query_start_loc[1:], device=device)[seq_of]
    tokens = torch.arange(seq_of.numel(), device=device)
    return seq_of, meta.seq_lens_tensor[seq_of] - (ends - 1 - tokens)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Context of one sequence, [length, Hk, D], from its blocks."""
    blocks = cache[block_table]  # [nb, bs, Hk, D]
    return blocks.flatten(0, 1)[:length]


def _attend(q, k, v, mask, scale, gqa, softcap=None, is_causal=False):
    """SDPA over [B, H, L, D] or [H, L, D] tensors; with ``softcap`` the scores are soft-capped
    (eager path)."""
    if softcap is None:
        # torch's fused CPU kernel takes only 4-D inputs; 3-D ones (with GQA) fall to the math path,
        # about 3x slower for a prompt's attention
        batched = q.dim() == 4
        if not batched:
            q, k, v = q[None], k[None], v[None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        return o if batched else o[0]
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@register_backend("torch")
class TorchAttention(AttentionBackend):
    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        if kv_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("--kv-cache-dtype fp8 needs the Triton attention backend (CUDA); the torch "
                             "backend reads float and Q8_0/Q4_0 caches")
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        window = sliding_window
        nd = meta.num_decodes
        ext = fused_ops(q) if k_cache.dtype in CACHE_DTYPES else None
        if k_cache.dtype == torch.uint8 and ext is None:
            raise RuntimeError("a Q8_0/Q4_0 KV cache is read by the CPU kernels alone (float32, no autograd)")
        if ext is not None:
            # every query through the one-position kernel, reading K/V straight from their blocks
            if nd == meta.num_seqs:
                return ext.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor, scale,
                                        window or 0, softcap or 0.0, _NONE)
            seq_of, lens = _query_rows(meta, q.device)
            return ext.paged_decode(q, k_cache, v_cache, meta.block_tables, lens, scale, window or 0,
                                    softcap or 0.0, seq_of)
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        gqa = num_heads != num_kv_heads
        bs = meta.block_size
        if nd:
            max_len = max(meta.seq_lens[:nd])
            nb = (max_len + bs - 1) // bs
            # with a window, blocks wholly before every decode's window are not read at all
            first = 0 if window is None else max(0, min(meta.seq_lens[:nd]) - window) // bs
            tables = meta.block_tables[:nd, first:nb]
            keys = k_cache[tables].flatten(1, 2)[:, : max_len - first * bs]  # [B, L, Hk, D]
            values = v_cache[tables].flatten(1, 2)[:, : max_len - first * bs]
            pos = torch.arange(first * bs, max_len, device=q.device)
            lens = meta.seq_lens_tensor[:nd, None]
            mask = pos[None, :] < lens
            if window is not None:
                mask &= pos[None, :] >= lens - window
            o = _attend(
                q[:nd].unsqueeze(2).to(keys.dtype),  # [B, Hq, 1, D]
                keys.transpose(1, 2),
                values.transpose(1, 2),
                mask[:, None, None, :],
                scale, gqa, softcap,
            )
            out[:nd] = o.squeeze(2).to(out.dtype)

        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            qlen, seq_len = end - start, meta.seq_lens[i]
            qi = q[start:end].transpose(0, 1)  # [Hq, qlen, D]
            ctx = seq_len - qlen
            if seq_len == qlen and (window is None or window >= qlen):
                # Nothing cached before this chunk: attend to the fresh K/V, plain causal.
                ki, vi = k[start:end], v[start:end]
                o = _attend(
                    qi, ki.transpose(0, 1).to(qi.dtype), vi.transpose(0, 1).to(qi.dtype),
                    None, scale, gqa, softcap, is_causal=True,
                )
            else:
                first = 0 if window is None else max(0, ctx - window + 1) // bs
                ki = _gather(k_cache, meta.block_tables[i, first:], seq_len - first * bs)
                vi = _gather(v_cache, meta.block_tables[i, first:], seq_len - first * bs)
                qpos = torch.arange(ctx, seq_len, device=q.device)
                kpos = torch.arange(first * bs, seq_len, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                if window is not None:
                    mask &= kpos[None, :] > qpos[:, None] - window
                o = _attend(
                    qi.to(ki.dtype), ki.transpose(0, 1), vi.transpose(0, 1), mask, scale, gqa, softcap,
                )
            out[start:end] = o.transpose(0, 1).to(out.dtype)
        return out
