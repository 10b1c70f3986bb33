"""The Llama-style decoder and its relatives, as one model with per-family flags.

Families handled here (HF ``model_type``): ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``phi3``,
``glm4``, ``gemma2``, ``gemma3``. What differs between them, and where it is handled:

- q/k/v biases (Qwen2, GLM-4): ``config.attention_bias``.
- q/k norms, an RMSNorm over each head before RoPE (Qwen3, Gemma 3): ``config.qk_norm``.
- sliding-window layers (Mistral: all; Gemma 2: every other; Gemma 3: five of six, whose RoPE
  base is ``rope_local_theta``): ``config.layer_types`` / ``config.sliding_window``, passed to
  the attention backend per layer.
- "sandwich" norms, i.e. a norm after attention and after the MLP as well as before (Gemma 2/3,
  GLM-4): :attr:`Family.sandwich_norms`.
- Gemma: RMSNorm weights stored as offsets from 1 (:class:`GemmaRMSNorm`), embeddings scaled by
  ``sqrt(hidden_size)``, GeGLU (``gelu_pytorch_tanh``), attention scale
  ``query_pre_attn_scalar ** -0.5``, tanh soft-capping of attention scores and logits.
- partial and interleaved RoPE (Phi-3, GLM-4): ``config.partial_rotary_factor``,
  :attr:`Family.interleaved_rope`.

Projections are fused (``qkv_proj``, ``gate_up_proj``) so each layer runs three big matmuls
instead of seven; :meth:`LlamaForCausalLM.load_weights` splits the checkpoint's separate tensors
into the fused ones (Phi-3 and GLM-4 checkpoints are already partly fused).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from tianxia.config import ModelConfig
from tianxia.layers.activation import ActAndMul, SiluAndMul
from tianxia.layers.attention import AttentionBackend, AttentionMetadata
from tianxia.layers.lora import LoRATarget
from tianxia.layers.linear import QuantizedEmbedding, QuantizedLinear, SplitQuantizedLinear, dense_linear
from tianxia.layers.norm import GemmaRMSNorm, RMSNorm
from tianxia.layers.rotary import RotaryEmbedding
from tianxia.models.base import LayerSplitPlan, TensorParallelPlan
from tianxia.quant.packed import PackedWeight, stack_runs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    norm: type[nn.Module] = RMSNorm
    sandwich_norms: bool = False  # post-attention and post-MLP norms too
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    interleaved_rope: bool = False  # RoPE on (even, odd) pairs instead of halves
    # checkpoint layer-module name -> ours, for families that name the same norms differently
    renames: dict[str, str] = field(default_factory=dict)


_GEMMA = Family(norm=GemmaRMSNorm, sandwich_norms=True, embed_scale=True)
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    "phi3": Family(),
    "glm4": Family(
        sandwich_norms=True,
        interleaved_rope=True,
        renames={
            "post_self_attn_layernorm": "post_attention_layernorm",
            "post_attention_layernorm": "pre_feedforward_layernorm",
            "post_mlp_layernorm": "post_feedforward_layernorm",
        },
    ),
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
}


def _rotary(config: ModelConfig, layer: int, family: Family, shared: dict) -> RotaryEmbedding:
    """The layer's RoPE; layers with equal settings share one instance (one cos/sin table)."""
    theta, scaling = config.rope_theta, config.rope_scaling
    if config.is_sliding(layer) and config.rope_local_theta is not None:
        theta, scaling = config.rope_local_theta, None  # Gemma 3: local layers are unscaled
    rotary_dim = int(config.head_dim * config.partial_rotary_factor)
    key = (theta, json.dumps(scaling, sort_keys=True), rotary_dim)
    if key not in shared:
        shared[key] = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, theta, scaling,
            rotary_dim=rotary_dim, interleaved=family.interleaved_rope,
        )
    return shared[key]


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, family: Family,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        scalar = config.query_pre_attn_scalar or self.head_dim
        self.scale = scalar**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = family.norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = family.norm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary
        self.sliding_window = config.sliding_window if config.is_sliding(layer) else None
        self.softcap = config.attn_logit_softcapping
        self.backend = backend
        # an fp8 KV cache's K and V scales [2], set by the model runner that owns the cache
        self.kv_scale: torch.Tensor | None = None

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
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.backend.forward(
            q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window, softcap=self.softcap,
            kv_scale=self.kv_scale,
        )
        return self.o_proj(o.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = SiluAndMul() if config.hidden_act == "silu" else ActAndMul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, family: Family,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        norm, eps, hidden = family.norm, config.rms_norm_eps, config.hidden_size
        self.self_attn = LlamaAttention(config, layer, backend, family, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = norm(hidden, eps)
        self.post_attention_layernorm = norm(hidden, eps)
        self.sandwich = family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(hidden, eps)
            self.post_feedforward_layernorm = norm(hidden, eps)

    def forward(self, positions, hidden, residual, kv_cache, meta, keep: torch.Tensor | None = None):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if keep is not None:  # every token's K/V is in the cache: only these rows go on
            hidden, residual = hidden[keep], residual[keep]
            if not len(keep):
                return hidden, residual
        if not self.sandwich:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, family: Family) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5 if family.embed_scale else None
        shared: dict = {}
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, family, _rotary(config, i, family, shared))
            for i in range(config.num_hidden_layers)
        )
        self.rotary_embs = list(shared.values())
        self.norm = family.norm(config.hidden_size, config.rms_norm_eps)
        self.int8_activations = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden

    def forward(self, input_ids, positions, kv_caches, meta, keep: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids)
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, keep if i == last else None)
        if not len(hidden):
            return hidden
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
_LAYER_MODULE = re.compile(r"^(model\.layers\.\d+\.)([a-z_]+)(\..+)$")

