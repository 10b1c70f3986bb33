"""GPT-2: learned absolute positions, LayerNorm with bias, fused ``c_attn``, GELU (tanh) MLP.

Hugging Face stores GPT-2's projections as ``Conv1D`` (weight ``[in, out]``); :meth:`load_weights`
transposes them into ``nn.Linear`` layout. Parameter names otherwise follow the checkpoint.
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

logger = logging.getLogger(__name__)

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.c_attn = nn.Linear(hidden, 3 * hidden, bias=True)
        self.c_proj = nn.Linear(hidden, hidden, bias=True)
        self.scale = self.head_dim**-0.5 if config.extra.get("scale_attn_weights", True) else 1.0
        self.backend = backend
        # an fp8 KV cache's K and V scales [2], set by the model runner that owns the cache
        self.kv_scale: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, kv_scale=self.kv_scale)
        return self.c_proj(o.reshape(hidden.shape))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, backend)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden, kv_cache, meta):
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, backend) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta, keep: torch.Tensor | None = None):
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            hidden = block(hidden, kv_cache, meta)
        return self.ln_f(hidden if keep is None else hidden[keep])


class GPT2LMHeadModel(nn.Module):
    keeps_rows = True  # forward takes `keep`: only those rows' final hidden states are returned

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config, backend)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )

    def forward(self, input_ids, positions, kv_caches, meta, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer(input_ids, positions, kv_caches, meta, keep)

    def fast_decode_step(self, kv_caches: list[torch.Tensor], max_model_len: int) -> DecodeStep | None:
        """The fused GPU decode step (:mod:`tianxia.models.gpt2_gpu_step`) on CUDA; None elsewhere
        or where it does not apply (the reason logged), and the engine runs (and on CUDA
        captures) the module forward."""
        if self.transformer.wte.weight.device.type != "cuda":
            return None  # no fused CPU step: the module forward is the CPU route
        from tianxia.models import gpt2_gpu_step as step

        reason = step.unsupported_reason(self)
        if reason is None:
            return step.GPT2GpuStep(self, kv_caches, max_model_len)
        logger.info("gpt2: no fused decode step (%s)", reason)
        return None

    def cuda_graph_unsafe_reason(self) -> str | None:
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        return dense_linear(hidden, weight).float()

    def init_buffers(self, device: torch.device | str) -> None:
        pass

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name  # GPT2Model checkpoints have no prefix
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            param = params.get(name)
            if param is None:
                continue
            if name.endswith(_CONV1D):
                tensor = tensor.t()
            if param.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(tensor)
            seen.add(name)
        return sorted(set(params) - seen)
