"""The Triton kernels against the torch reference implementations.

On a machine without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set here
before the kernels are imported) on small shapes; with a GPU they run compiled, on the GPU. The
whole module is skipped when Triton is not installed (CPU builds of PyTorch do not ship it).
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

CUDA = torch.cuda.is_available()
if not CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter must be on before triton's own jit functions are defined
        pytest.skip("triton was imported before TRITON_INTERPRET could be set; run with "
                    "TRITON_INTERPRET=1", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

if not CUDA:
    # Triton's interpreter turns a loaded scalar (a 1-element array) into a loop bound with int(),
    # which NumPy >= 2.4 refuses for 1-d arrays; take the element instead.
    from triton.runtime import interpreter as _interp

    _orig_patch = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor

from tianxia.layers.attention import AttentionMetadata, get_backend
from tianxia.layers.attention import triton_attention as ta
from tianxia.layers import triton_linear as tlin
from tianxia.layers import triton_lora
from tianxia.layers import triton_pointwise as tpw
from tianxia.layers.attention import triton_rope
from tianxia.layers import triton_sampling

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32, torch.bfloat16]


def _exact(dtype):
    """Equal up to how float32 products are summed: bit-exact in bf16 on the GPU (float32 there
    differs by an ulp where the compiler contracts a product and a sum into one FMA, which eager
    torch does not) and in float32 on the interpreter (which truncates float32 -> bf16 instead of
    rounding)."""
    if dtype == torch.float32:
        return dict(atol=1e-6, rtol=1e-6) if CUDA else dict(atol=0, rtol=0)
    return dict(atol=0, rtol=0) if CUDA else dict(atol=2e-2, rtol=2e-2)


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=2e-4, rtol=2e-4)


def _batch(q_lens, ctx_lens, num_blocks, bs, seed=0):
    """Metadata for sequences with ``ctx_lens`` cached tokens and ``q_lens`` new ones (decodes,
    query length 1, first), each over a random set of blocks."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, seq_lens, starts = [], [], [], [0]
    for q, c in zip(q_lens, ctx_lens):
        n = c + q
        nb = (n + bs - 1) // bs
        table = [free.pop() for _ in range(nb)]
        tables.append(table)
        slots.extend(table[p // bs] * bs + p % bs for p in range(c, n))
        seq_lens.append(n)
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int64)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
        block_tables=bt.to(DEV),
        seq_lens=seq_lens,
        query_lens=list(q_lens),
        query_start_loc=starts,
        num_decodes=sum(1 for q in q_lens if q == 1),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=DEV),
        block_size=bs,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,window,softcap",
    [((4, 2, 32), None, None), ((6, 2, 16), None, None), ((4, 4, 16), 7, None), ((4, 1, 16), None, 5.0)],
)
def test_triton_backend_matches_torch(dtype, heads, window, softcap):
    hq, hk, d = heads
    bs, num_blocks = 4, 64
    # three decodes (short, mid, long), a fresh prompt, a chunk after a cached prefix, a 1-token prompt tail
    q_lens = [1, 1, 1, 9, 6, 2]
    ctx_lens = [0, 5, 30, 0, 11, 3]
    meta = _batch(q_lens, ctx_lens, num_blocks, bs, seed=hq + hk)
    g = torch.Generator().manual_seed(0)
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=g).to(dtype).to(DEV)
    k = torch.randn(T, hk, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(T, hk, d, generator=g).to(dtype).to(DEV)
    cache = torch.randn(2, num_blocks, bs, hk, d, generator=g).to(dtype).to(DEV)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    scale = d**-0.5
    ref = get_backend(DEV, "torch").forward(q, k, v, ref_cache, meta, scale, window, softcap)
    out = get_backend(DEV, "triton").forward(q, k, v, tri_cache, meta, scale, window, softcap)
    assert torch.equal(ref_cache, tri_cache)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_null_block_entries_leak_nothing(backend):
    """A sliding-window cache gives back blocks below ``ctx - window + 1`` and points their table
    entries at a zeroed null block; the blocks themselves are reused (here: filled with NaN).
    Attention must equal the run over the original table and cache, whatever the kernels read."""
    hq, hk, d, bs, window = 4, 2, 16, 4, 7
    q_lens, ctx_lens = [1, 1, 1, 9, 6, 2], [0, 5, 30, 0, 19, 3]
    meta = _batch(q_lens, ctx_lens, 64, bs, seed=3)
    g = torch.Generator().manual_seed(1)
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h, d, generator=g).to(DEV) for h in (hq, hk, hk))
    cache = torch.randn(2, 64, bs, hk, d, generator=g).to(DEV)
    tables = meta.block_tables.clone()
    null = min(set(range(1, 64)) - set(tables.flatten().tolist()))
    freed_cache = cache.clone()
    freed_cache[:, null] = 0
    num_freed = 0
    for i, (qlen, seq_len) in enumerate(zip(q_lens, meta.seq_lens)):
        dead = max(0, seq_len - qlen - window + 1) // bs
        freed_cache[:, tables[i, :dead]] = float("nan")
        tables[i, :dead] = null
        num_freed += dead
    assert num_freed >= 8
    attn = get_backend(DEV, backend)
    ref = attn.forward(q, k, v, cache, meta, d**-0.5, window)
    meta.block_tables = tables
    out = attn.forward(q, k, v, freed_cache, meta, d**-0.5, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_splits_and_padding_rows(splits):
    hq, hk, d, bs, num_blocks = 8, 2, 32, 4, 64
    meta = _batch([1, 1, 1], [40, 3, 17], num_blocks, bs, seed=splits)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, hq, d, generator=g).to(DEV)
    cache = torch.randn(2, num_blocks, bs, hk, d, generator=g).to(DEV)
    ref = _dense_decode(q, cache, meta, d**-0.5)
    # padding rows: length 0 -> zeros
    lens = torch.cat([meta.seq_lens_tensor, torch.zeros(2, dtype=torch.int64, device=DEV)])
    tables = torch.cat([meta.block_tables, torch.zeros(2, meta.block_tables.shape[1], dtype=torch.int64, device=DEV)])
    qp = torch.cat([q, torch.randn(2, hq, d, device=DEV)])
    out = ta.decode_attention(qp, cache, tables, lens, d**-0.5, splits)
    torch.testing.assert_close(out[:3], ref, atol=2e-4, rtol=2e-4)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


def _dense_decode(q, cache, meta, scale):
    outs = []
    for i, n in enumerate(meta.seq_lens):
        tbl = meta.block_tables[i]
        kk = cache[0][tbl].flatten(0, 1)[:n]  # [n, hk, d]
        vv = cache[1][tbl].flatten(0, 1)[:n]
        rep = q.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), kk.float()) * scale
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv.float()))
    return torch.stack(outs).to(q.dtype)


def test_write_kv_skips_negative_slots():
    hk, d, bs, nb = 2, 16, 4, 8
    cache = torch.zeros(2, nb, bs, hk, d, device=DEV)
    k = torch.randn(3, hk, d, device=DEV)
    v = torch.randn(3, hk, d, device=DEV)
    ta.write_kv(k, v, cache, torch.tensor([5, -1, 30], device=DEV))
    expected = torch.zeros(2, nb * bs, hk, d, device=DEV)
    expected[0, 5], expected[1, 5], expected[0, 30], expected[1, 30] = k[0], v[0], k[2], v[2]
    assert torch.equal(cache.view(2, -1, hk, d), expected)


