"""The CPU kernels (``csrc/``), built on first use: products with packed and float32 weights (the
float path in ``kernels.cpp``, the integer path for 8-bit activations in ``gemm_int8.cpp``), the
fused float32 ops of a step (residual add + RMSNorm, RoPE, gated activations, paged attention;
``fused_ops.cpp``), each one call where torch would take several, a whole decode step of a
Llama-style model in one call (``decoder.cpp``), and the sampler's draw (``sampling.cpp``).

Every product computes a row the same way whatever the other rows are (``kernels.h``): a token's
numbers do not depend on its batch, on how its prompt was chunked, or on the prefix cache.

The extension is compiled once per machine with ``torch.utils.cpp_extension`` (cached under
``$TORCH_EXTENSIONS_DIR``, a minute or two on 2 cores the first time). Its name carries a digest
of the sources, their folder and the flags, so two installs on one machine each keep their own
build instead of rebuilding over each other (torch keys a build directory by the name alone).
Without AVX2 or a C++ compiler, the same products are computed by dequantizing in torch (correct,
but slower and with a float32 copy of each weight while it is used).

The integer path has three variants in the one build, chosen per call (``cpu_isa``): AVX2, AVX-512
VNNI (``gemm_int8_avx512.cpp``) and AMX-INT8 (``gemm_int8_amx.cpp``, products of many rows), each
compiled under its own target pragma so that the library loads on any AVX2 CPU; all give the same
bits.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tianxia.quant import cpu_isa
from tianxia.quant.packed import PackedWeight

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ["bindings.cpp", "kernels.cpp", "gemm_int8.cpp", "gemm_int8_avx512.cpp", "gemm_int8_amx.cpp", "isa.cpp",
            "fused_ops.cpp", "decoder.cpp", "sampling.cpp"]
# -ffp-contract=off: the compiler fuses no multiply and add of its own, so that the same
# expression rounds the same way wherever it is inlined (the kernels write their fmas out)
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]


def _build_name() -> str:
    """The extension's name: a digest of the sources' folder, every source and header, and the
    flags (torch rebuilds a build directory whose recorded source paths changed)."""
    h = hashlib.sha256(f"{_CSRC.resolve()} {' '.join(CFLAGS)}".encode())
    for f in sorted(_CSRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return f"tianxia_cpu_kernels_{h.hexdigest()[:12]}"


@functools.cache
def extension():
    """The compiled kernels, or None where they cannot be built here (or ``TIANXIA_CPU_ISA=none``),
    set to the instruction set that ``cpu_isa.choose()`` picks."""
    best = cpu_isa.best_available() if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "none"
    isa = cpu_isa.choose(best)
    if isa == "none":
        why = f"{cpu_isa.ENV}=none" if best != "none" else "this CPU has no AVX2"
        logger.warning("packed-weight kernels need AVX2 (%s); using the torch fallback", why)
        return None
    try:
        from torch.utils.cpp_extension import load

        t0 = time.perf_counter()
        ext = load(
            name=_build_name(),
            sources=[str(_CSRC / f) for f in _SOURCES],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        if (took := time.perf_counter() - t0) > 5:  # built now, not found in torch's cache
            logger.info("built the CPU kernels in %.0f s (once per machine and torch version)", took)
        ext.set_cpu_isa(cpu_isa.kernel_level(isa), cpu_isa.avx512_min_rows(), cpu_isa.amx_min_rows())
        logger.info("CPU kernels: %s", describe(ext, isa))
        return ext
    except Exception as e:  # no compiler, no headers: stay correct, just slower
        logger.warning("could not build the packed-weight kernels (%s); using the torch fallback", e)
        return None


def describe(ext, isa: str) -> str:
    """The variant in use, in words (the start-up log and ``tianxia doctor``)."""
    level = ext.cpu_isa()
    if level >= cpu_isa.KERNEL_LEVEL["amx"]:
        return (f"AMX-INT8 (8-bit-activation products of {ext.amx_min_rows()}+ rows; AVX-512 VNNI for "
                f"{ext.avx512_min_rows()}+ rows below that; AVX2 for single rows and the float paths)")
    if level >= cpu_isa.KERNEL_LEVEL["avx512"]:
        s = (f"AVX-512 VNNI (8-bit-activation products of {ext.avx512_min_rows()}+ rows; "
             "AVX2 for single rows and the float paths)")
        return s + (", AMX present but the kernels found no tile permission" if isa == "amx" else "")
    return "AVX2"


# the KV cache types that paged_decode and the fused decode step read; uint8: Q8_0/Q4_0 block rows
# (quant/kv_blocks.py)
CACHE_DTYPES = (torch.float32, torch.float16, torch.uint8)


def fused_ops(t: torch.Tensor):
    """The extension when ``t`` can take the fused float32 CPU ops (rms_norm, rope, silu_and_mul,
    paged_decode), else None."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or torch.is_grad_enabled():
        return None
    return extension()


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, int8: bool = False,
                  table: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for a float32 ``[M, K]`` x; ``int8`` rounds every row to 8-bit codes per
    32 values first (llama.cpp's numerics) for integer dot products. Each row's result is the same
    for any number of rows. ``table``: w's :func:`scale_table`, which products of a few rows read
    (the same results, without gathering the scales per call). The torch fallback stays float."""
    ext = extension()
    if ext is None:
        return F.linear(x, w.dequantize(), bias)
    mins = w.mins if w.mins is not None else _EMPTY
    return ext.packed_linear(x, w.qs, w.scales, mins, bias, w.bits, w.group, int8, table)


def scale_table(w: PackedWeight) -> torch.Tensor | None:
    """w's scales and mins laid out per quad of rows for the integer path's products of a few rows
    (as many bytes as w's scales and mins), or None where the kernels have no such table."""
    ext = extension()
    if ext is None:
        return None
    mins = w.mins if w.mins is not None else _EMPTY
    table = ext.packed_scale_table(w.qs, w.scales, mins, w.bits, w.group)
    return table if table.numel() > 0 else None


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with each row computed alone (no blocking by the number of rows, as
    BLAS does), for a float32 x and a float32 or float16 weight on CPU (float16 values widened
    to float32 as they are read: the float32 product with them); anything else goes to
    ``F.linear``."""
    ext = fused_ops(x)
    if ext is None or weight.dtype not in (torch.float32, torch.float16) or weight.device.type != "cpu":
        if weight.dtype == torch.float16 and x.dtype == torch.float32:
            weight = weight.float()
        return F.linear(x, weight, bias)
    shape = x.shape
    y = ext.dense_linear(x.reshape(-1, shape[-1]), weight, bias)
    return y.reshape(*shape[:-1], weight.shape[0])


def packed_rows(index: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """Rows ``index`` of ``w``, dequantized (an embedding lookup)."""
    ext = extension()
    if ext is None:
        return w.select_rows(index.reshape(-1)).dequantize()
    mins = w.mins if w.mins is not None else _EMPTY
    return ext.packed_rows(index.reshape(-1), w.qs, w.scales, mins, w.bits, w.group)


_EMPTY = torch.empty(0)
