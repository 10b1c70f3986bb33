"""tianxia on one GPU, against transformers on the same random weights, in one run.

Sections (``--sections``, default all):

- ``env``: versions, the GPU, the device-to-device copy bandwidth (bytes read + written).
- ``correct``: Qwen2.5-0.5B shape, 8 prompts, 32 greedy tokens, bf16: tianxia (batched, and one
  prompt at a time, which takes the batch-1 GEMV path) against ``transformers.generate``; a
  divergence is reported with the reference's logit gap between the two tokens there (near-tie
  when under ``--tie-gap``); plus the relative error of the prompt logits.
- ``decode``: Qwen2.5-7B shape, batch 1, bf16: ms/token of the captured decode graph (GPU time),
  of the engine end to end (graphs; eager), and of ``transformers.generate``, against the roofline
  = (weight bytes + KV bytes read per token) / the copy bandwidth measured in this run.
- ``quant``: ``--quant-shapes``, FP8 and INT8 weights (per-channel scales) against bf16: batch-1
  decode graph ms/token against the roofline of each weight size, decode ms/token at batch 64, the
  prompt logits' error against transformers in bf16, and greedy agreement with the bf16 engine.
- ``throughput``: both shapes, ``--num-seqs`` sequences with input and output lengths uniform in
  [100, 1024] (ignore EOS): output tokens/s of tianxia (all requests at once) and of
  ``transformers`` batched ``generate`` (left-padded, every row generating the longest output).

Random weights of the real shapes are built on the GPU with ``transformers``; tianxia takes the
same tensors (its loader is bypassed: no files, no tokenizer). Results: ``--out``/gpu_bench.json
and gpu_bench.md, and the table printed last.

    PYTHONPATH=src python benchmarks/gpu_bench.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

SHAPES = {
    "qwen2.5-0.5b": dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
    ),
    # for a dry run of this script on a CPU
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
}
EOS = 151643

RESULTS: dict = {}
LOG = logging.getLogger("gpu_bench")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- models ---------------------------------------------------------------------------------------


def build_hf(shape: str, device: str, dtype: torch.dtype, **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        **{**SHAPES[shape], **overrides}, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        use_sliding_window=False, bos_token_id=EOS, eos_token_id=EOS, hidden_act="silu",
    )
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.eval()  # parameters already in dtype; the RoPE buffers stay float32, as from_pretrained leaves them
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


class StubTokenizer:
    """Just enough tokenizer for the engine when prompts are token ids and detokenize=False."""

    eos_token_id = EOS
    chat_template = None

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def encode(self, text, add_special_tokens=True):
        return [1 + (ord(c) % (self.vocab - 1)) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return ""

    def convert_ids_to_tokens(self, ids):
        return ["" for _ in ids]

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab)}


def build_engine(hf, device: str, dtype_name: str, *, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, gpu_util: float | None, kv_memory: int | None,
                 enforce_eager: bool = False, release_hf: bool = False,
                 quantization: str | None = None, batch_invariant: bool = False,
                 enable_prefix_caching: bool = True, speculative: dict | None = None,
                 drafts: dict | None = None, kv_cache_dtype: str = "auto", calculate_kv_scales: bool | None = None):
    """An LLMEngine over a copy of ``hf``'s weights (the loader is patched out). With
    ``release_hf`` the transformers model's tensors are freed once copied, before the engine
    plans its GPU memory. ``speculative``: a speculative config, whose draft ``model`` names one
    of ``drafts`` (name -> a transformers model of the target's vocabulary)."""
    import tianxia.engine.llm_engine as le
    import tianxia.loader as loader
    from tianxia.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from tianxia.loader import LoadedModel
    from tianxia.loader.safetensors import hf_model_config
    from tianxia.models.registry import get_model_class

    tmp = Path(tempfile.mkdtemp(prefix="tx-bench-"))
    hf.config.save_pretrained(tmp)
    target = hf

    def fake_load(spec, *, dtype, device, backend, **_options):
        hf = (drafts or {}).get(spec, target)
        where = tmp if hf is target else Path(tempfile.mkdtemp(prefix="tx-draft-"))
        hf.config.save_pretrained(where)
        mcfg = hf_model_config(where)
        with torch.device("meta"):
            model = get_model_class(mcfg)(mcfg, backend)
        model.to_empty(device=device)
        model.to(dtype)
        missing = model.load_weights(hf.state_dict().items())
        assert not missing, missing
        if quantization:
            from tianxia.quant.channelwise import quantize_model

            quantize_model(model, quantization)
        if release_hf and hf is target:
            for t in (*hf.parameters(), *hf.buffers()):
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            free_memory()
        model.init_buffers(device)
        model.eval()
        return LoadedModel(model, mcfg, StubTokenizer(mcfg.vocab_size), where, None)

    orig = le.load_model, loader.load_model
    le.load_model = loader.load_model = fake_load
    try:
        cache = CacheConfig(block_size=16, gpu_memory_utilization=gpu_util,
                            enable_prefix_caching=enable_prefix_caching,
                            **({"kv_cache_memory": kv_memory} if kv_memory else {}))
        cfg = EngineConfig(
            model=str(tmp), dtype=dtype_name, device=device, cache=cache,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                      max_num_batched_tokens=max_num_batched_tokens),
            enforce_eager=enforce_eager, batch_invariant=batch_invariant,
            speculative=SpeculativeConfig.parse(speculative), kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
        )
        t0 = time.perf_counter()
        engine = le.LLMEngine(cfg)
        startup = time.perf_counter() - t0
    finally:
        le.load_model, loader.load_model = orig
    return engine, startup


