"""Block-quantized weights kept packed in memory, and their conversions.

A :class:`PackedWeight` stores an ``[N, K]`` matrix as ``w = q * scale + min`` per group of
consecutive elements of a row, in a layout that the CPU kernels
(:mod:`tianxia.quant.cpu_kernels`) multiply with directly. Rows are blocks of 32 codes:

- ``bits=4``: 16 bytes per block, ggml's nibble order (byte ``j`` holds element ``j`` in its low
  and ``j + 16`` in its high nibble); codes 0..15, groups of 32;
- ``bits=5``: 20 bytes per block, the codes' low 4 bits as for ``bits=4``, then 4 bytes whose byte
  ``j`` bit ``i`` is bit 4 of element ``4i + j``; codes are those 5 bits minus 16, groups of 32;
- ``bits=6``: 24 bytes per block, the low 4 bits as for ``bits=4``, then 8 bytes whose byte ``j``
  bits ``2i, 2i+1`` are bits 4 and 5 of element ``8i + j``; codes are those 6 bits minus 32,
  groups of 16 or 32;
- ``bits=8``: ``[N, K]`` int8 (stored as uint8 bytes), groups of 16 or more.

The high bits sit in planes so that AVX2 spreads them over a block with one variable shift.
``scales`` and ``mins`` are ``[N, K/group]``, float16 where every value is exactly a float16 (the
``d`` of Q4_0, Q4_1, Q5_0, Q8_0: what the GGUF file stores), float32 otherwise (k-quant scales
``d * sc`` are products that float16 cannot hold); ``mins`` is None for symmetric formats.

GGUF blocks map onto these layouts without loss (:func:`from_gguf`): Q4_0, Q4_1 and Q4_K become
4-bit groups of 32; Q5_0, Q5_1 and Q5_K 5-bit groups of 32; Q6_K 6-bit groups of 16; Q8_0 8-bit
groups of 32; Q3_K and Q2_K 8-bit groups of 16 (their sub-block scales are per 16 elements). Each
(scale, min) is the float32 value ggml's own dequantization computes (``d * sc``, ``-dmin * m``;
for 5-bit codes with a min, ``min + 16 * scale``, as the codes are stored centred), so the only
difference from :func:`tianxia.quant.gguf_codecs.dequantize` is float rounding in the kernel. The
IQ types and float tensors have no packed form; they stay float.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from tianxia.quant.gguf_codecs import (
    _as_bytes,
    _as_tensor,
    _bits,
    _f16,
    _k_scale_min,
    _nibbles,
    _shifts,
    _split,
    block_info,
)

__all__ = ["PACKABLE_TYPES", "PackedWeight", "concat_rows", "from_gguf", "quantize_float", "stack_runs"]


@dataclass
class PackedWeight:
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int
    source: str  # the encoding it came from ("Q4_1", "int8", ...), for logs and errors

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def ints(self) -> torch.Tensor:
        """The integer codes as an int16 ``[N, K]`` tensor."""
        n = self.qs.shape[0]
        if self.bits == 8:
            return self.qs.view(torch.int8).to(torch.int16)
        blocks = self.qs.reshape(n, -1, 4 * self.bits)
        # per 16 bytes: 16 low, then 16 high nibbles
        q = _nibbles(blocks[:, :, :16].reshape(n, -1), 16).to(torch.int16).reshape(n, -1, 32)
        if self.bits == 4:
            return q.reshape(n, -1)
        planes, width = (8, 1) if self.bits == 5 else (4, 2)
        high = blocks[:, :, 16:].to(torch.int16)
        shifts = torch.arange(planes, dtype=torch.int16)[:, None] * width
        high = (high[:, :, None, :] >> shifts) & ((1 << width) - 1)  # [n, blocks, plane, byte]
        return (q | (high.reshape(n, -1, 32) << 4)).reshape(n, -1) - (1 << (self.bits - 1))

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[N, K]``, computed in torch (the reference for the kernels)."""
        n, k = self.shape
        q = self.ints().to(torch.float32).reshape(n, -1, self.group)
        w = q * self.scales.float()[:, :, None]
        if self.mins is not None:
            w = w + self.mins.float()[:, :, None]
        return w.reshape(n, k)

    def select_rows(self, index: torch.Tensor) -> PackedWeight:
        mins = None if self.mins is None else self.mins[index].contiguous()
        return PackedWeight(self.qs[index].contiguous(), self.scales[index].contiguous(), mins,
                            self.bits, self.group, self.source)


def _same_layout(parts: list[PackedWeight]) -> bool:
    return all(p.bits == 4 for p in parts) or all((p.bits, p.group) == (parts[0].bits, parts[0].group) for p in parts)


