"""K-quant quantizers (Q2_K .. Q6_K) in numpy, following llama.cpp's ``quantize_row_q*_K_ref``.

These are the reference (no importance matrix) algorithms of ``ggml-quants.c``, vectorized over
blocks: every per-block loop of the C code becomes array arithmetic over all blocks at once, in
float32 as the C code computes, with ``np.rint`` for ``nearest_int`` (both round half to even).
Sums are accumulated in a different order than the C loops, so a value that lands exactly on a
rounding boundary can come out one step apart; the formats and the search are the same.

Each function takes float32 ``(n_blocks, 256)`` and returns ``(n_blocks, type_size)`` uint8 in
the GGUF block layout that :mod:`tianxia.quant.gguf_codecs` (and ``gguf.quants``) decode.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
f32 = np.float32


def _rint(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)


def _f16(x: np.ndarray) -> np.ndarray:
    """fp32 -> fp16 (round to nearest even, as GGML_FP32_TO_FP16) -> back to fp32."""
    return x.astype(np.float16).astype(np.float32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _signed_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the element of largest magnitude (first one on ties) and that magnitude."""
    idx = np.abs(x).argmax(axis=-1)
    mx = np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    return mx, np.abs(mx)


def make_qkx2_quants(x, weights, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """Scale and min for asymmetric quants ``x ~ scale * L - the_min``; rows are sub-blocks."""
    mn = np.minimum(x.min(axis=-1), f32(0))
    mx = x.max(axis=-1)
    sum_w = weights.sum(axis=-1)
    sum_x = (weights * x).sum(axis=-1)
    flat = mx == mn
    rng = np.where(flat, f32(1), mx - mn)

    def err(scale, mins, L):
        diff = scale[..., None] * L + mins[..., None] - x
        diff = np.abs(diff) if use_mad else diff * diff
        return (weights * diff).sum(axis=-1)

    iscale = f32(nmax) / rng
    scale = f32(1) / iscale
    L = np.clip(_rint(iscale[..., None] * (x - mn[..., None])), 0, nmax).astype(np.float32)
    best = err(scale, mn, L)
    for step in range(nstep + 1):
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / rng
        laux = np.clip(_rint(iscale[..., None] * (x - mn[..., None])), 0, nmax).astype(np.float32)
        sum_l = (weights * laux).sum(axis=-1)
        sum_l2 = (weights * laux * laux).sum(axis=-1)
        sum_xl = (weights * laux * x).sum(axis=-1)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0
        this_min = np.where(pos, f32(0), this_min)
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 > 0, sum_l2, f32(1)), this_scale)
        cur = err(this_scale, this_min, laux)
        better = ok & (cur < best)
        L = np.where(better[..., None], laux, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    L = np.where(flat[..., None], f32(0), L)
    scale = np.where(flat, f32(0), scale)
    return scale.astype(np.float32), (-mn).astype(np.float32), L.astype(np.int32)


def make_qx_quants(x, nmax: int):
    """Symmetric quants with RMSE search (``rmse_type`` 1, no weights); L in [0, 2*nmax)."""
    mx, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    mxs = np.where(zero, f32(1), mx)
    w = x * x

    def attempt(iscale):
        l = np.clip(_rint(iscale[..., None] * x), -nmax, nmax - 1).astype(np.float32)
        return l, (w * x * l).sum(axis=-1), (w * l * l).sum(axis=-1)

    l, sumlx, suml2 = attempt(f32(-nmax) / mxs)
    L = l + nmax
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, f32(1)), f32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        l, sumlx, suml2 = attempt(-(f32(nmax) + f32(0.1) * f32(step)) / mxs)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better[..., None], l + nmax, L)
        scale = np.where(better, sumlx / np.where(suml2 > 0, suml2, f32(1)), scale)
        best = np.where(better, scale * sumlx, best)
    L = np.where(zero[..., None], f32(0), L)
    scale = np.where(zero, f32(0), scale)
    return scale.astype(np.float32), L.astype(np.int32)


