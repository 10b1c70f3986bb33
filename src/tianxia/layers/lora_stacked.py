"""LoRA adapters inside CUDA graphs: every resident adapter's matrices stacked in fixed device
buffers, and each row's adapter read from a device tensor.

:class:`~tianxia.layers.lora.LoRAState` groups a step's rows by adapter on the host and runs one
product per group; the groups change every step, so a captured graph cannot replay them. Here
each targeted module keeps, for ``S`` adapter positions, ``A`` stacked ``[S * W, in]`` and ``B``
``[out, S * W]`` (``W`` columns per position: the module's parts times the largest rank, the
unused ones zero), and a step writes each row's position (-1: the base model) into a static
device tensor. In a captured step the hook adds, for row ``i`` at position ``p``,

    out[i] += (x[i] @ A[p * W : (p + 1) * W].T) @ B[:, p * W : (p + 1) * W].T

On CUDA that is Punica's BGMV pair (:mod:`tianxia.layers.triton_lora`): a shrink and an expand
kernel that read the position inside the kernel and only that position's columns, and skip base
rows at once (a step of base rows replays the hooks as two near-empty launches per module).
Elsewhere (the CPU tests) the same delta is the dense ``((x @ A.T) * (row_position ==
column_position)) @ B.T`` over every position. Either way the shapes depend on the batch size
only, so the decode graphs capture the hooks with the rest of the step and a step with adapters
replays like one without. A put or a drop rewrites a position's columns in place, so the graphs
stay valid. Steps that run eagerly (prompts, mixed steps) know their rows' adapters on the host:
there each adapter's run of rows multiplies by its own position's columns alone, as
:class:`LoRAState` groups them.

This is vLLM's approach of fixed GPU LoRA slots with per-token indices.
"""

from __future__ import annotations

import torch
from torch import nn

from tianxia.layers.lora import LoRAAdapter, LoRAError, LoRAState, LoRATarget


class StackedLoRAState(LoRAState):
    """A :class:`LoRAState` whose hooks run the same operations on every step (graph-safe)."""

    on_device = True

    def __init__(self, model: nn.Module, targets: dict[str, LoRATarget], *, positions: int, max_rank: int,
                 max_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.positions, self.max_rank = positions, max_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.width: dict[str, int] = {}  # columns per position
        self.columns: dict[str, torch.Tensor] = {}  # each stacked column's position
        for name, target in targets.items():
            width = self.width[name] = len(target.parts) * max_rank
            out = sum(rows for _, rows in target.parts)
            self.a[name] = torch.zeros(positions * width, target.in_features, dtype=dtype, device=device)
            self.b[name] = torch.zeros(out, positions * width, dtype=dtype, device=device)
            self.columns[name] = torch.arange(positions * width, device=device) // width
        self.position_of: dict[int, int] = {}  # adapter slot -> stacked position
        # each row's position, which the graphs read
        self.static_rows = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self._rows_clear = True  # every static row is -1
        self._active = True  # outside a step (graph capture): the hooks record their products
        # the captured steps' products: the Triton kernels on CUDA, the masked dense product
        # elsewhere
        self.kernels = torch.device(device).type == "cuda"
        super().__init__(model, targets)

    def put(self, slot: int, adapter: LoRAAdapter) -> None:
        free = sorted(set(range(self.positions)) - set(self.position_of.values()))
        pos = self.position_of.get(slot, free[0] if free else None)
        if pos is None:
            raise LoRAError(f"adapter {adapter.name!r}: all {self.positions} GPU adapter positions are in use "
                            "by running requests; raise --max-loras or --max-cpu-loras")
        for name, parts in adapter.weights.items():
            rank = sum(p.a.shape[0] for p in parts)
            if rank > self.width[name]:
                raise LoRAError(f"adapter {adapter.name!r}: {name} needs rank {rank}, "
                                f"above the {self.width[name]} columns --max-lora-rank {self.max_rank} gives it")
        self._clear(pos)
        for name, parts in adapter.weights.items():
            col = pos * self.width[name]
            for p in parts:
                r = p.a.shape[0]
                self.a[name][col : col + r].copy_(p.a)
                self.b[name][p.row0 : p.row0 + p.b.shape[0], col : col + r].copy_(p.b)
                col += r
        self.position_of[slot] = pos
        super().put(slot, adapter)

    def drop(self, slot: int) -> None:
        self._clear(self.position_of.pop(slot))
        super().drop(slot)

    def _clear(self, pos: int) -> None:
        for name, a in self.a.items():
            width = self.width[name]
            a[pos * width : (pos + 1) * width].zero_()
            self.b[name][:, pos * width : (pos + 1) * width].zero_()

    def begin_step(self, row_slots: list[int] | None, keep: list[int] | None) -> None:
        """As :meth:`LoRAState.begin_step`; ``row_slots`` None: every row is on the base model."""
        rows = [self.position_of.get(s, -1) if s >= 0 else -1 for s in row_slots or ()]
        self._active = any(r >= 0 for r in rows)
        if not self._active:
            if not self._rows_clear:  # base steps in a row write the static rows once
                self.static_rows.fill_(-1)
                self._rows_clear = True
            return
        super().begin_step(row_slots, keep)  # the runs an eager step's hooks multiply
        n = min(len(rows), self.static_rows.shape[0])
        self.static_rows[:n].copy_(torch.tensor(rows[:n], dtype=torch.int64), non_blocking=True)
        self.static_rows[n:].fill_(-1)
        self._rows_clear = False

    def end_step(self) -> None:
        super().end_step()
        self._active = True

    def _hook(self, name: str):
        a, b, columns, width = self.a[name], self.b[name], self.columns[name], self.width[name]

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            if not self._active:
                return output
            n = output.shape[0]
            x = inputs[0].to(a.dtype)
            runs = self._groups.get(n) if self._groups else None
            if runs is not None:  # an eager step: each run by its own adapter's columns
                for slot, start, end in runs:
                    first = self.position_of[slot] * width
                    cols = slice(first, first + width)
                    delta = (x[start:end] @ a[cols].T) @ b[:, cols].T
                    output[start:end] += delta.to(output.dtype)
                return output
            # a captured step: each row's position read from the static rows on the device
            rows = self.static_rows[:n]
            flat = output.view(-1, output.shape[-1])
            if self.kernels:
                from tianxia.layers.triton_lora import lora_expand, lora_shrink

                lora_expand(flat, lora_shrink(x, a, rows, width), b, rows, width)
                return output
            shrunk = (x @ a.T) * (rows[:, None] == columns[None, :])
            flat.addmm_(shrunk.to(flat.dtype), b.T.to(flat.dtype))
            return output

        return hook
