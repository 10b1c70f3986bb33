"""Llama and its close relatives (Mistral, Qwen2) as one model with flags.

The differences handled here: q/k/v biases (Qwen2), tied embeddings (small Llamas, Qwen2), the
sliding window (Mistral; honoured by the cache only within ``max_model_len``), and RoPE scaling.
Projections are fused (``qkv_proj``, ``gate_up_proj``) so each layer runs three big matmuls
instead of seven; :meth:`LlamaForCausalLM.load_weights` splits the checkpoint's separate tensors
into the fused ones.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tianxia.config import ModelConfig
from tianxia.layers.activation import SiluAndMul
from tianxia.layers.attention import AttentionBackend, AttentionMetadata
from tianxia.layers.norm import RMSNorm
from tianxia.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.backend = backend

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        if config.hidden_act != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported for llama")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# checkpoint name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def init_buffers(self, device: torch.device | str) -> None:
        for layer in self.model.layers:
            layer.self_attn.rotary_emb.build_cache(device)

    def _shard_slices(self, fused_name: str, shard: int, dim0: int) -> slice:
        attn = self.model.layers[0].self_attn
        if ".qkv_proj." in fused_name:
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy checkpoint tensors (HF names) into the parameters.

        Returns the HF names of the tensors that were expected but never seen, so the loader can
        report them against its own file.
        """
        params = dict(self.named_parameters())
        expected: set[str] = set()
        for name in params:
            for frag, (fused, shard) in _STACKED.items():
                if fused in name:
                    expected.add(name.replace(fused, frag))
            if not any(fused in name for fused, _ in _STACKED.values()):
                expected.add(name)
        seen: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, rows = name, None
            for frag, (fused, shard) in _STACKED.items():
                if frag in name:
                    target = name.replace(frag, fused)
                    rows = self._shard_slices(target, shard, 0)
                    break
            param = params.get(target)
            if param is None:
                continue  # tensors the model does not use (e.g. extra metadata tensors)
            dst = param.data if rows is None else param.data[rows]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            seen.add(name)
        return sorted(expected - seen)