# --- fused ops of the CUDA-graph decode path ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(dtype, with_residual):
    from tianxia.layers.norm import RMSNorm

    norm = RMSNorm(48, 1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    norm = norm.to(dtype)
    x = torch.randn(5, 48, device=DEV).to(dtype)
    res = torch.randn(5, 48, device=DEV).to(dtype) if with_residual else None
    if res is None:
        ref = norm(x)
        out, new_res = tpw.add_rmsnorm(x, None, norm.weight, 1e-6)
        assert new_res is x
    else:
        ref, ref_res = norm(x, res)
        out, new_res = tpw.add_rmsnorm(x, res, norm.weight, 1e-6)
        torch.testing.assert_close(new_res, ref_res, **_exact(dtype))
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_add_layernorm(dtype, with_residual, bias):
    g = torch.Generator().manual_seed(8)
    norm = torch.nn.LayerNorm(48, eps=1e-5, bias=bias)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
        if bias:
            norm.bias.copy_(torch.randn(48, generator=g))
    norm = norm.to(dtype).to(DEV)
    x = (torch.randn(5, 48, generator=g) + 3.0).to(dtype).to(DEV)  # a mean far from 0
    res = torch.randn(5, 48, generator=g).to(dtype).to(DEV) if with_residual else None
    out, new_res = tpw.add_layernorm(x, res, norm.weight, norm.bias, 1e-5)
    if res is None:
        assert new_res is x
    else:
        torch.testing.assert_close(new_res, x + res, **_exact(dtype))
    torch.testing.assert_close(out, norm(new_res), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    from tianxia.layers.activation import SiluAndMul

    x = torch.randn(3, 2 * 40, device=DEV).to(dtype)
    torch.testing.assert_close(tpw.silu_mul(x), SiluAndMul()(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv(dtype):
    from tianxia.layers.rotary import RotaryEmbedding

    hq, hk, d, bs, nb = 4, 2, 32, 4, 16
    rope = RotaryEmbedding(d, 256, 10000.0)
    rope.build_cache(DEV)
    T = 3
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=DEV).to(dtype)
    pos = torch.tensor([0, 17, 200], device=DEV)
    slots = torch.tensor([3, -1, 40], device=DEV)
    cache = torch.zeros(2, nb, bs, hk, d, device=DEV, dtype=dtype)
    q_out = triton_rope.rope_write_kv(qkv, pos, rope.cos_sin, cache, slots, hq, hk, d)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], -1)
    rq, rk = rope(pos, q.reshape(T, hq, d), k.reshape(T, hk, d))
    torch.testing.assert_close(q_out, rq, **_tol(dtype))
    flat = cache.view(2, -1, hk, d)
    torch.testing.assert_close(flat[0, 3], rk[0], **_tol(dtype))
    torch.testing.assert_close(flat[0, 40], rk[2], **_tol(dtype))
    assert torch.equal(flat[1, 40], v.reshape(T, hk, d)[2])
    assert flat[:, 17].abs().sum() == 0  # slot -1 skipped


def _torch_rope(rope, pos, x):
    """The eager rotation (not the CPU's fused in-place one)."""
    cos, sin = rope._cos_sin(pos).chunk(2, dim=-1)
    return rope._rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["half", "partial", "interleaved", "partial-interleaved"])
@pytest.mark.parametrize("norm", [None, "rms", "gemma"])
def test_rope_variants(dtype, layout, norm):
    """The generic RoPE kernels (partial / interleaved rotation, q/k norms before it) against the
    eager modules: ``rope_write_kv`` (the fused decode step) and ``rope`` (the module forward)."""
    from tianxia.layers.norm import GemmaRMSNorm, RMSNorm
    from tianxia.layers.rotary import RotaryEmbedding

    hq, hk, d, bs, nb, T = 4, 2, 32, 4, 16, 3
    rot = d // 2 if layout.startswith("partial") else d
    rope = RotaryEmbedding(d, 256, 10000.0, rotary_dim=rot, interleaved="interleaved" in layout)
    rope.build_cache(DEV)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(DEV).to(dtype)
    pos = torch.tensor([1, 17, 200], device=DEV)
    slots = torch.tensor([3, -1, 40], device=DEV)
    q, k, v = (t.reshape(T, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], -1))
    kw = {}
    if norm is not None:
        cls = RMSNorm if norm == "rms" else GemmaRMSNorm
        qn, kn = cls(d), cls(d)
        with torch.no_grad():
            qn.weight.copy_(torch.randn(d, generator=g) * 0.3 + (1.0 if norm == "rms" else 0.0))
            kn.weight.copy_(torch.randn(d, generator=g) * 0.3 + (1.0 if norm == "rms" else 0.0))
        qn, kn = qn.to(DEV).to(dtype), kn.to(DEV).to(dtype)
        kw = dict(q_norm=qn.weight, k_norm=kn.weight, eps=qn.eps, gemma_norm=norm == "gemma")
        # the eager norms in torch ops (the CPU's fused norm would take another rounding path)
        def eager(mod, x):
            h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + mod.eps)
            if norm == "gemma":
                return (h * (1.0 + mod.weight.float())).to(x.dtype)
            return mod.weight * h.to(x.dtype)
        q, k = eager(qn, q), eager(kn, k)
    rq, rk = _torch_rope(rope, pos, q), _torch_rope(rope, pos, k)
    cache = torch.zeros(2, nb, bs, hk, d, device=DEV, dtype=dtype)
    q_out = triton_rope.rope_write_kv(qkv, pos, rope.cos_sin, cache, slots, hq, hk, d, rotary_dim=rot,
                                      interleaved=rope.interleaved, **kw)
    torch.testing.assert_close(q_out, rq, **_tol(dtype))
    flat = cache.view(2, -1, hk, d)
    torch.testing.assert_close(flat[0, 3], rk[0], **_tol(dtype))
    torch.testing.assert_close(flat[0, 40], rk[2], **_tol(dtype))
    assert torch.equal(flat[1, 40], v[2])
    assert flat[:, 17].abs().sum() == 0  # slot -1 skipped
    if norm is None:
        got_q, got_k = triton_rope.rope(q, k, pos, rope.cos_sin, rot, rope.interleaved)
        torch.testing.assert_close(got_q, rq, **_exact(dtype))
        torch.testing.assert_close(got_k, rk, **_exact(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["plain", "bias", "norm", "add_norm", "silu", "layernorm", "add_layernorm",
                                  "gelu_new", "gelu", "add"])
def test_gemv(dtype, mode):
    K, N = 96, 40
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, K, generator=g).to(dtype).to(DEV)
    w = (torch.randn(2 * N if mode == "silu" else N, K, generator=g) / K**0.5).to(dtype).to(DEV)
    b = torch.randn(N, generator=g).to(dtype).to(DEV) if mode in ("bias", "gelu_new", "gelu") else None
    nw = torch.randn(K, generator=g).to(dtype).to(DEV)
    res = torch.randn(1, K, generator=g).to(dtype).to(DEV)
    kw = dict(block_n=8, block_k=32)
    if mode in ("plain", "bias"):
        ref = torch.nn.functional.linear(x, w, b)
        out = tlin.gemv(x, w, b, **kw)
    elif mode == "silu":
        from tianxia.layers.activation import SiluAndMul

        ref = SiluAndMul()(torch.nn.functional.linear(x, w))
        out = tlin.gemv(x, w, act="silu", **kw)
    elif mode in ("gelu_new", "gelu"):
        from tianxia.layers.activation import get_activation

        ref = get_activation(mode)(torch.nn.functional.linear(x, w, b))
        out = tlin.gemv(x, w, b, out_act=mode, **kw)
    elif mode == "add":
        ref = torch.nn.functional.linear(x, w) + res[:, :N]
        out = tlin.gemv(x, w, add=res[:, :N], **kw)
    elif mode in ("layernorm", "add_layernorm"):
        norm = torch.nn.LayerNorm(K, eps=1e-5).to(DEV).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(nw)
            norm.bias.copy_(torch.randn(K, generator=g))
        ln = dict(norm_weight=norm.weight, norm_bias=norm.bias, eps=1e-5, layer_norm=True, **kw)
        if mode == "layernorm":
            ref_res = x
            out, new_res = tlin.gemv(x, w, **ln)
        else:
            ref_res = x + res
            out, new_res = tlin.gemv(x, w, residual=res, **ln)
        ref = torch.nn.functional.linear(norm(ref_res), w)
        torch.testing.assert_close(new_res, ref_res, **_exact(dtype))
    else:
        from tianxia.layers.norm import RMSNorm

        norm = RMSNorm(K, 1e-6).to(DEV).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(nw)
        if mode == "norm":
            h, ref_res = norm(x), x
            out, new_res = tlin.gemv(x, w, norm_weight=norm.weight, eps=1e-6, **kw)
        else:
            h, ref_res = norm(x, res)
            out, new_res = tlin.gemv(x, w, residual=res, norm_weight=norm.weight, eps=1e-6, **kw)
        ref = torch.nn.functional.linear(h, w)
        torch.testing.assert_close(new_res, ref_res, **_exact(dtype))
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


