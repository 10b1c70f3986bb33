"""Falcon (RoPE variants): fused ``query_key_value``, LayerNorm, parallel or sequential blocks.

Three fused-qkv layouts exist, told apart by the config: the "new decoder architecture"
(Falcon-40B/180B: per KV group, its query heads then one key and one value head), multi-query
(7B: all query heads, then one key, one value) and plain multi-head (``[head, (q, k, v)]``).
:meth:`FalconForCausalLM.load_weights` reorders every one of them into ``[q | k | v]`` rows, so
the attention splits it one way. ALiBi variants (Falcon-RW) are not supported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from tianxia.config import ModelConfig
from tianxia.layers.activation import get_activation
from tianxia.layers.attention import AttentionBackend, AttentionMetadata
from tianxia.layers.linear import dense_linear
from tianxia.models.base import DecodeStep
from tianxia.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)


def falcon_qkv_to_standard(w: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Reorder Falcon's fused qkv rows (weight or bias) into ``[q | k | v]``."""
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    rest = w.shape[1:]
    if config.extra.get("new_decoder_architecture"):
        g = w.reshape(kv, heads // kv + 2, d, *rest)
        q, k, v = g[:, :-2], g[:, -2], g[:, -1]
    elif kv == 1:  # multi-query
        g = w.reshape(heads + 2, d, *rest)
        q, k, v = g[:heads], g[heads], g[heads + 1]
    else:
        g = w.reshape(heads, 3, d, *rest)
        q, k, v = g[:, 0], g[:, 1], g[:, 2]
    return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])


class FalconAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.query_key_value = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.dense = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.rotary_emb = rotary
        self.scale = self.head_dim**-0.5
        self.backend = backend
        # an fp8 KV cache's K and V scales [2], set by the model runner that owns the cache
        self.kv_scale: torch.Tensor | None = None

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.query_key_value(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, kv_scale=self.kv_scale)
        return self.dense(o.reshape(-1, self.q_size))


class FalconMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.attention_bias
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.new_arch = bool(config.extra.get("new_decoder_architecture"))
        self.parallel = bool(config.extra.get("parallel_attn", True))
        self.two_ln = self.new_arch and config.extra.get("num_ln_in_parallel_attn", 2) == 2
        self.self_attention = FalconAttention(config, backend, rotary)
        self.mlp = FalconMLP(config)
        if self.two_ln:
            self.ln_attn = nn.LayerNorm(hidden, eps=eps)
            self.ln_mlp = nn.LayerNorm(hidden, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        if not self.parallel:
            self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, positions, hidden, kv_cache, meta):
        residual = hidden
        if self.two_ln:
            attn_in, mlp_in = self.ln_attn(hidden), self.ln_mlp(hidden)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden)
        attn_out = self.self_attention(positions, attn_in, kv_cache, meta)
        if not self.new_arch and not self.parallel:
            residual = attn_out + residual
            mlp_in = self.post_attention_layernorm(residual)
        mlp_out = self.mlp(mlp_in)
        if self.new_arch or self.parallel:
            mlp_out = mlp_out + attn_out
        return mlp_out + residual


class FalconModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.h = nn.ModuleList(
            FalconDecoderLayer(config, backend, self.rotary) for _ in range(config.num_hidden_layers)
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta, keep: torch.Tensor | None = None):
        hidden = self.word_embeddings(input_ids)
        for layer, kv_cache in zip(self.h, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.ln_f(hidden if keep is None else hidden[keep])


class FalconForCausalLM(nn.Module):
    keeps_rows = True  # forward takes `keep`: only those rows' final hidden states are returned

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.transformer = FalconModel(config, backend)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )

    def forward(self, input_ids, positions, kv_caches, meta, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer(input_ids, positions, kv_caches, meta, keep)

    def fast_decode_step(self, kv_caches: list[torch.Tensor], max_model_len: int) -> DecodeStep | None:
        """The fused GPU decode step (:mod:`tianxia.models.falcon_gpu_step`) on CUDA; None elsewhere
        or where it does not apply (the reason logged), and the engine runs (and on CUDA
        captures) the module forward."""
        if self.transformer.word_embeddings.weight.device.type != "cuda":
            return None  # no fused CPU step: the module forward is the CPU route
        from tianxia.models import falcon_gpu_step as step

        reason = step.unsupported_reason(self)
        if reason is None:
            return step.FalconGpuStep(self, kv_caches, max_model_len)
        logger.info("falcon: no fused decode step (%s)", reason)
        return None

    def cuda_graph_unsafe_reason(self) -> str | None:
        if self.transformer.rotary.rope_type == "dynamic":
            return "dynamic RoPE scaling recomputes its table from the step's longest position"
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.transformer.word_embeddings.weight if self.lm_head is None else self.lm_head.weight
        return dense_linear(hidden, weight).float()

    def init_buffers(self, device: torch.device | str) -> None:
        self.transformer.rotary.build_cache(device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Load HF-named tensors; ``query_key_value`` is expected in Falcon's own layout."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            param = params.get(name)
            if param is None:
                continue
            if ".query_key_value." in name and self.config.extra.get("qkv_layout") != "standard":
                tensor = falcon_qkv_to_standard(tensor, self.config)
            if param.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(tensor)
            seen.add(name)
        return sorted(set(params) - seen)