# q/k/v and gate/up column-parallel, o and down row-parallel, the vocabulary split (Phi-3 and
# GLM-4 checkpoints hold q/k/v or gate/up already fused)
_TENSOR_PARALLEL = TensorParallelPlan(
    weights={
        "self_attn.q_proj": ("heads", 0),
        "self_attn.k_proj": ("kv_heads", 0),
        "self_attn.v_proj": ("kv_heads", 0),
        "self_attn.qkv_proj": ("qkv", 0),
        "self_attn.o_proj": ("heads", 1),
        "mlp.gate_proj": ("intermediate", 0),
        "mlp.up_proj": ("intermediate", 0),
        "mlp.gate_up_proj": ("gate_up", 0),
        "mlp.down_proj": ("intermediate", 1),
        "model.embed_tokens": ("vocab", 0),
        "lm_head": ("vocab", 0),
    },
    row_parallel=("self_attn.o_proj", "mlp.down_proj"),
    embedding="model.embed_tokens",
    lm_head="lm_head",
)


class LlamaForCausalLM(nn.Module):
    packed_weights = True  # load_weights takes PackedWeight matrices (CPU kernels)
    keeps_rows = True  # forward takes `keep`
    tensor_parallel_plan = _TENSOR_PARALLEL
    layer_split_plan = LayerSplitPlan("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"),
                                      ("model.norm",))

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.family = FAMILIES[config.architecture]
        self.model = LlamaModel(config, backend, self.family)
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
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of every token, or with ``keep`` of those rows only: the last
        layer then runs its MLP on them alone (as llama.cpp does), the rest of a prompt needing
        only its K/V."""
        return self.model(input_ids, positions, kv_caches, meta, keep)

    @property
    def int8_activations(self) -> bool:
        """Products with packed weights round activations to 8 bits per 32 values, for integer
        dot products in decode steps (``--cpu-activations int8``, llama.cpp's numerics)."""
        return self.model.int8_activations

    @int8_activations.setter
    def int8_activations(self, value: bool) -> None:
        self.model.int8_activations = value
        for module in self.modules():
            if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
                module.int8 = value

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        embed = self.model.embed_tokens
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif isinstance(embed, QuantizedEmbedding):
            logits = embed.linear(hidden)
        else:
            logits = dense_linear(hidden, embed.weight).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def init_buffers(self, device: torch.device | str) -> None:
        for rotary in self.model.rotary_embs:
            rotary.build_cache(device)

    def fast_decode_step(self, kv_caches: list[torch.Tensor], max_model_len: int):
        """The fused decode step for the model's device: one C++ call per step on a CPU
        (:mod:`tianxia.models.llama_cpu_step`), a few Triton kernels a layer on a GPU
        (:mod:`tianxia.models.llama_gpu_step`); None (with the reason logged) where it does not
        apply, and the engine runs the module forward instead."""
        device = self.model.norm.weight.device
        if device.type == "cpu":
            from tianxia.models import llama_cpu_step as step

            reason = step.unsupported_reason(self.model, kv_caches)
            if reason is None:
                return step.LlamaCpuStep(self, kv_caches, self.int8_activations)
        elif device.type == "cuda":
            from tianxia.models import llama_gpu_step as step

            reason = step.unsupported_reason(self)
            if reason is None:
                return step.LlamaGpuStep(self, kv_caches, max_model_len)
        else:
            reason = f"no fused step for {device.type}"
        logger.info("%s: no fused decode step (%s)", self.config.architecture, reason)
        return None

    def lora_targets(self, config: ModelConfig | None = None) -> dict[str, LoRATarget]:
        """The fused modules LoRA adapters may adapt, with the checkpoint projections in each, at
        the sizes of this model or of ``config`` (a tensor-parallel rank reads adapters for the
        whole model)."""
        c = config or self.config
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        targets = {}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            for ours, parts, n_in in (
                ("self_attn.qkv_proj", (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
                 c.hidden_size),
                ("self_attn.o_proj", (("o_proj", c.hidden_size),), q_size),
                ("mlp.gate_up_proj", (("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)),
                 c.hidden_size),
                ("mlp.down_proj", (("down_proj", c.hidden_size),), c.intermediate_size),
            ):
                prefix = p + ours.rsplit(".", 1)[0] + "."
                targets[p + ours] = LoRATarget(p + ours, tuple((prefix + n, rows) for n, rows in parts), n_in)
        return targets

    def cuda_graph_unsafe_reason(self) -> str | None:
        if any(r.rope_type == "dynamic" for r in self.model.rotary_embs):
            return "dynamic RoPE scaling recomputes its table from the step's longest position"
        return None

    def _shard_slices(self, fused_name: str, shard: int, dim0: int) -> slice:
        attn = self.model.layers[0].self_attn
        if ".qkv_proj." in fused_name:
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    def _rename(self, name: str) -> str:
        if self.family.renames:
            m = _LAYER_MODULE.match(name)
            if m and m.group(2) in self.family.renames:
                return m.group(1) + self.family.renames[m.group(2)] + m.group(3)
        return name

    def _install(self, target: str, parts: list[torch.Tensor | PackedWeight], param: nn.Parameter) -> None:
        """Put a (possibly fused) weight whose parts arrived packed into its module."""
        module_name = target.rsplit(".", 1)[0]
        parent_name, _, attr = module_name.rpartition(".")
        parent = self.get_submodule(parent_name)
        old = getattr(parent, attr)
        if not all(isinstance(p, PackedWeight) for p in parts):
            # a fused module with float and packed parts: it stays float
            rows = torch.cat([p.dequantize() if isinstance(p, PackedWeight) else p for p in parts])
            param.data.copy_(rows)
            return
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        if shape != tuple(param.shape) or any(p.shape[1] != shape[1] for p in parts):
            raise ValueError(f"tensor {target!r} has shape {shape}, expected {tuple(param.shape)}")
        if isinstance(old, nn.Embedding):
            setattr(parent, attr, QuantizedEmbedding(parts[0]))
        else:
            runs = stack_runs(parts)
            new = QuantizedLinear(runs[0]) if len(runs) == 1 else SplitQuantizedLinear(runs)
            new.bias = old.bias  # the same parameter object, so a bias loaded later still lands
            setattr(parent, attr, new)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy checkpoint tensors (HF names) into the parameters.

        Returns the HF names of the tensors that were expected but never seen, so the loader can
        report them against its own file.
        """
        params = dict(self.named_parameters())
        filled: dict[str, set[int | None]] = {name: set() for name in params}
        pending: dict[str, dict[int | None, torch.Tensor | PackedWeight]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, shard, rows = self._rename(name), None, None
            for frag, (fused, idx) in _STACKED.items():
                if frag in target:
                    target = target.replace(frag, fused)
                    shard, rows = idx, self._shard_slices(target, idx, 0)
                    break
            param = params.get(target)
            if param is None:
                continue  # tensors the model does not use (e.g. extra metadata tensors)
            if isinstance(tensor, PackedWeight) and filled[target] and target not in pending:
                tensor = tensor.dequantize()  # float siblings already copied: this one joins them
            if isinstance(tensor, PackedWeight) or target in pending:
                # a packed matrix (or a shard of a fused one) waits for its siblings, then
                # replaces the float module
                pending.setdefault(target, {})[shard] = tensor
                shards = pending[target]
                needed = {None} if shard is None else {i for f, i in _STACKED.values() if f in target}
                if set(shards) == needed:
                    self._install(target, [shards[i] for i in sorted(needed, key=lambda i: i or 0)], param)
                    del pending[target]
                filled[target].add(shard)
                continue
            dst = param.data if rows is None else param.data[rows]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            filled[target].add(shard)
        missing = []
        for name, shards in filled.items():
            # a fused matrix still pending has some shards but not all: named below, shard by shard
            if None in shards:
                continue
            fused = next((f for f, _ in _STACKED.values() if f in name), None)
            if fused is None:
                missing.append(name)
                continue
            for frag, (f, idx) in _STACKED.items():
                if f == fused and idx not in shards:
                    missing.append(name.replace(fused, frag))
        return sorted(missing)