# --- the fused decode forward, against the model's own forward --------------------------------------


# the layouts of the non-Llama families' fused steps: architecture, config fields
_TINY_FAMILIES = {
    "gpt2": ("gpt2", dict(num_key_value_heads=4, hidden_act="gelu_new", rms_norm_eps=1e-5)),
    "falcon": ("falcon", dict(hidden_act="gelu", rms_norm_eps=1e-5, extra={
        "new_decoder_architecture": True, "parallel_attn": True, "num_ln_in_parallel_attn": 2})),
    "falcon-mq": ("falcon", dict(num_key_value_heads=1, hidden_act="gelu", extra={
        "new_decoder_architecture": False, "parallel_attn": True, "num_ln_in_parallel_attn": 1})),
    "falcon-seq": ("falcon", dict(num_key_value_heads=4, hidden_act="gelu", extra={
        "new_decoder_architecture": False, "parallel_attn": False, "num_ln_in_parallel_attn": 1})),
}


def _tiny_runner(dtype, vocab=96, layers=2, bias=True, tie=True, family="qwen2"):
    from tianxia.config import CacheConfig, ModelConfig
    from tianxia.engine.model_runner import ModelRunner
    from tianxia.models.registry import get_model_class

    arch, fields = _TINY_FAMILIES.get(family, (family, {}))
    cfg = ModelConfig(**dict(dict(
        architecture=arch, vocab_size=vocab, hidden_size=64, intermediate_size=96,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=bias,
        tie_word_embeddings=tie,
    ), **fields))
    torch.manual_seed(0)
    model = get_model_class(cfg)(cfg, get_backend(DEV, "triton")).to(DEV)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
            if p.dim() == 1 and p.shape[0] == 64:  # norm weights around 1
                p.add_(1.0)
    model = model.to(dtype)
    model.init_buffers(DEV)
    model.eval()
    return ModelRunner(model, cfg, CacheConfig(block_size=4, num_blocks=64), DEV, dtype), cfg


def _greedy(runner, prompts, steps):
    from tianxia.engine.sequence import Sequence
    from tianxia.engine.step_io import make_step_input
    from tianxia.sampling_params import SamplingParams

    seqs = []
    free = list(range(runner.num_blocks))
    for i, p in enumerate(prompts):
        s = Sequence(f"r{i}", None, p, SamplingParams(temperature=0, max_tokens=steps))
        s.block_table = [free.pop() for _ in range((len(p) + steps + 3) // 4)]
        seqs.append(s)
    res = runner.execute(make_step_input([(s, len(s)) for s in seqs], 4, ()))
    for s in seqs:
        s.num_computed_tokens = len(s)
        s.token_ids.append(res.tokens()[s.seq_id])
    for _ in range(steps - 1):
        res = runner.execute(make_step_input([(s, 1) for s in seqs], 4, ()))
        for s in seqs:
            s.num_computed_tokens += 1
            s.token_ids.append(res.tokens()[s.seq_id])
    return [s.output_token_ids for s in seqs]


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_decode_matches_model(batch):
    from tianxia.engine.cuda_graph import CudaGraphRunner
    from tianxia.models.llama_gpu_step import LlamaGpuStep

    dtype = torch.float32
    runner, cfg = _tiny_runner(dtype)
    prompts = [[(7 * i + 3 * j) % cfg.vocab_size for j in range(5 + 2 * i)] for i in range(batch)]
    expected = _greedy(runner, prompts, 6)
    runner2, _ = _tiny_runner(dtype)
    step = LlamaGpuStep(runner2.model, runner2.kv_caches, 64)
    runner2.graph_runner = CudaGraphRunner(
        step, vocab_size=cfg.vocab_size, num_kv_heads=cfg.num_key_value_heads, block_size=4,
        max_num_seqs=4, max_model_len=64, device=DEV, variants=step.variants, set_variant=step.set_variant,
        use_graphs=CUDA,
    )
    runner2.graph_runner.capture()
    assert _greedy(runner2, prompts, 6) == expected
    assert runner2.route_counts["graph"] == 5


def _check_fused_decoder_logits(runner, cfg, step_cls=None) -> None:
    """One decode step: fused logits vs the eager model's, at batch 1 (GEMV path) and 3."""
    from tianxia.engine.sequence import Sequence
    from tianxia.engine.step_io import make_step_input
    from tianxia.layers.attention.triton_attention import decode_num_splits
    from tianxia.models.llama_gpu_step import LlamaGpuStep
    from tianxia.sampling_params import SamplingParams

    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17]]
    _greedy(runner, prompts, 2)  # fills the cache
    step = (step_cls or LlamaGpuStep)(runner.model, runner.kv_caches, 64)
    for b in (1, 3):
        seqs = []
        for i, p in enumerate(prompts[:b]):
            s = Sequence(f"x{i}", None, p + [5], SamplingParams(max_tokens=1))
            s.block_table = list(range(10 * i, 10 * i + 3))
            s.num_computed_tokens = len(p)
            seqs.append(s)
        ids, pos, meta = runner.tensors(make_step_input([(s, 1) for s in seqs], 4, ()))
        ref = runner.model.compute_logits(runner.model(ids, pos, runner.kv_caches, meta))
        meta.num_splits = decode_num_splits(b, cfg.num_key_value_heads, 64)
        torch.testing.assert_close(step(ids, pos, meta), ref, atol=1e-3, rtol=1e-3)


def test_fused_decoder_logits_close():
    _check_fused_decoder_logits(*_tiny_runner(torch.float32, tie=False))


