"""GPT-2's decode step on a GPU, fused into a few Triton kernels a layer.

Per layer: residual add + LayerNorm, ``c_attn`` (bias), the K/V write into the paged cache (no
RoPE: positions are the learned ``wpe`` rows added to the embeddings), split-K paged decode
attention, ``c_proj``, residual add + LayerNorm, ``c_fc`` with its GELU, ``c_proj``. At batch 1
(the ``gemv`` variant) each projection is a Triton GEMV with the LayerNorm in its prologue and the
bias and GELU in its epilogue (6 or 7 launches a layer; the module forward's graph has about 12); at
larger batches the projections are cuBLAS GEMMs beside ``add_layernorm`` (see
:mod:`tianxia.models.gpu_step`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tianxia.layers.attention import AttentionMetadata
from tianxia.models.gpu_step import GpuStep, StepNorm, linear, lm_logits, norm_linear


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` (a :class:`~tianxia.models.gpt2.GPT2LMHeadModel`) cannot run this step."""
    from tianxia.layers.attention.backend import triton_available

    if not triton_available():
        return "Triton is not installed"
    from tianxia.layers.triton_pointwise import ACTIVATIONS

    if model.config.hidden_act not in ACTIVATIONS:
        return f"activation {model.config.hidden_act!r}"
    for block in model.transformer.h:
        for proj in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            if getattr(proj, "weight", None) is None or proj.weight.device.type != "cuda":
                return f"{type(proj).__name__} projections"
    return None


class GPT2GpuStep(GpuStep):
    """A :class:`~tianxia.models.base.DecodeStep` over a GPT2LMHeadModel's weights and KV caches."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_model_len: int) -> None:
        cfg = model.config
        t = model.transformer
        self.kv_caches = kv_caches
        self.wte, self.wpe = t.wte.weight, t.wpe.weight
        self.lm_head = t.wte.weight if model.lm_head is None else model.lm_head.weight
        self.final_norm = StepNorm.of(t.ln_f)
        self.act = cfg.hidden_act
        self.layers = [dict(
            ln1=StepNorm.of(b.ln_1), c_attn=b.attn.c_attn, attn_proj=b.attn.c_proj, scale=b.attn.scale,
            kv_scale=b.attn.kv_scale,
            ln2=StepNorm.of(b.ln_2), c_fc=b.mlp.c_fc, mlp_proj=b.mlp.c_proj,
        ) for b in t.h]
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32) of every row, or of ``rows``: one decode token per row, or a step with
        prompt chunks after its decodes."""
        from tianxia.layers.attention.triton_attention import decode_splits, paged_attention, write_kv

        B = input_ids.shape[0]
        h, d = self.num_heads, self.head_dim
        splits = decode_splits(meta, h)
        g = self.gemv_path(B)
        x = F.embedding(input_ids, self.wte) + F.embedding(positions, self.wpe)
        res = None
        for L, kv_cache in zip(self.layers, self.kv_caches):
            qkv, res = norm_linear(x, res, L["ln1"], L["c_attn"], g)
            # views of the fused output: the kernels take its row stride, so nothing is copied
            q, k, v = qkv.view(B, 3, h, d).unbind(1)
            write_kv(k, v, kv_cache, meta.slot_mapping, kv_scale=L["kv_scale"])
            o = paged_attention(q, kv_cache, meta, L["scale"], splits, kv_scale=L["kv_scale"])
            x = linear(L["attn_proj"], o.view(B, h * d), g)
            act, res = norm_linear(x, res, L["ln2"], L["c_fc"], g, out_act=self.act)
            x = linear(L["mlp_proj"], act, g)
        return lm_logits(x, res, self.final_norm, self.lm_head, g, rows)