def stack_runs(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Stack each run of consecutive weights that share a layout into one (Q5_0 q and k, then a
    Q8_0 v: two), so that no part is widened to another layout."""
    runs: list[list[PackedWeight]] = []
    for p in parts:
        if runs and _same_layout([runs[-1][-1], p]):
            runs[-1].append(p)
        else:
            runs.append([p])
    return [run[0] if len(run) == 1 else concat_rows(run) for run in runs]


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights of one layout along the output dimension (fused projections)."""
    if not _same_layout(parts):
        raise ValueError(f"cannot stack {', '.join(p.source for p in parts)} rows: their layouts differ")
    dtype = parts[0].scales.dtype if len({p.scales.dtype for p in parts}) == 1 else torch.float32
    mins = None
    if any(p.mins is not None for p in parts):
        mins = torch.cat([(p.mins if p.mins is not None else torch.zeros_like(p.scales)).to(dtype) for p in parts])
    sources = sorted({p.source for p in parts})
    return PackedWeight(torch.cat([p.qs for p in parts]), torch.cat([p.scales.to(dtype) for p in parts]), mins,
                        parts[0].bits, parts[0].group, "+".join(sources))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] codes in 0..15 -> [..., 16] bytes in ggml's order."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _pack_blocks(q: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Signed codes ``[..., 32]`` per block -> the 5- or 6-bit rows ``[rows, K * bits / 8]``."""
    u = (q.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8).reshape(rows, -1, 32)
    planes, width = (8, 1) if bits == 5 else (4, 2)
    high = (u >> 4).reshape(rows, -1, planes, 32 // planes)
    shifts = torch.arange(planes, dtype=torch.uint8)[:, None] * width
    plane_bytes = (high << shifts).sum(dim=2, dtype=torch.uint8)  # disjoint bits: the sum is an or
    return torch.cat([_pack_nibbles(u & 0x0F), plane_bytes], dim=2).reshape(rows, -1)


def _compact_scales(
    scales: torch.Tensor, mins: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both as float16 where that holds every value of both exactly (they share one type), else as
    they are (float32)."""
    half = [t.to(torch.float16) for t in (scales, mins) if t is not None]
    if all(torch.equal(h.to(t.dtype), t) for h, t in zip(half, (scales, mins))):
        return half[0], half[1] if mins is not None else None
    return scales, mins


def _half_if_finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to float16 values (kept as float32) where they stay finite and nonzero ones
    stay nonzero, so the codes are chosen for the scales that will be stored."""
    half = t.to(torch.float16).to(torch.float32)
    ok = torch.isfinite(half).all() and bool(((half != 0) | (t == 0)).all())
    return half if ok else t


def _q8(q: torch.Tensor, rows: int) -> torch.Tensor:
    return q.to(torch.int8).reshape(rows, -1).view(torch.uint8)


def _decompose(blocks: torch.Tensor, qtype: QT):
    """(codes [nb, groups, G], scale [nb, groups], min [nb, groups] | None, bits) of GGUF blocks."""
    nb = blocks.shape[0]
    if qtype == QT.Q4_0:
        d, qs = _split(blocks, 2, 16)
        d = _f16(d)
        return qs.reshape(nb, 1, 16), d, -8 * d, 4
    if qtype == QT.Q4_1:
        d, m, qs = _split(blocks, 2, 2, 16)
        return qs.reshape(nb, 1, 16), _f16(d), _f16(m), 4
    if qtype == QT.Q4_K:
        d, dmin, scales, qs = _split(blocks, 2, 2, 12, 128)
        sc, mn = _k_scale_min(scales)
        q = _nibbles(qs, 32).reshape(nb, 8, 32)
        return _pack_nibbles(q), _f16(d) * sc.float(), -(_f16(dmin) * mn.float()), 4
    if qtype == QT.Q8_0:
        d, qs = _split(blocks, 2, 32)
        return qs.contiguous().view(torch.int8).reshape(nb, 1, 32), _f16(d), None, 8
    if qtype in (QT.Q5_0, QT.Q5_1):
        if qtype == QT.Q5_0:
            d, qh, qs = _split(blocks, 2, 4, 16)
            m = None
        else:
            d, m, qh, qs = _split(blocks, 2, 2, 4, 16)
            m = _f16(m)
        q = (_nibbles(qs, 16) | (_bits(qh) << 4)).to(torch.int16)
        if qtype == QT.Q5_0:
            q = q - 16
        return q.reshape(nb, 1, 32), _f16(d), m, 5
    if qtype == QT.Q5_K:
        d, dmin, scales, qh, qs = _split(blocks, 2, 2, 12, 32, 128)
        sc, mn = _k_scale_min(scales)
        hb = (qh.reshape(nb, 1, 32) >> _shifts(list(range(8)), (1, 8, 1), qh)) & 1
        q = _nibbles(qs, 32).reshape(nb, 8, 32) | (hb << 4)
        return q, _f16(d) * sc.float(), -(_f16(dmin) * mn.float()), 5
    if qtype == QT.Q6_K:
        ql, qh, scales, d = _split(blocks, 128, 64, 16, 2)
        lo = _nibbles(ql, 64).reshape(nb, 8, 32)
        hi = ((qh.reshape(nb, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qh)) & 3).reshape(nb, 8, 32)
        q = (lo | (hi << 4)).to(torch.int16) - 32
        return q.reshape(nb, 16, 16), _f16(d) * scales.contiguous().view(torch.int8).float(), None, 6
    if qtype == QT.Q2_K:
        scales, qs, d, dmin = _split(blocks, 16, 64, 2, 2)
        q = ((qs.reshape(nb, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qs)) & 3).reshape(nb, 16, 16)
        return q, _f16(d) * (scales & 0x0F).float(), -(_f16(dmin) * (scales >> 4).float()), 8
    if qtype == QT.Q3_K:
        hmask, qs, scales, d = _split(blocks, 32, 64, 12, 2)
        lo, hi = _split(scales, 8, 4)
        lo = (lo.reshape(nb, 1, 8) >> _shifts([0, 4], (1, 2, 1), lo)).reshape(nb, 16) & 0x0F
        hi = (hi.reshape(nb, 1, 4) >> _shifts([0, 2, 4, 6], (1, 4, 1), hi)).reshape(nb, 16) & 0x03
        sc = (lo | (hi << 4)).float() - 32
        ql = (qs.reshape(nb, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qs)).reshape(nb, 16, 16) & 3
        qh = (hmask.reshape(nb, 1, 32) >> _shifts(list(range(8)), (1, 8, 1), hmask)).reshape(nb, 16, 16) & 1
        q = ql.to(torch.int16) - ((qh ^ 1) << 2).to(torch.int16)
        return q, _f16(d) * sc, None, 8
    raise KeyError(qtype)


PACKABLE_TYPES = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K,
                            QT.Q2_K, QT.Q3_K})


