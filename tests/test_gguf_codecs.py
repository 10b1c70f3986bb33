"""Bit-exactness of tianxia.quant.gguf_codecs against gguf.quants.dequantize."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as ref_quants

from tianxia.quant.gguf_codecs import (
    SUPPORTED_TYPES,
    UnsupportedQuantTypeError,
    block_info,
    dequantize,
)

ROWS, COLS = 64, 512

# Byte offsets, inside one block, of every fp16 scale field. Random bytes there
# would often be NaN/inf, which makes the comparison meaningless, so the random
# byte tests overwrite them with finite values.
F16_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q8_0: (0,),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
    QT.IQ4_NL: (0,),
    QT.IQ4_XS: (0,),
    QT.IQ2_XXS: (0,),
    QT.IQ2_XS: (0,),
    QT.IQ2_S: (0,),
    QT.IQ3_XXS: (0,),
    QT.IQ3_S: (0,),
    QT.IQ1_S: (0,),
    QT.IQ1_M: (),  # its fp16 scale is spread over the top nibbles of 4 u16s: see random_blocks
}
BLOCK_TYPES = sorted(F16_FIELDS)


def _ids(types):
    return [t.name for t in types]


def assert_bit_exact(ours: torch.Tensor, ref: np.ndarray) -> None:
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == tuple(ref_t.shape)
    # compare bit patterns: stricter than ==, and NaN-safe
    a, b = ours.contiguous().view(torch.int32), ref_t.view(torch.int32)
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        i = tuple(bad[0].tolist())
        pytest.fail(
            f"{len(bad)} mismatching values; first at {i}: ours={ours[i].item()!r} ref={ref_t[i].item()!r}"
        )


def random_matrix(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    x *= np.float32(0.02)
    x[3, 7] = 40.0  # outliers, so scales vary widely across blocks
    x[10, 300] = -25.0
    x[11, :100] *= 1e-4
    x[5] = 0.0  # all-zero row: zero scales
    return x


def random_blocks(qtype: QT, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random block bytes with finite, moderately sized fp16 scales."""
    rng = np.random.default_rng(seed + int(qtype))
    _, type_size = block_info(qtype)
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        # magnitudes from fp16-subnormal to ~10, both signs, some exact zeros
        mag = 10.0 ** rng.uniform(-7.5, 1.0, size=n_blocks)
        val = (np.where(rng.random(n_blocks) < 0.5, -mag, mag)).astype(np.float16)
        val[::17] = 0
        raw[:, off : off + 2] = val.view(np.uint8).reshape(n_blocks, 2)
    if qtype == QT.IQ1_M:
        mag = 10.0 ** rng.uniform(-7.5, 1.0, size=n_blocks)
        bits = np.where(rng.random(n_blocks) < 0.5, -mag, mag).astype(np.float16).view(np.uint16)
        sc = raw[:, 48:56].copy().view(np.uint16)
        for i, shift in enumerate((12, 8, 4, 0)):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((bits >> shift) & 0xF) << 12)
        raw[:, 48:56] = sc.view(np.uint8)
    return raw


