"""What the families' fused GPU decode steps share: the batch-1 variants, and a projection with
its norm and activation either fused into the Triton GEMV or as cuBLAS + Triton pointwise ops.

The steps (:mod:`tianxia.models.llama_gpu_step`, :mod:`tianxia.models.gpt2_gpu_step`,
:mod:`tianxia.models.falcon_gpu_step`) differ in their layer's wiring, not in how one of its
sub-layers runs: a norm of the residual stream (after adding the last sub-layer's output to it),
a projection, an activation. At batch 1 with the ``gemv`` variant that is one GEMV launch (the
norm in its prologue, bias and activation in its epilogue); otherwise a fused add + norm kernel,
the module's own product (cuBLAS, or the int8 / fp8 kernels of a quantized projection) and the
activation. Triton is imported when a step runs, so these modules import without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tianxia.layers.norm import GemmaRMSNorm, RMSNorm


@dataclass(frozen=True)
class StepNorm:
    """A norm module's weights, in the form the fused kernels take."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    kind: str  # "rms", "gemma" (RMSNorm with an offset weight), "layer" (LayerNorm)

    @classmethod
    def of(cls, module: nn.Module) -> StepNorm:
        if isinstance(module, nn.LayerNorm):
            return cls(module.weight, module.bias, module.eps, "layer")
        if isinstance(module, RMSNorm):
            return cls(module.weight, None, module.eps, "gemma" if isinstance(module, GemmaRMSNorm) else "rms")
        raise TypeError(f"no fused form of {type(module).__name__}")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(x + residual)`` and the new residual, in one launch."""
        from tianxia.layers.triton_pointwise import add_layernorm, add_rmsnorm

        if self.kind == "layer":
            return add_layernorm(x, residual, self.weight, self.bias, self.eps)
        return add_rmsnorm(x, residual, self.weight, self.eps, gemma=self.kind == "gemma")

    def prologue(self) -> dict:
        """The GEMV options that apply this norm to its input."""
        return dict(norm_weight=self.weight, norm_bias=self.bias, eps=self.eps,
                    gemma_norm=self.kind == "gemma", layer_norm=self.kind == "layer")


class GpuStep:
    """The :class:`~tianxia.models.base.DecodeStep` surface of a fused GPU step: any batch size,
    and two batch-1 variants the CUDA-graph runner times at capture, keeping the faster (Triton
    GEMVs, or cuBLAS products, which win on small models)."""

    max_batch = None
    takes_prompt_rows = True  # attention through paged_attention: decode rows and prompt chunks
    variants = ("gemv", "cublas")
    use_gemv = True

    def set_variant(self, name: str) -> None:
        if name not in self.variants:
            raise ValueError(f"unknown decode step variant {name!r}; known: {self.variants}")
        self.use_gemv = name == "gemv"

    def gemv_path(self, batch: int) -> bool:
        return batch == 1 and self.use_gemv

    def attach_lora(self, state) -> bool:
        """Take rows with LoRA adapters when ``state`` runs on the device (a
        :class:`~tianxia.layers.lora_stacked.StackedLoRAState`): the projections then go through
        their modules at every batch size (the ``cublas`` form), whose hooks add the deltas inside
        the captured graphs; the GEMV form, which fuses the norms into the products, is dropped."""
        if not state.on_device:
            return False
        self.variants = ("cublas",)
        self.set_variant("cublas")
        return True


def linear(mod: nn.Module, x: torch.Tensor, gemv_path: bool, *, act: str | None = None,
           out_act: str | None = None, add: torch.Tensor | None = None, **prologue) -> torch.Tensor:
    """``mod(x)`` (an ``nn.Linear``, or an int8 / fp8 ``ChannelwiseLinear``), then ``act(gate) *
    up`` over its two halves (``act``) or ``out_act`` of each output, then ``+ add``."""
    if gemv_path:
        from tianxia.layers.triton_linear import gemv

        return gemv(x, mod.weight, mod.bias, w_scale=getattr(mod, "weight_scale", None), act=act,
                    out_act=out_act, add=add, **prologue)
    y = mod(x)
    if act is not None:
        from tianxia.layers.triton_pointwise import act_mul

        y = act_mul(y, act)
    if out_act is not None:
        from tianxia.layers.activation import get_activation

        y = get_activation(out_act)(y)
    return y if add is None else y + add


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: StepNorm, mod: nn.Module,
                gemv_path: bool, **epilogue) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear` of ``norm(x + residual)``, and the new residual (``x`` when None)."""
    if gemv_path:
        return linear(mod, x, True, residual=residual, **norm.prologue(), **epilogue)
    h, residual = norm(x, residual)
    return linear(mod, h, False, **epilogue), residual


def lm_logits(x: torch.Tensor, residual: torch.Tensor | None, norm: StepNorm, lm_head: torch.Tensor,
              gemv_path: bool, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits of the final ``norm(x + residual)`` against the LM head's weight, of every
    row or of ``rows`` (a mixed step's sampled rows)."""
    if rows is not None:
        x, residual = x[rows], residual[rows]
    if gemv_path:
        from tianxia.layers.triton_linear import gemv

        logits, _ = gemv(x, lm_head, residual=residual, **norm.prologue())
    else:
        h, _ = norm(x, residual)
        logits = F.linear(h, lm_head)
    return logits.float()

