"""Rotary position embeddings, with the scaling schemes long-context checkpoints configure.

Layouts: rotate-half ("NeoX", what Hugging Face uses for Llama-style models; GGUF ``llama`` files
store q/k rows permuted for the interleaved layout and the GGUF loader undoes that) and
interleaved pairs (GLM-4). ``rotary_dim`` < ``head_dim`` rotates only the leading dimensions
(Phi-3, GLM-4 ``partial_rotary_factor``).

Scaling (``rope_scaling["rope_type"]``), each computed as ``transformers`` computes it:

- ``linear``: positions divided by ``factor`` (all frequencies divided).
- ``dynamic`` (NTK-aware): once the sequence outgrows ``max_position_embeddings`` the base grows
  to ``base * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2))``; ``L`` is the largest
  position of the forward pass plus one, as in ``transformers`` (keys already cached keep the
  rotation they were written with).
- ``yarn``: per-frequency blend of interpolation and extrapolation (ramp between the
  ``beta_fast``/``beta_slow`` correction dimensions), cos/sin scaled by the attention factor.
- ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between.
- ``freq_factors``: explicit per-frequency divisors (how GGUF files carry llama3 scaling, in their
  ``rope_freqs`` tensor).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tianxia.layers.attention.backend import triton_available
from tianxia.quant.cpu_kernels import fused_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, dim: int, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = scaling.get("factor")
    orig = scaling.get("original_max_position_embeddings") or max_position
    if factor is None:
        factor = max_position / orig

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_position = max_position
        self.base = base
        self.scaling = scaling
        self.interleaved = interleaved
        self.rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or "default"
        if self.rope_type not in ("default", "linear", "dynamic", "yarn", "llama3", "freq_factors"):
            raise NotImplementedError(f"RoPE scaling {self.rope_type!r} is not supported")
        self.attention_factor = 1.0
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)

    def _base_inv_freq(self, base: float | torch.Tensor) -> torch.Tensor:
        d = self.rotary_dim
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def build_cache(self, device: torch.device | str, length: int | None = None) -> None:
        """(Re)compute the cos/sin table; called after the model leaves the meta device."""
        inv_freq = self._base_inv_freq(self.base)
        if self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
        elif self.rope_type == "linear":
            inv_freq = inv_freq / self.scaling["factor"]
        elif self.rope_type == "freq_factors":  # GGUF's rope_freqs tensor (llama3 scaling)
            inv_freq = inv_freq / torch.tensor(self.scaling["factors"], dtype=torch.float32)
        elif self.rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(
                self.base, self.rotary_dim, self.scaling, self.max_position
            )
        self.inv_freq = inv_freq.to(device)
        length = length or min(self.max_position, 8192)
        self.cos_sin = self._table(torch.arange(length, dtype=torch.float32, device=device), self.inv_freq)

    def _table(self, t: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        freqs = t[:, None] * inv_freq[None, :]
        return torch.cat([freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor], dim=-1)

    def _cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        if self.rope_type == "dynamic":
            seq_len = int(positions.max()) + 1
            if seq_len > self.max_position:
                factor = self.scaling["factor"]
                d = self.rotary_dim
                # float32 tensor arithmetic, as transformers does it (seq_len is a tensor there)
                ratio = factor * torch.tensor(seq_len) / self.max_position - (factor - 1)
                base = self.base * ratio ** (d / (d - 2))
                inv_freq = self._base_inv_freq(base).to(positions.device)
                return self._table(positions.float(), inv_freq)
        if positions.numel() and positions.device.type == "cpu":
            self.ensure_positions(int(positions.max()))
        # on a GPU the table was sized for the longest context at start-up (ensure_positions):
        # reading the step's largest position back would sync the host, and break graph capture
        return self.cos_sin[positions]

    def ensure_positions(self, last: int) -> None:
        """Grow the cos/sin table (doubling) so that it covers position ``last``."""
        if last >= self.cos_sin.shape[0]:
            size = max(last + 1, 2 * self.cos_sin.shape[0])
            device = self.cos_sin.device
            self.cos_sin = self._table(torch.arange(size, dtype=torch.float32, device=device), self.inv_freq)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] in float32, returning their dtype."""
        ext = fused_ops(q) if self.rope_type != "dynamic" and k.dtype == torch.float32 else None
        if ext is not None and ext.rope(q, k, positions, self.cos_sin, self.interleaved):
            return q, k  # rotated in place
        if q.is_cuda and self.rope_type != "dynamic" and triton_available():
            from tianxia.layers.attention.triton_rope import rope

            return rope(q, k, positions, self.cos_sin, self.rotary_dim, self.interleaved)
        cos, sin = self._cos_sin(positions).chunk(2, dim=-1)
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        xr = x[..., :rd].float()
        if self.interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        else:
            x1, x2 = xr.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if rd < x.shape[-1]:
            out = torch.cat([out, x[..., rd:].float()], dim=-1)
        return out.to(x.dtype)
