"""CPU offload of weights (vLLM's ``--cpu-offload-gb``): a model larger than the GPU's memory
runs with some of its decoder layers' weights kept in pinned host memory and copied to the GPU
each time the layer runs.

The offloaded layers are the first ones, whole, until the requested bytes are reached (as vLLM
does): their parameters are materialized on the host from the start, so the GPU never holds the
whole model, even while loading. Each such layer's forward copies its parameters to the GPU
(``non_blocking`` from pinned memory) and runs on the copies through
:func:`torch.func.functional_call`; the copies are freed when the layer returns. The copies are
ordinary stream work, so CUDA graphs capture them as memcpy nodes and a decode step replays
from its graph as usual. Buffers (RoPE tables and the like) stay on the GPU. The cost is the
PCIe transfer of the offloaded bytes on every forward: the trade-off is memory for speed, and
the KV cache gets the memory the offloaded weights leave free.
"""

from __future__ import annotations

import torch
from torch import nn


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList | None:
    """The model's list of decoder layers: its first ``ModuleList`` of ``num_layers`` modules."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    return None


def layers_to_offload(layers: nn.ModuleList, max_bytes: int, dtype: torch.dtype) -> list[nn.Module]:
    """The first layers whose parameters, stored as ``dtype``, fit in ``max_bytes`` together."""
    chosen: list[nn.Module] = []
    total = 0
    for layer in layers:
        size = sum(p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size())
                   for p in layer.parameters())
        if total + size > max_bytes:
            break
        chosen.append(layer)
        total += size
    return chosen


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype, offloaded: list[nn.Module]) -> None:
    """``model.to_empty(device)``, except that the parameters of ``offloaded`` are allocated on
    the host (pinned when ``device`` is a GPU), already in ``dtype``."""
    on_host = {id(p) for layer in offloaded for p in layer.parameters()}
    pin = device.type == "cuda"
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in on_host:
                kind = dtype if p.is_floating_point() else p.dtype
                t = torch.empty(p.shape, dtype=kind, device="cpu", pin_memory=pin)
            else:
                t = torch.empty_like(p, device=device)
            module._parameters[name] = nn.Parameter(t, requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[name] = torch.empty_like(b, device=device)


def stream_to(layer: nn.Module, device: torch.device) -> None:
    """Make ``layer`` run on copies of its host-resident parameters made on ``device`` per call."""
    params = dict(layer.named_parameters())
    module_forward = layer.forward

    def forward(*args, **kwargs):
        state = {name: p.to(device, non_blocking=True) for name, p in params.items()}
        # functional_call calls the module again: the module's own forward must be in place then
        layer.forward = module_forward
        try:
            return torch.func.functional_call(layer, state, args, kwargs, strict=False)
        finally:
            layer.forward = forward

    layer.forward = forward


def offloaded_bytes(layers: list[nn.Module]) -> int:
    """Bytes of the parameters of ``layers``."""
    return sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
