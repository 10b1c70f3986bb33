"""CUDA graphs for decode steps, over a fused decode forward of Llama-family models.

A decode step (one new token per sequence) launches hundreds of small kernels; on a GPU their
launch gaps, not the arithmetic, set its time at small batches. At start-up
:class:`CudaGraphRunner` captures one CUDA graph per batch size of a ladder (1, 2, 4, 8, then
steps of 16 up to ``max_num_seqs``) over static input buffers; a step pads its batch to the next
size (padding rows: slot -1, so nothing is written to the cache, and length 0, so attention
returns zeros), copies its inputs in and replays the graph. ``--enforce-eager`` turns it off.

The captured forward is :class:`FusedDecoder`: the model's own weights, run through the Triton
ops of :mod:`tianxia.layers.triton_linear` and :mod:`tianxia.layers.triton_pointwise` instead of the module tree: per layer, residual
add + RMSNorm, the qkv projection, RoPE + KV write in one kernel, split-K paged decode attention,
the output projection, add + RMSNorm, gate/up, SiLU-mul, down. At batch 1 each projection is a
Triton GEMV with the norm fused into its prologue and the bias / SiLU-mul into its epilogue (6
or 7 launches a layer: 4 GEMVs, RoPE + KV write, attention and, with split-K, its combine), unless
a cuBLAS-projection graph replays faster at capture time (small models); at larger batches the
projections are cuBLAS GEMMs. The logits are computed inside the graph. Models outside the family (Gemma's norms, soft-capping, q/k norms, partial or
interleaved RoPE, dynamic RoPE scaling) keep the eager path.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from tianxia.config import ModelConfig
from tianxia.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def batch_ladder(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def unsupported_reason(model: torch.nn.Module, config: ModelConfig) -> str | None:
    """Why ``model`` cannot run the fused decode forward (None: it can)."""
    from tianxia.layers.norm import RMSNorm
    from tianxia.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model"
    fam = model.family
    if fam.norm is not RMSNorm or fam.sandwich_norms or fam.embed_scale or fam.interleaved_rope:
        return f"architecture {config.architecture!r} (norms / embedding scale / RoPE layout)"
    if config.qk_norm:
        return "q/k norms"
    if config.partial_rotary_factor != 1.0:
        return "partial RoPE"
    if config.attn_logit_softcapping is not None or config.final_logit_softcapping is not None:
        return "logit soft-capping"
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r}"
    if config.head_dim % 2 or config.head_dim < 16:
        return f"head_dim {config.head_dim}"
    if any(r.rope_type == "dynamic" for r in model.model.rotary_embs):
        return "dynamic RoPE scaling"
    return None


class FusedDecoder:
    """The decode forward of a :class:`~tianxia.models.llama.LlamaForCausalLM`, fused."""

    def __init__(self, model, config: ModelConfig, kv_caches: list[torch.Tensor],
                 max_model_len: int, use_gemv: bool = True) -> None:
        self.config = config
        self.kv_caches = kv_caches
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.lm_head = inner.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        self.final_norm = (inner.norm.weight, inner.norm.eps)
        self.layers = []
        for layer in inner.layers:
            attn = layer.self_attn
            rope = attn.rotary_emb
            if rope.cos_sin.shape[0] < max_model_len:
                rope.build_cache(rope.cos_sin.device, length=max_model_len)
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, eps1=layer.input_layernorm.eps,
                ln2=layer.post_attention_layernorm.weight, eps2=layer.post_attention_layernorm.eps,
                qkv=attn.qkv_proj, o=attn.o_proj, gu=layer.mlp.gate_up_proj, down=layer.mlp.down_proj,
                rope=rope, scale=attn.scale,
                window=attn.sliding_window,
            ))
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.use_gemv = use_gemv

    def forward(self, ids, positions, slots, block_tables, seq_lens, num_splits: int) -> torch.Tensor:
        """Logits [B, vocab] (float32) for one decode token per row."""
        from tianxia.layers.attention.triton_attention import decode_attention
        from tianxia.layers.attention.triton_rope import rope_write_kv
        from tianxia.layers.triton_linear import gemv
        from tianxia.layers.triton_pointwise import add_rmsnorm, silu_mul

        B = ids.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        gemv_path = B == 1 and self.use_gemv
        x = F.embedding(ids, self.embed)
        res = None
        def proj(mod, v, **fused):
            # projections are nn.Linear or int8/fp8 ChannelwiseLinear (weight + per-row weight_scale)
            return gemv(v, mod.weight, mod.bias, w_scale=getattr(mod, "weight_scale", None), **fused)

        for L, kv_cache in zip(self.layers, self.kv_caches):
            if gemv_path:
                qkv, res = proj(L["qkv"], x, residual=res, norm_weight=L["ln1"], eps=L["eps1"])
            else:
                h, res = add_rmsnorm(x, res, L["ln1"], L["eps1"])
                qkv = L["qkv"](h)
            q = rope_write_kv(qkv, positions, L["rope"].cos_sin, kv_cache, slots, hq, hk, d)
            o = decode_attention(q, kv_cache, block_tables, seq_lens, L["scale"], num_splits,
                                 sliding_window=L["window"]).view(B, hq * d)
            if gemv_path:
                x = proj(L["o"], o)
                act, res = proj(L["gu"], x, residual=res, norm_weight=L["ln2"], eps=L["eps2"],
                                act="silu_mul")
                x = proj(L["down"], act)
            else:
                x = L["o"](o)
                h, res = add_rmsnorm(x, res, L["ln2"], L["eps2"])
                x = L["down"](silu_mul(L["gu"](h)))
        w, eps = self.final_norm
        if gemv_path:
            logits, _ = gemv(x, self.lm_head, residual=res, norm_weight=w, eps=eps)
        else:
            h, _ = add_rmsnorm(x, res, w, eps)
            logits = F.linear(h, self.lm_head)
        return logits.float()


class CudaGraphRunner:
    """Static buffers, one captured graph per ladder size, and the replay of a decode step."""

    def __init__(self, model, config: ModelConfig, kv_caches: list[torch.Tensor], block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device,
                 use_graphs: bool = True, use_gemv: bool = True) -> None:
        from tianxia.layers.attention.triton_attention import decode_num_splits

        self.decoder = FusedDecoder(model, config, kv_caches, max_model_len, use_gemv=use_gemv)
        self.device = device
        self.ladder = batch_ladder(max_num_seqs)
        self.max_batch = self.ladder[-1]
        P = self.max_batch
        max_blocks = (max_model_len + block_size - 1) // block_size + 1
        self.ids = torch.zeros(P, dtype=torch.int64, device=device)
        self.pos = torch.zeros(P, dtype=torch.int64, device=device)
        self.slots = torch.full((P,), -1, dtype=torch.int64, device=device)
        self.lens = torch.zeros(P, dtype=torch.int64, device=device)
        self.tables = torch.zeros(P, max_blocks, dtype=torch.int64, device=device)
        self.logits = torch.zeros(P, config.vocab_size, dtype=torch.float32, device=device)
        self.splits = {p: decode_num_splits(p, config.num_key_value_heads, max_model_len) for p in self.ladder}
        self.use_graphs = use_graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.batch1_variants_ms: dict[str, float] | None = None

    def _forward(self, p: int) -> None:
        logits = self.decoder.forward(
            self.ids[:p], self.pos[:p], self.slots[:p], self.tables[:p], self.lens[:p], self.splits[p]
        )
        self.logits[:p].copy_(logits)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles and autotunes the kernels) and capture every ladder size, largest
        first, all graphs sharing one memory pool."""
        t0 = time.perf_counter()
        self.slots.fill_(-1)
        self.lens.zero_()
        for p in sorted(self.ladder, reverse=True):
            self._forward(p)  # eager: compile, autotune, cuBLAS handles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.use_graphs and self.device.type == "cuda":
            pool = None
            for p in sorted(self.ladder, reverse=True):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._forward(p)
                if pool is None:
                    pool = g.pool()
                self.graphs[p] = g
            if 1 in self.graphs and self.decoder.use_gemv:
                self._pick_batch1(pool)
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("decode %s for batch sizes %s in %.1fs",
                    "CUDA graphs captured" if self.use_graphs else "kernels warmed up",
                    self.ladder, self.capture_seconds)

    def _pick_batch1(self, pool) -> None:
        """Batch 1: keep the faster of the Triton-GEMV graph and a cuBLAS-projection graph (the
        GEMV wins on large weights, cuBLAS's fewer-but-heavier kernels can on small models)."""
        self.decoder.use_gemv = False
        try:
            g = torch.cuda.CUDAGraph()
            self._forward(1)
            with torch.cuda.graph(g, pool=pool):
                self._forward(1)
        finally:
            self.decoder.use_gemv = True
        times = {}
        for name, graph in (("gemv", self.graphs[1]), ("cublas", g), ("gemv2", self.graphs[1])):
            for _ in range(3):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            times[name] = start.elapsed_time(end) / 20
        gemv = min(times.pop("gemv"), times.pop("gemv2"))
        self.batch1_variants_ms = {"gemv": gemv, "cublas": times["cublas"]}
        if times["cublas"] < gemv:
            self.graphs[1] = g
            self.decoder.use_gemv = False
        logger.info("batch-1 decode graph: Triton GEMV %.3f ms, cuBLAS %.3f ms: using %s",
                    gemv, times["cublas"], "cuBLAS" if times["cublas"] < gemv else "GEMV")

    def padded_size(self, batch: int) -> int:
        return next(p for p in self.ladder if p >= batch)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a pure-decode batch (B <= max_batch)."""
        B = ids.shape[0]
        p = self.padded_size(B)
        self.ids[:B].copy_(ids, non_blocking=True)
        self.pos[:B].copy_(pos, non_blocking=True)
        self.slots[:B].copy_(meta.slot_mapping, non_blocking=True)
        self.lens[:B].copy_(meta.seq_lens_tensor, non_blocking=True)
        if p > B:
            self.slots[B:p].fill_(-1)
            self.lens[B:p].zero_()
        w = meta.block_tables.shape[1]
        self.tables[:B, :w].copy_(meta.block_tables, non_blocking=True)
        if p in self.graphs:
            self.graphs[p].replay()
        else:
            self._forward(p)
        return self.logits[:B]