@pytest.mark.parametrize("family", list(_TINY_FAMILIES))
def test_layernorm_family_steps_logits_close(family):
    """GPT-2's and Falcon's fused steps (LayerNorm prologues, GELU epilogues, Falcon's parallel
    sum) against their module forward, on the GPU as well as in the interpreter."""
    from tianxia.models.falcon_gpu_step import FalconGpuStep
    from tianxia.models.gpt2_gpu_step import GPT2GpuStep

    runner, cfg = _tiny_runner(torch.float32, tie=family != "falcon", family=family)
    _check_fused_decoder_logits(runner, cfg, GPT2GpuStep if family == "gpt2" else FalconGpuStep)


# --- int8 / fp8 weights with per-channel scales ------------------------------------------------------


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("mode", ["bias", "add_norm", "silu"])
def test_gemv_quantized_weight(method, mode):
    """The GEMV on a narrow weight equals a float GEMV on the same weight, dequantized."""
    from tianxia.quant.channelwise import quantize_rows

    K, N = 96, 40
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, K, generator=g).to(DEV)
    wf = torch.randn(2 * N if mode == "silu" else N, K, generator=g) / K**0.5
    q, s = quantize_rows(wf, method)
    q, s = q.to(DEV), s.to(DEV)
    deq = q.float() * s[:, None]
    kw = dict(block_n=8, block_k=32, w_scale=s)
    if mode == "bias":
        b = torch.randn(N, generator=g).to(DEV)
        ref, out = torch.nn.functional.linear(x, deq, b), tlin.gemv(x, q, b, **kw)
    elif mode == "silu":
        from tianxia.layers.activation import SiluAndMul

        ref, out = SiluAndMul()(torch.nn.functional.linear(x, deq)), tlin.gemv(x, q, act="silu", **kw)
    else:
        from tianxia.layers.norm import RMSNorm

        norm = RMSNorm(K, 1e-6).to(DEV)
        res = torch.randn(1, K, generator=g).to(DEV)
        h, _ = norm(x, res)
        ref = torch.nn.functional.linear(h, deq)
        out, _ = tlin.gemv(x, q, residual=res, norm_weight=norm.weight, eps=1e-6, **kw)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("bias", [False, True])
def test_wq_matmul(method, bias):
    from tianxia.quant.channelwise import quantize_rows

    g = torch.Generator().manual_seed(6)
    M, K, N = 21, 80, 50  # none a multiple of the blocks: every mask is exercised
    x = torch.randn(M, K, generator=g).to(DEV)
    q, s = quantize_rows(torch.randn(N, K, generator=g), method)
    b = torch.randn(N, generator=g).to(DEV) if bias else None
    out = tlin.wq_matmul(x, q.to(DEV), s.to(DEV), b)
    ref = torch.nn.functional.linear(x, (q.float() * s[:, None]).to(DEV), b)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("method,bound", [("int8", 0.01), ("fp8", 0.04)])
def test_channelwise_quantization_error(method, bound):
    """Relative RMS error of a row-scaled weight: about 1/(sqrt(3)*2*127) for int8 rounding, a few
    percent for e4m3's 3 mantissa bits; an outlier row does not spoil the others."""
    from tianxia.quant.channelwise import quantize_rows

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    w[3] *= 100.0
    q, s = quantize_rows(w, method)
    deq = q.float() * s[:, None]
    rel = ((deq - w).pow(2).mean(1).sqrt() / w.pow(2).mean(1).sqrt())
    assert rel.max() < bound, rel.max()
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_rows(w, "int3")


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_fused_decoder_quantized_weights(method):
    """A model with quantized projections: the fused decode forward (GEMV at batch 1, the module's
    own kernel path at batch 3) gives the eager model's logits."""
    from tianxia.quant.channelwise import ChannelwiseLinear, quantize_model

    runner, cfg = _tiny_runner(torch.float32, tie=False)
    sizes = quantize_model(runner.model, method)
    assert sizes["bytes_after"] < sizes["bytes_before"] / 3.5
    assert isinstance(runner.model.model.layers[0].mlp.down_proj, ChannelwiseLinear)
    _check_fused_decoder_logits(runner, cfg)


@pytest.mark.parametrize("K", [80, 2500])  # one block with a masked tail; several blocks
def test_quantize_rows_fp8_matches_eager(K):
    """The one-launch activation quantizer of the FP8 products equals the eager formula (the
    CPU branch of ``channelwise._quantize_tokens_fp8``)."""
    from tianxia.quant.channelwise import _quantize_tokens_fp8

    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, K, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[:, None]
    q, s = tlin.quantize_rows_fp8(x.to(DEV))
    ref_q, ref_s = _quantize_tokens_fp8(x)
    torch.testing.assert_close(s.cpu(), ref_s, rtol=0, atol=0)
    got, want = q.float().cpu(), ref_q.float()
    if not CUDA:
        # the interpreter's float8 conversion drops the carry of a round-up into the next binade
        # (127.9 -> 64 where it should be 128); the GPU's conversion rounds correctly
        y = (x / ref_s).clamp(-448.0, 448.0)
        carry = (want.abs() > y.abs()) & (torch.frexp(want)[0].abs() == 0.5)
        got, want = got[~carry], want[~carry]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- every family through the CUDA-graph runner's decode functions ----------------------------------

LLAMA_STYLE = ("llama", "qwen2", "qwen3", "phi3", "glm4", "gemma2", "gemma3", "mistral-swa")


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from test_model_families import make_model, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("route-families")
    make_tiny_tokenizer(root / "tok")
    return lambda arch: make_model(arch, root / arch, root / "tok")


def _routes_agree(llm, prompts, params, installs) -> None:
    """Greedy tokens and logprobs of the eager module forward, then with each of ``installs``
    having set up a decode route on the runner: the same tokens, logprobs within float32
    rounding."""
    runner = llm.engine.runner
    runner.decode_step = runner.graph_runner = None
    eager = llm.generate(prompts, params, use_tqdm=False)
    for install in installs:
        install(runner)
        before = runner.route_counts["graph"]
        routed = llm.generate(prompts, params, use_tqdm=False)
        assert runner.route_counts["graph"] - before >= params.max_tokens - 1
        _same_tokens_and_logprobs(eager, routed)


def _same_tokens_and_logprobs(eager, routed) -> None:
    """The same greedy tokens, and logprobs within float32 rounding, output by output."""
    for a, b in zip(eager, routed, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in step_a:
                assert abs(step_a[t].logprob - step_b[t].logprob) < 1e-4


@pytest.mark.skipif(CUDA, reason="the GPU captures these for real in the GPU benchmarks")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "glm4", "gemma2", "gemma3",
                                  "mistral-swa", "gpt2", "falcon", "falcon-mq", "falcon-seq"])
