"""Packed (block-quantized) weights on CPU: the kernels against dequantize-then-matmul, the engine
on the real SmolLM2 GGUF against the same engine with dequantized weights, and ``quantization=``
on a float model against transformers running the same quantized-then-dequantized weights."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from helpers import INT8_NEAR_TIE, assert_greedy_match

from tianxia import LLM, SamplingParams
from tianxia.layers.linear import QuantizedEmbedding, QuantizedLinear, SplitQuantizedLinear
from tianxia.quant import cpu_kernels
from tianxia.quant.gguf_codecs import dequantize
from tianxia.quant.packed import (
    PACKABLE_TYPES,
    PackedWeight,
    _pack_blocks,
    concat_rows,
    from_gguf,
    quantize_float,
    stack_runs,
)
from tianxia.quant.quantize import quantize_array

ROWS, COLS = 40, 512  # 512: two k-quant super-blocks per row


def _gguf_matrix(qtype: QT, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw GGUF bytes, their float32 decoding by the reference codec) of a random matrix."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(ROWS, COLS, generator=g) * torch.rand(ROWS, 1, generator=g)
    raw = torch.from_numpy(quantize_array(w.numpy(), qtype).reshape(-1))
    return raw, dequantize(raw, qtype, (ROWS, COLS))


def _check_products(packed, reference: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    x = torch.randn(520, reference.shape[1])
    whole = cpu_kernels.packed_linear(x, packed, bias)
    for m in (1, 3, 5, 8, 9, 40, 520):  # dequantized in registers (up to 4 rows) or in tiles
        want = torch.nn.functional.linear(x[:m], reference, bias)
        got = cpu_kernels.packed_linear(x[:m], packed, bias)
        scale = want.abs().max()
        assert float((got - want).abs().max() / scale) < 1e-5, f"{packed.source}, {m} rows"
        # a row's result does not depend on the rows beside it, bit for bit
        assert torch.equal(got, whole[:m]), f"{packed.source}, {m} rows"


@pytest.mark.parametrize("qtype", sorted(PACKABLE_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_packed_matmul_equals_dequantize_then_matmul(qtype):
    raw, reference = _gguf_matrix(qtype)
    packed = from_gguf(raw, qtype, (ROWS, COLS))
    # the codes keep their width (Q2_K and Q3_K take 8 bits); never a float copy
    width = {QT.Q4_0: 4, QT.Q4_1: 4, QT.Q4_K: 4, QT.Q5_0: 5, QT.Q5_1: 5, QT.Q5_K: 5, QT.Q6_K: 6}
    assert packed.bits == width.get(qtype, 8)
    # the file's own scales are float16: kept at that size, so these formats take as much memory
    # as in the GGUF file (Q4_0 adds its implied min, -8 * d, per block)
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0):
        implied = ROWS * COLS // 32 * 2 if qtype == QT.Q4_0 else 0
        assert packed.scales.dtype == torch.float16 and packed.nbytes == raw.numel() + implied
    assert packed.nbytes <= 0.4 * ROWS * COLS * 4
    assert torch.allclose(packed.dequantize(), reference, rtol=0, atol=1e-6 * reference.abs().max())
    _check_products(packed, reference, bias=torch.randn(ROWS))
    rows = torch.tensor([5, 0, ROWS - 1, 5])
    assert torch.allclose(cpu_kernels.packed_rows(rows, packed), reference[rows], atol=1e-6)


@pytest.mark.parametrize("cols", [16, 576, 83])  # a LoRA B's rank, a hidden size, one with a tail
@torch.no_grad()  # dense_linear takes the kernels outside autograd only
def test_float16_weights_give_the_float32_products_of_their_values(cols):
    """dense_linear with a float16 weight (LoRA adapters over packed models) is the float32
    product with the weight's values, bit for bit, and each row's result is the same for any
    number of rows and threads."""
    g = torch.Generator().manual_seed(cols)
    w16 = (torch.randn(37, cols, generator=g) * 0.1).half()
    x = torch.randn(11, cols, generator=g)
    bias = torch.randn(37, generator=g)
    whole = cpu_kernels.dense_linear(x, w16, bias)
    assert torch.equal(whole, cpu_kernels.dense_linear(x, w16.float(), bias))
    want = x.double() @ w16.double().T + bias.double()
    assert float((whole - want).abs().max()) < 1e-5 * float(want.abs().max())
    threads = torch.get_num_threads()
    try:
        for n_threads in {1, threads}:
            torch.set_num_threads(n_threads)
            for m in (1, 2, 3, 4, 5, 9):
                assert torch.equal(cpu_kernels.dense_linear(x[:m], w16, bias), whole[:m]), (m, n_threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", sorted(PACKABLE_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_int8_activations_stay_close_and_batch_invariant(qtype):
    # 8-bit activation codes (one scale per 32 values) against the exact float product: an error
    # of the size of the rounding, and each row's result independent of the rows beside it, bit
    # for bit, in decode-sized calls (codes unpacked in registers) and prompt-sized ones (tiles)
    raw, reference = _gguf_matrix(qtype)
    packed = from_gguf(raw, qtype, (ROWS, COLS))
    x = torch.randn(13, COLS)
    want = x @ reference.T
    got = cpu_kernels.packed_linear(x, packed, None, int8=True)
    assert float((got - want).norm() / want.norm()) < 0.03, qtype.name
    for i in (0, 7, 12):
        one = cpu_kernels.packed_linear(x[i:i + 1], packed, None, int8=True)[0]
        assert torch.equal(one, got[i])
        pair = cpu_kernels.packed_linear(x[i - i % 2:i - i % 2 + 2], packed, None, int8=True)
        assert torch.equal(one, pair[i % 2])
    for rows in (40, 520):
        many = cpu_kernels.packed_linear(torch.cat([x, torch.randn(rows - 13, COLS)]), packed, None, int8=True)
        assert torch.equal(many[:13], got), qtype.name


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q6_K", "Q8_0", "Q3_K", "Q2_K", "int8"])
def test_many_rows_equal_the_direct_integer_kernel(kind):
    # more than 8 rows (16 with AVX-512) widen tiles of codes (4- to 8-bit, groups of 16 or 32,
    # with or without mins), fewer unpack them in registers, through the same register tiles of 4
    # (8 with AVX-512) rows and the last rows' shorter one: every row count
    # around the tile edges, a weight whose rows are not a multiple of 4, and a bias, bit for bit
    # against one activation row at a time. int8: one group per row.
    rows = 42
    g = torch.Generator().manual_seed(1)
    w = torch.randn(rows, COLS, generator=g)
    if kind == "int8":
        packed = quantize_float(w, "int8")
    else:
        qtype = QT[kind]
        packed = from_gguf(torch.from_numpy(quantize_array(w.numpy(), qtype).reshape(-1)), qtype, (rows, COLS))
    bias = torch.randn(rows, generator=g)
    for m in (5, 6, 7, 9, 13, 16, 17, 18, 19, 20, 23, 131):
        x = torch.randn(m, COLS, generator=g)
        got = cpu_kernels.packed_linear(x, packed, bias, int8=True)
        want = torch.cat([cpu_kernels.packed_linear(x[i:i + 1], packed, bias, int8=True) for i in range(m)])
        assert torch.equal(got, want), f"{kind}, {m} rows"


def test_fused_projection_of_mixed_types_keeps_each_part():
    # GGUF mixes write one fused projection in several types (q, k: Q5_0, v: Q8_0; or Q4_K, Q5_0,
    # Q6_K): runs of one layout are stacked, each run keeps its own codes and kernel, and the
    # outputs meet side by side, bias after; float and 8-bit activations, direct kernel and GEMM
    types = (QT.Q5_0, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q4_0, QT.Q6_K)
    parts = [_gguf_matrix(t, seed=i) for i, t in enumerate(types)]
    runs = stack_runs([from_gguf(raw, t, (ROWS, COLS)) for (raw, _), t in zip(parts, types)])
    assert [(r.bits, r.shape[0]) for r in runs] == [(5, 2 * ROWS), (8, ROWS), (4, 2 * ROWS), (6, ROWS)]
    with pytest.raises(ValueError, match="layouts differ"):
        concat_rows(runs)
    reference = torch.cat([ref for _, ref in parts])
    bias = torch.randn(reference.shape[0])
    layer = SplitQuantizedLinear(runs, bias.clone())
    for m in (1, 8, 9, 40):
        x = torch.randn(m, COLS)
        want = torch.nn.functional.linear(x, reference, bias)
        for int8, tol in ((False, 1e-5), (True, 0.03)):
            for part in layer.parts:
                part.int8 = int8
            got = layer(x)
            assert got.shape == want.shape
            assert float((got - want).norm() / want.norm()) < tol, (m, int8)


@pytest.mark.parametrize("bits", [5, 6])
def test_sub_byte_codes_round_trip(bits):
    # every code value at every position of a block, through the bit planes and back
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    q = torch.arange(ROWS * COLS).reshape(ROWS, COLS) % (hi - lo) + lo
    q = q[:, torch.randperm(COLS)]
    packed = PackedWeight(_pack_blocks(q, bits, ROWS), torch.ones(ROWS, COLS // 32, dtype=torch.float16), None,
                          bits, 32, f"{bits}-bit")
    assert packed.qs.shape == (ROWS, COLS * bits // 8)
    assert torch.equal(packed.ints(), q.to(torch.int16))
    assert torch.equal(cpu_kernels.packed_rows(torch.arange(ROWS), packed), q.float())


@pytest.mark.parametrize("method", ["q8_0", "q4_0", "int8", "int4"])
def test_float_quantizers_round_trip(method):
    w = torch.randn(64, 256)
    packed = quantize_float(w, method)
    err = float((packed.dequantize() - w).abs().max() / w.abs().max())
    assert err < (0.02 if method in ("q8_0", "int8") else 0.2)
    _check_products(packed, packed.dequantize())


def test_gguf_weights_stay_packed_and_match_dequantized(smollm2_path, smollm2_llm):
    model = smollm2_llm.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, QuantizedLinear)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)  # tied output head, Q8_0
    assert not any(p.dim() == 2 for p in model.parameters())  # no float copy of any matrix
    dense = LLM(str(smollm2_path), kv_cache_memory="64MiB", max_model_len=512, quantization="none")
    assert isinstance(dense.engine.runner.model.model.layers[0].mlp.gate_up_proj, torch.nn.Linear)
    prompts = ["The capital of France is", "def fibonacci(n):\n", "List three primary colors:"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert not model.int8_activations  # exact products (the default rounds activations to 8 bits)
    ours = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    assert smollm2_llm.engine.runner.route_counts["fused"] > 0  # the decode steps ran as one C++ call each
    ref = [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]
    assert ours == ref



def test_int8_activations_follow_the_float_path(smollm2_path, smollm2_llm):
    """The default 8-bit activations (llama.cpp's numerics) change a greedy token only where the
    exact float path is itself nearly tied."""
    exact = smollm2_llm
    assert not exact.engine.runner.model.int8_activations
    int8 = LLM(str(smollm2_path), kv_cache_memory="64MiB", max_model_len=512)  # the default
    assert int8.engine.runner.model.int8_activations
    prompts = ["The capital of France is", "def fibonacci(n):\n", "List three primary colors:",
               "Once upon a time, in a small village by the sea,", "The theory of relativity says"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    fast = int8.generate(prompts, params, use_tqdm=False)
    ref = exact.generate(prompts, params, use_tqdm=False)
    tok = exact.get_tokenizer()
    for prompt, f, r in zip(prompts, fast, ref):
        want = r.outputs[0].token_ids
        print(assert_greedy_match(
            want, f.outputs[0].token_ids,
            lambda i, prompt=prompt, want=want: exact.engine.score(tok.encode(prompt) + want[:i])[-1],
            label=repr(prompt), near_tie=INT8_NEAR_TIE,
        ))


@pytest.mark.parametrize("method", ["q8_0", "int4"])
def test_quantization_of_a_float_model_matches_transformers(method, tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    llm = LLM(str(path), num_kv_blocks=64, quantization=method, cpu_activations="float32")
    assert isinstance(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    ids = llm.get_tokenizer().encode("Quantized weights keep their structure")
    ours = llm.engine.score(ids)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():  # the same rounding applied to transformers' weights
        for name, p in ref.named_parameters():
            if p.dim() == 2:
                p.copy_(quantize_float(p, method).dequantize())
        want = ref(torch.tensor([ids])).logits[0]
    assert float((ours - want).abs().max() / want.abs().max()) < 1e-4


def test_quantization_option_is_validated():
    with pytest.raises(ValueError, match="--quantization must be one of"):
        LLM("smollm2-135m", quantization="q3_x")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        LLM("smollm2-135m", kv_cache_dtype="int2")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp8 weights need a CUDA GPU"):
            LLM("smollm2-135m", quantization="fp8", device="cpu")
