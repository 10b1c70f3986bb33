"""The CPU kernels' instruction-set variants (quant/cpu_isa.py, csrc/isa.cpp): the choice from
``TIANXIA_CPU_ISA`` and the CPU, and every variant this CPU runs giving the same bits as AVX2: the
kernels on each packed layout and row count, and SmolLM2's prompt and decode logprobs with 8-bit and
float32 activations. The variants are switched in-process (the extension's ``set_cpu_isa``), which is
what the environment variable does at load."""

from __future__ import annotations

import logging

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
VARIANTS = [lvl for lvl in (1,) if ext is not None and ext.best_cpu_isa() >= lvl]


@pytest.fixture
def isa_level():
    """Restores the extension's variant after a test that switches it."""
    before, rows = ext.cpu_isa(), ext.avx512_min_rows()
    yield
    ext.set_cpu_isa(before, rows)


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
    assert cpu_isa.kernel_level("amx") == cpu_isa.kernel_level("avx512") == 1


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
        ext.set_cpu_isa(level, 1)
        assert torch.equal(cpu_kernels.packed_linear(x[:m], packed, bias, True), want), f"{m} rows"


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
        for rows in (1, 2):  # every product on the variant (decode too), and the default split
            ext.set_cpu_isa(level, rows)
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