def test_every_family_decodes_through_the_graph_runner(arch, family_models, monkeypatch):
    """The decode functions a GPU captures, run here uncaptured with the Triton backend: the
    family's fused GPU step (Llama-style families: q/k norms, Gemma norms and soft-capping,
    partial and interleaved RoPE, sliding windows; GPT-2; Falcon's two-LayerNorm, one-LayerNorm
    parallel and sequential blocks) and the module forward over the runner's static, padded
    buffers (every family), each giving the eager path's tokens. Three prompts (padded to a batch
    of 4) take the GEMM form of the fused step; one prompt its GEMV form, with the Llama, Gemma
    and LayerNorm prologues and the SiLU, GeGLU and GELU epilogues."""
    from tianxia import LLM, SamplingParams
    from tianxia.engine.cuda_graph import CudaGraphRunner, module_decode_fn
    from tianxia.models.falcon_gpu_step import FalconGpuStep
    from tianxia.models.gpt2_gpu_step import GPT2GpuStep
    from tianxia.models.llama_gpu_step import LlamaGpuStep

    monkeypatch.setenv("TIANXIA_ATTENTION_BACKEND", "triton")
    llm = LLM(str(family_models(arch)), num_kv_blocks=48, block_size=4, enable_prefix_caching=False,
              max_num_seqs=4, max_model_len=64)
    cfg = llm.engine.model_config
    ids = llm.get_tokenizer().encode("the quick brown fox jumps over the lazy dog and the river")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)

    def graph_runner(runner, decode, step=None):
        gr = CudaGraphRunner(
            decode, vocab_size=cfg.vocab_size, num_kv_heads=cfg.num_key_value_heads, block_size=4,
            max_num_seqs=4, max_model_len=64, device=DEV, variants=step.variants if step else (),
            set_variant=step.set_variant if step else None, use_graphs=False,
        )
        gr.capture()
        runner.graph_runner = gr

    def module_route(runner):
        graph_runner(runner, module_decode_fn(runner.model, runner.kv_caches))

    step_cls = LlamaGpuStep if arch in LLAMA_STYLE else GPT2GpuStep if arch == "gpt2" else FalconGpuStep

    def fused_route(runner):
        step = step_cls(runner.model, runner.kv_caches, 64)
        graph_runner(runner, step, step)

    batch = [{"prompt_token_ids": p} for p in (ids[:5], ids[:11], ids[:7])]
    _routes_agree(llm, batch, params, [module_route, fused_route])
    if arch in ("qwen2", "gemma2", "gpt2", "falcon", "falcon-mq", "falcon-seq"):
        _routes_agree(llm, batch[1:2], params, [fused_route])


def _staggered(llm, prompts, params, tag: str) -> list:
    """Each prompt added one step after the one before, while the earlier ones decode: steps of a
    prompt chunk beside decodes. The outputs in the prompts' order."""
    engine, done = llm.engine, {}
    pending = [(f"{tag}-{i}", {"prompt_token_ids": p}) for i, p in enumerate(prompts)]
    order = [rid for rid, _ in pending]
    while pending or engine.has_unfinished_requests():
        if pending:
            engine.add_request(*pending.pop(0), params)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[rid] for rid in order]


def _staggered_eager(family_models, arch: str, max_num_seqs: int):
    """An engine on the Triton backend (no fused step, no graphs), the staggered prompts and
    parameters the route tests use, and their outputs through the module forward."""
    from tianxia import LLM, SamplingParams

    llm = LLM(str(family_models(arch)), num_kv_blocks=64, block_size=4, enable_prefix_caching=False,
              max_num_seqs=max_num_seqs, max_model_len=64)
    ids = llm.get_tokenizer().encode("the quick brown fox jumps over the lazy dog and the river")
    prompts = [ids[:3], ids[2:7], ids[:4], ids[5:11]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    runner = llm.engine.runner
    runner.decode_step = runner.graph_runner = None
    return llm, prompts, params, _staggered(llm, prompts, params, "eager")


@pytest.mark.skipif(CUDA, reason="the GPU captures these for real in the GPU benchmarks")
@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "gpt2"])
def test_prompt_chunks_beside_decodes_ride_the_decode_graphs(arch, family_models, monkeypatch):
    """Where the decode graphs hold a step's rows, a step with a prompt chunk (alone, or beside
    decodes) replays them as one-token rows instead of launching the module forward: requests
    that arrive while others decode give the eager path's tokens and logprobs, and no step runs
    eagerly. Uncaptured here, with the Triton backend, as above."""
    from tianxia.engine.cuda_graph import CudaGraphRunner
    from tianxia.models.gpt2_gpu_step import GPT2GpuStep
    from tianxia.models.llama_gpu_step import LlamaGpuStep

    monkeypatch.setenv("TIANXIA_ATTENTION_BACKEND", "triton")
    llm, prompts, params, eager = _staggered_eager(family_models, arch, 16)
    cfg, runner = llm.engine.model_config, llm.engine.runner
    step = (LlamaGpuStep if arch in LLAMA_STYLE else GPT2GpuStep)(runner.model, runner.kv_caches, 64)
    gr = CudaGraphRunner(step, vocab_size=cfg.vocab_size, num_kv_heads=cfg.num_key_value_heads,
                         block_size=4, max_num_seqs=16, max_model_len=64, device=DEV,
                         variants=step.variants, set_variant=step.set_variant, use_graphs=False)
    gr.capture()
    runner.graph_runner = gr
    runner.route_counts.clear()
    routed = _staggered(llm, prompts, params, "graph")
    assert runner.route_counts["eager"] == 0 and runner.route_counts["graph"] > 0, runner.route_counts
    _same_tokens_and_logprobs(eager, routed)


@pytest.mark.skipif(CUDA, reason="the GPU captures these for real in the GPU benchmarks")
def test_mixed_steps_above_the_decode_batch_ride_the_larger_graphs(family_models, monkeypatch):
    """The decode graphs go past ``max_num_seqs`` rows (``max_rows``): a mixed step with more
    rows than a decode batch replays them where its prompts are short, and takes the fused step
    where its prompt rows would read more context than the bound (here lowered to 8 positions),
    giving the module forward's tokens and logprobs either way. Uncaptured here, with the Triton
    backend."""
    from tianxia.engine import model_runner
    from tianxia.engine.cuda_graph import CudaGraphRunner
    from tianxia.models.llama_gpu_step import LlamaGpuStep

    monkeypatch.setenv("TIANXIA_ATTENTION_BACKEND", "triton")
    llm, prompts, params, eager = _staggered_eager(family_models, "qwen2", 4)
    cfg, runner = llm.engine.model_config, llm.engine.runner
    step = LlamaGpuStep(runner.model, runner.kv_caches, 64)
    runner.decode_step = step
    gr = CudaGraphRunner(step, vocab_size=cfg.vocab_size, num_kv_heads=cfg.num_key_value_heads,
                         block_size=4, max_num_seqs=4, max_model_len=64, device=DEV,
                         variants=step.variants, set_variant=step.set_variant, use_graphs=False, max_rows=16)
    gr.capture()
    assert gr.ladder == [1, 2, 4, 16]
    runner.graph_runner = gr
    rows = []
    as_decodes = runner._as_decodes

    def watch(s, verification):
        flat = as_decodes(s, verification)
        if flat is not None and not verification:
            rows.append(len(flat.input_ids))
        return flat

    monkeypatch.setattr(runner, "_as_decodes", watch)
    runner.route_counts.clear()
    _same_tokens_and_logprobs(eager, _staggered(llm, prompts, params, "graph"))
    assert max(rows) > 4 and runner.route_counts["eager"] == runner.route_counts["fused"] == 0, (rows, runner.route_counts)
    monkeypatch.setattr(model_runner, "_MIXED_ROWS_CONTEXT", 8)
    runner.route_counts.clear()
    _same_tokens_and_logprobs(eager, _staggered(llm, prompts, params, "bounded"))
    assert runner.route_counts["fused"] > 0 and runner.route_counts["eager"] == 0, runner.route_counts


