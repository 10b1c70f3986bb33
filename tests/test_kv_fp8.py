"""The fp8 KV cache (``--kv-cache-dtype fp8``): the Triton KV writes against torch's own float8
conversion, attention over an fp8 cache against attention over its dequantized values and over a
float cache, the scales, the engine end to end through the Triton backend, and the errors.

Without a GPU the kernels run in Triton's interpreter (``helpers.use_triton_interpreter``).
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_greedy_match, exact_fp8_conversion, first_divergence, use_triton_interpreter

CUDA = use_triton_interpreter()

from tianxia.config import CacheConfig, EngineConfig  # noqa: E402
from tianxia.engine.kv_scales import calibrate_kv_scales, scales_from_amax  # noqa: E402
from tianxia.engine.llm_engine import kv_type_name, resolve_kv_cache_dtype  # noqa: E402
from tianxia.engine.model_runner import kv_bytes_per_token  # noqa: E402
from tianxia.layers.attention import AttentionMetadata, get_backend  # noqa: E402
from tianxia.layers.attention import triton_attention as ta  # noqa: E402
from tianxia.layers.attention import triton_rope  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _exact_fp8(monkeypatch):
    if not CUDA:
        exact_fp8_conversion(monkeypatch)


def quantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference write: torch's division, clamp and float8 conversion."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def dequantized(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An fp8 cache [2, ...] as float32 values (K times K's scale, V times V's)."""
    return cache.float() * scales.view(2, *[1] * (cache.dim() - 1)).float().to(cache.device)


