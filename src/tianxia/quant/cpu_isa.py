"""Which instruction set the CPU kernels use, chosen when they load.

The extension carries an AVX2 build of every kernel and two variants of the integer path (8-bit
activations): AVX-512 VNNI and AMX-INT8; it picks the best the CPU has by CPUID. ``TIANXIA_CPU_ISA``
forces a lower one for A/B runs and tests: ``avx2``, ``avx512``, ``amx``, or ``none`` (no C++
kernels: torch's own, as on a CPU without AVX2). Asking for one the CPU lacks warns and takes the
best available below it. The variants give the same bits (integer dot products are exact, and the
float steps around them are the same), so the choice changes speed only.

Within a variant the number of activation rows picks the kernel: AMX takes products of at least
``TIANXIA_CPU_AMX_MIN_ROWS`` rows (10 by default: prompts, batches of 10 or more), AVX-512 VNNI
those of at least ``TIANXIA_CPU_AVX512_MIN_ROWS`` (2) below that, AVX2 single rows and the float
paths.

AMX needs the CPU's flags and Linux's permission for tile data, which a process must request with
``arch_prctl(ARCH_REQ_XCOMP_PERM)`` before its first tile instruction (without it that instruction
is killed with SIGILL). :func:`amx_permitted` asks from Python, and the extension asks again in C++
when it loads (``isa.cpp``), so every process that runs the kernels, engine-core subprocesses
included, has asked before any tile instruction; the permission covers all of a process's threads.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

ENV = "TIANXIA_CPU_ISA"
# lowest first; the kernels' own numbering is "avx2" = 0, "avx512" = 1, "amx" = 2
ORDER = ("none", "avx2", "avx512", "amx")
KERNEL_LEVEL = {"avx2": 0, "avx512": 1, "amx": 2}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def amx_permitted() -> bool:
    """Whether this process may use AMX tile data: Linux (5.16+) needs it requested once per process
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), else the first tile instruction faults."""
    if platform.system() != "Linux" or platform.machine() != "x86_64" or "amx_tile" not in cpu_flags():
        return False
    SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def best_available() -> str:
    """The best of ORDER this CPU (and OS, for AMX) supports, by its flags."""
    f = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= f:
        return "none"
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= f:
        return "avx2"
    if {"amx_tile", "amx_int8"} <= f and amx_permitted():
        return "amx"
    return "avx512"


def requested() -> str | None:
    """``TIANXIA_CPU_ISA`` (lower case), or None when unset; an unknown value warns and is ignored."""
    v = os.environ.get(ENV, "").strip().lower()
    if not v:
        return None
    if v not in ORDER:
        logger.warning("%s=%s is not one of %s; ignoring it", ENV, v, "|".join(ORDER))
        return None
    return v


def choose(best: str | None = None) -> str:
    """The ISA the kernels should use: the requested one, or the best available where none is asked
    for or the CPU lacks it (with a warning)."""
    best = best or best_available()
    want = requested()
    if want is None:
        return best
    if ORDER.index(want) > ORDER.index(best):
        logger.warning("%s=%s asked for, but this CPU's best is %s; using %s", ENV, want, best, best)
        return best
    return want


def avx512_min_rows() -> int:
    """``TIANXIA_CPU_AVX512_MIN_ROWS``: the fewest activation rows a product takes the AVX-512 variant
    for (an A/B knob for benchmarks; -1, the kernels' default, when unset)."""
    v = os.environ.get("TIANXIA_CPU_AVX512_MIN_ROWS", "").strip()
    return int(v) if v.isdigit() else -1


def amx_min_rows() -> int:
    """``TIANXIA_CPU_AMX_MIN_ROWS``: the fewest activation rows a product takes the AMX variant for
    (an A/B knob for benchmarks; -1, the kernels' default, when unset)."""
    v = os.environ.get("TIANXIA_CPU_AMX_MIN_ROWS", "").strip()
    return int(v) if v.isdigit() else -1


def kernel_level(isa: str) -> int:
    """The extension's variant for an ISA (``set_cpu_isa``'s argument)."""
    return KERNEL_LEVEL[isa]


NAMES = {"none": "none (torch's own kernels)", "avx2": "AVX2", "avx512": "AVX-512 VNNI", "amx": "AMX"}


def amx_status() -> str:
    """AMX in words: absent, present but refused by the OS, or present and permitted."""
    f = cpu_flags()
    if "amx_tile" not in f:
        return "not on this CPU"
    if not amx_permitted():
        return "on this CPU, but the OS refuses tile data (Linux 5.16+ grants it on request)"
    return ("on this CPU and permitted by the OS; the integer products of many activation rows (prompts, "
            "large batches) run on AMX-INT8 tiles")
