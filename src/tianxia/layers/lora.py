"""LoRA adapters over a model's fused projections, and the grouped product that applies many of
them to one batch.

An adapter is read from a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``)
into, per fused module of the base (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``),
the parts it targets: each its own ``A`` ``[r, in]``, its ``B`` ``[rows, r]`` with the scaling
folded in, and the first output row of the fused module it adds to. Only what the adapter trained
is stored (no zero blocks for the parts it leaves alone). A decode step reads every adapter
matrix of its batch whole, like the weights, so their bytes count: over a packed (GGUF) base on
CPU the matrices are held in float16 (:func:`adapter_dtype`; half the bytes of float32, as
llama.cpp's GGUF adapters usually come), which the row-invariant float kernel widens to float32
in registers; over a float base they stay float32, where results are compared with
transformers + PEFT in float32. (``loader/gguf_lora.py`` reads llama.cpp's GGUF adapters into
the same form through :func:`build_adapter`.)

A step's rows are grouped by adapter (Punica / S-LoRA's segmented product): the runner orders
them by adapter, each adapter present multiplies its own run of rows in place, and the base rows
cost nothing. The products go through
:func:`~tianxia.quant.cpu_kernels.dense_linear` on CPU, which computes each row alone, so a row's
delta does not depend on what else is in the batch. On the module path the deltas are added by
forward hooks on the fused modules, so the model code is unchanged; a family's fused decode step
may take them instead (it is told of every adapter placed in or dropped from a slot, and reads
the step's runs from :meth:`LoRAState.runs`), with the same products in the same order. Under
tensor parallelism each rank holds its shard of every adapter (``distributed/sharding.py``), and
the hook of a row-parallel module sits on its local product, so the delta, a partial sum like the
product's, joins it before the all-reduce.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tianxia.layers.parallel_linear import RowParallelLinear
from tianxia.quant.cpu_kernels import dense_linear


class LoRAError(ValueError):
    """An adapter that cannot be served on this base model (the message says why)."""


@dataclass(frozen=True)
class LoRATarget:
    """A fused module of the base and the checkpoint modules it is made of, in row order."""

    module: str  # our module name, e.g. "model.layers.0.self_attn.qkv_proj"
    parts: tuple[tuple[str, int], ...]  # (checkpoint module name, its output rows)
    in_features: int


@dataclass(frozen=True)
class LoRAPart:
    """One targeted part of a fused module: its delta ``(x @ a.T) @ b.T`` is added to the
    module's output rows ``row0 : row0 + b.shape[0]``."""

    row0: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [rows, r], scaled

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> LoRAPart:
        """On ``device``, in ``dtype`` (None: as it is); a part whose values would overflow
        float16 stays float32."""
        a, b = self.a.to(device), self.b.to(device)
        if dtype is not None and dtype != a.dtype:
            a2, b2 = a.to(dtype), b.to(dtype)
            if bool(torch.isfinite(a2).all()) and bool(torch.isfinite(b2).all()):
                a, b = a2.contiguous(), b2.contiguous()
        return LoRAPart(self.row0, a, b)


@dataclass
class LoRAAdapter:
    """One adapter's parts, per fused module name."""

    name: str
    path: str
    rank: int
    weights: dict[str, list[LoRAPart]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.weights.values() for p in parts
                   for t in (p.a, p.b))

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> LoRAAdapter:
        weights = {module: [p.to(device, dtype) for p in parts] for module, parts in self.weights.items()}
        return LoRAAdapter(self.name, self.path, self.rank, weights)


def adapter_dtype(model: nn.Module, targets: dict[str, LoRATarget]) -> torch.dtype:
    """The dtype a CPU model holds its adapters' matrices in: float16 where every targeted
    module's weight is packed (a GGUF model, or one quantized at load), else float32.

    Over packed weights a decode step's bytes are the model's quantized weights plus every
    adapter matrix of the batch, read whole (SmolLM2-135M Q4_1: ~98 MiB, and 18.6 MiB per
    rank-16 adapter over all seven projections in float32), so float16 halves the adapters'
    share; the kernel widens each value exactly to float32 and computes as for float32, so the
    deltas are those of the adapter rounded once to float16 (llama.cpp's GGUF adapters are
    usually float16 too), and the fused decode step and the module path still agree bit for bit.
    A float base keeps float32 adapters: its results are compared with transformers + PEFT in
    float32, and its own weights' bytes dwarf the adapters'."""
    from tianxia.layers.linear import QuantizedLinear, SplitQuantizedLinear

    modules = [model.get_submodule(name) for name in targets]
    packed = bool(modules) and all(isinstance(m, (QuantizedLinear, SplitQuantizedLinear)) for m in modules)
    return torch.float16 if packed else torch.float32


