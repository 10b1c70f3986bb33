"""The CPU kernels' instruction-set variants (quant/cpu_isa.py, csrc/isa.cpp): the choice from
``TIANXIA_CPU_ISA`` and the CPU, and every variant this CPU runs giving the same bits as AVX2: the
kernels on each packed layout and row count, and SmolLM2's prompt and decode logprobs with 8-bit and
float32 activations. The variants are switched in-process (the extension's ``set_cpu_isa``), which is
what the environment variable does at load. The AMX tests skip where the CPU has no AMX or the OS
refuses tile data."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tianxia import LLM, SamplingParams
from tianxia.quant import cpu_isa, cpu_kernels
from tianxia.quant.packed import from_gguf
from tianxia.quant.quantize import quantize_array

ext = cpu_kernels.extension()
needs_kernels = pytest.mark.skipif(ext is None, reason="no C++ kernels on this machine")
# the variants beyond AVX2 this CPU runs (none on an AVX2-only CPU: the tests then check AVX2 alone)
VARIANTS = [lvl for lvl in (1, 2) if ext is not None and ext.best_cpu_isa() >= lvl]
AVX512, AMX = cpu_isa.KERNEL_LEVEL["avx512"], cpu_isa.KERNEL_LEVEL["amx"]
needs_amx = pytest.mark.skipif(AMX not in VARIANTS, reason="no AMX-INT8 here (CPU or OS permission)")
needs_avx512 = pytest.mark.skipif(AVX512 not in VARIANTS, reason="no AVX-512 VNNI here")


@pytest.fixture
def isa_level():
    """Restores the extension's variant after a test that switches it."""
    before, rows, amx_rows = ext.cpu_isa(), ext.avx512_min_rows(), ext.amx_min_rows()
    yield
    ext.set_cpu_isa(before, rows, amx_rows)


@pytest.mark.parametrize(("want", "best", "got"), [
    (None, "avx512", "avx512"), ("avx2", "avx512", "avx2"), ("none", "avx512", "none"),
    ("avx512", "avx2", "avx2"), ("amx", "avx512", "avx512"), ("AVX2", "amx", "avx2"), ("sse", "avx2", "avx2")])
def test_the_requested_isa_is_taken_when_the_cpu_has_it(monkeypatch, caplog, want, best, got):
    if want is None:
        monkeypatch.delenv(cpu_isa.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_isa.ENV, want)
    with caplog.at_level(logging.WARNING, logger="tianxia.quant.cpu_isa"):
        assert cpu_isa.choose(best) == got
    # a request above the CPU's best, or not an ISA at all, says so
    above = want is not None and want.lower() in cpu_isa.ORDER and \
        cpu_isa.ORDER.index(want.lower()) > cpu_isa.ORDER.index(best)
    assert bool(caplog.records) == (above or want == "sse")
    assert (cpu_isa.kernel_level("avx2"), cpu_isa.kernel_level("avx512"), cpu_isa.kernel_level("amx")) == (0, 1, 2)


@needs_kernels
def test_forcing_avx2_or_none_at_load(monkeypatch, caplog, isa_level):
    monkeypatch.setenv(cpu_isa.ENV, "none")
    with caplog.at_level(logging.WARNING, logger="tianxia.quant.cpu_kernels"):
        assert cpu_kernels.extension.__wrapped__() is None  # torch's own kernels, with a log line
    assert "torch fallback" in caplog.text and "TIANXIA_CPU_ISA=none" in caplog.text
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    with caplog.at_level(logging.INFO, logger="tianxia.quant.cpu_kernels"):
        assert cpu_kernels.extension.__wrapped__().cpu_isa() == 0  # (the same module: it set the variant)
    assert "CPU kernels: AVX2" in caplog.text
    assert ext.set_cpu_isa(9, -1) == ext.best_cpu_isa()  # never past the CPU's own


@needs_kernels
@pytest.mark.parametrize("level", VARIANTS)
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0,
                                   QT.Q3_K, QT.Q2_K], ids=lambda t: t.name)
def test_integer_products_are_bit_exact_with_avx2(qtype, level, isa_level):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(44, 512, generator=g) * torch.rand(44, 1, generator=g)
    packed = from_gguf(torch.from_numpy(quantize_array(w.numpy(), qtype).reshape(-1)), qtype, (44, 512))
    x = torch.randn(70, 512, generator=g)
    bias = torch.randn(44, generator=g)
    # codes unpacked in registers (up to 8 or 16 rows) and widened tiles, every panel size of both
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 23, 70):
        ext.set_cpu_isa(0, 1)
        want = cpu_kernels.packed_linear(x[:m], packed, bias, True)
        ext.set_cpu_isa(level, 1, 1)
        assert torch.equal(cpu_kernels.packed_linear(x[:m], packed, bias, True), want), f"{m} rows"


