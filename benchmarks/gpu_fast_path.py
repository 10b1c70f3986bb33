"""The fast path for every request, on one GPU: every family, sampled decoding, real weights.

Sections (``--sections``, default all):

- ``env``: versions, the GPU, the copy bandwidth (bytes read + written).
- ``families``: batch-1 decode of every family we load, each a random-weight model of the same
  size built with ``transformers`` (28 layers, hidden 1024, 16 heads of 64, 8 KV heads,
  intermediate 3072, vocabulary 151,936: about 0.5B parameters), bf16: ms/token end to end and
  of the captured graph's replay, the route the engine took (a family's fused step or its module
  forward in the graph), and the ratio to the Qwen2 row.
- ``realweights``: SmolLM2-135M's trained weights (``--gguf``, a GGUF small enough to travel; see
  ``benchmarks/gpu_test_model.py``) through tianxia's own loader, bf16 and float32, against
  ``transformers`` on the same dequantized weights: greedy tokens of 16 prompts, alone (batch 1)
  and all together (batch 16), for each decode route (graph, fused step without graphs, eager
  module forward). A divergence counts as a near-tie when the reference's logit gap between its
  token and ours is under ``--tie-gap``.
- ``throughput``: ``--shapes`` (Qwen2.5-0.5B and -7B shapes), 256 sequences with input and output
  lengths uniform in [100, 1024] (EOS ignored): output tokens/s with greedy, ``temperature=0.8,
  top_p=0.95`` and ``temperature=0.8, top_k=40, seed=i``, each against greedy; then batch-1
  decode of the same engine against the copy roofline.
- ``sampler``: one sampling step alone on [rows, 151,936] float32 logits (rows 1, 64, 256):
  the greedy argmax against ``Sampler`` with ``temperature=0.8, top_p=0.95`` and with
  ``temperature=0.8, top_k=40`` and a seed per row (ms, CUDA events, median of 20), and the
  truncation-threshold and Gumbel-max kernels on their own.

    PYTHONPATH=src python benchmarks/gpu_fast_path.py --out /tmp/out --gguf smollm2-q2k.gguf
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench as gb  # noqa: E402  (the shared helpers: engine over HF weights, copy bandwidth)

RESULTS: dict = {}
log = gb.log

_DIMS = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2)
# family -> (transformers config class, model class, overrides)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64, "tie_word_embeddings": True}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "tie_word_embeddings": True}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 64, "pad_token_id": 0, "tie_word_embeddings": True}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {
        "num_kv_heads": 8, "new_decoder_architecture": True, "bias": False, "parallel_attn": True}),
}


# --dry-run (a CPU check of this script): the same families at a toy size
_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def build_family(name: str, device: str, dtype: torch.dtype, tiny: bool = False):
    import transformers

    cfg_name, model_name, extra = FAMILIES[name]
    d = dict(_DIMS, **(_TINY if tiny else {}))
    if name == "gpt2":
        kw = dict(vocab_size=d["vocab_size"], n_embd=d["hidden_size"], n_layer=d["num_hidden_layers"],
                  n_head=d["num_attention_heads"], n_inner=d["intermediate_size"], n_positions=4096,
                  bos_token_id=1, eos_token_id=2)
    elif name == "falcon":
        kw = dict(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
                  num_attention_heads=d["num_attention_heads"], max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2)
    else:
        kw = d
    kw.update(extra)
    if tiny:
        kw.update({k: v for k, v in (("head_dim", 16), ("query_pre_attn_scalar", 16), ("num_kv_heads", 2))
                   if k in kw})
    cfg = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, model_name)(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def timed_decode(engine, prompt: list[int], n: int) -> tuple[float, float | None]:
    """(engine ms/token end to end, graph replay ms) of one sequence decoding ``n`` tokens."""
    steps: list[float] = []
    gb.engine_generate(engine, [prompt], [n], steps)
    ms = sum(steps[1:]) / len(steps[1:]) * 1e3
    gr = engine.runner.graph_runner
    graph_ms = gb._time_graph(gr.graphs[1]) * 1e3 if gr is not None and 1 in gr.graphs else None
    return ms, graph_ms


def section_env(args):
    gb.section_env(args)
    RESULTS["env"] = gb.RESULTS["env"]


def section_families(args):
    res = {}
    vocab = (_TINY if args.dry_run else _DIMS)["vocab_size"]
    prompt = [random.Random(2).randrange(3, vocab) for _ in range(128)]
    for name in args.families:
        t0 = time.perf_counter()
        try:
            dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
            hf = build_family(name, args.device, dtype, tiny=args.dry_run)
            nbytes = sum(p.numel() * p.element_size() for p in hf.parameters())
            engine, startup = gb.build_engine(
                hf, args.device, str(dtype).removeprefix("torch."), max_num_seqs=4, max_model_len=1024,
                max_num_batched_tokens=1024,
                gpu_util=None, kv_memory=1 << 30, release_hf=True)
            del hf
            gb.free_memory()
            gb.engine_generate(engine, [prompt[:16]], [4])  # warm-up
            ms, graph_ms = timed_decode(engine, prompt, args.decode_tokens)
            runner = engine.runner
            route = gb.decode_route(runner)
            gr = runner.graph_runner
            res[name] = dict(ms_per_token=ms, graph_ms=graph_ms, route=route, startup_s=startup,
                             weight_gb=nbytes / 1e9, routes=dict(runner.route_counts),
                             batch1_variants_ms=getattr(gr, "batch1_variants_ms", None))
            del engine, runner, gr
        except Exception:
            traceback.print_exc()
            res[name] = {"error": traceback.format_exc()[-1500:]}
        gb.free_memory()
        log(f"family {name}: {res[name]} ({time.perf_counter() - t0:.0f}s)")
    base = res.get("qwen2", {}).get("ms_per_token")
    for r in res.values():
        if base and "ms_per_token" in r:
            r["vs_qwen2"] = r["ms_per_token"] / base
    RESULTS["families"] = res


PROMPTS = [
    "The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,",
    "List three primary colors:", "The theory of relativity states that", "import numpy as np\n",
    "Q: What is 12 times 7?\nA:", "The best way to learn a language is", "Water boils at",
    "In 1492, Columbus", "Write a haiku about autumn:\n", "The mitochondria is",
    "SELECT name FROM users WHERE", "My favourite book is", "The three laws of motion are",
    "To make a cup of tea, first",
]


def section_realweights(args):
    from transformers import AutoModelForCausalLM

    from tianxia import LLM, SamplingParams

    path = Path(args.gguf)
    n = args.correct_tokens
    res: dict = {"gguf": path.name, "size_mb": path.stat().st_size / 1e6}
    gpu = {"kv_cache_memory": "1GiB" if args.device == "cuda" else "256MiB"}
    for dtype_name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        if args.device != "cuda" and dtype_name == "bfloat16":
            continue
        llm = LLM(str(path), device=args.device, dtype=dtype_name, max_model_len=512, max_num_seqs=16, seed=0,
                  cpu_activations="float32", **gpu)
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in PROMPTS]
        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(args.device).eval()
        refs = [gb.hf_greedy(ref, p, n, args.device) for p in prompts]
        ref_tokens, ref_logits = [r[0] for r in refs], [r[1] for r in refs]
        del ref
        gb.free_memory()
        runner = llm.engine.runner
        graph, step = runner.graph_runner, runner.decode_step
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        out = {}
        for route, (gr, st) in {"graph": (graph, step), "fused": (None, step), "eager": (None, None)}.items():
            runner.graph_runner, runner.decode_step = gr, st
            if route == "fused" and st is None:
                continue
            for batch in (1, 16):
                before = dict(runner.route_counts)
                if batch == 1:
                    got = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
                           for p in prompts]
                else:
                    got = [o.outputs[0].token_ids for o in
                           llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
                key = f"{route} batch {batch}"
                out[key] = gb.compare(f"realweights {dtype_name} {key}", ref_tokens, ref_logits, got, args.tie_gap)
                out[key].pop("rows")
                out[key]["steps"] = {k: v - before.get(k, 0) for k, v in runner.route_counts.items()}
        runner.graph_runner, runner.decode_step = graph, step
        res[dtype_name] = out
        del llm, runner, graph, step
        gb.free_memory()
    RESULTS["realweights"] = res


SAMPLING = {
    "greedy": dict(temperature=0.0),
    "temperature=0.8, top_p=0.95": dict(temperature=0.8, top_p=0.95),
    "temperature=0.8, top_k=40, seed=i": dict(temperature=0.8, top_k=40, seed=True),
}


def run_workload(engine, prompts, outs, sampling: dict, loras: list | tuple = (None,)) -> float:
    """Seconds to run every prompt to its output length (``ignore_eos``); request ``i`` uses
    LoRA request ``loras[i % len(loras)]`` (None: the base model)."""
    from tianxia.sampling_params import SamplingParams

    for i, (p, m) in enumerate(zip(prompts, outs)):
        kw = dict(sampling)
        if kw.pop("seed", False):
            kw["seed"] = i
        engine.add_request(f"w{i}-{time.monotonic_ns()}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=m, ignore_eos=True, detokenize=False, **kw),
                           lora_request=loras[i % len(loras)])
    gb.sync()
    t0 = time.perf_counter()
    done = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done += len(o.outputs[0].token_ids)
    gb.sync()
    assert done == sum(outs)
    return time.perf_counter() - t0


def section_throughput(args):
    res = {}
    for shape in args.shapes:
        t0 = time.perf_counter()
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        hf = gb.build_hf(shape, args.device, dtype)
        params = dict(hf.named_parameters())
        wbytes = gb.weight_bytes_per_token(params, gb.SHAPES[shape])
        del params
        rng = random.Random(3)
        vocab = gb.SHAPES[shape]["vocab_size"]
        lo, hi = (100, 1024) if not args.dry_run else (8, 24)
        lens = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(args.num_seqs)]
        prompts = [[rng.randrange(1, vocab) for _ in range(i)] for i, _ in lens]
        outs = [o for _, o in lens]
        engine, startup = gb.build_engine(
            hf, args.device, str(dtype).removeprefix("torch."), max_num_seqs=args.num_seqs, max_model_len=2048,
            max_num_batched_tokens=8192, gpu_util=args.gpu_util if args.device == "cuda" else None,
            kv_memory=None if args.device == "cuda" else 1 << 30, release_hf=True)
        del hf
        gb.free_memory()
        r: dict = {"startup_s": startup, "output_tokens": sum(outs),
                   "kv_cache_tokens": engine.runner.num_blocks * engine.runner.block_size}
        # the whole workload with short outputs first: every prompt shape autotunes its kernels now,
        # not inside the first measured case
        run_workload(engine, prompts, [8] * len(prompts), {"temperature": 0.8, "top_p": 0.95})
        for name, sampling in SAMPLING.items():
            dt = run_workload(engine, prompts, outs, sampling)
            r[name] = {"seconds": dt, "tokens_per_s": sum(outs) / dt}
            log(f"{shape} throughput {name}: {sum(outs) / dt:.0f} tok/s")
        greedy = r["greedy"]["tokens_per_s"]
        for name in SAMPLING:
            r[name]["vs_greedy"] = r[name]["tokens_per_s"] / greedy
        cfg = gb.SHAPES[shape]
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_per_tok = 2 * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim
        n = args.decode_tokens
        roof_bytes = wbytes + kv_per_tok * (128 + n / 2)
        bw = RESULTS.get("env", {}).get("copy_bw_tbs", float("nan")) * 1e12
        ms, graph_ms = timed_decode(engine, prompts[0][:128], n)
        r["batch1"] = dict(roofline_ms=roof_bytes / bw * 1e3, engine_ms_per_token=ms, graph_ms=graph_ms,
                           pct_roofline_graph=100 * roof_bytes / bw * 1e3 / graph_ms if graph_ms else None,
                           pct_roofline_engine=100 * roof_bytes / bw * 1e3 / ms)
        log(f"{shape} batch-1: {r['batch1']}")
        res[shape] = r
        del engine
        gb.free_memory()
        log(f"{shape}: {time.perf_counter() - t0:.0f}s")
    RESULTS["throughput"] = res


class _Row:
    """What the sampler reads of a sequence, for a step outside the engine."""

    def __init__(self, params, seed):
        from tianxia.layers.sampler import sampling_terms

        self.params, self.sample_seed = params, seed
        self.sampling_terms = sampling_terms(params)
        self.output_token_ids, self.prompt_token_ids, self.num_output_tokens = [], [], 0
        self.bad_words_ids, self.generator, self.grammar = [], None, None


def _cuda_ms(fn, reps: int = 20) -> float:
    import statistics

    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def _cpu_ms(fn, reps: int = 3) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def section_sampler(args):
    from tianxia.layers import triton_sampling
    from tianxia.layers.sampler import Sampler, SamplingBatch
    from tianxia.sampling_params import SamplingParams

    from tianxia.layers.sampler_graphs import DEFAULT_KINDS, SamplerGraphs

    res = {}
    vocab = 512 if args.dry_run else _DIMS["vocab_size"]
    timer = _cuda_ms if args.device == "cuda" else _cpu_ms
    sampler = Sampler(0)
    ladder = [1, 64, 256]

    def graphed_sampler(seed: int) -> Sampler:
        s = Sampler(seed)
        s.graphs = SamplerGraphs(ladder, vocab, torch.device(args.device))
        s.graphs.warm_up(DEFAULT_KINDS)
        return s

    graphed = graphed_sampler(0) if args.device == "cuda" else None
    for rows in ladder:
        torch.manual_seed(rows)
        logits = torch.randn(rows, vocab, device=args.device) * 3
        r = {"greedy": timer(lambda: logits.argmax(-1).cpu())}
        for name, kw, seeded in (("top_p", dict(temperature=0.8, top_p=0.95), False),
                                 ("top_k_seeded", dict(temperature=0.8, top_k=40), True)):
            seqs = [_Row(SamplingParams(seed=i if seeded else None, **kw), i if seeded else None) for i in range(rows)]
            batch = SamplingBatch.from_sequences(seqs, eos_ids=(2,))
            r[name] = timer(lambda: sampler(logits.clone(), batch))
            r[f"{name}_batch_build"] = _cpu_ms(lambda: SamplingBatch.from_sequences(seqs, eos_ids=(2,)), 20)
            if graphed is not None:
                r[f"{name}_graphed"] = timer(lambda: graphed(logits.clone(), batch))
                # the same keys give the same tokens, eager or replayed
                same = Sampler(5)(logits.clone(), batch).tokens == graphed_sampler(5)(logits.clone(), batch).tokens
                r[f"{name}_graphed_same"] = float(same)
        res[rows] = r
        if args.device != "cuda":  # the kernels alone need a GPU (or Triton's interpreter)
            continue
        k = torch.full((rows,), 40, dtype=torch.int64, device=args.device)
        p = torch.full((rows,), 0.95, device=args.device)
        none_k, none_p = torch.zeros_like(k), torch.ones_like(p)
        r["thresholds_top_p"] = timer(lambda: triton_sampling.truncation_thresholds(logits, none_k, p))
        r["thresholds_top_k"] = timer(lambda: triton_sampling.truncation_thresholds(logits, k, none_p))
        keys = torch.zeros(rows, 2, dtype=torch.int64, device=args.device)
        r["gumbel_argmax"] = timer(lambda: triton_sampling.gumbel_argmax(logits, keys, None))
        log(f"sampler rows={rows}: " + ", ".join(f"{n} {v:.3f} ms" for n, v in r.items()))
    RESULTS["sampler"] = res


def report() -> str:
    def fmt(v, d=2):
        return "-" if v is None else f"{v:.{d}f}"

    lines = []
    env = RESULTS.get("env", {})
    if env:
        lines += [f"GPU {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
                  f"copy bandwidth {fmt(env.get('copy_bw_tbs'), 2)} TB/s", ""]
    fam = RESULTS.get("families")
    if fam:
        lines += ["| family | route | batch-1 ms/token (engine) | graph replay ms | vs Qwen2 |", "|---|---|---|---|---|"]
        for name, r in fam.items():
            if "error" in r:
                lines.append(f"| {name} | error: {r['error'].splitlines()[-1][:80]} | | | |")
            else:
                lines.append(f"| {name} | {r['route']} | {fmt(r['ms_per_token'], 3)} | {fmt(r.get('graph_ms'), 3)} | "
                             f"{fmt(r.get('vs_qwen2'), 2)} |")
        lines.append("")
    rw = RESULTS.get("realweights")
    if rw:
        lines += [f"Real weights: {rw['gguf']} ({rw['size_mb']:.1f} MB)", "",
                  "| dtype | route, batch | identical / 16 | near-tie divergences | other divergences |",
                  "|---|---|---|---|---|"]
        for dtype in ("bfloat16", "float32"):
            for key, c in rw.get(dtype, {}).items():
                lines.append(f"| {dtype} | {key} | {c['equal']} | {c['near_tie_divergences']} | {c['bad_divergences']} |")
        lines.append("")
    tp = RESULTS.get("throughput")
    if tp:
        lines += ["| shape | sampling | output tok/s | vs greedy |", "|---|---|---|---|"]
        for shape, r in tp.items():
            for name in SAMPLING:
                if name in r:
                    lines.append(f"| {shape} | {name} | {fmt(r[name]['tokens_per_s'], 0)} | {fmt(r[name]['vs_greedy'], 3)} |")
        lines += ["", "| shape | batch-1 roofline ms | graph ms (% roofline) | engine ms (% roofline) |", "|---|---|---|---|"]
        for shape, r in tp.items():
            b = r.get("batch1", {})
            lines.append(f"| {shape} | {fmt(b.get('roofline_ms'), 3)} | {fmt(b.get('graph_ms'), 3)} "
                         f"({fmt(b.get('pct_roofline_graph'), 1)}) | {fmt(b.get('engine_ms_per_token'), 3)} "
                         f"({fmt(b.get('pct_roofline_engine'), 1)}) |")
        lines.append("")
    sm = RESULTS.get("sampler")
    if sm:
        cols = max((list(r) for r in sm.values()), key=len)
        lines += ["| rows | " + " | ".join(f"{c} ms" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for rows, r in sm.items():
            lines.append(f"| {rows} | " + " | ".join(fmt(r.get(c), 3) for c in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="fast_path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sections", nargs="+", default=["env", "families", "realweights", "throughput", "sampler"])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--gguf", default=str(Path(tempfile.gettempdir()) / "smollm2-gpu-test.gguf"))
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-7b"])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--correct-tokens", type=int, default=32)
    ap.add_argument("--tie-gap", type=float, default=0.1)
    ap.add_argument("--gpu-util", type=float, default=0.85)
    ap.add_argument("--dry-run", action="store_true", help="toy sizes, to check the script on a CPU")
    args = ap.parse_args()
    if args.dry_run:
        args.shapes, args.num_seqs, args.decode_tokens, args.correct_tokens = ["tiny"], 8, 8, 8
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
        gb.free_memory()
        (out / f"{args.tag}.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    table = report()
    (out / f"{args.tag}.md").write_text(table + "\n")
    print("\n" + table)
    if failed:
        print(f"\nFAILED sections: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