@pytest.mark.skipif(CUDA, reason="the GPU benchmarks serve these steps for real")
@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "gpt2", "falcon"])
def test_prompt_chunks_beyond_the_graphs_take_the_fused_step(arch, family_models, monkeypatch):
    """A step with prompt chunks that no decode graph holds (here: no graphs at all, as with more
    rows than the largest graph) runs through the family's fused step, its chunks' attention in
    the paged prefill kernel and logits for the sampled rows only, instead of the module forward:
    staggered requests give the module forward's tokens and logprobs, and no step runs eagerly."""
    from tianxia.models.falcon_gpu_step import FalconGpuStep
    from tianxia.models.gpt2_gpu_step import GPT2GpuStep
    from tianxia.models.llama_gpu_step import LlamaGpuStep

    monkeypatch.setenv("TIANXIA_ATTENTION_BACKEND", "triton")
    llm, prompts, params, eager = _staggered_eager(family_models, arch, 16)
    runner = llm.engine.runner
    step_cls = LlamaGpuStep if arch in LLAMA_STYLE else GPT2GpuStep if arch == "gpt2" else FalconGpuStep
    runner.decode_step = step_cls(runner.model, runner.kv_caches, 64)
    runner.route_counts.clear()
    fused = _staggered(llm, prompts, params, "fused")
    assert runner.route_counts["eager"] == 0 and runner.route_counts["fused"] > 0, runner.route_counts
    _same_tokens_and_logprobs(eager, fused)


@pytest.mark.skipif(CUDA, reason="test_async_scheduling runs it on the GPU, captured")
def test_steps_launched_ahead_through_the_gpu_route(family_models, monkeypatch):
    """Async scheduling over the GPU's route (uncaptured decode graphs, the Triton backend and
    the sampler's Triton draw, as above): ids stay on the device (DeviceTokens), each step is
    launched before the previous one's are read, its decode rows reading them where they are
    beside the prompt rows of requests that arrive meanwhile, and every request gets the seeded
    tokens it gets without async scheduling."""
    from tianxia import LLM, SamplingParams
    from tianxia.engine.cuda_graph import CudaGraphRunner
    from tianxia.models.llama_gpu_step import LlamaGpuStep

    monkeypatch.setenv("TIANXIA_ATTENTION_BACKEND", "triton")
    llm = LLM(str(family_models("qwen2")), num_kv_blocks=64, block_size=4, enable_prefix_caching=False,
              max_num_seqs=16, max_model_len=64, async_scheduling=True)
    cfg, engine, runner = llm.engine.model_config, llm.engine, llm.engine.runner
    step = LlamaGpuStep(runner.model, runner.kv_caches, 64)
    runner.graph_runner = CudaGraphRunner(step, vocab_size=cfg.vocab_size, num_kv_heads=cfg.num_key_value_heads,
                                          block_size=4, max_num_seqs=16, max_model_len=64, device=DEV,
                                          variants=step.variants, set_variant=step.set_variant, use_graphs=False)
    runner.graph_runner.capture()
    runner.sampler.device_kernels = True
    ids = llm.get_tokenizer().encode("the quick brown fox jumps over the lazy dog and the river")
    prompts = [ids[:3], ids[2:7], ids[:4], ids[5:11]]
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=6, ignore_eos=True)
    engine.async_scheduling = False
    plain = _staggered(llm, prompts, params, "plain")
    engine.async_scheduling = True
    seen = []
    execute = runner.execute

    def watch(s):
        result = execute(s)
        seen.append((s.prev_rows is not None, result.pending is not None))
        return result

    runner.execute = watch
    try:
        ahead = _staggered(llm, prompts, params, "ahead")
    finally:
        del runner.execute
    assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in plain]
    assert all(pending for _, pending in seen) and sum(prev for prev, _ in seen) >= 5, seen
    assert runner.route_counts["eager"] == 0


# --- the batch-invariant mode (--batch-invariant) ---------------------------------------------------


