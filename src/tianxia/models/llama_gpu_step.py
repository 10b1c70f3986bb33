"""The decode step of the Llama-style families on a GPU, fused into a few Triton kernels a layer.

A decode step (one new token per sequence) launches hundreds of small kernels; on a GPU their
launch gaps, not the arithmetic, set its time at small batches. :class:`LlamaGpuStep` runs the
model's own weights through the Triton ops of :mod:`tianxia.layers.triton_pointwise`,
:mod:`tianxia.layers.triton_linear` and :mod:`tianxia.layers.attention.triton_rope` instead of
the module tree, and the engine's CUDA-graph runner (:mod:`tianxia.engine.cuda_graph`) captures
it. Per layer: residual add + RMSNorm, the qkv projection, the q/k norms + RoPE + KV write in one
kernel, split-K paged decode attention, the output projection, add + RMSNorm, gate/up, the gated
activation, down. A mixed step (prompt chunks after the decodes) runs here too, uncaptured, its
chunks' attention in the paged prefill kernel and logits for its sampled rows only: a third of
the module forward's launches, which set such a step's time on the host. At batch 1 each
projection is a Triton GEMV with the norm fused into its prologue and the bias / gated
activation into its epilogue (6 or 7 launches a layer), unless a
cuBLAS-projection graph replays faster at capture time (small models: the ``cublas`` variant); at
larger batches the projections are cuBLAS GEMMs. Those two forms of a sub-layer are
:mod:`tianxia.models.gpu_step`'s, shared with GPT-2's and Falcon's steps.

Every family of :mod:`tianxia.models.llama` runs here: Gemma's offset norms, embedding scale,
sandwich norms, GeGLU and soft-capping, q/k norms (Qwen3, Gemma 3), partial and interleaved RoPE
(Phi-3, GLM-4), per-layer sliding windows and RoPE bases. Only dynamic RoPE scaling, whose table
depends on the step's longest position, keeps the eager path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tianxia.layers.activation import ActAndMul, SiluAndMul
from tianxia.layers.attention import AttentionMetadata
from tianxia.layers.norm import GemmaRMSNorm, RMSNorm
from tianxia.models.gpu_step import GpuStep, StepNorm, linear, lm_logits, norm_linear


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` (a :class:`~tianxia.models.llama.LlamaForCausalLM`) cannot run this step."""
    from tianxia.layers.attention.backend import triton_available

    if not triton_available():
        return "Triton is not installed"
    inner = model.model
    if any(r.rope_type == "dynamic" for r in inner.rotary_embs):
        return "dynamic RoPE scaling recomputes the table per step"
    cfg = model.config
    if cfg.head_dim % 2 or cfg.head_dim < 16:
        return f"head_dim {cfg.head_dim}"
    for layer in inner.layers:
        act = layer.mlp.act
        if not isinstance(act, SiluAndMul) and not (isinstance(act, ActAndMul) and act.name == "gelu_pytorch_tanh"):
            return f"activation {cfg.hidden_act!r}"
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if getattr(proj, "weight", None) is None or proj.weight.device.type != "cuda":
                return f"{type(proj).__name__} projections"
        if type(layer.input_layernorm) not in (RMSNorm, GemmaRMSNorm):
            return "the layer norms"
    return None


def _gated(act: nn.Module) -> str:
    return "silu" if isinstance(act, SiluAndMul) else act.name


class LlamaGpuStep(GpuStep):
    """A :class:`~tianxia.models.base.DecodeStep` over a LlamaForCausalLM's weights and KV caches."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_model_len: int) -> None:
        cfg = model.config
        inner = model.model
        self.kv_caches = kv_caches
        self.embed = inner.embed_tokens.weight
        self.embed_scale = inner.embed_scale
        self.lm_head = inner.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        self.final_norm = StepNorm.of(inner.norm)
        self.gemma = isinstance(inner.norm, GemmaRMSNorm)
        self.final_softcap = cfg.final_logit_softcapping
        for rope in inner.rotary_embs:
            rope.ensure_positions(max_model_len)
        self.layers = []
        for layer in inner.layers:
            attn = layer.self_attn
            norms = dict(ln1=layer.input_layernorm, ln2=layer.post_attention_layernorm)
            if layer.sandwich:
                norms.update(pre_ff=layer.pre_feedforward_layernorm, post_ff=layer.post_feedforward_layernorm)
            self.layers.append(dict(
                norms={k: StepNorm.of(n) for k, n in norms.items()},
                qkv=attn.qkv_proj, o=attn.o_proj, gu=layer.mlp.gate_up_proj, down=layer.mlp.down_proj,
                act=_gated(layer.mlp.act), rope=attn.rotary_emb, scale=attn.scale, window=attn.sliding_window,
                softcap=attn.softcap, sandwich=layer.sandwich, kv_scale=attn.kv_scale,
                qk_norm=None if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps),
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
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        splits = decode_splits(meta, hk)
        g = self.gemv_path(B)
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        res = None
        for L, kv_cache in zip(self.layers, self.kv_caches):
            norms = L["norms"]
            qkv, res = norm_linear(x, res, norms["ln1"], L["qkv"], g)
            rope = L["rope"]
            qn, kn, qk_eps = L["qk_norm"] or (None, None, 1e-6)
            q = rope_write_kv(qkv, positions, rope.cos_sin, kv_cache, meta.slot_mapping, hq, hk, d,
                              rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, q_norm=qn, k_norm=kn,
                              eps=qk_eps, gemma_norm=self.gemma, kv_scale=L["kv_scale"])
            o = paged_attention(q, kv_cache, meta, L["scale"], splits, sliding_window=L["window"],
                                softcap=L["softcap"], kv_scale=L["kv_scale"]).view(B, hq * d)
            x = linear(L["o"], o, g)
            ffn = norms["ln2"]
            if L["sandwich"]:
                x, _ = norms["ln2"](x, None)
                ffn = norms["pre_ff"]
            act, res = norm_linear(x, res, ffn, L["gu"], g, act=L["act"])
            x = linear(L["down"], act, g)
            if L["sandwich"]:
                x, _ = norms["post_ff"](x, None)
        logits = lm_logits(x, res, self.final_norm, self.lm_head, g, rows)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
