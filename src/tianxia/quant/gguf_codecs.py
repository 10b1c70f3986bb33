"""Dequantization of GGUF (ggml) tensor encodings into float32 torch tensors.

Every codec is a handful of vectorized torch ops over a ``(n_blocks, type_size)``
uint8 view of the raw bytes, so it runs unchanged on CPU or CUDA, and every
value is bit-exact against ``gguf.quants.dequantize`` (the numpy reference in
the ``gguf`` package). Bit-exactness comes from computing as the reference
does: fp16 scales are widened to float32 first and all arithmetic is float32.
Every product in these formulas is exact in float32 (an fp16 significand has
11 bits and the integer factors add at most 12 more, e.g. Q6_K's int8 scale
times its (q - 32)), so the grouping of products does not matter and neither
would FMA contraction; the only rounding is the final ``+ m`` / ``- dmin * mn``,
which must stay a single float32 add of the same two terms.

Block layouts (little endian; ``d``/``m``/``dmin`` are fp16; ``QK_K`` = 256):

    Q4_0   32 elems, 18 B: d, 16 B nibbles. x = d * (q - 8)
    Q4_1   32 elems, 20 B: d, m, 16 B nibbles. x = d * q + m
    Q5_0   32 elems, 22 B: d, 4 B high bits (u32, bit i -> elem i), 16 B nibbles. x = d * (q - 16)
    Q5_1   32 elems, 24 B: d, m, 4 B high bits, 16 B nibbles. x = d * q + m
    Q8_0   32 elems, 34 B: d, 32 x int8. x = q * d
    Nibble layout of the 32-elem types: byte j holds elem j (low) and elem j+16 (high).

    Q2_K   256 elems, 84 B: 16 B scales (lo nibble: scale, hi nibble: min, one per
           16 elems), 64 B 2-bit quants, d, dmin. x = (d * sc) * q - (dmin * mn)
    Q3_K   256 elems, 110 B: 32 B high-bit mask, 64 B 2-bit quants, 12 B packed
           6-bit signed scales (one per 16 elems), d. x = (d * (sc - 32)) * q, where
           q = low2 - 4 when the mask bit is *clear*.
    Q4_K   256 elems, 144 B: d, dmin, 12 B packed 6-bit scales+mins (8 sub-blocks
           of 32), 128 B nibbles. x = (d * sc) * q - (dmin * mn)
    Q5_K   256 elems, 176 B: as Q4_K plus 32 B high bits before the nibbles.
    Q6_K   256 elems, 210 B: 128 B low nibbles, 64 B high 2-bits, 16 x int8
           scales (one per 16 elems), d. x = (d * sc) * (q - 32)

    IQ4_NL 32 elems, 18 B: d, 16 B nibbles indexing a fixed 16-entry non-linear
           table. x = d * table[q]
    IQ4_XS 256 elems, 136 B: d, 2 B high scale bits, 4 B low scale nibbles
           (6-bit signed scale per 32 elems), 128 B nibbles into the IQ4_NL table.
           x = (d * (sc - 32)) * table[q]

    IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M
           256 elems: indices into llama.cpp's codebooks ("grids") of 8 (IQ2, IQ1) or
           4 (IQ3) values, with sign bits (IQ2/IQ3) or a +-1/8 delta (IQ1), and 3-4 bit
           sub-block scales; see the codecs for the exact packing.

F32/F16/BF16 are plain element arrays; ``gguf.GGUFReader`` hands out F32 and
F16 as typed arrays but BF16 as raw bytes, so all forms are accepted.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

QType = GGMLQuantizationType

__all__ = [
    "SUPPORTED_TYPES",
    "UnsupportedQuantTypeError",
    "block_info",
    "dequantize",
]


class UnsupportedQuantTypeError(ValueError):
    """Raised for a GGML tensor type that has no codec here."""

    def __init__(self, qtype: GGMLQuantizationType | int):
        self.qtype = qtype
        super().__init__(
            f"unsupported GGML tensor type {_type_name(qtype)}; "
            f"supported types: {', '.join(t.name for t in sorted(SUPPORTED_TYPES))}"
        )


def _type_name(qtype: GGMLQuantizationType | int) -> str:
    try:
        return QType(int(qtype)).name
    except ValueError:
        return f"<unknown GGML type id {int(qtype)}>"


def block_info(qtype: GGMLQuantizationType | int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type."""
    try:
        return GGML_QUANT_SIZES[QType(int(qtype))]
    except (ValueError, KeyError):
        raise UnsupportedQuantTypeError(qtype) from None