def _gguf_can_quantize(qtype: QT) -> bool:
    try:
        ref_quants.quantize(np.zeros((1, block_info(qtype)[0]), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


# --------------------------------------------------------------------------
# synthetic data
# --------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=_ids(sorted(SUPPORTED_TYPES)))
def test_matches_reference(qtype: QT) -> None:
    x = random_matrix()
    if _gguf_can_quantize(qtype):
        raw = ref_quants.quantize(x, qtype)
    else:
        block_size, _ = block_info(qtype)
        raw = random_blocks(qtype, ROWS * COLS // block_size).reshape(ROWS, -1)
    ref = ref_quants.dequantize(raw, qtype)
    assert_bit_exact(dequantize(raw, qtype, (ROWS, COLS)), ref)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=_ids(BLOCK_TYPES))
def test_random_bytes_match_reference(qtype: QT) -> None:
    """Every bit pattern, including ones a quantizer never writes (e.g. int8 -128)."""
    block_size, _ = block_info(qtype)
    raw = random_blocks(qtype, 2048 * 32 // block_size, seed=1)
    ref = ref_quants.dequantize(raw, qtype).reshape(-1)
    ours = dequantize(torch.from_numpy(raw).reshape(-1), qtype, (2048 * 32,))
    assert_bit_exact(ours, ref)


def test_reader_style_inputs() -> None:
    x = random_matrix()
    # F16 arrives typed; BF16 arrives as raw bytes (rows, 2*cols); also accept torch bf16
    assert_bit_exact(dequantize(x.astype(np.float16), QT.F16, x.shape), x.astype(np.float16).astype(np.float32))
    raw_bf16 = ref_quants.quantize(x, QT.BF16)
    ref = ref_quants.dequantize(raw_bf16, QT.BF16)
    assert_bit_exact(dequantize(raw_bf16, QT.BF16, x.shape), ref)
    assert_bit_exact(dequantize(torch.from_numpy(x).to(torch.bfloat16), QT.BF16, x.shape), ref)
    # F32 as bytes and as an int type id
    assert_bit_exact(dequantize(x.view(np.uint8), int(QT.F32), x.shape), x)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=_ids(sorted(SUPPORTED_TYPES)))
def test_device_agnostic(qtype: QT) -> None:
    """Running on the meta device proves the codec is pure tensor ops (no host round trips)."""
    block_size, type_size = block_info(qtype)
    raw = torch.empty(4 * 256 // block_size * type_size, dtype=torch.uint8, device="meta")
    out = dequantize(raw, qtype, (4, 256))
    assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == (4, 256)


def test_block_info() -> None:
    assert block_info(QT.Q4_K) == (256, 144)
    assert block_info(int(QT.Q8_0)) == (32, 34)


def test_unsupported_type() -> None:
    raw = np.zeros(block_info(QT.TQ1_0)[1], dtype=np.uint8)
    with pytest.raises(UnsupportedQuantTypeError, match="TQ1_0") as exc:
        dequantize(raw, QT.TQ1_0, (256,))
    assert isinstance(exc.value, ValueError)
    assert "Q4_K" in str(exc.value)  # lists what is supported
    with pytest.raises(UnsupportedQuantTypeError, match="9999"):
        dequantize(raw, 9999, (256,))


def test_size_mismatch() -> None:
    with pytest.raises(ValueError, match="bytes"):
        dequantize(np.zeros(17, dtype=np.uint8), QT.Q4_0, (32,))
    with pytest.raises(ValueError, match="block size"):
        dequantize(np.zeros(18, dtype=np.uint8), QT.Q4_0, (2, 16))


# --------------------------------------------------------------------------
# real model files
# --------------------------------------------------------------------------

SLOW_FILE_BYTES = 150 * 2**20


def _models_dir() -> Path:
    home = os.environ.get("TIANXIA_HOME") or os.path.expanduser("~/.cache/tianxia")
    return Path(home) / "models"


def _gguf_files() -> list:
    files = sorted(_models_dir().glob("**/*.gguf"))
    if not files:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no *.gguf files under {_models_dir()}"))]
    # GGUFReader parses every metadata array element in Python (the tokenizer
    # vocab), ~15 s for a 150k-token vocab, so the bigger files count as slow.
    return [
        pytest.param(f, id=f.name, marks=[pytest.mark.slow] if f.stat().st_size > SLOW_FILE_BYTES else [])
        for f in files
    ]


MAX_ROWS = 256
PER_TYPE = 2


@pytest.mark.parametrize("path", _gguf_files())
def test_real_gguf_tensors(path: Path) -> None:
    reader = gguf.GGUFReader(path)
    picked: dict[QT, list] = {}
    for t in reader.tensors:
        qtype = QT(t.tensor_type)
        if qtype in SUPPORTED_TYPES and len(picked.setdefault(qtype, [])) < PER_TYPE:
            picked[qtype].append(t)
    checked = []
    for qtype, tensors in picked.items():
        block_size, type_size = block_info(qtype)
        for t in tensors:
            data = t.data[:MAX_ROWS] if t.data.ndim > 1 else t.data
            shape = tuple(data.shape)
            if data.dtype == np.uint8:  # quantized and BF16 come as raw bytes
                shape = (*shape[:-1], shape[-1] // type_size * block_size)
            ours = dequantize(data, qtype, shape)
            assert_bit_exact(ours, ref_quants.dequantize(np.asarray(data), qtype).reshape(shape))
            checked.append(f"{t.name}:{qtype.name}")
    assert checked

    unsupported = sorted({QT(t.tensor_type).name for t in reader.tensors} - {q.name for q in SUPPORTED_TYPES})
    assert not unsupported, f"{path.name} uses tensor types without a codec: {unsupported}"