def _batch(q_lens, ctx_lens, num_blocks, bs, seed=0):
    """Metadata for sequences with ``ctx_lens`` cached tokens and ``q_lens`` new ones (decodes
    first), each over a random set of blocks."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, seq_lens, starts = [], [], [], [0]
    for q, c in zip(q_lens, ctx_lens):
        n = c + q
        table = [free.pop() for _ in range((n + bs - 1) // bs)]
        tables.append(table)
        slots.extend(table[p // bs] * bs + p % bs for p in range(c, n))
        seq_lens.append(n)
        starts.append(starts[-1] + q)
    bt = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int64)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), block_tables=bt.to(DEV),
        seq_lens=seq_lens, query_lens=list(q_lens), query_start_loc=starts,
        num_decodes=sum(1 for q in q_lens if q == 1),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=DEV), block_size=bs,
    )


# --- the writes --------------------------------------------------------------------------------------


def test_write_kv_stores_torchs_float8_of_x_over_scale():
    T, hk, d, bs = 7, 2, 32, 4
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(T, hk, d, generator=g) * 40).to(DEV)
    v = (torch.randn(T, hk, d, generator=g) * 3).to(DEV)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, 1e-7])  # saturates at ±448, zero, underflow
    scales = torch.tensor([0.37, 0.011], device=DEV)
    cache = torch.zeros(2, 4, bs, hk, d, dtype=FP8, device=DEV)
    slots = torch.tensor([3, 0, 9, -1, 14, 5, 6], device=DEV)  # -1: a padding row, skipped
    ta.write_kv(k, v, cache, slots, scales)
    want = torch.zeros(2, 4 * bs, hk, d, dtype=FP8)
    keep = slots.cpu() >= 0
    want[0, slots.cpu()[keep]] = quantized(k.cpu()[keep], 0.37)
    want[1, slots.cpu()[keep]] = quantized(v.cpu()[keep], 0.011)
    got = cache.cpu().view(2, -1, hk, d)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.float().isfinite().all()
    assert got[0, 3, 0, :2].float().tolist() == [448.0, -448.0]
    # read back: the stored values times the scale are the inputs within e4m3's half-ulp (2^-4)
    back = dequantized(got, scales)[:, slots.cpu()[keep]]
    ref = torch.stack([k.cpu()[keep], v.cpu()[keep]])
    ok = ref.abs() < 400 * scales.cpu().view(2, 1, 1, 1)
    ok &= ref.abs() > 2**-6 * scales.cpu().view(2, 1, 1, 1)  # e4m3 normals
    torch.testing.assert_close(back[ok], ref[ok], rtol=2**-4, atol=0)


@pytest.mark.parametrize("norm", [False, True])
def test_rope_write_kv_quantizes_what_it_would_store_in_float(norm):
    """The fused decode step's q/k norm + RoPE + write: its fp8 cache is torch's float8 of what it
    writes into a float32 cache, divided by the scales; q is unchanged."""
    from tianxia.layers.rotary import RotaryEmbedding

    T, hq, hk, d, bs = 3, 4, 2, 32, 4
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 5).to(DEV)
    rope = RotaryEmbedding(d, 64, 10000.0)
    rope.build_cache(DEV)
    pos = torch.tensor([3, 17, 40], device=DEV)
    slots = torch.tensor([2, 9, 13], device=DEV)
    norms = dict(q_norm=torch.rand(d, generator=g).to(DEV) + 0.5, k_norm=torch.rand(d, generator=g).to(DEV) + 0.5) \
        if norm else {}
    scales = torch.tensor([0.05, 0.02], device=DEV)
    f32 = torch.zeros(2, 4, bs, hk, d, device=DEV)
    fp8 = torch.zeros(2, 4, bs, hk, d, dtype=FP8, device=DEV)
    cs = rope.cos_sin
    q32 = triton_rope.rope_write_kv(qkv, pos, cs, f32, slots, hq, hk, d, **norms)
    q8 = triton_rope.rope_write_kv(qkv, pos, cs, fp8, slots, hq, hk, d, kv_scale=scales, **norms)
    assert torch.equal(q32, q8)
    want = torch.stack([quantized(f32[0].cpu(), 0.05), quantized(f32[1].cpu(), 0.02)])
    assert torch.equal(fp8.cpu().view(torch.uint8), want.view(torch.uint8))


# --- attention over an fp8 cache ---------------------------------------------------------------------


def _attention_case(seed, hq=4, hk=2, d=32, magnitude=1.0):
    bs, num_blocks = 4, 48
    # three decodes (short, mid, long), a fresh prompt, a chunk after a cached prefix
    q_lens, ctx_lens = [1, 1, 1, 9, 6], [0, 5, 30, 0, 11]
    meta = _batch(q_lens, ctx_lens, num_blocks, bs, seed=seed)
    g = torch.Generator().manual_seed(seed)
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=g).to(DEV)
    k = (torch.randn(T, hk, d, generator=g) * magnitude).to(DEV)
    v = torch.randn(T, hk, d, generator=g).to(DEV)
    old = torch.randn(2, num_blocks, bs, hk, d, generator=g)
    old[0] *= magnitude
    return q, k, v, old, meta, d**-0.5


def _fp8_attention(q, k, v, old, meta, scale, scales, backend="triton", **kw):
    cache = torch.stack([quantized(old[0], float(scales[0])), quantized(old[1], float(scales[1]))]).to(DEV)
    out = get_backend(DEV, backend).forward(q, k, v, cache, meta, scale, kv_scale=scales.to(DEV), **kw)
    return out, cache


@pytest.mark.parametrize("backend", ["triton", "triton_invariant"])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 5.0)])
def test_attention_over_fp8_equals_attention_over_its_dequantized_values(backend, window, softcap):
    """Decodes (split-K) and prefill chunks over an fp8 cache equal the same kernels over a
    float32 cache holding the fp8 values times the scales, up to float32 rounding; and they are
    within fp8's rounding of attention over the unquantized float32 cache."""
    if backend == "triton_invariant":
        from tianxia.layers import batch_invariant  # noqa: F401  (registers it)
    q, k, v, old, meta, scale = _attention_case(seed=3)
    scales = torch.tensor([0.012, 0.011])  # about amax / 448: no value clipped
    kw = dict(sliding_window=window, softcap=softcap)
    out, cache = _fp8_attention(q, k, v, old, meta, scale, scales, backend, **kw)
    # the reference writes the fp8 cache's new rows, dequantized, so its cache equals the fp8 one's
    deq = dequantized(cache, scales)
    ref = get_backend(DEV, backend).forward(q, *_fresh_rows(deq, meta), deq, meta, scale, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    exact = get_backend(DEV, backend).forward(q, k, v, old.clone().to(DEV), meta, scale, **kw)
    # e4m3 keeps 3 mantissa bits: each stored value within 2^-4 of itself (relative); an output
    # is a weighted mean of V rows, its weights moved a little by K's rounding
    err = (out - exact).abs()
    assert err.max() < 2**-4 * torch.cat([old[1].flatten(), v.cpu().flatten()]).abs().max(), err.max()
    assert 1e-4 < err.mean() < 2**-5, err.mean()  # and the cache really was fp8


def _fresh_rows(cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows the step wrote, read back from ``cache`` (so rewriting them changes
    nothing)."""
    flat = cache.flatten(1, 2)  # [2, slots, Hk, D]
    return flat[0, meta.slot_mapping], flat[1, meta.slot_mapping]


def test_scale_is_applied():
    """K of magnitude ~1000: with scale amax / 448 the fp8 attention is close to the float one;
    with scale 1.0 it saturates at 448 and the scores (and the output) are far off."""
    q, k, v, old, meta, scale = _attention_case(seed=5, magnitude=1000.0)
    q = q * 1e-3  # keep the softmax soft
    exact = get_backend(DEV, "triton").forward(q, k, v, old.clone().to(DEV), meta, scale)
    amax = torch.stack([torch.cat([old[0].flatten(), k.cpu().flatten()]).abs().max(),
                        torch.cat([old[1].flatten(), v.cpu().flatten()]).abs().max()])
    good, _ = _fp8_attention(q, k, v, old, meta, scale, amax / 448)
    bad, _ = _fp8_attention(q, k, v, old, meta, scale, torch.ones(2))
    print((good - exact).abs().max(), (bad - exact).abs().max())
    assert (good - exact).abs().max() < 2**-4 * amax[1]
    assert (bad - exact).abs().max() > 1.0


# --- sizes, names, scales ----------------------------------------------------------------------------


def test_fp8_halves_the_bytes_per_token_and_doubles_the_blocks():
    from tianxia.config import ModelConfig
    from tianxia.engine.model_runner import ModelRunner

    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=64)
    assert kv_bytes_per_token(cfg, FP8) * 2 == kv_bytes_per_token(cfg, torch.bfloat16)
    cache = CacheConfig(block_size=4, kv_cache_memory=40 * 4 * kv_bytes_per_token(cfg, torch.bfloat16))
    fp8 = ModelRunner(torch.nn.Module(), cfg, cache, torch.device("cpu"), FP8)
    bf16 = ModelRunner(torch.nn.Module(), cfg, cache, torch.device("cpu"), torch.bfloat16)
    assert fp8.num_blocks == 2 * bf16.num_blocks and fp8.kv_cache_bytes == bf16.kv_cache_bytes
    assert fp8.kv_cache.dtype == FP8 and fp8.kv_scales.tolist() == [[1.0, 1.0]] * 3
    assert bf16.kv_scales is None
    assert kv_type_name(FP8) == "float8_e4m3fn"


def test_scales_from_amax_floor():
    """K's maximum lands at 200 and V's at 100 (vLLM's constants: headroom up to 448), with
    maxima below 1 taken as 1."""
    got = scales_from_amax(torch.tensor([[800.0, 0.0], [1.0, 0.25], [0.5, 300.0]]))
    f = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    assert got.tolist() == [[4.0, f(1 / 100)], [f(1 / 200), f(1 / 100)], [f(1 / 200), 3.0]]


def test_fp8_calibrates_by_default_on_one_rank():
    assert EngineConfig(model="x", kv_cache_dtype="fp8").kv_scales_calibrated
    assert not EngineConfig(model="x", kv_cache_dtype="fp8", calculate_kv_scales=False).kv_scales_calibrated
    assert not EngineConfig(model="x", kv_cache_dtype="fp8", tensor_parallel_size=2).kv_scales_calibrated
    assert not EngineConfig(model="x", kv_cache_dtype="bf16").kv_scales_calibrated
    with pytest.raises(ValueError, match="--calculate-kv-scales is not supported with --tensor-parallel-size"):
        EngineConfig(model="x", kv_cache_dtype="fp8", tensor_parallel_size=2, calculate_kv_scales=True)


# --- the engine --------------------------------------------------------------------------------------


def test_cpu_without_the_triton_backend_refuses_fp8(monkeypatch):
    monkeypatch.delenv("TIANXIA_ATTENTION_BACKEND", raising=False)
    for name in ("fp8", "fp8_e4m3"):
        with pytest.raises(ValueError, match="fp8 is a CUDA cache format; on CPU use q8_0"):
            resolve_kv_cache_dtype(name, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="--calculate-kv-scales applies to --kv-cache-dtype fp8"):
        EngineConfig(model="x", calculate_kv_scales=True)


def test_cli_options():
    import argparse

    from tianxia.config import add_kv_cache_args, kv_cache_dtype_from_args

    p = argparse.ArgumentParser()
    add_kv_cache_args(p)
    args = p.parse_args(["--kv-cache-dtype", "fp8_e4m3", "--calculate-kv-scales"])
    assert kv_cache_dtype_from_args(args) == "fp8_e4m3" and args.calculate_kv_scales is True
    assert p.parse_args(["--no-calculate-kv-scales"]).calculate_kv_scales is False
    assert p.parse_args([]).calculate_kv_scales is None  # the engine decides: on for fp8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from test_model_families import make_model, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("fp8-kv")
    make_tiny_tokenizer(root / "tok")
    return make_model("llama", root / "llama", root / "tok")


# the tiny model's logprobs move by up to 0.02 with an fp8 cache (measured: 0.009 at scale 1.0,
# 0.02 calibrated), against 1e-4 between two float32 routes
FP8_LOGPROB_ERROR = 0.05


def _top_logprobs(out, i: int) -> torch.Tensor:
    return torch.tensor([lp.logprob for lp in out.logprobs[i].values()])


def _generate(path, monkeypatch, **kw):
    from tianxia import LLM, SamplingParams

    monkeypatch.setenv("TIANXIA_ATTENTION_BACKEND", "triton")
    llm = LLM(str(path), num_kv_blocks=48, block_size=4, enable_prefix_caching=False, max_num_seqs=4,
              max_model_len=64, **kw)
    ids = llm.get_tokenizer().encode("the quick brown fox jumps over the lazy dog and the river")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": ids[:11]}, {"prompt_token_ids": ids[:6]}], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


@pytest.mark.skipif(CUDA, reason="the GPU benchmark benchmarks/gpu_kv_fp8.py checks real weights")
def test_engine_greedy_with_fp8_kv_follows_float32_kv(tiny_llama, monkeypatch):
    """A tiny random Llama through the Triton backend: fp8 KV (scales 1.0, then calibrated) gives
    the float32 KV's greedy tokens, logprobs within fp8's error; the calibrated scales are the
    calibration prefill's maxima over 200 (K) and 100 (V)."""
    _, ref = _generate(tiny_llama, monkeypatch, kv_cache_dtype="f32")
    for calibrate in (False, None):  # scales of 1.0, then the default: calibrated
        llm, got = _generate(tiny_llama, monkeypatch, kv_cache_dtype="fp8", calculate_kv_scales=calibrate)
        runner = llm.engine.runner
        assert runner.kv_cache.dtype == FP8 and llm.engine.stats()["kv_cache_bytes_per_token"] == \
            kv_bytes_per_token(llm.engine.model_config, FP8)
        assert (runner.kv_scales == 1.0).all() == (calibrate is False)
        for a, b in zip(ref, got):
            # the random model's distributions are nearly flat: greedy may flip at a near-tie
            assert_greedy_match(a.token_ids, b.token_ids, lambda i: _top_logprobs(a, i), near_tie=FP8_LOGPROB_ERROR)
            same = first_divergence(a.token_ids, b.token_ids) or len(a.token_ids)
            for step_a, step_b in zip(a.logprobs[:same], b.logprobs[:same]):
                for t in step_a.keys() & step_b.keys():  # a top-3 at a near-tie may differ
                    assert abs(step_a[t].logprob - step_b[t].logprob) < FP8_LOGPROB_ERROR
    # the engine's scales are the calibration's; this random model's K and V stay below 1 (about
    # 0.5), so every scale is the floor's
    from tianxia.engine.kv_scales import CALIBRATION_TEXT

    engine = llm.engine
    ids = engine.tokenizer.encode(CALIBRATION_TEXT)
    scales = calibrate_kv_scales(engine.runner.model, engine.model_config, ids, DEV, torch.float32, 4)
    torch.testing.assert_close(engine.runner.kv_scales, scales, rtol=0, atol=0)
    assert (scales == scales_from_amax(torch.zeros(()))).all()
