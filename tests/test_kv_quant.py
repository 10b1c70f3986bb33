"""Q8_0 / Q4_0 KV caches (``--kv-cache-dtype q8_0|q4_0``, llama.cpp's ``-ctk/-ctv``) on CPU: the
block bytes against the ``gguf`` package's quantizer, the attention kernel over block rows against
the same values in a float cache, and the real models against their float32 KV cache (greedy
agreement and logprob error, printed with ``-s``), prefix-cache hits and preemption (bit-identical
to a miss and to a run alone: each row is quantized on its own), capacity and the CLI's errors.

One engine per KV type and model, shared by the module; short prompts keep it to about a minute.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tianxia import LLM, SamplingParams
from tianxia.quant.kv_blocks import KV_BLOCK_BYTES, kv_row_bytes, quantize_kv

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about autumn leaves."]
N_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=0)


def _rows() -> torch.Tensor:
    """K/V-like rows: varied magnitudes, an outlier per row, a zero block, exact ties at .5."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 128, generator=g) * torch.rand(48, 1, generator=g) * 8
    x[:, 5] *= 20  # attention sinks and outlier channels are what K caches hold
    x[3, :32] = 0
    x[4, :32] = torch.arange(32) - 15.5
    return x


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_blocks_equal_gguf_and_round_trip_within_the_format_error(fmt):
    x = _rows()
    ours = quantize_kv(x, fmt)
    assert ours.shape == (48, kv_row_bytes(fmt, 128)) and ours.dtype == torch.uint8
    assert np.array_equal(ours.numpy(), quantize(x.numpy(), GGML[fmt]))  # the same bytes, row by row
    assert torch.equal(quantize_kv(x[7:8], fmt), ours[7:8])  # a row alone: the same bytes
    back = torch.from_numpy(dequantize(ours.numpy(), GGML[fmt]))
    blocks, err = x.reshape(-1, 32), (back - x).reshape(-1, 32).abs()
    amax = blocks.abs().amax(1, keepdim=True)
    # half a step (a step: amax/127, or amax/8 for Q4_0, whose top code clips at +7 steps: one
    # whole step there), plus the float16 rounding of the scale
    step = amax / 127 if fmt == "q8_0" else amax / 8
    bound = step * (0.5 if fmt == "q8_0" else 1.0) + amax * 2**-10
    assert (err <= bound + 1e-6).all()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_paged_attention_reads_blocks_as_their_values(fmt):
    """The kernel over block rows equals the kernel over a float32 cache holding the dequantized
    values (float rounding: the widening is exact, the sums are the same)."""
    from tianxia.quant.cpu_kernels import extension

    ext = extension()
    g = torch.Generator().manual_seed(1)
    blocks, bs, hk, hq, d = 6, 16, 2, 6, 64
    k, v = (torch.randn(blocks, bs, hk, d, generator=g) for _ in range(2))
    kq, vq = quantize_kv(k, fmt), quantize_kv(v, fmt)
    deq = [torch.from_numpy(dequantize(t.numpy(), GGML[fmt])).reshape(blocks, bs, hk, d) for t in (kq, vq)]
    q = torch.randn(3, hq, d, generator=g)
    tables = torch.tensor([[5, 0, 3], [1, 2, 4], [4, 3, 0]])
    lens = torch.tensor([40, 17, 9])
    empty = torch.empty(0, dtype=torch.long)
    got = ext.paged_decode(q, kq, vq, tables, lens, 0.125, 0, 0.0, empty)
    want = ext.paged_decode(q, deq[0], deq[1], tables, lens, 0.125, 0, 0.0, empty)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- the real models -----------------------------------------------------------------------------


def _quant_llm(path, kv: str, **kw) -> LLM:
    return LLM(str(path), kv_cache_memory="32MiB", max_model_len=512, seed=0, cpu_activations="float32",
               kv_cache_dtype=kv, **kw)