def _packed(qtype, n: int, k: int, half: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    packed = from_gguf(torch.from_numpy(quantize_array(w.numpy(), qtype).reshape(-1)), qtype, (n, k))
    if not half:  # float32 scales and mins, where GGUF's are float16
        packed = dataclasses.replace(packed, scales=packed.scales.float(),
                                     mins=None if packed.mins is None else packed.mins.float())
    return packed


AMX_ROWS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 64, 100, 257)
# 4-, 5-, 6- and 8-bit codes with and without mins, groups of 16 and 32, weight rows that no
# 16-row tile divides
PACKED_SHAPES = [(QT.Q4_0, 44, 512), (QT.Q4_1, 77, 576), (QT.Q5_0, 50, 576), (QT.Q5_1, 37, 256), (QT.Q4_K, 61, 512),
                 (QT.Q5_K, 19, 256), (QT.Q6_K, 45, 512), (QT.Q8_0, 83, 576), (QT.Q3_K, 30, 256), (QT.Q2_K, 53, 512)]


@needs_kernels
@needs_avx512
@pytest.mark.parametrize("half", [True, False], ids=["fp16 scales", "fp32 scales"])
@pytest.mark.parametrize(("qtype", "n", "k"), PACKED_SHAPES, ids=lambda v: v.name if isinstance(v, QT) else str(v))
def test_avx512_hex_products_are_bit_exact_with_avx2(qtype, n, k, half, isa_level):
    """From 9 activation rows the AVX-512 variant widens 16 weight rows at a time for vpdpbusd on
    512-bit vectors (8-bit codes offset by 128, each sum started from -128 times the activations'):
    every row count around its thresholds and tiles, with and without bias, against AVX2."""
    packed = _packed(qtype, n, k, half, seed=n)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(max(AMX_ROWS), k, generator=g) * torch.rand(max(AMX_ROWS), 1, generator=g) * 4
    bias = torch.randn(n, generator=g)
    for m in (*AMX_ROWS, 5, 6, 7, 8, 9, 10, 12):
        for b in (None, bias):
            ext.set_cpu_isa(0, 1)
            want = cpu_kernels.packed_linear(x[:m], packed, b, True)
            ext.set_cpu_isa(AVX512, 1, 1)
            got = cpu_kernels.packed_linear(x[:m], packed, b, True)
            assert torch.equal(got, want), f"{m} rows, bias {b is not None}"


@needs_kernels
@needs_avx512
def test_avx512_keeps_the_8_bit_products_of_extreme_activations(isa_level):
    """Activations whose 8-bit codes reach -128, where AVX2's sign trick differs from an exact
    product, give the AVX2 bits on AVX-512 too (such products skip the hexes)."""
    packed = _packed(QT.Q8_0, 40, 256, True, seed=5)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(6))
    x[3, :32] = 1e-38
    x[7, 40] = float("inf")
    x[9, 70] = float("nan")
    ext.set_cpu_isa(0, 1)
    want = cpu_kernels.packed_linear(x, packed, None, True)
    ext.set_cpu_isa(AVX512, 1, 1)
    got = cpu_kernels.packed_linear(x, packed, None, True)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # (bits: NaN equals no float)


@needs_kernels
@needs_amx
@pytest.mark.parametrize("half", [True, False], ids=["fp16 scales", "fp32 scales"])
@pytest.mark.parametrize(("qtype", "n", "k"), PACKED_SHAPES, ids=lambda v: v.name if isinstance(v, QT) else str(v))
def test_amx_products_are_bit_exact_with_avx512_and_avx2(qtype, n, k, half, isa_level):
    """Every row count around the tiles' 16 and pairs of them, with and without bias: AMX (every
    row count forced onto it) against AVX-512 and AVX2."""
    packed = _packed(qtype, n, k, half, seed=n)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(max(AMX_ROWS), k, generator=g) * torch.rand(max(AMX_ROWS), 1, generator=g) * 4
    bias = torch.randn(n, generator=g)
    for m in AMX_ROWS:
        for b in (None, bias):
            got = {}
            for level in (0, AVX512, AMX):
                ext.set_cpu_isa(level, 1, 1)
                assert ext.cpu_isa() == level
                got[level] = cpu_kernels.packed_linear(x[:m], packed, b, True)
            assert torch.equal(got[AMX], got[AVX512]), f"{m} rows, bias {b is not None}: AMX vs AVX-512"
            assert torch.equal(got[AMX], got[0]), f"{m} rows, bias {b is not None}: AMX vs AVX2"