def make_q3_quants(x, nmax: int):
    """Symmetric quants refined element by element (``do_rmse``); L in [0, 2*nmax)."""
    mx, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    iscale = f32(-nmax) / np.where(zero, f32(1), mx)
    L = np.clip(_rint(iscale[..., None] * x), -nmax, nmax - 1).astype(np.float32)
    w = x * x
    sumlx = (w * x * L).sum(axis=-1)
    suml2 = (w * L * L).sum(axis=-1)
    active = np.ones(x.shape[0], dtype=bool)
    for _ in range(5):
        changed = np.zeros(x.shape[0], dtype=bool)
        for i in range(x.shape[1]):
            xi, wi, li = x[:, i], w[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            cand = active & (slx > 0)
            new_l = np.clip(_rint(xi * sl2 / np.where(cand, slx, f32(1))), -nmax, nmax - 1).astype(np.float32)
            cand &= new_l != li
            slx2 = slx + wi * xi * new_l
            sl22 = sl2 + wi * new_l * new_l
            take = cand & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(take, new_l, li)
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
            changed |= take
        active &= changed
        if not active.any():
            break
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, f32(1)), f32(0))
    L = np.where(zero[..., None], f32(0), L + nmax)
    scale = np.where(zero, f32(0), scale)
    return scale.astype(np.float32), L.astype(np.int32)


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """(n, 256) values 0..3 -> (n, 64): byte j/4+l of each 128 half holds l, l+32, l+64, l+96."""
    n = L.shape[0]
    h = L.reshape(n, 2, 4, 32).astype(np.uint8)
    return (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(n, 64)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n * 16, 16)
    scales, mins, L = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, True)
    scales, mins, L = scales.reshape(n, 16), mins.reshape(n, 16), L.reshape(n, 16, 16)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    q4 = f32(15)
    has_s, has_m = max_scale > 0, max_min > 0
    sc = np.where(has_s[:, None], _rint((q4 / np.where(has_s, max_scale, 1))[:, None] * scales), 0)
    mq = np.where(has_m[:, None], _rint((q4 / np.where(has_m, max_min, 1))[:, None] * mins), 0)
    d = np.where(has_s, max_scale / q4, f32(0)).astype(np.float32)
    dmin = np.where(has_m, max_min / q4, f32(0)).astype(np.float32)
    dl = _f16(d)[:, None] * sc.astype(np.float32)
    ml = _f16(dmin)[:, None] * mq.astype(np.float32)
    xs = x.reshape(n, 16, 16)
    newL = np.clip(_rint((xs + ml[..., None]) / np.where(dl != 0, dl, 1)[..., None]), 0, 3)
    L = np.where((dl != 0)[..., None], newL, L).reshape(n, 256)
    scale_bytes = (sc.astype(np.uint8) & 0xF) | (mq.astype(np.uint8) << 4)
    return np.concatenate([scale_bytes, _pack_2bit(L), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    scales, L = make_q3_quants(x.reshape(n * 16, 16), 4)
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    max_scale, _ = _signed_max(scales)
    has = max_scale != 0
    iscale = f32(-32) / np.where(has, max_scale, f32(1))
    l = np.where(has[:, None], np.clip(_rint(iscale[:, None] * scales), -32, 31) + 32, 0).astype(np.uint8)
    packed = np.zeros((n, 12), dtype=np.uint8)
    packed[:, :8] = (l[:, :8] & 0xF) | ((l[:, 8:] & 0xF) << 4)
    hi = (l >> 4).reshape(n, 4, 4)  # [j // 4, j % 4]
    packed[:, 8:] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    d = np.where(has, f32(1) / iscale, f32(0)).astype(np.float32)
    dl = _f16(d)[:, None] * (l.astype(np.float32) - 32)
    dl = np.where(has[:, None], dl, f32(0))
    xs = x.reshape(n, 16, 16)
    newL = np.clip(_rint(xs / np.where(dl != 0, dl, 1)[..., None]), -4, 3) + 4
    L = np.where((dl != 0)[..., None], newL, L).reshape(n, 256)
    high = L > 3
    # the high bit of element j goes to hmask byte j % 32, bit j // 32
    hmask = (high.reshape(n, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(
        axis=1, dtype=np.uint8
    )
    L = np.where(high, L - 4, L)
    return np.concatenate([hmask, _pack_2bit(L), packed, _f16_bytes(d)], axis=1)


def _pack_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins -> the 12-byte Q4_K/Q5_K field."""
    n = ls.shape[0]
    out = np.zeros((n, 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return out


def _k_scales(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    av_x = np.sqrt((sub * sub).sum(axis=-1) / f32(32))
    scales, mins, L = make_qkx2_quants(sub, av_x[:, None] + np.abs(sub), nmax, rmin, 0.1, nstep, False)
    scales, mins, L = scales.reshape(n, 8), mins.reshape(n, 8), L.reshape(n, 8, 32)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    inv_s = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, 1), f32(0))
    inv_m = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, 1), f32(0))
    ls = np.minimum(63, _rint(inv_s[:, None] * scales)).astype(np.uint8)
    lm = np.minimum(63, _rint(inv_m[:, None] * mins)).astype(np.uint8)
    d = (max_scale / f32(63)).astype(np.float32)
    dmin = (max_min / f32(63)).astype(np.float32)
    dl = _f16(d)[:, None] * ls.astype(np.float32)
    ml = _f16(dmin)[:, None] * lm.astype(np.float32)
    xs = x.reshape(n, 8, 32)
    newL = np.clip(_rint((xs + ml[..., None]) / np.where(dl != 0, dl, 1)[..., None]), 0, nmax)
    L = np.where((dl != 0)[..., None], newL, L).reshape(n, 256)
    head = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(ls, lm)], axis=1)
    return head, L


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    head, L = _k_scales(x, 15, -1.0, 20)
    q = L.reshape(n, 4, 2, 32).astype(np.uint8)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([head, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    head, L = _k_scales(x, 31, -0.5, 15)
    q = L.reshape(n, 4, 2, 32).astype(np.uint8)  # [pair of sub-blocks, lo/hi, 32]
    hb = (q >> 4).reshape(n, 8, 32)  # sub-block s sets bit s of qh[j]
    qh = (hb << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    q &= 0xF
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([head, qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    scales, L = make_qx_quants(x.reshape(n * 16, 16), 32)
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    max_scale, max_abs = _signed_max(scales)
    zero = max_abs < GROUP_MAX_EPS
    iscale = f32(-128) / np.where(zero, f32(1), max_scale)
    d = np.where(zero, f32(0), f32(1) / iscale).astype(np.float32)
    sc = np.where(zero[:, None], 0, np.minimum(127, _rint(iscale[:, None] * scales))).astype(np.int8)
    dl = _f16(d)[:, None] * sc.astype(np.float32)
    xs = x.reshape(n, 16, 16)
    newL = np.clip(_rint(xs / np.where(dl != 0, dl, 1)[..., None]), -32, 31) + 32
    L = np.where((dl != 0)[..., None], newL, L)
    L = np.where(zero[:, None, None], 0, L).reshape(n, 2, 4, 32).astype(np.uint8)  # [half, quarter, l]
    lo = L & 0xF
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    hi = L >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


KQUANTIZERS = {
    "Q2_K": quantize_q2_k,
    "Q3_K": quantize_q3_k,
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
}
