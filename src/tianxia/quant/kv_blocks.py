"""KV cache rows in llama.cpp's Q8_0 / Q4_0 block formats (``--kv-cache-dtype q8_0|q4_0``, CPU).

One head's K or V row of ``head_dim`` values (a multiple of 32) is stored as ``head_dim / 32``
blocks of 32 values: Q8_0 = a float16 scale and 32 int8 codes (34 bytes), Q4_0 = a float16 scale
and 16 bytes of 4-bit codes (18 bytes, value = (q - 8) * scale). The cache tensor is uint8
``[..., Hk, row_bytes]``; the C++ kernels (``csrc/kv_blocks.h``) tell the two formats apart by
the row size. Each row is quantized on its own by ggml's reference quantizer (the bytes equal the
``gguf`` package's), whichever path writes it, so a token's cached K/V, and with them its
attention, do not depend on its batch, its prompt's chunking or a prefix-cache hit.
"""

from __future__ import annotations

import torch

# bytes per block of 32 values
KV_BLOCK_BYTES: dict[str, int] = {"q8_0": 34, "q4_0": 18}
_BITS = {"q8_0": 8, "q4_0": 4}


def kv_row_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one head's row of ``head_dim`` values in block format ``fmt``."""
    if head_dim % 32:
        raise ValueError(f"--kv-cache-dtype {fmt} needs a head size that is a multiple of 32; this model's is "
                         f"{head_dim}: use f32 or fp16")
    return head_dim // 32 * KV_BLOCK_BYTES[fmt]


def quantize_kv(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x [..., D]`` (float) as uint8 block rows ``[..., row_bytes]``, each row on its own."""
    from tianxia.quant.cpu_kernels import extension

    ext = extension()
    if ext is None:
        raise RuntimeError(f"--kv-cache-dtype {fmt} needs the CPU kernels, which could not be built")
    shape = x.shape
    rows = ext.quantize_kv(x.reshape(-1, shape[-1]).float(), _BITS[fmt])
    return rows.reshape(*shape[:-1], rows.shape[-1])