# ---------------------------------------------------------------------------
# small helpers (all operate on (n_blocks, k) uint8 tensors)
# ---------------------------------------------------------------------------

def _split(blocks: torch.Tensor, *sizes: int) -> tuple[torch.Tensor, ...]:
    return torch.split(blocks, list(sizes), dim=1)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) bytes -> (n, 1) float32. fp16 -> fp32 widening is exact."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _shifts(values: list[int], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).reshape(shape)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Unpack nibbles laid out as [lo of `group` bytes, hi of the same bytes] per group."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _shifts([0, 4], (1, 1, 2, 1), qs)
    return (q & 0x0F).reshape(n, -1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 8k) bits, LSB first, i.e. bit i of the little-endian integer."""
    n = b.shape[0]
    return ((b.unsqueeze(-1) >> _shifts(list(range(8)), (1, 1, 8), b)) & 1).reshape(n, -1)


def _table(values: tuple[int, ...], idx: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(values, dtype=torch.float32, device=idx.device)
    return table[idx.long()]


# ---------------------------------------------------------------------------
# codecs: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32
# ---------------------------------------------------------------------------

def _dq_bf16(blocks: torch.Tensor) -> torch.Tensor:
    # bf16 -> fp32 is a pure 16-bit shift in torch too, so NaN payloads survive.
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


def _dq_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _split(blocks, 2, 16)
    q = _nibbles(qs, 16).to(torch.float32) - 8
    return _f16(d) * q


def _dq_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qs = _split(blocks, 2, 2, 16)
    q = _nibbles(qs, 16).to(torch.float32)
    return _f16(d) * q + _f16(m)


def _dq_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qh, qs = _split(blocks, 2, 4, 16)
    q = (_nibbles(qs, 16) | (_bits(qh) << 4)).to(torch.float32) - 16
    return _f16(d) * q


def _dq_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qh, qs = _split(blocks, 2, 2, 4, 16)
    q = (_nibbles(qs, 16) | (_bits(qh) << 4)).to(torch.float32)
    return _f16(d) * q + _f16(m)


def _dq_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _split(blocks, 2, 32)
    return qs.contiguous().view(torch.int8).to(torch.float32) * _f16(d)


def _dq_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs, d, dmin = _split(blocks, 16, 64, 2, 2)
    dl = (_f16(d) * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (_f16(dmin) * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    # each 32-byte half holds 4 consecutive 32-elem runs, at bit offsets 0, 2, 4, 6
    q = (qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qs)) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _dq_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales, d = _split(blocks, 32, 64, 12, 2)
    # 16 6-bit scales: low nibbles from bytes 0..7 (lo then hi nibble halves),
    # high 2 bits from bytes 8..11 at offsets 0, 2, 4, 6.
    lo, hi = _split(scales, 8, 4)
    lo = (lo.reshape(n, 1, 8) >> _shifts([0, 4], (1, 2, 1), lo)).reshape(n, 16) & 0x0F
    hi = (hi.reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], (1, 4, 1), hi)).reshape(n, 16) & 0x03
    sc = (lo | (hi << 4)).to(torch.float32) - 32
    dl = (_f16(d) * sc).reshape(n, 16, 1)

    ql = (qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qs)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, 1, 32) >> _shifts(list(range(8)), (1, 8, 1), hmask)).reshape(n, 16, 16) & 1
    # the -4 offset applies when the mask bit is 0, not 1
    q = ql.to(torch.float32) - ((qh ^ 1) << 2).to(torch.float32)
    return (dl * q).reshape(n, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K field into 8 6-bit scales and 8 6-bit mins.

    Sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scale) and 4-7 (min);
    sub-blocks 4-7 take their low nibbles from bytes 8-11 and their top 2 bits
    from the spare top bits of bytes 0-7.
    """
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _dq_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qs = _split(blocks, 2, 2, 12, 128)
    sc, mn = _k_scale_min(scales)
    dl = (_f16(d) * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (_f16(dmin) * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(qs, 32).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _dq_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qh, qs = _split(blocks, 2, 2, 12, 32, 128)
    sc, mn = _k_scale_min(scales)
    dl = (_f16(d) * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (_f16(dmin) * mn.to(torch.float32)).reshape(n, 8, 1)
    # high bit of sub-block j is bit j of each of the 32 qh bytes
    hb = (qh.reshape(n, 1, 32) >> _shifts(list(range(8)), (1, 8, 1), qh)) & 1
    q = (_nibbles(qs, 32).reshape(n, 8, 32) | (hb << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _dq_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales, d = _split(blocks, 128, 64, 16, 2)
    dl = (_f16(d) * scales.contiguous().view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    lo = _nibbles(ql, 64).reshape(n, 8, 32)
    hi = ((qh.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qh)) & 3).reshape(n, 8, 32)
    q = (lo | (hi << 4)).to(torch.float32) - 32
    return (dl * q.reshape(n, 16, 16)).reshape(n, 256)


IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _dq_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _split(blocks, 2, 16)
    return _f16(d) * _table(IQ4_NL_VALUES, _nibbles(qs, 16))


def _dq_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, sh, sl, qs = _split(blocks, 2, 2, 4, 128)
    lo = (sl.reshape(n, 4, 1) >> _shifts([0, 4], (1, 1, 2), sl)).reshape(n, 8) & 0x0F
    # 2 high bits per sub-block, packed LSB first into a little-endian u16
    hi = _bits(sh).reshape(n, 8, 2)
    hi = hi[..., 0] | (hi[..., 1] << 1)
    sc = (lo | (hi << 4)).to(torch.float32) - 32
    dl = (_f16(d) * sc).reshape(n, 8, 1)
    q = _table(IQ4_NL_VALUES, _nibbles(qs, 16)).reshape(n, 8, 32)
    return (dl * q).reshape(n, 256)


# --- i-quants (IQ2_*, IQ3_*, IQ1_*): codebook ("grid") lookups with sign bits ------------------
# The grids are gguf-py's (``gguf.quants.<TYPE>.init_grid()``: llama.cpp's tables, decoded to
# float32). Every product below is exact in float32 (an fp16 scale times small integers and grid
# values of at most 6 bits, or a multiple of 1/8 for IQ1), so the results are bit-exact whatever
# the grouping.

_GRID_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def _grid(name: str, device: torch.device) -> torch.Tensor:
    key = (name, str(device))
    if key not in _GRID_CACHE:
        from gguf import quants

        cls = getattr(quants, name)
        if cls.grid is None:
            cls.init_grid()
        g = np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)
        _GRID_CACHE[key] = torch.from_numpy(g).to(device)
    return _GRID_CACHE[key]


def _ksigns(device: torch.device) -> torch.Tensor:
    """The 128-entry table of 8-bit sign patterns with even parity (llama.cpp's ksigns_iq2xs)."""
    key = ("ksigns", str(device))
    if key not in _GRID_CACHE:
        from gguf import quants

        k = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64)
        _GRID_CACHE[key] = torch.from_numpy(k).to(device)
    return _GRID_CACHE[key]


def _le(b: torch.Tensor, width: int) -> torch.Tensor:
    """(n, k*width) little-endian bytes -> (n, k) unsigned integers as int64."""
    n = b.shape[0]
    parts = b.reshape(n, -1, width).to(torch.int64)
    out = parts[..., 0]
    for i in range(1, width):
        out = out | (parts[..., i] << (8 * i))
    return out


def _sign_bits(bytes_: torch.Tensor) -> torch.Tensor:
    """int64 bytes (...,) -> (..., 8) of +1.0 / -1.0, bit i set meaning negative."""
    bits = (bytes_.unsqueeze(-1) >> torch.arange(8, device=bytes_.device)) & 1
    return torch.where(bits == 0, 1.0, -1.0).to(torch.float32)


def _nibble_scales(sc: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 2k) 4-bit scales, low nibble first."""
    n = sc.shape[0]
    return ((sc.reshape(n, -1, 1).to(torch.int64) >> torch.tensor([0, 4], device=sc.device)) & 0x0F).reshape(n, -1)


def _dq_iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs = _split(blocks, 2, 64)
    aux = _le(qs, 4).reshape(n, 8, 2)  # per 32 elems: 4 grid indices, then signs + scale
    db = (_f16(d) * (0.5 + (aux[..., 1] >> 28).to(torch.float32)) * 0.25).reshape(n, 8, 1, 1)
    sidx = (aux[..., 1].unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=blocks.device)) & 0x7F
    signs = _sign_bits(_ksigns(blocks.device)[sidx])  # (n, 8, 4, 8)
    gidx = qs.reshape(n, 8, 8)[:, :, :4].to(torch.int64)
    grid = _grid("IQ2_XXS", blocks.device)[gidx]  # (n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def _dq_iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, sc = _split(blocks, 2, 64, 8)
    q = _le(qs, 2)  # (n, 32): 9-bit grid index, 7-bit sign index
    db = (_f16(d) * (0.5 + _nibble_scales(sc).to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    signs = _sign_bits(_ksigns(blocks.device)[q >> 9]).reshape(n, 16, 2, 8)
    grid = _grid("IQ2_XS", blocks.device)[q & 511].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def _dq_iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, sg, qh, sc = _split(blocks, 2, 32, 32, 8, 8)
    db = (_f16(d) * (0.5 + _nibble_scales(sc).to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    signs = _sign_bits(sg.to(torch.int64)).reshape(n, 16, 2, 8)
    hi = ((qh.reshape(n, 8, 1).to(torch.int64) >> torch.tensor([0, 2, 4, 6], device=blocks.device)) & 3).reshape(n, 32)
    idx = qs.to(torch.int64) | (hi << 8)
    grid = _grid("IQ2_S", blocks.device)[idx].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def _dq_iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, sc = _split(blocks, 2, 64, 32)
    aux = _le(sc, 4)  # (n, 8): 4 x 7-bit sign indices, 4-bit scale
    db = (_f16(d) * (0.5 + (aux >> 28).to(torch.float32)) * 0.5).reshape(n, 8, 1, 1)
    sidx = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=blocks.device)) & 0x7F
    signs = _sign_bits(_ksigns(blocks.device)[sidx])  # (n, 8, 4, 8)
    grid = _grid("IQ3_XXS", blocks.device)[qs.to(torch.int64)].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def _dq_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, qh, sg, sc = _split(blocks, 2, 64, 8, 32, 4)
    db = (_f16(d) * (1 + 2 * _nibble_scales(sc)).to(torch.float32)).reshape(n, 8, 1, 1)
    signs = _sign_bits(sg.to(torch.int64)).reshape(n, 8, 4, 8)
    hi = ((qh.reshape(n, 8, 1).to(torch.int64) >> torch.arange(8, device=blocks.device)) & 1).reshape(n, 64)
    idx = qs.to(torch.int64) | (hi << 8)
    grid = _grid("IQ3_S", blocks.device)[idx].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


_IQ1_DELTA = 0.125


def _dq_iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, qh = _split(blocks, 2, 32, 16)
    h = _le(qh, 2)  # (n, 8): 4 x 3-bit index highs, 3-bit scale, delta sign
    dl = (_f16(d) * (2 * ((h >> 12) & 7) + 1).to(torch.float32)).reshape(n, 8, 1, 1)
    delta = torch.where((h & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).to(torch.float32).reshape(n, 8, 1, 1)
    hi = ((h.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=blocks.device)) & 7).reshape(n, 32)
    idx = qs.to(torch.int64) | (hi << 8)
    grid = _grid("IQ1_S", blocks.device)[idx].reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, 256)


def _dq_iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qs, qh, sc = _split(blocks, 32, 16, 8)
    s = _le(sc, 2)  # (n, 4); the fp16 super-block scale is the top nibbles of the four
    dev = blocks.device
    dbits = ((s & 0xF000) >> torch.tensor([12, 8, 4, 0], device=dev)).sum(-1)  # disjoint bits: sum == or
    dbits = torch.where(dbits >= 0x8000, dbits - 0x10000, dbits)  # as a signed 16-bit pattern
    d = dbits.to(torch.int16).view(torch.float16).to(torch.float32).reshape(n, 1)
    sub = ((s.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=dev)) & 7).reshape(n, 16)
    dl = (d * (2 * sub + 1).to(torch.float32)).reshape(n, 8, 2, 1, 1)
    h = (qh.reshape(n, 16, 1).to(torch.int64) >> torch.tensor([0, 4], device=dev)).reshape(n, 32)
    idx = qs.to(torch.int64) | ((h & 7) << 8)
    delta = torch.where((h & 8) == 0, _IQ1_DELTA, -_IQ1_DELTA).to(torch.float32).reshape(n, 8, 2, 2, 1)
    grid = _grid("IQ1_S", dev)[idx].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, 256)


_CODECS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.BF16: _dq_bf16,
    QType.Q4_0: _dq_q4_0,
    QType.Q4_1: _dq_q4_1,
    QType.Q5_0: _dq_q5_0,
    QType.Q5_1: _dq_q5_1,
    QType.Q8_0: _dq_q8_0,
    QType.Q2_K: _dq_q2_k,
    QType.Q3_K: _dq_q3_k,
    QType.Q4_K: _dq_q4_k,
    QType.Q5_K: _dq_q5_k,
    QType.Q6_K: _dq_q6_k,
    QType.IQ4_NL: _dq_iq4_nl,
    QType.IQ4_XS: _dq_iq4_xs,
    QType.IQ2_XXS: _dq_iq2_xxs,
    QType.IQ2_XS: _dq_iq2_xs,
    QType.IQ2_S: _dq_iq2_s,
    QType.IQ3_XXS: _dq_iq3_xxs,
    QType.IQ3_S: _dq_iq3_s,
    QType.IQ1_S: _dq_iq1_s,
    QType.IQ1_M: _dq_iq1_m,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset({QType.F32, QType.F16, *_CODECS})


# ---------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------

def _as_tensor(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw
    arr = np.ascontiguousarray(raw)
    # GGUFReader hands out read-only memmaps; we never write through the view.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(arr)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype != torch.uint8:
        t = t.reshape(-1).view(torch.uint8)
    return t.reshape(-1)


def dequantize(
    raw: torch.Tensor | np.ndarray,
    qtype: GGMLQuantizationType | int,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """Decode one GGUF tensor into a float32 tensor of ``shape`` (PyTorch order).

    ``raw`` is the tensor's raw bytes as uint8 (any shape), or for F32/F16/BF16
    a typed array of the elements. The result lives on ``raw``'s device.
    """
    try:
        qtype = QType(int(qtype))
    except ValueError:
        raise UnsupportedQuantTypeError(qtype) from None
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedQuantTypeError(qtype)

    shape = tuple(int(s) for s in shape)
    n_elems = math.prod(shape)
    t = _as_tensor(raw)

    # typed F32/F16 arrays are decoded directly (no byte round trip needed)
    if qtype == QType.F32 and t.dtype == torch.float32:
        out = t
    elif qtype == QType.F16 and t.dtype == torch.float16:
        out = t.to(torch.float32)
    elif qtype == QType.BF16 and t.dtype == torch.bfloat16:
        out = t.to(torch.float32)
    else:
        block_size, type_size = block_info(qtype)
        if shape and shape[-1] % block_size:
            raise ValueError(
                f"{qtype.name}: row length {shape[-1]} is not a multiple of the block size {block_size}"
            )
        data = _as_bytes(t)
        n_bytes = n_elems // block_size * type_size
        if data.numel() != n_bytes:
            raise ValueError(
                f"{qtype.name}: got {data.numel()} bytes for shape {shape}, expected {n_bytes}"
            )
        if qtype == QType.F32:
            out = data.view(torch.float32)
        elif qtype == QType.F16:
            out = data.view(torch.float16).to(torch.float32)
        else:
            out = _CODECS[qtype](data.reshape(-1, type_size))

    if out.numel() != n_elems:
        raise ValueError(f"{qtype.name}: got {out.numel()} elements for shape {shape}")
    return out.reshape(shape)