@needs_kernels
@needs_amx
def test_amx_rows_are_independent_of_their_batch_and_thresholds(isa_level):
    """A row's result is the same alone, among 300 rows (AMX), and under every split of a product
    between the variants, and the default threshold sends many rows to AMX and few to AVX-512."""
    packed = _packed(QT.Q4_1, 200, 576, True, seed=3)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(4))
    ext.set_cpu_isa(0, 1)
    alone = torch.cat([cpu_kernels.packed_linear(x[i:i + 1], packed, None, True) for i in range(0, 300, 37)])
    for amx_rows in (1, 16, 64, 1000):
        ext.set_cpu_isa(AMX, 2, amx_rows)
        assert ext.amx_min_rows() == amx_rows
        for m in (1, 20, 100, 300):
            got = cpu_kernels.packed_linear(x[:m], packed, None, True)
            assert torch.equal(got[::37], alone[:len(got[::37])]), f"{m} rows, AMX from {amx_rows}"


@needs_kernels
@needs_amx
def test_amx_keeps_the_8_bit_products_of_extreme_activations(isa_level):
    """Activations whose 8-bit codes reach -128 (infinite, NaN or vanishingly small blocks), where
    the other variants' sign trick differs from an exact product, give the AVX-512 bits."""
    packed = _packed(QT.Q8_0, 40, 256, True, seed=5)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(6))
    x[3, :32] = 1e-38
    x[7, 40] = float("inf")
    x[9, 70] = float("nan")
    ext.set_cpu_isa(AVX512, 1, 1)
    want = cpu_kernels.packed_linear(x, packed, None, True)
    ext.set_cpu_isa(AMX, 1, 1)
    got = cpu_kernels.packed_linear(x, packed, None, True)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # (bits: NaN equals no float)


@needs_kernels
@needs_amx
def test_amx_runs_in_a_fresh_process_and_its_threads():
    """A new process (as an engine core is) loads the kernels with AMX chosen and runs tile
    instructions on every intra-op thread without being killed for lack of tile permission."""
    code = ("import torch; torch.set_num_threads(2); from tianxia.quant import cpu_kernels as k; "
            "e = k.extension(); assert e.cpu_isa() == 2, e.cpu_isa(); "
            "qs = torch.randint(0, 256, (256, 128), dtype=torch.uint8); s = torch.rand(256, 8); "
            "y = e.packed_linear(torch.randn(64, 256), qs, s, torch.empty(0), None, 4, 32, True); "
            "assert y.shape == (64, 256) and torch.isfinite(y).all(); print(k.describe(e, 'amx'))")
    env = {k: v for k, v in os.environ.items() if k != cpu_isa.ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("AMX-INT8")


PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
PARAMS = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=3, ignore_eos=True)


def _answers(llm: LLM) -> list:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.prompt_logprobs, [(c.token_ids, c.logprobs) for c in o.outputs]) for o in outs]


@needs_kernels
@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_smollm2_logprobs_are_the_same_under_every_variant(smollm2_path, activations, isa_level):
    llm = LLM(str(smollm2_path), num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False,
              cpu_activations=activations)
    ext.set_cpu_isa(0, 1)
    want = _answers(llm)
    for level in VARIANTS:
        # every product on the variant (decode too), and the default split
        for rows, amx_rows in ((1, 1), (2, cpu_isa.amx_min_rows() if cpu_isa.amx_min_rows() >= 0 else 10)):
            ext.set_cpu_isa(level, rows, amx_rows)
            assert ext.cpu_isa() == level
            assert _answers(llm) == want, f"variant {level} from {rows} rows"


def test_doctor_names_the_isa_and_amx(monkeypatch):
    from tianxia.doctor import check_kernel_isa

    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    isa, amx = check_kernel_isa()
    best = cpu_isa.best_available()
    assert isa.detail.startswith("AVX2" if best != "none" else "none")
    if best not in ("avx2", "none"):
        assert "forced by TIANXIA_CPU_ISA" in isa.detail
    assert amx.name == "amx" and amx.detail
    monkeypatch.setenv(cpu_isa.ENV, "none")
    assert check_kernel_isa()[0].status == "warn"