# PEFT keys: "base_model.model.<module>.lora_A[.<adapter name>].weight"
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
_REFUSED_OPTIONS = {
    "modules_to_save": "it replaces whole modules (modules_to_save), which a shared base cannot serve per request",
    "use_dora": "DoRA (use_dora) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layouts) is not supported",
}


def read_peft_config(path: str | Path) -> dict:
    """``adapter_config.json`` of a PEFT adapter directory, checked for what we can serve."""
    path = Path(path)
    cfg_file = path / "adapter_config.json"
    if not path.is_dir() or not cfg_file.is_file():
        raise LoRAError(f"{path}: not a PEFT adapter directory (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_file}: unreadable adapter config ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{cfg_file}: not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    for key, why in _REFUSED_OPTIONS.items():
        if cfg.get(key):
            raise LoRAError(f"{path}: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{path}: trained biases (bias={cfg['bias']!r}) are not supported")
    if not isinstance(cfg.get("r"), int) or cfg["r"] <= 0:
        raise LoRAError(f"{cfg_file}: 'r' must be a positive integer")
    return cfg


def load_peft_adapter(
    name: str, path: str | Path, targets: dict[str, LoRATarget], max_rank: int, scale: float = 1.0,
) -> LoRAAdapter:
    """Read a PEFT LoRA adapter for a base whose fused modules are ``targets`` (keyed by our
    module name), its deltas times ``scale`` (llama.cpp's ``--lora-scaled``). Every problem
    (rank above ``max_rank``, modules the base lacks, shapes of another model, a corrupt file) is
    a :class:`LoRAError` naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_peft_config(path)
    rank = cfg["r"]
    alpha = cfg.get("lora_alpha", rank)
    scaling = scale * (alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAError(f"{path}: no adapter_model.safetensors")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"{file}: unreadable safetensors file ({e})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for key, tensor in tensors.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            others.append(key)
        else:
            pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    if others and all(m in _owners(targets) for m in pairs):
        raise LoRAError(f"{file}: unexpected tensor {others[0]!r} (only lora_A / lora_B weights are served)")
    return build_adapter(name, path, pairs, rank, scaling, targets, max_rank)


def build_adapter(name: str, path: str | Path, pairs: dict[str, dict[str, torch.Tensor]], rank: int,
                  scaling: float, targets: dict[str, LoRATarget], max_rank: int) -> LoRAAdapter:
    """An adapter from its ``A`` / ``B`` matrices per checkpoint module (Hugging Face names,
    ``pairs[module]["A"]`` ``[rank, in]``, ``["B"]`` ``[out, rank]``), checked against the base."""
    if rank > max_rank:
        raise LoRAError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}")
    owner = _owners(targets)
    lacking = sorted(m for m in pairs if m not in owner)
    if lacking:
        raise LoRAError(f"{path}: the base model has no module {lacking[0]!r} to adapt "
                        f"(adapters may target q/k/v/o and gate/up/down projections)")
    weights = {}
    for target in {owner[m].module: owner[m] for m in pairs}.values():
        weights[target.module] = _fuse(target, pairs, rank, scaling, path)
    if not weights:
        raise LoRAError(f"{path}: no LoRA weights")
    return LoRAAdapter(name, str(path), rank, weights)


def _owners(targets: dict[str, LoRATarget]) -> dict[str, LoRATarget]:
    """Checkpoint module name -> the fused target it belongs to."""
    return {part: t for t in targets.values() for part, _ in t.parts}


def stack_adapters(name: str, adapters: list[LoRAAdapter]) -> LoRAAdapter:
    """One adapter whose delta is the sum of ``adapters``' (llama.cpp applies every ``--lora``
    at once): every adapter's parts, one after the other."""
    if len(adapters) == 1:
        return LoRAAdapter(name, adapters[0].path, adapters[0].rank, adapters[0].weights)
    weights: dict[str, list[LoRAPart]] = {}
    for a in adapters:
        for module, parts in a.weights.items():
            weights.setdefault(module, []).extend(parts)
    return LoRAAdapter(name, adapters[0].path, sum(a.rank for a in adapters), weights)


