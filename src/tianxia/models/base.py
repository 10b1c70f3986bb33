"""What the engine may ask of a model: the seam between ``engine/`` and ``models/``.

The engine never imports a model class. It loads a model through the registry and talks to it
through :class:`CausalLM`; a family that has a faster way to run a step where every sequence
decodes one token offers it as a :class:`DecodeStep` (``fast_decode_step``), and the model runner
is the one place that picks the route of each step:

- the family's fused step, replayed from a CUDA graph on a GPU (or called directly on a CPU);
- the model's own forward plus ``compute_logits``, captured in a CUDA graph, for a family that
  has no fused step (every family we load is graph-safe unless ``cuda_graph_unsafe_reason`` says
  otherwise);
- the module forward, eagerly (prompt chunks, mixed steps, ``--enforce-eager``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from tianxia.config import ModelConfig
from tianxia.layers.attention import AttentionMetadata
from tianxia.layers.lora import LoRATarget


@runtime_checkable
class DecodeStep(Protocol):
    """A family's fused forward for a batch of single-token decodes: token ids and positions in,
    float32 logits ``[B, vocab]`` out, the new K/V written to the cache at ``meta.slot_mapping``.

    Padding rows (a CUDA-graph batch rounded up) have slot -1 and length 0: nothing is written and
    their logits are ignored. ``meta.num_splits`` fixes the decode attention's split count when a
    graph is captured (its grid must not depend on the context lengths).

    A step with ``takes_prompt_rows`` also runs a mixed step (decodes first, then prompt chunks,
    as :class:`AttentionMetadata` lays them out) and returns the logits of ``rows`` only: on a GPU
    the runner sends it the mixed steps its decode graphs cannot replay, whose module forward
    launches three times as many kernels.

    A step may also take rows with LoRA adapters: it then has ``attach_lora(state)``
    (:class:`~tianxia.layers.lora.LoRAState`), which returns whether it adds the deltas of the
    step's adapter runs itself (else the runner sends those steps to the module forward).
    """

    #: largest batch the step takes (None: any); larger decode batches take the module forward
    max_batch: int | None
    #: batch-1 variants a CUDA-graph runner may capture and time, keeping the fastest
    #: (e.g. ``("gemv", "cublas")``); empty when there is one way to run
    variants: tuple[str, ...]

    def set_variant(self, name: str) -> None: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, rows: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a family splits over tensor-parallel ranks (Megatron's scheme), named by checkpoint
    tensors and modules, so the distributed code needs no model class.

    ``weights`` maps the end of a checkpoint module name (``"self_attn.q_proj"``) to what it splits
    by and along which dimension. The splits: ``"heads"`` (query heads), ``"kv_heads"``, ``"qkv"``
    (q, k and v fused in one matrix), ``"intermediate"``, ``"gate_up"`` (gate and up fused),
    ``"vocab"``; dimension 0 keeps output rows (column-parallel: no communication), 1 keeps input
    columns (row-parallel: the rank's output is a partial sum). The modules named in
    ``row_parallel`` are summed over the ranks after their product; ``embedding`` and ``lm_head``
    (None when tied) are the model's attributes that hold the vocabulary.

    A family with a plan builds itself at a rank's size from a config whose head counts,
    intermediate size and vocabulary (equal shares, the last padded) are the rank's, so each
    rank's slices of the checkpoint load as they are.
    """

    weights: dict[str, tuple[str, int]]
    row_parallel: tuple[str, ...]
    embedding: str
    lm_head: str


@dataclass(frozen=True)
class LayerSplitPlan:
    """Where a family's modules sit for a split between CPU and GPU (``-ngl``), by module path:
    ``layers`` the list of decoder layers, ``inputs`` the modules before them (the token
    embedding), ``outputs`` those after them (final norm, LM head), and ``final`` the module whose
    output is the model's final hidden states."""

    layers: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    final: tuple[str, ...]


class CausalLM(Protocol):
    """The calls the engine makes on a loaded model (every class in ``models/`` provides them)."""

    #: whether ``forward`` takes ``keep`` (rows to carry through the last layer's MLP)
    keeps_rows: bool
    #: how the family splits over tensor-parallel ranks (a class attribute); a family without
    #: one runs on one rank only
    tensor_parallel_plan: TensorParallelPlan | None
    #: where its modules sit when split between CPU and GPU (``-ngl``); None: one device only
    layer_split_plan: LayerSplitPlan | None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def fast_decode_step(self, kv_caches: list[torch.Tensor], max_model_len: int) -> DecodeStep | None:
        """The family's fused decode step for these caches on the model's device, or None."""

    def lora_targets(self, config: ModelConfig | None = None) -> dict[str, LoRATarget]:
        """The modules LoRA adapters may adapt (``--enable-lora``), by module name, at the sizes
        of this model or of ``config`` (the whole model, for a tensor-parallel rank built at its
        share); a family without this method serves no adapters."""

    def cuda_graph_unsafe_reason(self) -> str | None:
        """Why the module forward cannot be captured in a CUDA graph (a host sync or a
        data-dependent shape in a decode step), or None when it can."""
