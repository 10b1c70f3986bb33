"""Triton kernels of the stacked LoRA state's captured decode steps: Punica's BGMV pair, each row
reading only its own adapter's columns of the stacked matrices.

:class:`~tianxia.layers.lora_stacked.StackedLoRAState` keeps, per targeted module, ``A`` stacked
``[S * W, in]`` and ``B`` ``[out, S * W]`` (``W`` columns per adapter position) and a device
tensor of each row's position (-1: the base model). For row ``i`` at position ``p``:

- ``lora_shrink``: ``s[i] = x[i] @ A[p * W : (p + 1) * W].T``, summed in float32 and left as
  partial sums over ``splits`` slices of ``in`` (a batch-1 step would otherwise read a long row
  of ``A`` from one program; the slices spread it over the GPU without atomics or a zeroed
  buffer, and stay deterministic);
- ``lora_expand``: ``out[i] += s[i] @ B[:, p * W : (p + 1) * W].T`` in place, adding the
  partial sums first. A program takes a few consecutive rows and reads a tile of ``B`` again only
  where the position changes: with the rows ordered by adapter, a batch on one adapter reads
  ``B`` once per program's rows instead of once a row.

From :data:`_GROUP_ROWS` rows on, both are grouped instead (SGMV): a program takes a block of
consecutive rows and multiplies the whole block by one position's tile with ``tl.dot``, the rows
of other positions masked out, then again for each other position the block holds (a segment
boundary, a stray row; base rows need no pass). With the rows ordered by adapter a block mostly
holds one position, so ``A`` and ``B`` are read once per block instead of once per row (or per
few rows). The grouped expand multiplies the summed partial sums rounded to a 16-bit ``B``'s dtype
(as the dense form does; float32 in Triton's interpreter), the row-wise one in float32.

Base rows exit at once in both kernels (their partial sums are never written nor read; a
program whose rows are all base returns at once), so a step without adapters costs two
near-empty launches per module. Block shapes, split counts and the choice of the row-wise or
grouped kernels depend on the shapes alone, never on the positions (a block's passes loop on the
device), so both launches capture in CUDA graphs; they are fixed rather than autotuned because
autotuning cannot run inside a capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tianxia.layers.triton_utils import interpreting

# programs a launch aims for: a few per SM of an H100 / H200 (132 SMs), so a small batch still
# spreads its reads over the GPU
_TARGET_PROGRAMS = 512
# rows an expand program takes, reading each tile of B once for a run of rows of one position
_EXPAND_ROWS = 8
# elements of one [BLOCK_W, BLOCK_K] or [BLOCK_N, BLOCK_W] tile: 64 float32 registers a thread
# at 4 warps
_TILE = 8192
# batches of at least this many rows take the grouped kernels: blocks of rows through tl.dot (on an
# H200 at Qwen2.5-0.5B's shapes, rank 16: as fast as the row-wise ones at 4 rows, twice as fast from
# 8 rows to 256; slower at 1 row)
_GROUP_ROWS = 4
# rows of a grouped block (at least 16, tl.dot's least size), and the in / out columns of a tile
_GROUP_M = 32
_GROUP_K = 128
_GROUP_N = 64
# in-columns a grouped shrink slice takes at least: each slice's partial sums are read again by
# every expand program of their rows, so the grouped shrink splits only long rows
_GROUP_K_SLICE = 512
_GROUP_WARPS = 4


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, pos_ptr, s_ptr, K, W, ROWS, K_SPLIT, stride_x,
                   BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    if pos < 0:
        return
    w = tl.arange(0, BLOCK_W)
    wmask = w < W
    a_rows = a_ptr + (pos * W + w).to(tl.int64)[:, None] * K
    x_row = x_ptr + row.to(tl.int64) * stride_x
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_W, BLOCK_K], tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        ks = split * K_SPLIT + k0 + kk
        kmask = ks < K
        xv = tl.load(x_row + ks, mask=kmask, other=0.0)
        a = tl.load(a_rows + ks[None, :], mask=wmask[:, None] & kmask[None, :], other=0.0)
        acc += a.to(tl.float32) * xv.to(tl.float32)[None, :]
    tl.store(s_ptr + (split * ROWS + row).to(tl.int64) * W + w, tl.sum(acc, 1), mask=wmask)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, pos_ptr, out_ptr, N, W, ROWS, SPLITS, N_SPLIT, stride_b, stride_out,
                   BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
    # BLOCK_M consecutive rows per program: the runner orders a step's rows by adapter, so they
    # mostly share a position, and a tile of B is read once for them instead of once a row
    first = tl.program_id(0) * BLOCK_M
    part = tl.program_id(1)
    block = first + tl.arange(0, BLOCK_M)
    if tl.max(tl.load(pos_ptr + block, mask=block < ROWS, other=-1)) < 0:
        return
    w = tl.arange(0, BLOCK_W)
    wmask = w < W
    nn = tl.arange(0, BLOCK_N)
    for n0 in range(0, N_SPLIT, BLOCK_N):
        ns = part * N_SPLIT + n0 + nn
        nmask = ns < N
        bmask = nmask[:, None] & wmask[None, :]
        b = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
        last = tl.full([], -1, tl.int64)
        for r in tl.static_range(BLOCK_M):
            row = first + r
            pos = tl.load(pos_ptr + row, mask=row < ROWS, other=-1).to(tl.int64)
            if pos >= 0:
                if pos != last:
                    b = tl.load(b_ptr + pos * W + w[None, :] + ns.to(tl.int64)[:, None] * stride_b, mask=bmask,
                                other=0.0).to(tl.float32)
                    last = pos
                s = tl.zeros([BLOCK_W], tl.float32)
                for k in range(0, SPLITS):
                    s += tl.load(s_ptr + (k * ROWS + row).to(tl.int64) * W + w, mask=wmask, other=0.0)
                delta = tl.sum(b * s[None, :], 1)
                out_row = out_ptr + row.to(tl.int64) * stride_out
                o = tl.load(out_row + ns, mask=nmask, other=0.0)
                # one rounding of base + delta, as cuBLAS's addmm rounds
                tl.store(out_row + ns, (o.to(tl.float32) + delta).to(o.dtype), mask=nmask)


@triton.jit
def _shrink_group_kernel(x_ptr, a_ptr, pos_ptr, s_ptr, K, W, ROWS, K_SPLIT, stride_x,
                         DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    # BLOCK_M consecutive rows: one pass of tl.dot per distinct position among them, each pass's
    # rows of other positions zeroed (their x rows load as 0), so a block of one adapter reads
    # its tile of A once
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    pos = tl.load(pos_ptr + rows, mask=rows < ROWS, other=-1)
    top = tl.max(pos)
    if top < 0:
        return
    w = tl.arange(0, BLOCK_W)
    wmask = w < W
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    dt = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    todo = (pos >= 0).to(tl.int32)
    while tl.max(todo) > 0:
        p = tl.min(tl.where(todo > 0, pos, top))
        sel = pos == p
        a_cols = a_ptr + (p.to(tl.int64) * W + w)[None, :] * K
        for k0 in range(0, K_SPLIT, BLOCK_K):
            ks = split * K_SPLIT + k0 + kk
            kmask = ks < K
            xv = tl.load(x_rows + ks[None, :], mask=sel[:, None] & kmask[None, :], other=0.0)
            av = tl.load(a_cols + ks[:, None], mask=kmask[:, None] & wmask[None, :], other=0.0)  # [K, W]
            if DOT_F32:
                acc = tl.dot(xv.to(tl.float32), av.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xv.to(dt), av.to(dt), acc)
        todo = tl.where(sel, 0, todo)
    smask = (pos >= 0)[:, None] & wmask[None, :]
    tl.store(s_ptr + (split * ROWS + rows).to(tl.int64)[:, None] * W + w[None, :], acc, mask=smask)


@triton.jit
def _expand_group_kernel(s_ptr, b_ptr, pos_ptr, out_ptr, N, W, ROWS, SPLITS, N_SPLIT, stride_b, stride_out,
                         DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    # BLOCK_M consecutive rows: their partial sums summed once, then for each tile of out one
    # pass of tl.dot per distinct position among them (other rows' sums zeroed), added up in
    # float32 and added to out once
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    part = tl.program_id(1)
    pos = tl.load(pos_ptr + rows, mask=rows < ROWS, other=-1)
    top = tl.max(pos)
    if top < 0:
        return
    adapted = pos >= 0
    w = tl.arange(0, BLOCK_W)
    wmask = w < W
    s_rows = s_ptr + rows.to(tl.int64)[:, None] * W + w[None, :]
    smask = adapted[:, None] & wmask[None, :]  # base rows' partial sums are never written
    s = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    for k in range(0, SPLITS):
        s += tl.load(s_rows + (k * ROWS).to(tl.int64) * W, mask=smask, other=0.0)
    dt = b_ptr.dtype.element_ty
    b_cols = b_ptr + w.to(tl.int64)[:, None]
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_out
    nn = tl.arange(0, BLOCK_N)
    for n0 in range(0, N_SPLIT, BLOCK_N):
        ns = part * N_SPLIT + n0 + nn
        nmask = ns < N
        bmask = wmask[:, None] & nmask[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        todo = adapted.to(tl.int32)
        while tl.max(todo) > 0:
            p = tl.min(tl.where(todo > 0, pos, top))
            sel = pos == p
            bv = tl.load(b_cols + p.to(tl.int64) * W + ns.to(tl.int64)[None, :] * stride_b, mask=bmask,
                         other=0.0)  # [W, N]
            sv = tl.where(sel[:, None], s, 0.0)
            if DOT_F32:
                acc = tl.dot(sv, bv.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(sv.to(dt), bv.to(dt), acc)
            todo = tl.where(sel, 0, todo)
        omask = adapted[:, None] & nmask[None, :]
        o = tl.load(out_rows + ns[None, :], mask=omask, other=0.0)
        # one rounding of base + delta, as cuBLAS's addmm rounds
        tl.store(out_rows + ns[None, :], (o.to(tl.float32) + acc).to(o.dtype), mask=omask)


def _block_w(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


def _split(length: int, rows: int, block: int) -> tuple[int, int]:
    """(slices, elements per slice, a multiple of ``block``) for ``length`` split so that ``rows``
    rows give about :data:`_TARGET_PROGRAMS` programs, with at least one block per slice."""
    slices = max(1, min(triton.cdiv(_TARGET_PROGRAMS, rows), triton.cdiv(length, block)))
    per = triton.cdiv(triton.cdiv(length, slices), block) * block
    return triton.cdiv(length, per), per


def _grouped(rows: int) -> tuple[bool, int]:
    """(whether ``rows`` rows take the grouped kernels, their block of rows)."""
    return rows >= _GROUP_ROWS, max(16, min(_GROUP_M, triton.next_power_of_2(rows)))


def _dot_f32(dtype: torch.dtype) -> bool:
    # float32 matrices keep float32 products (as torch's matmul), not TF32's 10-bit mantissa; the
    # interpreter has no bf16 dot
    return dtype == torch.float32 or interpreting()


def lora_shrink(x: torch.Tensor, a: torch.Tensor, pos: torch.Tensor, width: int) -> torch.Tensor:
    """Each row of ``x`` ``[rows, in]`` times its position's ``width`` rows of ``a``
    ``[S * width, in]`` (``pos`` ``[rows]``, integer, on the device; -1: none): float32 partial
    sums ``[splits, rows, width]`` whose sum over the first axis is the product. A base row's
    entries are left unwritten; :func:`lora_expand` skips those rows."""
    rows, k = x.shape
    assert a.shape[1] == k and a.is_contiguous() and x.stride(1) == 1 and pos.shape == (rows,)
    block_w = _block_w(width)
    grouped, block_m = _grouped(rows)
    if grouped:
        assert x.dtype == a.dtype
        block_k = _GROUP_K
        blocks = triton.cdiv(rows, block_m)
        splits = max(1, min(triton.cdiv(_TARGET_PROGRAMS, blocks), triton.cdiv(k, max(block_k, _GROUP_K_SLICE))))
        k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
        splits = triton.cdiv(k, k_split)
        s = torch.empty(splits, rows, width, dtype=torch.float32, device=x.device)
        _shrink_group_kernel[(blocks, splits)](x, a, pos, s, k, width, rows, k_split, x.stride(0),
                                               DOT_F32=_dot_f32(a.dtype), BLOCK_M=block_m, BLOCK_W=block_w,
                                               BLOCK_K=block_k, num_warps=_GROUP_WARPS)
        return s
    block_k = max(32, min(256, _TILE // block_w, triton.next_power_of_2(k)))
    splits, k_split = _split(k, rows, block_k)
    s = torch.empty(splits, rows, width, dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows, splits)](x, a, pos, s, k, width, rows, k_split, x.stride(0),
                                   BLOCK_W=block_w, BLOCK_K=block_k)
    return s


def lora_expand(out: torch.Tensor, s: torch.Tensor, b: torch.Tensor, pos: torch.Tensor, width: int) -> None:
    """``out[i] += sum(s[:, i]) @ b[:, pos[i] * width : (pos[i] + 1) * width].T`` in place for
    every row ``i`` of ``out`` ``[rows, N]`` whose position is not -1 (``s`` from
    :func:`lora_shrink`, ``b`` ``[N, S * width]``); ``out`` keeps its dtype."""
    rows, n = out.shape
    splits = s.shape[0]
    assert s.shape[1:] == (rows, width) and s.is_contiguous() and b.shape[0] == n and b.stride(1) == 1
    assert out.stride(1) == 1 and pos.shape == (rows,)
    block_w = _block_w(width)
    grouped, block_m = _grouped(rows)
    if grouped:
        blocks = triton.cdiv(rows, block_m)
        parts, n_split = _split(n, blocks, _GROUP_N)
        _expand_group_kernel[(blocks, parts)](s, b, pos, out, n, width, rows, splits, n_split, b.stride(0),
                                              out.stride(0), DOT_F32=_dot_f32(b.dtype), BLOCK_M=block_m,
                                              BLOCK_W=block_w, BLOCK_N=_GROUP_N, num_warps=_GROUP_WARPS)
        return
    block_n = max(16, min(256, _TILE // block_w, triton.next_power_of_2(n)))
    block_m = min(_EXPAND_ROWS, triton.next_power_of_2(rows))
    blocks = triton.cdiv(rows, block_m)
    parts, n_split = _split(n, blocks, block_n)
    _expand_kernel[(blocks, parts)](s, b, pos, out, n, width, rows, splits, n_split, b.stride(0), out.stride(0),
                                    BLOCK_M=block_m, BLOCK_W=block_w, BLOCK_N=block_n)