def _fuse(target: LoRATarget, pairs: dict[str, dict[str, torch.Tensor]], rank: int, scaling: float,
          file: str | Path) -> list[LoRAPart]:
    """A fused module's targeted parts, checked against the base's shapes, B scaled."""
    parts = []
    row = 0
    for part, rows in target.parts:
        if part in pairs:
            ab = pairs[part]
            if set(ab) != {"A", "B"}:
                raise LoRAError(f"{file}: {part} has lora_{'A' if 'A' not in ab else 'B'} missing")
            want_a, want_b = (rank, target.in_features), (rows, rank)
            if tuple(ab["A"].shape) != want_a or tuple(ab["B"].shape) != want_b:
                raise LoRAError(
                    f"{file}: {part} has lora_A {tuple(ab['A'].shape)} and lora_B {tuple(ab['B'].shape)}, "
                    f"this base needs {want_a} and {want_b} (an adapter of another base model?)")
            parts.append(LoRAPart(row, ab["A"].float().contiguous(), (ab["B"].float() * scaling).contiguous()))
        row += rows
    return parts


class LoRAState:
    """The adapters a model serves (by slot) and the current step's rows per adapter; forward
    hooks on the targeted modules add each group's delta to the module's output."""

    #: whether the hooks run the same device operations every step, so CUDA graphs capture them
    #: (:class:`~tianxia.layers.lora_stacked.StackedLoRAState`)
    on_device = False

    def __init__(self, model: nn.Module, targets: dict[str, LoRATarget]) -> None:
        self.targets = targets
        self.slots: dict[int, LoRAAdapter] = {}
        # told of each change of a slot (the adapter, or None when dropped): a fused decode step
        # that keeps its own view of the adapters
        self.listeners: list[Callable[[int, LoRAAdapter | None], None]] = []
        # per step: the (slot, first row, end row) runs of adapter rows, for every row count the
        # step sees (the whole batch, and the kept rows of the last layer's MLP)
        self._groups: dict[int, list[tuple[int, int, int]]] = {}
        for name in targets:
            module = model.get_submodule(name)
            if isinstance(module, RowParallelLinear):  # the delta joins the partial sum
                module = module.local
            module.register_forward_hook(self._hook(name))

    def put(self, slot: int, adapter: LoRAAdapter) -> None:
        self.slots[slot] = adapter
        for listener in self.listeners:
            listener(slot, adapter)

    def drop(self, slot: int) -> None:
        del self.slots[slot]
        for listener in self.listeners:
            listener(slot, None)

    def begin_step(self, row_slots: list[int], keep: list[int] | None) -> None:
        """Set the adapter slot of every row of the step (-1: the base model). The runner orders
        a step's rows by adapter, so each adapter's rows are one or two runs (decodes, prompts)
        and its product reads them in place."""
        self._groups = {len(row_slots): _runs(row_slots)}
        if keep is not None:
            self._groups.setdefault(len(keep), _runs([row_slots[r] for r in keep]))

    def end_step(self) -> None:
        self._groups = {}

    def runs(self, num_rows: int) -> list[tuple[int, int, int]]:
        """The (slot, start, end) runs of a step of ``num_rows`` rows (none outside a step)."""
        return self._groups.get(num_rows, [])

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            groups = self._groups.get(output.shape[0]) if self._groups else None
            if not groups:
                return output
            x = inputs[0]
            for slot, start, end in groups:
                rows = x[start:end].float()
                for p in self.slots[slot].weights.get(name, ()):
                    delta = dense_linear(dense_linear(rows, p.a), p.b)
                    output[start:end, p.row0 : p.row0 + p.b.shape[0]] += delta.to(output.dtype)
            return output

        return hook


def _runs(row_slots: list[int]) -> list[tuple[int, int, int]]:
    """(slot, start, end) for each run of consecutive rows with one adapter."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(row_slots):
        if s < 0:
            continue
        if runs and runs[-1][0] == s and runs[-1][2] == i:
            runs[-1] = (s, runs[-1][1], i + 1)
        else:
            runs.append((s, i, i + 1))
    return runs
