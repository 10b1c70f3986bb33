"""Where GPU kernels are cached: Triton's compiled kernels and autotuning results (see ``tianxia build``).

The directory is keyed by the GPU (name, compute capability) and the PyTorch / Triton / CUDA
versions, so a later start of the same model compiles and autotunes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def gpu_cache_key() -> str:
    import torch

    parts = [f"torch-{torch.__version__}", f"cuda-{torch.version.cuda}"]
    try:
        import triton

        parts.append(f"triton-{triton.__version__}")
    except ImportError:
        parts.append("triton-none")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        parts.append(f"{p.name}-sm{p.major}{p.minor}")
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]
    name = parts[-1].replace(" ", "_") if torch.cuda.is_available() else "nogpu"
    return f"{name}-{digest}"


def gpu_cache_dir() -> Path:
    from tianxia.loader.hub import tianxia_home

    return tianxia_home() / "cache" / "gpu" / gpu_cache_key()


def configure_gpu_caches() -> Path | None:
    """Point Triton's (and Inductor's) caches at the build cache, unless the user set them."""
    if "TRITON_CACHE_DIR" in os.environ:
        return Path(os.environ["TRITON_CACHE_DIR"])
    try:
        root = gpu_cache_dir()
        (root / "triton").mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: Triton's default cache still works
        logger.warning("GPU kernel cache not usable (%s); using Triton's default", e)
        return None
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    return root