@pytest.fixture(scope="module")
def smollm2_q8(smollm2_path):
    return _quant_llm(smollm2_path, "q8_0")


@pytest.fixture(scope="module")
def smollm2_q4(smollm2_path):
    return _quant_llm(smollm2_path, "q4_0")


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _compare(ref: LLM, quant: LLM, label: str, n_tokens: int = N_TOKENS) -> tuple[float, float, float]:
    """(the share of greedy tokens equal to the float KV's before the first divergence, the largest
    |logprob error| where both runs saw the same context: the prompt tokens' logprobs and the
    generated tokens before the divergence, and their mean); printed for the report."""
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    agree, errs = 0, []
    for want, got in zip(*(m.generate(PROMPTS, params, use_tqdm=False) for m in (ref, quant))):
        a, b = want.outputs[0], got.outputs[0]
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), n_tokens)
        agree += same
        pairs = list(zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:])) + list(zip(a.logprobs, b.logprobs))[:same]
        for x, y in pairs:
            tok = next(iter(x))
            errs.append(abs(x[tok].logprob - y[tok].logprob))
    share = agree / (n_tokens * len(PROMPTS))
    print(f"\n{label}: greedy agreement {share:.2f}, |logprob error| max {max(errs):.4f} mean {np.mean(errs):.4f} "
          f"over {len(errs)} tokens")
    return share, max(errs), float(np.mean(errs))


def test_smollm2_quantized_kv_against_float(smollm2_llm, smollm2_q8, smollm2_q4):
    share8, worst8, mean8 = _compare(smollm2_llm, smollm2_q8, "SmolLM2 q8_0")
    share4, worst4, mean4 = _compare(smollm2_llm, smollm2_q4, "SmolLM2 q4_0")
    assert share8 >= 0.9 and worst8 < 0.25 and mean8 < 0.05
    assert share4 >= 0.2 and worst4 < 3 and mean4 < 0.5  # 4-bit K/V: a coarse cache, as in llama.cpp  # 4-bit K/V: llama.cpp's own warning applies


def test_qwen_quantized_kv_against_float(qwen_path, qwen_llm):
    """Qwen2.5's K rows carry outlier channels (its k_proj bias: |k| up to ~150 in layers 0-2
    against a median ~1.6), so a Q8_0 block's step (amax/127) is as large as a typical value and
    greedy tokens part early and single logprobs move by several nats; the mean stays below 1."""
    q8 = _quant_llm(qwen_path, "q8_0")
    share8, _, mean8 = _compare(qwen_llm, q8, "Qwen2.5-Coder q8_0", n_tokens=8)
    assert share8 >= 0.25 and mean8 < 1.0


