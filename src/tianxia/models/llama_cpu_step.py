"""The whole decode step of a Llama-style model as one C++ call on CPU (``quant/csrc/decoder.cpp``).

A decode step of a small model on a CPU is dominated by dispatch, not arithmetic: a dozen torch
calls per layer, each a few microseconds of Python and a parallel region. :class:`LlamaCpuStep`
hands the layers' weights (packed or float32) and KV caches to the C++ decoder once; each step of
single-token decodes, of any batch, is then one call (plus the embedding lookup and the logits).
Steps with prompt chunks, and models or settings it does not cover (listed by
:func:`unsupported_reason`), take the module path, which runs the same kernels in the same order
(products, norms, RoPE, attention, activation), so a token's numbers do not depend on which of
the two computed its step.
"""

from __future__ import annotations

import torch
from torch import nn

from tianxia.layers.activation import ActAndMul, SiluAndMul
from tianxia.layers.attention import AttentionMetadata
from tianxia.layers.linear import QuantizedEmbedding, QuantizedLinear, SplitQuantizedLinear
from tianxia.layers.lora import LoRAAdapter, LoRAState
from tianxia.layers.norm import GemmaRMSNorm, RMSNorm
from tianxia.quant import cpu_kernels

_EMPTY = torch.empty(0)


def unsupported_reason(model: nn.Module, kv_caches: list[torch.Tensor]) -> str | None:
    """Why ``model`` (a :class:`~tianxia.models.llama.LlamaModel`) cannot run fused, or None."""
    if cpu_kernels.extension() is None:
        return "the CPU kernels are not available"
    if model.norm.weight.dtype != torch.float32:
        return "the model dtype is not float32"
    if kv_caches[0].dtype not in cpu_kernels.CACHE_DTYPES:
        return f"the KV cache dtype {kv_caches[0].dtype} (the fused step reads float32 or float16)"
    for rotary in model.rotary_embs:
        if rotary.rope_type == "dynamic":
            return "dynamic RoPE scaling recomputes the table per step"
    for layer in model.layers:
        act = layer.mlp.act
        if not (isinstance(act, SiluAndMul) or (isinstance(act, ActAndMul) and act.name == "gelu_pytorch_tanh")):
            return "the MLP activation has no fused form"
        attn = layer.self_attn
        for proj in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            parts = _parts(proj)
            if parts is None and proj.weight.dtype != torch.float32:
                return "weights are neither packed nor float32"
            if parts is not None and any(p.bits not in (4, 5, 6, 8) for p in parts):
                return "a packed weight has an unsupported layout"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if not all(type(n) is type(norms[0]) and type(n) in (RMSNorm, GemmaRMSNorm) for n in norms):
            return "the layer norms have no fused form"
    return None


def _parts(proj: nn.Module) -> list[QuantizedLinear] | None:
    """The packed parts of a projection, or None for a float one."""
    if isinstance(proj, SplitQuantizedLinear):
        return list(proj.parts)
    return [proj] if isinstance(proj, QuantizedLinear) else None


def _linear_args(proj: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
    """The decoder's (tensors, formats) of a projection: its bias, then per part (qs, scales, mins)
    and (bits, group), after the number of parts."""
    tensors: list[torch.Tensor] = [_EMPTY if proj.bias is None else proj.bias.data]
    parts = _parts(proj)
    if parts is None:
        return tensors + [proj.weight.data, _EMPTY, _EMPTY], [1, 32, 0]
    formats = [len(parts)]
    for p in parts:
        tensors += [p.qs, p.scales, _EMPTY if p.mins is None else p.mins]
        formats += [p.bits, p.group]
    return tensors, formats


class LlamaCpuStep:
    """A :class:`~tianxia.models.base.DecodeStep` over a LlamaForCausalLM's weights and KV caches."""

    max_batch = None  # results do not depend on the batch, so any decode batch takes this step
    variants = ()

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], int8: bool) -> None:
        ext = cpu_kernels.extension()
        self.lm = model
        inner = model.model
        first = inner.layers[0]
        attn, mlp = first.self_attn, first.mlp
        offset = 1.0 if isinstance(inner.norm, GemmaRMSNorm) else 0.0
        self.rotary = inner.rotary_embs
        self.lora: LoRAState | None = None
        # each projection the decoder runs -> (layer, projection index), for LoRA targets
        self._proj_index: dict[int, tuple[int, int]] = {}
        self._lora_modules: dict[str, int] = {}  # LoRA target name -> id of its projection
        self.decoder = ext.Decoder(
            inner.norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
            mlp.down_proj.in_features, inner.norm.eps, offset, attn.scale, attn.softcap or 0.0,
            first.sandwich, isinstance(mlp.act, ActAndMul), attn.rotary_emb.interleaved, int8,
            inner.norm.weight.data.float(),
        )
        for li, (layer, cache) in enumerate(zip(inner.layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            linears, formats = [], []
            for pi, proj in enumerate((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                self._proj_index[id(proj)] = (li, pi)
                tensors, fmt = _linear_args(proj)
                linears += tensors
                formats += fmt
            norms = [layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data]
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                norms.append(getattr(layer, name).weight.data if layer.sandwich else _EMPTY)
            for norm in (attn.q_norm, attn.k_norm):
                norms.append(_EMPTY if norm is None else norm.weight.data)
            self.decoder.add_layer(linears, formats, norms, cache, self.rotary.index(attn.rotary_emb),
                                   attn.sliding_window or 0)
        # the output head's products (one per step, the largest weight) read its scales from a
        # table laid out once, as the decoder's projections do
        head = model.lm_head if model.lm_head is not None else inner.embed_tokens
        if isinstance(head, (QuantizedLinear, QuantizedEmbedding)):
            head.scale_table = cpu_kernels.scale_table(head.packed) if int8 and head.int8 else None

    def attach_lora(self, state: LoRAState) -> bool:
        """Take the rows with LoRA adapters too (the decoder adds their deltas after each
        projection); False where the adapters target modules the decoder does not run."""
        modules = {name: id(self.lm.get_submodule(name)) for name in state.targets}
        if not all(key in self._proj_index for key in modules.values()):
            return False
        self.lora = state
        self._lora_modules = modules
        for slot, adapter in state.slots.items():
            self._set_lora(slot, adapter)
        state.listeners.append(self._set_lora)
        return True

    def _set_lora(self, slot: int, adapter: LoRAAdapter | None) -> None:
        if adapter is None:
            self.decoder.drop_lora(slot)
            return
        tensors, index = [], []
        for module, parts in adapter.weights.items():
            layer, proj = self._proj_index[self._lora_modules[module]]
            for p in parts:
                tensors += [p.a, p.b]
                index += [layer, proj, p.row0]
        self.decoder.set_lora(slot, tensors, index)

    def set_variant(self, name: str) -> None:
        raise ValueError(f"the CPU decode step has no variant {name!r}")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.lm.model.embed(input_ids)
        last = int(positions.max())
        for rotary in self.rotary:
            rotary.ensure_positions(last)
        runs = self.lora.runs(hidden.shape[0]) if self.lora is not None else []
        hidden = self.decoder.forward(hidden, positions, meta.slot_mapping, meta.block_tables,
                                      meta.seq_lens_tensor, [r.cos_sin for r in self.rotary],
                                      torch.tensor(runs, dtype=torch.long) if runs else _EMPTY)
        return self.lm.compute_logits(hidden)
