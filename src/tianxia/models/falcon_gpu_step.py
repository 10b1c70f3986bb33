"""Falcon's decode step on a GPU, fused into a few Triton kernels a layer.

Every layout :mod:`tianxia.models.falcon` runs: the new decoder architecture (``ln_attn`` and
``ln_mlp`` over the same input), the parallel block of one LayerNorm (7B), both of which add
attention and MLP to the residual together, and the sequential block (``post_attention_layernorm``
between them); multi-query, grouped or multi-head attention, with biases or without. Per layer:
residual add + LayerNorm, ``query_key_value``, RoPE + KV write in one kernel, split-K paged decode
attention, ``dense``, LayerNorm (after adding the attention output in the sequential block),
``dense_h_to_4h`` with its GELU, ``dense_4h_to_h``. At batch 1 (the ``gemv`` variant) each
projection is a Triton GEMV with the LayerNorm in its prologue and bias, GELU and the parallel
block's ``mlp + attention`` sum in its epilogue (6 or 7 launches a layer); at larger batches the
projections are cuBLAS GEMMs beside ``add_layernorm`` (see :mod:`tianxia.models.gpu_step`). Dynamic
RoPE scaling, whose table depends on the step's longest position, keeps the module forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tianxia.layers.attention import AttentionMetadata
from tianxia.models.gpu_step import GpuStep, StepNorm, linear, lm_logits, norm_linear


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` (a :class:`~tianxia.models.falcon.FalconForCausalLM`) cannot run this step."""
    from tianxia.layers.attention.backend import triton_available

    if not triton_available():
        return "Triton is not installed"
    cfg, t = model.config, model.transformer
    if t.rotary.rope_type == "dynamic":
        return "dynamic RoPE scaling recomputes the table per step"
    if cfg.head_dim % 2 or cfg.head_dim < 16:
        return f"head_dim {cfg.head_dim}"
    from tianxia.layers.triton_pointwise import ACTIVATIONS

    if cfg.hidden_act not in ACTIVATIONS:
        return f"activation {cfg.hidden_act!r}"
    for layer in t.h:
        attn, mlp = layer.self_attention, layer.mlp
        for proj in (attn.query_key_value, attn.dense, mlp.dense_h_to_4h, mlp.dense_4h_to_h):
            if getattr(proj, "weight", None) is None or proj.weight.device.type != "cuda":
                return f"{type(proj).__name__} projections"
    return None


class FalconGpuStep(GpuStep):
    """A :class:`~tianxia.models.base.DecodeStep` over a FalconForCausalLM's weights and KV caches."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_model_len: int) -> None:
        cfg = model.config
        t = model.transformer
        self.kv_caches = kv_caches
        self.embed = t.word_embeddings.weight
        self.lm_head = t.word_embeddings.weight if model.lm_head is None else model.lm_head.weight
        self.final_norm = StepNorm.of(t.ln_f)
        self.rope = t.rotary
        self.rope.ensure_positions(max_model_len)
        self.act = cfg.hidden_act
        self.layers = []
        for layer in t.h:
            attn, mlp = layer.self_attention, layer.mlp
            ln_attn = StepNorm.of(layer.ln_attn if layer.two_ln else layer.input_layernorm)
            parallel = layer.new_arch or layer.parallel
            self.layers.append(dict(
                ln_attn=ln_attn, ln_mlp=StepNorm.of(layer.ln_mlp) if layer.two_ln else ln_attn,
                # the sequential block's norm of (residual + attention); None: a parallel block
                post_ln=None if parallel else StepNorm.of(layer.post_attention_layernorm),
                qkv=attn.query_key_value, dense=attn.dense, up=mlp.dense_h_to_4h, down=mlp.dense_4h_to_h,
                scale=attn.scale, kv_scale=attn.kv_scale,
            ))
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32) of every row, or of ``rows``: one decode token per row, or a step with
        prompt chunks after its decodes."""
        from tianxia.layers.attention.triton_attention import decode_splits, paged_attention
        from tianxia.layers.attention.triton_rope import rope_write_kv

        B = input_ids.shape[0]
        hq, hk, d, rope = self.num_heads, self.num_kv_heads, self.head_dim, self.rope
        splits = decode_splits(meta, hk)
        g = self.gemv_path(B)
        x = F.embedding(input_ids, self.embed)
        res = None
        for L, kv_cache in zip(self.layers, self.kv_caches):
            qkv, res = norm_linear(x, res, L["ln_attn"], L["qkv"], g)
            q = rope_write_kv(qkv, positions, rope.cos_sin, kv_cache, meta.slot_mapping, hq, hk, d,
                              rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, kv_scale=L["kv_scale"])
            o = paged_attention(q, kv_cache, meta, L["scale"], splits, kv_scale=L["kv_scale"])
            attn_out = linear(L["dense"], o.view(B, hq * d), g)
            if L["post_ln"] is None:
                # attention and MLP both read the residual stream; their sum is added to it next
                h, _ = norm_linear(res, None, L["ln_mlp"], L["up"], g, out_act=self.act)
                x = linear(L["down"], h, g, add=attn_out)
            else:
                h, res = norm_linear(attn_out, res, L["post_ln"], L["up"], g, out_act=self.act)
                x = linear(L["down"], h, g)
        return lm_logits(x, res, self.final_norm, self.lm_head, g, rows)
