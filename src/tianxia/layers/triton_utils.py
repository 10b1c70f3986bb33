"""Helpers shared by the Triton kernels of ``layers/``."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET=1``: CPU tensors, tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
