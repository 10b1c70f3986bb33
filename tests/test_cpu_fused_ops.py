"""The fused float32 CPU ops (``quant/csrc/fused_ops.cpp``) against torch on the same inputs: the
gated activations and the paged attention (one query position at a time, for decodes and prompt
tokens alike) that the fused decode step and the module path are built from."""

from __future__ import annotations

import math

import pytest
import torch

from tianxia.quant import cpu_kernels


@pytest.fixture(scope="module")
def ext():
    ext = cpu_kernels.extension()
    if ext is None:
        pytest.skip("the CPU kernels are not built here")
    return ext


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activation_matches_torch(ext, gelu):
    # the vectorised exp of the fused activation, over the range where it saturates, row ends
    # that do not fill a vector (1539 = 192 * 8 + 3), and (SiLU) infinities; tanh-GELU of an
    # infinite input is NaN here and infinite in torch, a broken row either way
    x = torch.randn(5, 2 * 1539, generator=torch.Generator().manual_seed(1 + gelu)) * 8
    x[0, :12] = torch.tensor([-200.0, -90, -88, -50, -1e-8, 0, 1e-8, 50, 88, 90, 200, 300 if gelu else float("inf")])
    g, u = x.chunk(2, dim=-1)
    act = torch.nn.functional.gelu(g, approximate="tanh") if gelu else torch.nn.functional.silu(g)
    got = ext.gated_act(x, gelu)
    assert torch.allclose(got, act * u, rtol=1e-5, atol=1e-5, equal_nan=True)
    # each row alone: the same bits (the split between threads falls anywhere in a row)
    assert torch.equal(ext.gated_act(x[3:4], gelu), got[3:4])


_NO_SEQ = torch.empty(0, dtype=torch.long)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # register-tiled sizes and the generic one
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (37, 0.0), (0, 30.0)])
def test_paged_decode_matches_attention_over_the_gathered_cache(ext, head_dim, window, softcap, cache_dtype):
    g = torch.Generator().manual_seed(head_dim + window)
    hq, hk, bs, blocks = 6, 2, 16, 40
    lens = [1, 7, 8, 45, 130]  # fewer than, exactly and more than 8 keys per pass, ragged ends
    k_cache = torch.randn(blocks, bs, hk, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(blocks, bs, hk, head_dim, generator=g).to(cache_dtype)
    perm = torch.randperm(blocks, generator=g)  # blocks scattered over the cache
    per_seq = -(-max(lens) // bs)
    tables = torch.stack([perm[(i * 3) % (blocks - per_seq):][:per_seq] for i in range(len(lens))])
    q = torch.randn(len(lens), hq, head_dim, generator=g) * 2
    scale = 1 / math.sqrt(head_dim)
    got = ext.paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens), scale, window, softcap, _NO_SEQ)
    # the same queries as tokens of prompts (several per sequence, by sequence index): the same bits
    seq_of = torch.tensor([4, 0, 4, 2])
    prompt = ext.paged_decode(q[[4, 0, 4, 2]], k_cache, v_cache, tables, torch.tensor([lens[i] for i in seq_of]),
                              scale, window, softcap, seq_of)
    assert torch.equal(prompt, got[[4, 0, 4, 2]])
    for b, n in enumerate(lens):
        slots = [(int(tables[b, t // bs]), t % bs) for t in range(n)]
        keys = torch.stack([k_cache[blk, off] for blk, off in slots]).float()  # [n, hk, D]
        values = torch.stack([v_cache[blk, off] for blk, off in slots]).float()
        start = max(0, n - window) if window else 0
        keys, values = keys[start:], values[start:]
        rep = hq // hk
        s = torch.einsum("hd,nhd->hn", q[b], keys.repeat_interleave(rep, dim=1)) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        want = torch.einsum("hn,nhd->hd", s.softmax(-1), values.repeat_interleave(rep, dim=1))
        assert torch.allclose(got[b], want, rtol=1e-4, atol=1e-5), (b, n)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("window", [0, 50])
def test_rows_of_one_sequence_attend_as_each_row_alone(ext, head_dim, window, cache_dtype):
    # A verification step's rows (consecutive positions of one sequence, each with its own block
    # table row) and a prompt chunk's tokens (seq_of) are attended as groups that read each block
    # of keys and values once for every row: each row must still get the bits it gets alone,
    # across group edges (more than 8 rows), key blocks (lengths around 32 and 8) and, with a
    # window, rows whose window starts past the first key
    g = torch.Generator().manual_seed(head_dim + window)
    hq, hk, bs, blocks = 14, 2, 16, 24
    lens = list(range(27, 27 + 11)) + [3, 3]  # 11 rows of one sequence, then 2 of another
    k_cache = torch.randn(blocks, bs, hk, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(blocks, bs, hk, head_dim, generator=g).to(cache_dtype)
    perm = torch.randperm(blocks, generator=g)
    tables = torch.stack([perm[:4]] * 11 + [perm[4:8]] * 2)
    q = torch.randn(len(lens), hq, head_dim, generator=g)
    scale = 1 / math.sqrt(head_dim)
    together = ext.paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens), scale, window, 0.0, _NO_SEQ)
    by_seq = ext.paged_decode(q, k_cache, v_cache, tables[[0, 11]], torch.tensor(lens), scale, window, 0.0,
                              torch.tensor([0] * 11 + [1] * 2))
    for b, n in enumerate(lens):
        alone = ext.paged_decode(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], torch.tensor([n]), scale, window,
                                 0.0, _NO_SEQ)
        assert torch.equal(together[b], alone[0]), b
        assert torch.equal(by_seq[b], alone[0]), b
