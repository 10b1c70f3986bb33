"""Partial GPU offload, llama.cpp's ``-ngl N`` / ``--n-gpu-layers N``: the last N decoder layers run
on the GPU and the others on the CPU; the output layer (final norm and LM head) counts as one more
layer, on the GPU only when N exceeds the layer count, and the token embedding stays on the CPU
unless everything is on the GPU (llama.cpp's input layer).

Each layer's weights and KV cache live where the layer runs. CPU layers are built as the CPU engine
builds them: GGUF block-quantized matrices stay packed for the CPU kernels, everything else is
float32, and their attention is the CPU backend over a float32 cache. GPU layers hold the model
dtype and the GPU backend. Activations cross once per boundary per step: a pre-hook on each placed
module copies the inputs that live on the other side (floats in this side's dtype), and the step's
positions and attention metadata cross once per step, not once per layer. The final hidden states
and the logits come back to the GPU, where the engine samples.

A step with CPU layers in it runs eagerly (no CUDA graph can hold CPU work) and without the
family's fused decode step (it reads every layer's weights on one device).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, fields, is_dataclass, replace

import torch
from torch import nn

from tianxia.layers.attention import AttentionBackend, AttentionMetadata, get_backend
from tianxia.layers.rotary import RotaryEmbedding
from tianxia.models.base import LayerSplitPlan

_CPU = torch.device("cpu")
_CPU_DTYPE = torch.float32  # what the CPU kernels compute in


@dataclass(frozen=True)
class LayerPlacement:
    """Which parts of a model of ``num_layers`` decoder layers run on the GPU."""

    num_layers: int
    gpu_layers: int  # the last ones
    output_on_gpu: bool

    @classmethod
    def from_n_gpu_layers(cls, n: int, num_layers: int) -> LayerPlacement:
        return cls(num_layers, max(0, min(n, num_layers)), n > num_layers)

    @property
    def split(self) -> bool:
        """Whether anything runs on the CPU."""
        return not self.output_on_gpu

    def layer_on_gpu(self, i: int) -> bool:
        return i >= self.num_layers - self.gpu_layers

    def describe(self) -> str:
        cpu = self.num_layers - self.gpu_layers
        return (f"{self.gpu_layers} of {self.num_layers} decoder layers on the GPU, {cpu} on the CPU; "
                f"output layer on the {'GPU' if self.output_on_gpu else 'CPU'}")


class LayerSplit:
    """Where each module of a model runs: built from the family's plan and a placement."""

    def __init__(self, plan: LayerSplitPlan, placement: LayerPlacement, gpu: torch.device,
                 dtype: torch.dtype) -> None:
        self.plan, self.placement, self.gpu, self.dtype = plan, placement, gpu, dtype
        self._layer = re.compile(rf"^{re.escape(plan.layers)}\.(\d+)(\.|$)")

    def on_gpu(self, name: str) -> bool:
        """Whether the module or tensor ``name`` (a module path or a checkpoint name) runs on the GPU."""
        m = self._layer.match(name)
        if m:
            return self.placement.layer_on_gpu(int(m.group(1)))
        if any(name == p or name.startswith(p + ".") for p in self.plan.outputs):
            return self.placement.output_on_gpu
        if any(name == p or name.startswith(p + ".") for p in self.plan.inputs):
            return not self.placement.split
        return True

    def place(self, name: str) -> tuple[torch.device, torch.dtype]:
        return (self.gpu, self.dtype) if self.on_gpu(name) else (_CPU, _CPU_DTYPE)

    def packed(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` stays packed (a CPU module's matrix)."""
        return not self.on_gpu(name)

    def layer_devices(self) -> list[tuple[torch.device, torch.dtype]]:
        """Each decoder layer's device and compute dtype, in order."""
        return [(self.gpu, self.dtype) if self.placement.layer_on_gpu(i) else (_CPU, _CPU_DTYPE)
                for i in range(self.placement.num_layers)]

    # --- building ---------------------------------------------------------------------------------

    def materialize(self, model: nn.Module) -> None:
        """``model.to_empty`` and ``model.to(dtype)`` at once, each module on its side."""
        for name, module in model.named_modules():
            device, dtype = self.place(name)
            for pname, p in list(module._parameters.items()):
                if p is not None:
                    kind = dtype if p.is_floating_point() else p.dtype
                    module._parameters[pname] = nn.Parameter(torch.empty(p.shape, dtype=kind, device=device),
                                                             requires_grad=False)
            for bname, b in list(module._buffers.items()):
                if b is not None and b.device.type == "meta":
                    module._buffers[bname] = torch.empty_like(b, device=device)

    def install(self, model: nn.Module) -> None:
        """After the weights and buffers are in: CPU modules get their own RoPE tables and the CPU
        attention backend, and every placed module its crossing hook."""
        copies: dict[int, RotaryEmbedding] = {}
        cpu_backend: AttentionBackend = get_backend(_CPU)
        crossings = _Crossings()
        model.register_forward_pre_hook(lambda module, args: crossings.clear())
        for name, module in model.named_modules():
            if not name or self.on_gpu(name):
                continue
            for child_name, child in list(module.named_children()):
                if isinstance(child, RotaryEmbedding):  # shared with GPU layers: a host copy
                    if id(child) not in copies:
                        copies[id(child)] = copy.deepcopy(child).to(_CPU)
                    setattr(module, child_name, copies[id(child)])
            if isinstance(getattr(module, "backend", None), AttentionBackend):
                module.backend = cpu_backend
        for i in range(self.placement.num_layers):
            name = f"{self.plan.layers}.{i}"
            device, dtype = self.place(name)
            model.get_submodule(name).register_forward_pre_hook(crossings.hook(device, dtype), with_kwargs=True)
        for name in (*self.plan.inputs, *self.plan.outputs):
            module = _submodule(model, name)
            if module is None:
                continue
            device, dtype = self.place(name)
            module.register_forward_pre_hook(crossings.hook(device, dtype), with_kwargs=True)
        # the model's final hidden states come back to the GPU for the engine
        for name in self.plan.final:
            module = _submodule(model, name)
            if module is not None:
                module.register_forward_hook(
                    lambda module, args, out: crossings.move(out, self.gpu, self.dtype))
        if not self.placement.output_on_gpu:
            logits_on_cpu = model.compute_logits

            def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
                return logits_on_cpu(hidden.to(_CPU, _CPU_DTYPE)).to(self.gpu)

            model.compute_logits = compute_logits
        model.layer_split = self


def layer_split_of(model: nn.Module) -> LayerSplit | None:
    """The model's split between CPU and GPU, or None when it runs on one device."""
    split = getattr(model, "layer_split", None)
    return split if isinstance(split, LayerSplit) else None


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return module if isinstance(module, nn.Module) else None


class _Crossings:
    """Copies of one step's tensors on the other device, so that the positions and metadata every
    layer takes cross once a step (cleared when the model's forward begins)."""

    def __init__(self) -> None:
        self._copies: dict[tuple[int, str], tuple[object, object]] = {}

    def clear(self) -> None:
        self._copies.clear()

    def hook(self, device: torch.device, dtype: torch.dtype):
        def pre_hook(module, args, kwargs):
            return self.move(args, device, dtype), self.move(kwargs, device, dtype)

        return pre_hook

    def move(self, x, device: torch.device, dtype: torch.dtype):
        if isinstance(x, torch.Tensor):
            if x.device.type == device.type:
                return x
            return self._copy(x, device, lambda: x.to(device, dtype if x.is_floating_point() else x.dtype))
        if isinstance(x, AttentionMetadata):
            if x.slot_mapping.device.type == device.type:
                return x
            return self._copy(x, device, lambda: replace(x, **{
                f.name: getattr(x, f.name).to(device) for f in fields(x)
                if isinstance(getattr(x, f.name), torch.Tensor)}))
        if isinstance(x, tuple):
            return tuple(self.move(v, device, dtype) for v in x)
        if isinstance(x, dict):
            return {k: self.move(v, device, dtype) for k, v in x.items()}
        assert not is_dataclass(x) or isinstance(x, type), f"cannot move {type(x).__name__} between devices"
        return x

    def _copy(self, x, device: torch.device, make):
        key = (id(x), device.type)
        hit = self._copies.get(key)
        if hit is not None and hit[0] is x:  # the entry holds x: its id is not reused meanwhile
            return hit[1]
        y = make()
        self._copies[key] = (x, y)
        return y