def engine_generate(engine, prompts: list[list[int]], max_tokens: list[int], step_times=None,
                    sampling: dict | None = None):
    """Greedy (or ``sampling``'s parameters) tokens of each prompt, with each step's wall time
    in ``step_times``."""
    from tianxia.sampling_params import SamplingParams

    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(
            f"r{i}-{time.monotonic_ns()}", {"prompt_token_ids": p},
            SamplingParams(**(sampling or {"temperature": 0.0}), max_tokens=m, ignore_eos=True, detokenize=False),
        )
    outs = {}
    order = list(engine.requests)
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        if step_times is not None:
            step_times.append(time.perf_counter() - t0)
    return [outs[r] for r in order]


# --- sections -------------------------------------------------------------------------------------


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    if device != "cuda":
        return float("nan")
    n = 2 << 30  # 2 GiB each way: far beyond the 60 MB L2
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    free_memory()
    times.sort()
    return 2 * n / times[len(times) // 2]


def section_env(args):
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    for mod in ("gguf", "tokenizers", "fastapi", "uvicorn", "xgrammar"):
        try:
            __import__(mod)
            env[mod] = True
        except Exception:
            env[mod] = False
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = p.name
        env["sms"] = p.multi_processor_count
        env["gpu_mem_gib"] = round(p.total_memory / 2**30, 1)
    env["copy_bw_tbs"] = copy_bandwidth(args.device) / 1e12
    RESULTS["env"] = env
    log(f"env: {env}")


def _prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(hf, prompt: list[int], n: int, device: str):
    ids = torch.tensor([prompt], device=device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False)
    tokens = out[0, len(prompt):].tolist()
    # teacher-forced logits at every generated position (what each greedy choice looked at)
    with torch.no_grad():
        logits = hf(out[:, :-1]).logits[0, len(prompt) - 1:].float().cpu()
    return tokens, logits


def compare(name: str, ref_tokens, ref_logits, got_tokens, tie_gap: float) -> dict:
    rows = []
    for i, (ref, got) in enumerate(zip(ref_tokens, got_tokens)):
        div = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        row = {"prompt": i, "equal": div is None, "diverged_at": div}
        if div is not None:
            lg = ref_logits[i][div]
            gap = float(lg[ref[div]] - lg[got[div]])
            top2 = lg.topk(2).values
            row.update(gap=gap, top2_gap=float(top2[0] - top2[1]), near_tie=gap < tie_gap)
        rows.append(row)
    ok = all(r["equal"] or r["near_tie"] for r in rows)
    summary = {
        "ok": ok,
        "equal": sum(r["equal"] for r in rows),
        "near_tie_divergences": [(r["prompt"], r["diverged_at"], round(r["gap"], 4)) for r in rows if not r["equal"] and r["near_tie"]],
        "bad_divergences": [(r["prompt"], r["diverged_at"], round(r["gap"], 4)) for r in rows if not r["equal"] and not r["near_tie"]],
        "rows": rows,
    }
    log(f"{name}: {summary['equal']}/{len(rows)} identical; near-tie divergences "
        f"{summary['near_tie_divergences']}; other divergences {summary['bad_divergences']}")
    return summary


def weight_bytes_per_token(model_params: dict, cfg: dict) -> int:
    """Bytes of weights a decode step reads: all of them, except that an untied embedding table
    is read one row at a time."""
    total = sum(t.numel() * t.element_size() for t in model_params.values())
    if not cfg["tie_word_embeddings"]:
        emb = model_params["model.embed_tokens.weight"]
        total -= emb.numel() * emb.element_size()
    return total


def _time_graph(g, iters: int = 100) -> float:
    """Seconds per replay of a captured decode graph (over the inputs of the last step)."""
    for _ in range(5):
        g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters / 1e3


def section_kernels(args):
    """The kernel tests, compiled on this GPU (bf16 cases)."""
    import subprocess

    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "--noconftest", "-p", "no:cacheprovider",
         "tests/test_triton_kernels.py", "-k", args.kernel_tests],
        capture_output=True, text=True, timeout=300,
    )
    tail = (r.stdout + r.stderr).strip().splitlines()
    RESULTS["kernels"] = {"rc": r.returncode, "summary": tail[-1] if tail else "", "seconds": time.perf_counter() - t0}
    log(f"kernel tests: rc={r.returncode} {tail[-1] if tail else ''}")
    if r.returncode != 0:
        print("\n".join(tail[-60:]))