@pytest.fixture
def row_wise_dot(monkeypatch):
    """The interpreter's ``tl.dot`` is NumPy's matmul, whose result for a row depends on the row's
    place in the tile (OpenBLAS's register blocking); a GPU's matrix instructions compute every
    row of a tile alike. On CPU, model that: each row of the tile multiplied on its own."""
    if CUDA:
        return
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = [np.matmul(a.data[i:i + 1], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_batch_invariant_matmul_rows_do_not_depend_on_the_batch(dtype, bias, row_wise_dot):
    from tianxia.layers import batch_invariant as bi

    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 72, generator=g).to(dtype).to(DEV)  # an nn.Linear weight [N, K]
    b = torch.randn(40, generator=g).to(dtype).to(DEV) if bias else None
    x = torch.randn(37, 72, generator=g).to(dtype).to(DEV)
    full = bi.matmul(x, w.t(), b)  # F.linear's addmm(bias, x, w.t())
    for rows in (1, 2, 5, 17):  # every row count gives each row the same bits
        for start in (0, 3):
            assert torch.equal(bi.matmul(x[start:start + rows], w.t(), b), full[start:start + rows])
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(full.float(), ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant_rmsnorm_rows_do_not_depend_on_the_batch(dtype):
    from tianxia.layers import batch_invariant as bi
    from tianxia.layers.norm import GemmaRMSNorm, RMSNorm

    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 48, generator=g).to(dtype).to(DEV)
    res = torch.randn(9, 48, generator=g).to(dtype).to(DEV)
    for cls in (RMSNorm, GemmaRMSNorm):
        ref = cls(48, 1e-6)
        with torch.no_grad():
            ref.weight.copy_(torch.randn(48, generator=g) * 0.1 + (cls is RMSNorm))
        ref = ref.to(dtype).to(DEV)
        norm = cls(48, 1e-6).to(dtype).to(DEV)
        norm.load_state_dict(ref.state_dict())
        bi.make_batch_invariant(norm)
        assert isinstance(norm, bi.BatchInvariantRMSNorm)
        out, total = norm(x, res)
        for rows in (1, 4):
            o, t = norm(x[2:2 + rows], res[2:2 + rows])
            assert torch.equal(o, out[2:2 + rows]) and torch.equal(t, total[2:2 + rows])
        want, want_total = ref(x, res)
        torch.testing.assert_close(total, want_total, **_exact(dtype))
        torch.testing.assert_close(out.float(), want.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant_attention_is_the_same_for_any_batch_or_chunking(dtype, row_wise_dot):
    """One sequence of 13 tokens: its prompt in one chunk, in two chunks (the second after a cached
    prefix), and its last token as a decode step, alone and beside other sequences; a token's
    attention output is bit for bit the same in all of them, and close to the torch backend's."""
    from tianxia.layers import batch_invariant as bi

    hq, hk, d, bs, num_blocks, n = 4, 2, 16, 4, 64, 13
    g = torch.Generator().manual_seed(5)
    q = torch.randn(n, hq, d, generator=g).to(dtype).to(DEV)
    k = torch.randn(n, hk, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(n, hk, d, generator=g).to(dtype).to(DEV)
    backend = bi.TritonInvariantAttention()
    table = [7, 3, 20, 11]  # the sequence's blocks

    def step(cache, first, count, others=()):
        """Tokens first..first+count of the sequence (after ``first`` cached ones), then the
        ``others`` (query, context) pairs of other sequences, in one step."""
        seqs = [(first, count, table)] + [(c, 1, [30 + 4 * i + j for j in range(4)]) for i, (_, c) in enumerate(others)]
        decodes = [s for s in seqs if s[1] == 1]
        order = decodes + [s for s in seqs if s[1] != 1]
        slots, lens, starts, width = [], [], [0], max(len(s[2]) for s in seqs)
        qs, ks, vs = [], [], []
        for ctx, cnt, tab in order:
            slots += [tab[p // bs] * bs + p % bs for p in range(ctx, ctx + cnt)]
            lens.append(ctx + cnt)
            starts.append(starts[-1] + cnt)
            if tab is table:
                qs.append(q[ctx:ctx + cnt]), ks.append(k[ctx:ctx + cnt]), vs.append(v[ctx:ctx + cnt])
            else:
                oq = next(o for o, c in others if c == ctx)
                qs.append(oq[None]), ks.append(oq[None, :hk]), vs.append(oq[None, :hk])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=DEV), block_tables=torch.tensor(
                [s[2] + [0] * (width - len(s[2])) for s in order], device=DEV),
            seq_lens=lens, query_lens=[s[1] for s in order], query_start_loc=starts,
            num_decodes=len(decodes), seq_lens_tensor=torch.tensor(lens, device=DEV), block_size=bs)
        out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, d**-0.5)
        at = next(i for i, s in enumerate(order) if s[2] is table)
        return out[starts[at]:starts[at + 1]]

    def fresh():
        return torch.zeros(2, num_blocks, bs, hk, d, dtype=dtype, device=DEV)

    cache = fresh()
    whole = step(cache, 0, n)
    cache2 = fresh()
    first = step(cache2, 0, 8)
    second = step(cache2, 8, n - 8)
    assert torch.equal(torch.cat([first, second]), whole)
    cache3 = fresh()
    step(cache3, 0, n - 1)
    alone = step(cache3.clone(), n - 1, 1)
    others = [(torch.randn(hq, d, generator=g).to(dtype).to(DEV), c) for c in (3, 9)]
    beside = step(cache3, n - 1, 1, others)
    assert torch.equal(alone, whole[-1:]) and torch.equal(beside, whole[-1:])
    ref = get_backend(DEV, "torch").forward(q, k, v, fresh(), _batch([n], [0], num_blocks, bs), d**-0.5)
    torch.testing.assert_close(whole.float(), ref.float(), **_tol(dtype))


# --- sampling on the device: truncation thresholds and the Gumbel-max draw ---------------------------


@pytest.mark.parametrize("direct_top_k,slots", [(False, None), (True, None), (False, 2)],
                         ids=["searched", "topk", "overflow"])
def test_truncation_thresholds_keep_what_a_full_sort_keeps(monkeypatch, direct_top_k, slots):
    # rows with top-k, top-p, both and neither; one with min-p's -inf holes; nuclei of 1 to ~all;
    # smaller chunks than the kernels' own, so that a row spans several (the last one partly);
    # top-k found by the search, or read off torch's topk where the largest k is known; with 2
    # slots a chunk, rows whose interval still holds more logits after the full passes finish the
    # search over the whole row
    monkeypatch.setattr(triton_sampling, "_CHUNK", 1024)
    if slots is not None:
        monkeypatch.setattr(triton_sampling, "_SLOTS", slots)
    g = torch.Generator().manual_seed(0)
    vocab = 3000
    logits = torch.randn(8, vocab, generator=g) * 3
    logits[6, ::3] = float("-inf")
    logits[7] = torch.randn(vocab, generator=g) * 0.01  # nearly flat: the nucleus is most of it
    top_k = torch.tensor([0, 50, 5, 1, 0, vocab + 5, 40, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 1.0, 0.3, 0.95, 0.95])
    k_max = None
    if direct_top_k:
        top_k[5] = 0
        k_max = int(top_k.max())

    def thresholds(rows):
        return triton_sampling.truncation_thresholds(logits[rows].to(DEV), top_k[rows].to(DEV),
                                                     top_p[rows].to(DEV), k_max=k_max).cpu()

    thr = thresholds(torch.arange(len(logits)))
    for i in range(len(logits)):  # the reference: sort everything, then vLLM's rule in float64
        finite = logits[i] > float("-inf")
        values, order = logits[i][finite].double().sort(descending=True)
        order = finite.nonzero().flatten()[order]
        k = min(int(top_k[i]) or vocab, len(values))
        probs = values[:k].softmax(-1)
        kept = order[:k][(probs.cumsum(0) - probs) < top_p[i]]
        got = ((logits[i] >= thr[i]) & finite).nonzero().flatten()
        assert torch.equal(got, kept.sort().values), i
    # a row's threshold is the same bits in any batch
    rows = torch.tensor([7, 2, 0])
    assert torch.equal(thresholds(rows), thr[rows])


def test_gumbel_argmax_draws_from_the_truncated_softmax():
    vocab, draws = 12, 3000
    g = torch.Generator().manual_seed(1)
    row = torch.randn(vocab, generator=g) * 1.5
    logits = row.expand(draws, vocab).contiguous()
    thr = triton_sampling.truncation_thresholds(row[None].to(DEV), torch.tensor([8], device=DEV),
                                                torch.tensor([0.9], device=DEV)).expand(draws).contiguous()
    keys = torch.randint(0, 2**32, (draws, 2), generator=g)
    tokens = triton_sampling.gumbel_argmax(logits.to(DEV), keys.to(DEV), thr).cpu()

    values, order = row.double().sort(descending=True)
    probs = values[:8].softmax(-1)
    keep = order[:8][(probs.cumsum(0) - probs) < 0.9]
    expected = row.double()[keep].softmax(-1) * draws
    assert set(tokens.tolist()) <= set(keep.tolist()), "drew a token outside the truncated set"
    observed = torch.tensor([(tokens == t).sum().item() for t in keep.tolist()], dtype=torch.float64)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((len(keep) - 1) / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, f"chi2={chi2:.1f} p={p_value:.2e}"

    # a row's draw depends on its key and logits only: the same in any batch, in any place
    again = triton_sampling.gumbel_argmax(logits[:7].flip(0).to(DEV), keys[:7].flip(0).to(DEV), thr[:7].flip(0))
    assert torch.equal(again.cpu().flip(0), tokens[:7])


def test_device_sampler_is_seeded_per_row_and_keeps_greedy_rows():
    from tianxia.engine.sequence import Sequence
    from tianxia.layers.sampler import Sampler, SamplingBatch
    from tianxia.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(2)
    vocab = 500
    seeded = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, min_p=0.01, seed=5)

    def sample(params: list[SamplingParams], logits: torch.Tensor) -> list[int]:
        seqs = [Sequence(f"r{i}", None, [1, 2, 3], p) for i, p in enumerate(params)]
        batch = SamplingBatch.from_sequences(seqs, eos_ids=(0,))
        return Sampler(seed=len(params), device_kernels=True)(logits.clone().to(DEV), batch).tokens

    target = torch.randn(1, vocab, generator=g) * 2
    alone = sample([seeded], target)
    others = torch.randn(5, vocab, generator=g) * 2
    mixed = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), seeded,
             SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(temperature=0.0), SamplingParams(top_k=3)]
    logits = torch.cat([others[:2], target, others[2:]])
    tokens = sample(mixed, logits)
    assert tokens[2] == alone[0]
    assert tokens[1] == int(logits[1].argmax()) and tokens[4] == int(logits[4].argmax())
    assert tokens[5] in logits[5].topk(3).indices.tolist()
    # the same seed and position draw the same token in every row; unseeded rows draw apart
    assert len(set(sample([seeded] * 8, target.expand(8, vocab)))) == 1
    assert len(set(sample([SamplingParams(temperature=1.0)] * 8, torch.zeros(8, vocab)))) > 1