def from_gguf(raw: torch.Tensor | np.ndarray, qtype: QT | int, shape: tuple[int, int]) -> PackedWeight:
    """Repack one GGUF matrix (raw block bytes, PyTorch-order ``shape``) without loss."""
    qtype = QT(int(qtype))
    if qtype not in PACKABLE_TYPES:
        raise ValueError(f"{qtype.name} has no packed layout")
    rows, cols = shape
    _, type_size = block_info(qtype)
    data = _as_bytes(_as_tensor(raw)).reshape(-1, type_size)
    q, scale, mn, bits = _decompose(data, qtype)
    groups = q.shape[0] * q.shape[1] // rows
    group = cols // groups
    if bits == 5 and mn is not None:  # Q5_1, Q5_K: unsigned codes, stored centred
        q = q.to(torch.int16) - 16
        mn = mn + 16 * scale
    if bits == 4:
        qs = q.reshape(rows, cols // 2).contiguous()
    elif bits in (5, 6):
        qs = _pack_blocks(q, bits, rows).contiguous()
    else:
        qs = _q8(q, rows).contiguous()
    scales = scale.reshape(rows, groups).contiguous()
    mins = None if mn is None else mn.reshape(rows, groups).contiguous()
    scales, mins = _compact_scales(scales, mins)
    return PackedWeight(qs, scales, mins, bits, group, qtype.name)


def quantize_float(w: torch.Tensor, method: str) -> PackedWeight:
    """Quantize a float ``[N, K]`` matrix: ``q8_0`` / ``q4_0`` exactly as llama.cpp does (gguf-py's
    reference encoders), ``int8`` symmetric per output channel, ``int4`` asymmetric per group of 32
    (a scale and a min, like Q4_1 with float32 scale and min)."""
    rows, cols = w.shape
    w = w.detach().to(torch.float32)
    if method in ("q8_0", "q4_0"):
        from tianxia.quant.quantize import quantize_array

        qtype = QT.Q8_0 if method == "q8_0" else QT.Q4_0
        raw = quantize_array(w.contiguous().numpy(), qtype)
        return from_gguf(raw, qtype, (rows, cols))
    if method == "int8":
        scale = _half_if_finite(w.abs().amax(dim=1, keepdim=True) / 127)
        q = torch.where(scale > 0, w / scale, torch.zeros_like(w)).round().clamp(-127, 127)
        pad = (-cols) % 16
        if pad:  # the layout needs whole 16-element chunks; a row is one group here
            raise ValueError(f"int8 needs rows of a multiple of 16 elements, got {cols}")
        scale, _ = _compact_scales(scale.contiguous(), None)
        return PackedWeight(_q8(q, rows).contiguous(), scale, None, 8, cols, "int8")
    if method == "int4":
        if cols % 32:
            raise ValueError(f"int4 needs rows of a multiple of 32 elements, got {cols}")
        g = w.reshape(rows, -1, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = _half_if_finite((hi - lo) / 15)
        lo = _half_if_finite(lo)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15)
        scale, lo = _compact_scales(scale.contiguous(), lo.contiguous())
        return PackedWeight(_pack_nibbles(q).reshape(rows, cols // 2).contiguous(), scale, lo, 4, 32, "int4")
    raise ValueError(f"unknown quantization method {method!r}")