def _op_pair(kind, ws, b, x, r, nw, xin):
    """(Triton, cuBLAS) callables of one projection, cycling through the weight copies."""
    import itertools

    from tianxia.layers import triton_linear as tlin
    from tianxia.layers import triton_pointwise as tpw

    cycle = itertools.cycle(ws)
    linear = torch.nn.functional.linear

    def normed():
        return tpw.add_rmsnorm(x, r, nw, 1e-6)[0]

    if kind == "qkv":
        return (lambda: tlin.gemv(x, next(cycle), b, residual=r, norm_weight=nw),
                lambda: linear(normed(), next(cycle), b))
    if kind == "gu":
        return (lambda: tlin.gemv(x, next(cycle), residual=r, norm_weight=nw, act="silu"),
                lambda: tpw.silu_mul(linear(normed(), next(cycle))))
    if kind == "lm":
        return (lambda: tlin.gemv(x, next(cycle), residual=r, norm_weight=nw),
                lambda: linear(normed(), next(cycle)))
    return lambda: tlin.gemv(xin, next(cycle)), lambda: linear(xin, next(cycle))


def section_ops(args):
    """Per-op GPU times at the 7B shape, batch 1: Triton GEMV vs cuBLAS (weights rotated over
    several copies so that no run is served from the L2), decode attention, RoPE + KV write."""
    import triton.testing

    from tianxia.layers.attention import triton_attention as ta
    from tianxia.layers import triton_pointwise as tpw
    from tianxia.layers.attention import triton_rope

    dt = torch.bfloat16
    dev = "cuda"
    H, INTER, V = 3584, 18944, 152064
    res = {}

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3

    x = torch.randn(1, H, device=dev, dtype=dt)
    r = torch.randn(1, H, device=dev, dtype=dt)
    nw = torch.rand(H, device=dev, dtype=dt) + 0.5
    cases = [("qkv (norm+bias)", 4608, H, "qkv"), ("o_proj", H, H, "plain"),
             ("gate_up (norm+silu)", 2 * INTER, H, "gu"), ("down", H, INTER, "plain"), ("lm_head (norm)", V, H, "lm")]
    for name, N, K, kind in cases:
        nbytes = N * K * 2
        copies = max(1, -(-400_000_000 // nbytes))
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        b = torch.randn(N, device=dev, dtype=dt) if kind == "qkv" else None
        xin = torch.randn(1, K, device=dev, dtype=dt)
        tri, cub = _op_pair(kind, ws, b, x, r, nw, xin)
        tri()
        t_tri, t_cub = bench(tri), bench(cub)
        res[name] = {"MB": nbytes / 1e6, "triton_us": t_tri * 1e6, "cublas_us": t_cub * 1e6,
                     "triton_TBs": nbytes / t_tri / 1e12, "cublas_TBs": nbytes / t_cub / 1e12}
        del ws, tri, cub
        free_memory()
    # attention, rope, norm at the 7B head layout
    hq, hk, d, bs = 28, 4, 128, 16
    nb = 4096
    cache = torch.randn(2, nb, bs, hk, d, device=dev, dtype=dt)
    for B, ctx in ((1, 384), (1, 2000), (256, 1000)):
        nblk = -(-ctx // bs)
        tables = torch.randint(0, nb, (B, nblk), device=dev)
        lens = torch.full((B,), ctx, device=dev)
        q = torch.randn(B, hq, d, device=dev, dtype=dt)
        for splits in sorted({1, ta.decode_num_splits(B, hk, 2048)}):
            t = bench(functools.partial(ta.decode_attention, q, cache, tables, lens, d**-0.5, splits))
            kvb = 2 * B * ctx * hk * d * 2
            res[f"attention B={B} ctx={ctx} splits={splits}"] = {"us": t * 1e6, "kv_TBs": kvb / t / 1e12}
    qkv = torch.randn(1, (hq + 2 * hk) * d, device=dev, dtype=dt)
    cs = torch.randn(4096, d, device=dev)
    pos = torch.tensor([100], device=dev)
    slot = torch.tensor([5], device=dev)
    res["rope_write_kv B=1"] = {"us": bench(lambda: triton_rope.rope_write_kv(qkv, pos, cs, cache, slot, hq, hk, d)) * 1e6}
    res["add_rmsnorm B=1"] = {"us": bench(lambda: tpw.add_rmsnorm(x, r, nw, 1e-6)) * 1e6}
    res["empty graph-less launch (torch add)"] = {"us": bench(lambda: x.add(r)) * 1e6}
    RESULTS["ops"] = res
    for k, v in res.items():
        log(f"ops: {k}: " + ", ".join(f"{a}={b:.2f}" for a, b in v.items()))


def hf_phase(hf, shape: str, args, work) -> dict:
    """Every transformers measurement of one shape (before tianxia takes the GPU memory)."""
    cfg = SHAPES[shape]
    vocab = cfg["vocab_size"]
    res: dict = {}
    if "correct" in args.measure:
        prompts = _prompts(8, vocab, 8, 64, seed=1)
        t0 = time.perf_counter()
        ref = [hf_greedy(hf, p, args.correct_tokens, args.device) for p in prompts]
        with torch.no_grad():
            ids = torch.tensor([prompts[0]], device=args.device)
            prompt_logits = hf(ids).logits[0].float().cpu()
        res["correct"] = dict(prompts=prompts, tokens=[r[0] for r in ref], logits=[r[1] for r in ref],
                              prompt_logits=prompt_logits)
        log(f"{shape}: transformers greedy references in {time.perf_counter() - t0:.1f}s")
    if "decode" in args.measure:
        prompt = _prompts(1, vocab, 128, 128, seed=2)[0]
        ids = torch.tensor([prompt], device=args.device)
        mask = torch.ones_like(ids)
        gen = dict(attention_mask=mask, do_sample=False)
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **gen)
        sync()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
        sync()
        t1 = time.perf_counter()
        n = 64
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
        sync()
        t2 = time.perf_counter()
        res["decode"] = dict(prompt=prompt, hf_ms_per_token=((t2 - t1) - (t1 - t0)) / (n - 1) * 1e3)
        log(f"{shape}: transformers batch-1 decode {res['decode']['hf_ms_per_token']:.2f} ms/token")
    if "throughput" in args.measure and args.hf_throughput_seqs > 0:
        prompts, outs = work
        k = min(args.hf_throughput_seqs, len(prompts))
        sub, sub_out = prompts[:k], outs[:k]
        width = max(len(p) for p in sub)
        ids = torch.zeros(k, width, dtype=torch.int64)
        mask = torch.zeros(k, width, dtype=torch.int64)
        for j, p in enumerate(sub):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        ids, mask = ids.to(args.device), mask.to(args.device)
        new = max(sub_out)
        sync()
        t0 = time.perf_counter()
        try:
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            sync()
            dt = time.perf_counter() - t0
            res["throughput"] = {"seqs": k, "seconds": dt, "useful_output_tokens": sum(sub_out),
                                 "tokens_per_s": sum(sub_out) / dt}
        except torch.cuda.OutOfMemoryError as e:
            res["throughput"] = {"seqs": k, "error": f"OOM: {str(e).splitlines()[0]}"}
        del ids, mask
        free_memory()
        log(f"{shape}: transformers batched generate {res['throughput']}")
        RESULTS[shape]["hf_throughput"] = res["throughput"]
        Path(args.out, f"{args.tag}.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    return res


def tianxia_phase(engine, shape: str, args, work, ref: dict) -> dict:
    cfg = SHAPES[shape]
    out: dict = {}
    if "correct" in ref:
        r = ref["correct"]
        n = args.correct_tokens
        c = {"tokens": n}
        batched = engine_generate(engine, r["prompts"], [n] * len(r["prompts"]))
        c["batched"] = compare(f"{shape}/correct/batched", r["tokens"], r["logits"], batched, args.tie_gap)
        single = [engine_generate(engine, [p], [n])[0] for p in r["prompts"]]
        c["batch1"] = compare(f"{shape}/correct/batch-1", r["tokens"], r["logits"], single, args.tie_gap)
        tx = engine.score(r["prompts"][0]).float().cpu()
        ref_logits = r["prompt_logits"]
        c["prompt_logits_rel_err"] = float((tx - ref_logits).norm() / ref_logits.norm())
        c["prompt_logits_max_abs"] = float((tx - ref_logits).abs().max())
        log(f"{shape}: prompt logits rel. error {c['prompt_logits_rel_err']:.2e}, max abs {c['prompt_logits_max_abs']:.3f}")
        out["correct"] = c
    if "decode" in ref:
        d = {"hf_ms_per_token": ref["decode"]["hf_ms_per_token"]}
        prompt = ref["decode"]["prompt"]
        n = args.decode_tokens
        d.update(prompt_len=len(prompt), new_tokens=n, weight_bytes=RESULTS[shape]["weight_bytes"])
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_per_tok = 2 * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim
        d["roofline_bytes"] = d["weight_bytes"] + kv_per_tok * (len(prompt) + n / 2)
        bw = RESULTS.get("env", {}).get("copy_bw_tbs", float("nan")) * 1e12
        d["roofline_ms"] = d["roofline_bytes"] / bw * 1e3
        steps: list[float] = []
        engine_generate(engine, [prompt], [n], steps)
        d["engine_ms_per_token"] = sum(steps[1:]) / len(steps[1:]) * 1e3
        # what users run: sampled decoding; and each without async scheduling (the host's work
        # between two steps not hidden)
        for key, sampling in (("engine_sampled_ms_per_token", {"temperature": 0.8, "top_p": 0.95}),):
            steps = []
            engine_generate(engine, [prompt], [n], steps, sampling)
            d[key] = sum(steps[1:]) / len(steps[1:]) * 1e3
        if getattr(engine, "async_scheduling", False):
            engine.async_scheduling = False
            try:
                for key, sampling in (("engine_sync_ms_per_token", None),
                                      ("engine_sync_sampled_ms_per_token", {"temperature": 0.8, "top_p": 0.95})):
                    steps = []
                    engine_generate(engine, [prompt], [n], steps, sampling)
                    d[key] = sum(steps[1:]) / len(steps[1:]) * 1e3
            finally:
                engine.async_scheduling = True
        gr = engine.runner.graph_runner
        if gr is not None and gr.graphs:
            d["graph_ms_per_token"] = _time_graph(gr.graphs[1]) * 1e3
            graphs, gr.graphs = gr.graphs, {}
            steps = []
            engine_generate(engine, [prompt], [min(n, 64)], steps)
            d["fused_eager_ms_per_token"] = sum(steps[1:]) / len(steps[1:]) * 1e3
            gr.graphs = graphs
            # both batch-1 variants (Triton GEMV / cuBLAS projections), captured afresh over the
            # last step's inputs
            step = engine.runner.decode_step
            if step is not None and step.variants:
                chosen = "gemv" if step.use_gemv else "cublas"
                d["batch1_path"] = chosen
                try:
                    for variant in step.variants:
                        step.set_variant(variant)
                        gr._forward(1)
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            gr._forward(1)
                        d[f"graph_{variant}_ms_per_token"] = _time_graph(g) * 1e3
                        del g
                finally:
                    step.set_variant(chosen)
        runner = engine.runner
        saved = runner.graph_runner, runner.decode_step
        runner.graph_runner = runner.decode_step = None  # the module forward, eagerly
        steps = []
        engine_generate(engine, [prompt], [min(n, 32)], steps)
        d["eager_ms_per_token"] = sum(steps[1:]) / len(steps[1:]) * 1e3
        runner.graph_runner, runner.decode_step = saved
        log(f"{shape}: decode " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items()))
        out["decode"] = d
    if "throughput" in args.measure:
        prompts, outs = work
        e = {"num_seqs": len(prompts), "output_tokens": sum(outs), "input_tokens": sum(map(len, prompts))}
        engine_generate(engine, [prompts[0][:100]], [8])  # warm-up
        sync()
        steps = []
        t0 = time.perf_counter()
        got = engine_generate(engine, prompts, outs, steps)
        dt = time.perf_counter() - t0
        assert [len(g) for g in got] == outs
        e["tianxia"] = {"seconds": dt, "tokens_per_s": sum(outs) / dt, "steps": len(steps),
                        "kv_cache_tokens": engine.runner.num_blocks * engine.runner.block_size,
                        "preemptions": engine.scheduler.num_preemptions}
        hf = ref.get("throughput")
        if hf is not None:
            e["hf"] = hf
            if "tokens_per_s" in hf:
                e["speedup"] = e["tianxia"]["tokens_per_s"] / hf["tokens_per_s"]
        log(f"{shape}: throughput {e}")
        out["throughput"] = e
    return out


def section_shapes(args):
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    dtype_name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    for shape in args.shapes:
        t0 = time.perf_counter()
        hf = build_hf(shape, args.device, dtype)
        params = dict(hf.named_parameters())
        RESULTS[shape] = {"weight_bytes": weight_bytes_per_token(params, SHAPES[shape])}
        del params
        log(f"{shape}: transformers model built in {time.perf_counter() - t0:.1f}s")
        rng = random.Random(3)
        lo, hi = args.len_range
        vocab = SHAPES[shape]["vocab_size"]
        lens = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(args.num_seqs)]
        work = ([[rng.randrange(1, vocab) for _ in range(i)] for i, _ in lens], [o for _, o in lens])
        try:
            ref = hf_phase(hf, shape, args, work)
        except Exception:
            traceback.print_exc()
            RESULTS[shape]["hf_error"] = traceback.format_exc()[-1500:]
            ref = {}
        engine, startup = build_engine(
            hf, args.device, dtype_name, max_num_seqs=args.num_seqs, max_model_len=2048,
            max_num_batched_tokens=8192, gpu_util=args.gpu_util if args.device == "cuda" else None,
            kv_memory=None if args.device == "cuda" else 1 << 30, release_hf=True,
        )
        del hf
        free_memory()
        gr = engine.runner.graph_runner
        RESULTS[shape].update(engine_startup_s=startup, graph_capture_s=gr.capture_seconds if gr else None,
                              batch1_variants_ms=getattr(gr, "batch1_variants_ms", None),
                              kv_cache_tokens=engine.runner.num_blocks * engine.runner.block_size)
        del gr  # it holds the KV cache views: keep no reference past the engine's
        log(f"{shape}: engine up in {startup:.1f}s ({RESULTS[shape]})")
        try:
            RESULTS[shape].update(tianxia_phase(engine, shape, args, work, ref))
        except Exception:
            traceback.print_exc()
            RESULTS[shape]["tianxia_error"] = traceback.format_exc()[-1500:]
        finally:
            del engine
            free_memory()
            Path(args.out, f"{args.tag}.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def section_quant(args):
    """bf16 vs fp8 vs int8 weights on the same random model, one engine at a time."""
    dtype = torch.bfloat16
    for shape in args.quant_shapes:
        hf = build_hf(shape, args.device, dtype)
        cfg = SHAPES[shape]
        prompts = _prompts(8, cfg["vocab_size"], 16, 64, seed=12)
        with torch.no_grad():
            ref_logits = [hf(torch.tensor([p], device=args.device)).logits[0].float().cpu() for p in prompts[:4]]
        params = dict(hf.named_parameters())
        base_bytes = weight_bytes_per_token(params, cfg)
        proj = sum(t.numel() * t.element_size() for n, t in params.items()
                   if n.endswith("proj.weight") and ".layers." in n)
        del params
        bw = RESULTS.get("env", {}).get("copy_bw_tbs", float("nan")) * 1e12
        res: dict = {}
        base_tokens = None
        for method in (None, "fp8", "int8"):
            name = method or "bf16"
            engine, startup = build_engine(
                hf, args.device, "bfloat16", max_num_seqs=64, max_model_len=2048,
                max_num_batched_tokens=8192, gpu_util=None,
                kv_memory=(8 << 30) if args.device == "cuda" else (64 << 20), quantization=method,
            )
            r: dict = {"startup_s": startup}
            try:
                wbytes = base_bytes - proj // 2 if method else base_bytes  # 1-byte weights halve the projections
                prompt = prompts[0] * 2
                steps: list[float] = []
                engine_generate(engine, [prompt], [128], steps)
                r["engine_ms_per_token"] = sum(steps[1:]) / len(steps[1:]) * 1e3
                gr = engine.runner.graph_runner
                if gr is not None and 1 in gr.graphs:
                    r["graph_ms_per_token"] = _time_graph(gr.graphs[1]) * 1e3
                    r["roofline_ms"] = (wbytes + 0.0) / bw * 1e3
                    r["pct_roofline"] = 100 * r["roofline_ms"] / r["graph_ms_per_token"]
                steps = []
                batch = [prompts[i % len(prompts)] for i in range(64)]
                engine_generate(engine, batch, [64] * 64, steps)
                decode_steps = steps[2:]
                r["batch64_ms_per_step"] = sum(decode_steps) / len(decode_steps) * 1e3
                errs = []
                for p, ref in zip(prompts, ref_logits):
                    got = engine.score(p).float().cpu()
                    errs.append(float((got - ref).norm() / ref.norm()))
                r["prompt_logits_rel_err_vs_hf"] = max(errs)
                tokens = engine_generate(engine, prompts, [32] * len(prompts))
                if base_tokens is None:
                    base_tokens = tokens
                r["greedy_tokens_equal_bf16"] = sum(
                    next((i for i, (a, b) in enumerate(zip(t, b0)) if a != b), len(t))
                    for t, b0 in zip(tokens, base_tokens)) / (32 * len(prompts))
            except Exception:
                traceback.print_exc()
                r["error"] = traceback.format_exc()[-1500:]
            finally:
                del engine
                free_memory()
            log(f"{shape}/{name}: {r}")
            res[name] = r
        RESULTS.setdefault("quant", {})[shape] = res
        del hf
        free_memory()


# --- report ---------------------------------------------------------------------------------------


def fmt(v, nd=2):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def report() -> str:
    lines = []
    env = RESULTS.get("env", {})
    if env:
        lines.append(f"GPU {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
                     f"transformers {env.get('transformers')}; copy bandwidth "
                     f"{env.get('copy_bw_tbs', float('nan')):.2f} TB/s (read + write)")
        if "kernels" in RESULTS:
            lines.append(f"kernel tests on the GPU: {RESULTS['kernels']['summary']}")
        lines.append("")
    if "ops" in RESULTS:
        lines += ["| op at the 7B shape, batch 1 | Triton | cuBLAS / other |", "|---|---|---|"]
        for k, v in RESULTS["ops"].items():
            if "triton_us" in v:
                lines.append(f"| {k}, {v['MB']:.0f} MB | {v['triton_us']:.1f} us ({v['triton_TBs']:.2f} TB/s) | "
                             f"{v['cublas_us']:.1f} us ({v['cublas_TBs']:.2f} TB/s) |")
            else:
                extra = f" ({v['kv_TBs']:.2f} TB/s of KV)" if "kv_TBs" in v else ""
                lines.append(f"| {k} | {v['us']:.1f} us{extra} | |")
        lines.append("")
    shapes = [k for k in RESULTS if k in SHAPES]
    for shape in shapes:
        r = RESULTS[shape]
        lines.append(f"### {shape} (bf16): engine start-up {fmt(r.get('engine_startup_s'), 1)} s, "
                     f"graph capture {fmt(r.get('graph_capture_s'), 1)} s, KV cache {r.get('kv_cache_tokens')} tokens; "
                     f"batch-1 graph variants (ms, padding inputs) {r.get('batch1_variants_ms')}\n")
        c = r.get("correct")
        if c:
            lines += [f"| greedy vs transformers, 8 prompts x {c['tokens']} tokens | identical | near-tie divergences (prompt, token, gap) | other divergences |",
                      "|---|---|---|---|"]
            for k in ("batched", "batch1"):
                sm = c[k]
                lines.append(f"| tianxia {k} | {sm['equal']}/8 | {sm['near_tie_divergences']} | {sm['bad_divergences']} |")
            lines.append(f"\nprompt logits vs transformers: relative error {c['prompt_logits_rel_err']:.2e}, "
                         f"max abs {c['prompt_logits_max_abs']:.3f}\n")
        d = r.get("decode")
        if d:
            lines += [f"| batch-1 decode, prompt {d['prompt_len']}, {d['new_tokens']} tokens (engine uses: {d.get('batch1_path')}) | ms/token | % of roofline |", "|---|---|---|"]
            lines.append(f"| roofline: {d['roofline_bytes'] / 1e9:.3f} GB / copy bandwidth | {fmt(d['roofline_ms'], 3)} | 100 |")
            for k, label in [("graph_gemv_ms_per_token", "tianxia decode graph, GPU time, Triton GEMV projections"),
                             ("graph_cublas_ms_per_token", "tianxia decode graph, GPU time, cuBLAS projections"),
                             ("engine_ms_per_token", "tianxia engine, end to end (CUDA graphs)"),
                             ("engine_sampled_ms_per_token", "the same, temperature 0.8, top-p 0.95"),
                             ("engine_sync_ms_per_token", "the same greedy, without async scheduling"),
                             ("engine_sync_sampled_ms_per_token", "the same sampled, without async scheduling"),
                             ("fused_eager_ms_per_token", "tianxia engine, fused kernels, no graphs"),
                             ("eager_ms_per_token", "tianxia engine, --enforce-eager"),
                             ("hf_ms_per_token", "transformers generate")]:
                if k in d:
                    lines.append(f"| {label} | {fmt(d[k], 3)} | {fmt(100 * d['roofline_ms'] / d[k], 1)} |")
            lines.append("")
        t = r.get("throughput")
        if t:
            hf = t.get("hf", {})
            lines += ["| offline throughput | seqs | output tokens | tianxia tok/s | transformers tok/s (seqs) | speedup |",
                      "|---|---|---|---|---|---|",
                      f"| {shape} | {t['num_seqs']} | {t['output_tokens']} | {fmt(t['tianxia']['tokens_per_s'], 0)} | "
                      f"{fmt(hf.get('tokens_per_s'), 0)} ({hf.get('seqs', '-')}) | {fmt(t.get('speedup'), 1)} |", ""]
    for shape, res in RESULTS.get("quant", {}).items():
        lines += [f"| {shape} weights | batch-1 graph ms/token | roofline ms | % of roofline | engine ms/token "
                  "| batch-64 ms/step | prompt logits rel. err vs transformers bf16 | greedy tokens agreeing with bf16 |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in res.items():
            lines.append(f"| {name} | {fmt(r.get('graph_ms_per_token'), 3)} | {fmt(r.get('roofline_ms'), 3)} | "
                         f"{fmt(r.get('pct_roofline'), 1)} | {fmt(r.get('engine_ms_per_token'), 3)} | "
                         f"{fmt(r.get('batch64_ms_per_step'), 2)} | {fmt(r.get('prompt_logits_rel_err_vs_hf'), 4)} | "
                         f"{fmt(r.get('greedy_tokens_equal_bf16'), 3)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="gpu_bench", help="base name of the result files")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sections", nargs="+", default=["env", "kernels", "shapes"])
    ap.add_argument("--kernel-tests", default="not dtype1", help="pytest -k expression")
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-7b"])
    ap.add_argument("--measure", nargs="+", default=["correct", "decode", "throughput"])
    ap.add_argument("--correct-tokens", type=int, default=32)
    ap.add_argument("--tie-gap", type=float, default=0.1,
                    help="a divergence counts as a near-tie when the reference's logit gap between "
                         "its token and ours is below this")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--len-range", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--hf-throughput-seqs", type=int, default=256,
                    help="sequences given to transformers' batched generate (the first k of the workload)")
    ap.add_argument("--gpu-util", type=float, default=0.85)
    ap.add_argument("--quant-shapes", nargs="+", default=["qwen2.5-7b"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "transformers", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_grad_enabled(False)
    failed = []
    for sec in args.sections:
        t0 = time.perf_counter()
        try:
            globals()[f"section_{sec}"](args)
        except Exception:
            traceback.print_exc()
            failed.append(sec)
            RESULTS[f"{sec}_error"] = traceback.format_exc()[-2000:]
        log(f"section {sec}: {time.perf_counter() - t0:.1f}s")
        free_memory()
        (out / f"{args.tag}.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    table = report()
    (out / f"{args.tag}.md").write_text(table + "\n")
    print("\n" + table)
    if failed:
        print(f"\nFAILED sections: {failed}")
    return 1 if failed else 0


def decode_route(runner) -> str:
    """How the runner's decode steps run, in words."""
    if runner.graph_runner is not None:
        return "graph of the fused step" if runner.decode_step is not None else "graph of the module forward"
    return "fused step, no graph" if runner.decode_step is not None else "eager"


if __name__ == "__main__":
    sys.exit(main())