@pytest.mark.parametrize("extra", [{}, {"top_k": 40, "top_p": 0.9}, {"top_k": 900, "min_p": 0.05}])
def test_graphed_sampler_draws_what_the_eager_device_path_draws(extra):
    """The sampler's graphs (run here without capture, over their static buffers and padded to a
    ladder size) give the eager device path's tokens for the same noise keys, greedy rows too."""
    from tianxia.engine.sequence import Sequence
    from tianxia.layers.sampler import Sampler, SamplingBatch
    from tianxia.layers.sampler_graphs import SamplerGraphs
    from tianxia.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    vocab = 1000
    params = [SamplingParams(**{"temperature": 0.8, "top_p": 0.95, **extra}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=7, **extra), SamplingParams(temperature=0.6, **extra),
              SamplingParams(temperature=0.9, top_p=0.5, seed=1)]
    seqs = [Sequence(f"r{i}", None, [1, 2, 3], p) for i, p in enumerate(params)]
    logits = torch.randn(len(params), vocab, generator=g) * 3
    batch = SamplingBatch.from_sequences(seqs, eos_ids=(0,))
    eager = Sampler(seed=4, device_kernels=True)(logits.clone().to(DEV), batch).tokens
    graphed = Sampler(seed=4, device_kernels=True)
    graphed.graphs = SamplerGraphs([8], vocab, torch.device(DEV), use_graphs=False)
    assert graphed(logits.clone().to(DEV), batch).tokens == eager
    assert eager[1] == int(logits[1].argmax())
    # a second step of the same kind reuses what the first compiled; the keys move on
    assert graphed(logits.clone().to(DEV), batch).tokens[1] == eager[1]


def _lora_positions(rows: int) -> list[int]:
    """Rows' positions: from 17 rows, blocks of 16 rows (the grouped kernels' least block) that
    are a run of one position with a stray other position and a base row inside it, all base
    rows, a base row then runs of two positions (a segment boundary), and every position and the
    base mixed; below, the mixed ones."""
    mixed = [(3 * i + 1) % 5 - 1 for i in range(rows)]  # every position of 4 and the base
    if rows == 1:
        return [2]
    if rows < 17:
        return mixed
    run = [2] * 16
    run[5], run[9] = 3, -1
    pattern = run + [-1] * 16 + [-1] + [0] * 7 + [1] * 8 + mixed[:16]
    return (pattern * triton_lora.triton.cdiv(rows, 64))[:rows]


def _lora_case(rows: int, dtype, seed: int = 0):
    """Stacked LoRA matrices of 4 positions of width 48 (three parts of rank 16), in 300 and out
    200 (neither a multiple of the blocks), and ``rows`` rows as :func:`_lora_positions`."""
    g = torch.Generator().manual_seed(seed)
    S, W, K, N = 4, 48, 300, 200
    x = torch.randn(rows, K, generator=g)
    a = torch.randn(S * W, K, generator=g) * 0.1
    b = torch.randn(N, S * W, generator=g) * 0.1
    out = torch.randn(rows, N, generator=g)
    pos = torch.tensor(_lora_positions(rows))
    return [t.to(dtype).to(DEV) for t in (x, a, b, out)] + [pos.to(DEV), W]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("programs", [512, 1])  # 1: no slices, the kernels' loops run over blocks
@pytest.mark.parametrize("kernels", ["rows", "grouped", "grouped16", "default"])
def test_lora_shrink_expand_match_the_masked_product(dtype, rows, programs, kernels, monkeypatch):
    monkeypatch.setattr(triton_lora, "_TARGET_PROGRAMS", programs)
    monkeypatch.setattr(triton_lora, "_GROUP_K_SLICE", 128)  # the grouped shrink slices in 300 too
    if kernels != "default":  # row-wise or grouped whatever the rows; grouped in blocks of 16 or 32
        monkeypatch.setattr(triton_lora, "_GROUP_ROWS", 10**9 if kernels == "rows" else 1)
        monkeypatch.setattr(triton_lora, "_GROUP_M", 16 if kernels == "grouped16" else 32)
    elif rows < triton_lora._GROUP_ROWS:
        pytest.skip("the row-wise kernels' case")
    x, a, b, out, pos, W = _lora_case(rows, dtype)
    mask = pos[:, None] == torch.arange(a.shape[0], device=DEV)[None, :] // W
    shrunk = (x.float() @ a.float().T) * mask
    want = out.float() + shrunk @ b.float().T
    s = triton_lora.lora_shrink(x, a, pos, W)
    assert s.dtype == torch.float32 and s.shape[1:] == (rows, W) and (programs > 1) == (s.shape[0] > 1)
    adapted = pos >= 0
    got_shrunk = s.sum(0)[adapted]
    want_shrunk = shrunk.view(rows, -1, W).sum(1)[adapted]  # each row's own position's columns
    torch.testing.assert_close(got_shrunk, want_shrunk, **_tol(dtype))
    got = out.clone()
    triton_lora.lora_expand(got, s, b, pos, W)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **_tol(dtype))
    assert torch.equal(got[~adapted], out[~adapted])  # base rows untouched
    # a step of base rows alone (the kernels return at once) leaves every row as it was
    base = torch.full_like(pos, -1)
    got = out.clone()
    triton_lora.lora_expand(got, triton_lora.lora_shrink(x, a, base, W), b, base, W)
    assert torch.equal(got, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stacked_lora_hook_kernels_match_the_masked_product(dtype):
    """A captured step's hook through the kernels gives the dense masked product's output, over a
    module of three parts with adapters of rank 16 (all the columns) and 8 (half of them)."""
    from torch import nn

    from tianxia.layers.lora import LoRAAdapter, LoRAPart, LoRATarget
    from tianxia.layers.lora_stacked import StackedLoRAState

    g = torch.Generator().manual_seed(4)
    parts = (("q_proj", 40), ("k_proj", 24), ("v_proj", 24))
    target = LoRATarget("proj", parts, 30)

    def adapter(name: str, rank: int) -> LoRAAdapter:
        ps, row = [], 0
        for _, n in parts:
            ps.append(LoRAPart(row, torch.randn(rank, 30, generator=g), torch.randn(n, rank, generator=g) * 0.1))
            row += n
        return LoRAAdapter(name, name, rank, {"proj": ps})

    adapters = [adapter("r16", 16), adapter("r8", 8)]
    x = torch.randn(5, 30, generator=g).to(dtype).to(DEV)
    base = nn.Module()
    base.proj = nn.Linear(30, 88, dtype=dtype, device=DEV)
    outs = []
    for kernels in (False, True):
        model = nn.Module()
        model.proj = nn.Linear(30, 88, dtype=dtype, device=DEV)
        model.proj.load_state_dict(base.proj.state_dict())
        state = StackedLoRAState(model, {"proj": target}, positions=3, max_rank=16, max_rows=8, dtype=dtype,
                                 device=DEV)
        state.kernels = kernels
        for slot, ad in enumerate(adapters):
            state.put(slot, ad)
        state.static_rows[:5] = torch.tensor([state.position_of[s] if s >= 0 else -1 for s in [0, -1, 1, 1, 0]])
        with torch.inference_mode():
            outs.append(model.proj(x))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), **_tol(dtype))
    # the adapters move their rows (else equality would prove nothing), the base row not at all
    plain = base.proj(x).detach()
    assert all((outs[1][i] - plain[i]).abs().max() > 0.1 for i in (0, 2, 3, 4))
    assert torch.equal(outs[1][1], plain[1])