def test_prefix_cache_hit_is_bit_identical_to_a_miss(smollm2_q8):
    prompt = "You are a careful assistant. Answer briefly and precisely. " * 4 + "Name three colors."
    miss, hit = (smollm2_q8.generate(prompt, GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens >= 32
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    lp = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in (miss, hit)]
    assert lp[0] == lp[1]


def test_preemption_keeps_the_tokens(smollm2_path, smollm2_q4):
    """A tiny Q4_0 cache preempts and recomputes; the tokens equal the roomy cache's, exactly."""
    prompts = PROMPTS + ["Hi"]
    tiny = LLM(str(smollm2_path), num_kv_blocks=4, max_model_len=64, seed=0, cpu_activations="float32",
               kv_cache_dtype="q4_0")
    assert _tokens(tiny, prompts) == _tokens(smollm2_q4, prompts)
    assert tiny.engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_fused_decode_step_writes_and_reads_as_the_module_path(fmt, smollm2_q8, smollm2_q4):
    """The C++ decode step quantizes and attends as quantize_kv + paged_decode do: bit for bit."""
    llm = smollm2_q8 if fmt == "q8_0" else smollm2_q4
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    before = runner.route_counts["fused"]
    fused = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert runner.route_counts["fused"] > before
    step, runner.decode_step = runner.decode_step, None  # every step through the module forward
    try:
        plain = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        runner.decode_step = step
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_capacity_at_the_same_memory(smollm2_llm, smollm2_q8, smollm2_q4):
    """32 MiB of Q8_0 holds 128/34 (3.8x) the float32 tokens and 64/34 (1.9x) the float16 ones."""
    from tianxia.engine.model_runner import kv_bytes_per_token

    cfg = smollm2_llm.engine.model_config
    f32, f16 = kv_bytes_per_token(cfg, torch.float32), kv_bytes_per_token(cfg, torch.float16)
    s8, s4 = smollm2_q8.engine.stats(), smollm2_q4.engine.stats()
    assert s8["kv_cache_bytes_per_token"] * 128 == f32 * KV_BLOCK_BYTES["q8_0"]
    assert s4["kv_cache_bytes_per_token"] * 128 == f32 * KV_BLOCK_BYTES["q4_0"]
    per_block = 16
    f32_tokens = (32 * 2**20 // (f32 * per_block)) * per_block
    f16_tokens = (32 * 2**20 // (f16 * per_block)) * per_block
    # the usable blocks leave out one reserved block at most
    assert s8["kv_cache_capacity_tokens"] >= 1.85 * f16_tokens and s8["kv_cache_capacity_tokens"] >= 3.7 * f32_tokens
    assert s4["kv_cache_capacity_tokens"] >= 1.85 * s8["kv_cache_capacity_tokens"]


def test_server_reports_bytes_per_token_and_capacity(smollm2_path, smollm2_llm):
    """``tianxia serve -ctk q8_0 -ctv q8_0``: ``/metrics`` gives the cache's bytes per token (a
    Q8_0 row: 34 bytes per 32 values) and its token capacity at the given memory, and it serves."""
    import httpx

    from tianxia.engine.model_runner import kv_bytes_per_token
    from tianxia.server.testing import ServerProcess, metric

    f32 = kv_bytes_per_token(smollm2_llm.engine.model_config, torch.float32)
    with ServerProcess([str(smollm2_path), "--served-model-name", "m", "--kv-cache-memory", "32MiB",
                        "--max-model-len", "256", "-ctk", "q8_0", "-ctv", "q8_0"]) as srv:
        body = {"model": "m", "prompt": "The cat", "max_tokens": 4, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=120).status_code == 200
        text = httpx.get(srv.url + "/metrics", timeout=30).text
    per_token = metric(text, "tianxia:kv_cache_bytes_per_token", model_name="m")
    capacity = metric(text, "tianxia:kv_cache_capacity_tokens", model_name="m")
    assert per_token * 128 == f32 * KV_BLOCK_BYTES["q8_0"]
    blocks = 32 * 2**20 // (int(per_token) * 16)
    assert blocks * 16 - 16 <= capacity <= blocks * 16


@pytest.mark.parametrize("args, message", [
    (["-ctk", "q5_9"], "error: -ctk must be one of f32, f16, bf16, q8_0, q4_0; got 'q5_9'"),
    (["-ctk", "q8_0", "-ctv", "q4_0"], "error: -ctk q8_0 and -ctv q4_0 differ"),
])
def test_bad_cache_types_are_one_line_errors(args, message, capsys):
    from tianxia.cli import main

    assert main(["run", "-m", "smollm2-135m", "-p", "hi", *args]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message)


def test_llama_cpp_names_select_the_cache():
    import argparse

    from tianxia.config import add_quantization_args, kv_cache_dtype_from_args

    parser = argparse.ArgumentParser()
    add_quantization_args(parser)
    assert kv_cache_dtype_from_args(parser.parse_args(["-ctk", "q8_0", "-ctv", "q8_0"])) == "q8_0"
    assert kv_cache_dtype_from_args(parser.parse_args(["-ctk", "f16"])) == "fp16"
    assert kv_cache_dtype_from_args(parser.parse_args(["--kv-cache-dtype", "q4_0"])) == "q4_0"
