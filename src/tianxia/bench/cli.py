"""``tianxia bench serve | sweep | compare``.

``vllm bench serve``'s flag names are accepted too (``--dataset-name random|sharegpt|
prefix_repetition``, ``--random-input-len``, ``--random-output-len``, ``--random-range-ratio``,
``--backend openai-chat``, ``--endpoint /v1/chat/completions``, ``--host``/``--port``,
``--save-result`` with ``--result-dir``, ...), and the key is read from ``$OPENAI_API_KEY`` as
vLLM's benchmark does, so a vLLM user's command line runs unchanged.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from tianxia.bench.workloads import LenSpec, parse_len

# vLLM's dataset and endpoint names, and the workload or endpoint each one is here
_DATASETS = {"random": "random", "prefix": "prefix", "prefix_repetition": "prefix",
             "multi-turn": "multi-turn", "file": "file", "sharegpt": "file", "custom": "file"}
_ENDPOINTS = {"completions": "completions", "/v1/completions": "completions",
              "chat": "chat", "/v1/chat/completions": "chat"}

_DUR_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$")


def parse_duration(text: str) -> float:
    """``"1s"``, ``"100ms"``, ``"250"`` (milliseconds) -> seconds."""
    m = _DUR_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 1s, 100ms, 250 (ms)")
    v, unit = float(m.group(1)), m.group(2) or "ms"
    return v * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


def _rate(text: str) -> float:
    if text.strip().lower() in ("inf", "infinity", "max"):
        return math.inf
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("request rate must be > 0 (or inf)")
    return v


def _burst(text: str) -> float:
    if text.strip().lower() in ("inf", "constant"):
        return math.inf
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("burstiness must be > 0 (1 = Poisson, inf = constant)")
    return v


def _len(text: str):
    try:
        return parse_len(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _num_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: use e.g. 1,2,4,8") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"bad list {text!r}: positive numbers, e.g. 1,2,4,8")
    return vals


def _add_target_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=None,
                   help="server root or .../v1 (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1", help="server host without --base-url")
    g.add_argument("--port", type=int, default=8000, help="server port without --base-url")
    g.add_argument("--model", required=True,
                   help="model name sent in requests (and the tokenizer, if it resolves)")
    g.add_argument("--served-model-name", default=None,
                   help="name sent in requests instead of --model (vLLM's)")
    g.add_argument("--endpoint", choices=sorted(_ENDPOINTS), default="completions",
                   help="completions or chat, or vLLM's paths /v1/completions and "
                        "/v1/chat/completions (default: %(default)s)")
    g.add_argument("--backend", default=None,
                   help="vLLM's backend name: openai-chat means --endpoint chat; openai, vllm "
                        "and the others completions")
    g.add_argument("--api-key", default=None,
                   help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--label", default=None, help="name of this engine/run in tables and plots")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", "--dataset-name", dest="workload",
                   choices=sorted(_DATASETS), default="random",
                   help="random, prefix, multi-turn or file; vLLM's names: prefix_repetition "
                        "is prefix, sharegpt and custom are file (default: %(default)s)")
    w.add_argument("--input-len", "--random-input-len", "--prefix-repetition-suffix-len",
                   dest="input_len", type=_len, default=parse_len(128),
                   help="prompt tokens, N or LO:HI (random); suffix tokens (prefix); each user "
                        "turn's tokens (multi-turn). Default 128")
    w.add_argument("--output-len", "--random-output-len", "--sharegpt-output-len",
                   "--prefix-repetition-output-len", dest="output_len", type=_len, default=None,
                   help="tokens to generate, N or LO:HI (default 64; file: the reference replies)")
    w.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="vLLM's: lengths drawn from [N*(1-r), N*(1+r)] (default 0)")
    w.add_argument("--prefix-len", "--prefix-repetition-prefix-len", "--random-prefix-len",
                   dest="prefix_len", type=int, default=None,
                   help="shared prefix tokens (prefix), system prompt tokens (multi-turn); "
                        "default 256; with the random workload, "
                        "vLLM's --random-prefix-len makes it a prefix workload")
    w.add_argument("--num-prefixes", "--prefix-repetition-num-prefixes", dest="num_prefixes",
                   type=int, default=1,
                   help="distinct shared prefixes (prefix) or system prompts (multi-turn)")
    w.add_argument("--num-turns", type=int, default=4,
                   help="multi-turn: turns per conversation; --num-prompts counts turns, so "
                        "there are num-prompts / num-turns conversations (default 4)")
    w.add_argument("--dataset", "--dataset-path", dest="dataset", default=None,
                   help="JSON/JSONL prompts or ShareGPT conversations (file)")
    w.add_argument("--max-input-len", type=int, default=None, help="skip longer file prompts")
    w.add_argument("--tokenizer", default=None,
                   help="tianxia model spec or HF tokenizer dir for building prompts and "
                        "counting tokens (default: --model if it resolves; 'none' to skip)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos/min_tokens (outputs may stop at EOS)")
    w.add_argument("--extra-body", default=None, help="JSON object merged into every request")

    a = p.add_argument_group("load")
    if not sweep:
        a.add_argument("--num-prompts", type=int, default=100)
        a.add_argument("--max-concurrency", type=int, default=None,
                       help="at most N requests in flight")
        a.add_argument("--request-rate", type=_rate, default=math.inf,
                       help="requests/s (default inf: all at once, or as fast as "
                            "--max-concurrency allows)")
    else:
        a.add_argument("--num-prompts", type=int, default=None,
                       help="prompts per point (default: max(8, 4*c) or max(8, 10*rate))")
        a.add_argument("--max-concurrency", type=int, default=None,
                       help="cap on requests in flight while sweeping --request-rates")
    a.add_argument("--burstiness", type=_burst, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier, "
                        ">1 smoother, inf = constant")
    a.add_argument("--warmup", type=int, default=1, help="uncounted warm-up requests first")

    w.add_argument("--ignore-eos", action="store_true", default=True,
                   help="send ignore_eos/min_tokens for exact output lengths (the default)")

    o = p.add_argument_group("output")
    o.add_argument("--save-result", nargs="?", const="", default=None, metavar="OUT.json",
                   help="write the result JSON (without a path, as vLLM: into --result-dir, "
                        "named by --result-filename or by label, load and model)")
    o.add_argument("--result-dir", default=None, help="folder of --save-result (vLLM's)")
    o.add_argument("--result-filename", default=None, help="file name of --save-result (vLLM's)")
    o.add_argument("--save-text", action="store_true", help="keep generated text in the result")
    o.add_argument("--plot", default=None, metavar="OUT.png", help="write plots")
    o.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                   help="no progress bar")

    s = p.add_argument_group("SLO (goodput; sweep: best load whose p99s meet all)")
    for key, help_ in (("ttft", "time to first token"), ("tpot", "time per output token"),
                       ("itl", "inter-token latency"), ("e2el", "end-to-end latency")):
        s.add_argument(f"--slo-{key}-p99", type=parse_duration, default=None, metavar="DUR",
                       help=f"{help_}, e.g. 1s or 100ms")
    if sweep:
        s.add_argument("--slo-max-failed", type=int, default=0,
                       help="failed requests allowed per point (default 0)")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench", help="benchmark OpenAI-compatible servers (serve, sweep, compare)",
        description="Benchmark any OpenAI-compatible server: tianxia, llama.cpp, vLLM, SGLang.")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    sv = bsub.add_parser("serve", help="one workload at one load; metrics table, JSON, plots")
    _add_target_args(sv)
    sv.set_defaults(func=cmd_serve)

    sw = bsub.add_parser("sweep", help="one workload over several loads; saturation curve and "
                                       "the highest load meeting an SLO")
    _add_target_args(sw, sweep=True)
    g = sw.add_mutually_exclusive_group(required=True)
    g.add_argument("--concurrency", type=_num_list, default=None, metavar="1,2,4,...",
                   help="max concurrencies to sweep")
    g.add_argument("--request-rates", type=_num_list, default=None, metavar="1,2,4,...",
                   help="request rates (req/s) to sweep")
    sw.add_argument("--stop-on-fail", action="store_true",
                    help="stop at the first load that misses the SLO")
    sw.set_defaults(func=cmd_sweep)

    cp = bsub.add_parser("compare", help="markdown table (and plot) of several result files")
    cp.add_argument("results", nargs="+", help="result JSON files from bench serve / sweep")
    cp.add_argument("--labels", default=None, help="comma-separated names, one per file")
    cp.add_argument("--baseline", default=None,
                    help="label the ratios are against (default: the first)")
    cp.add_argument("--output", "-o", default=None, metavar="OUT.md", help="also write the table")
    cp.add_argument("--plot", default=None, metavar="OUT.png")
    cp.set_defaults(func=cmd_compare)
    return bench


# ----------------------------------------------------------------------------- commands


def _slo(args) -> dict[str, float]:
    return {k: v for k in ("ttft", "tpot", "itl", "e2el")
            if (v := getattr(args, f"slo_{k}_p99", None)) is not None}


def _vllm_names(args) -> None:
    """vLLM's spellings to this command's arguments (in place)."""
    args.workload = _DATASETS[args.workload]
    if args.backend is not None:
        args.endpoint = "chat" if args.backend == "openai-chat" else "completions"
    args.endpoint = _ENDPOINTS[args.endpoint]
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY") or None
    if args.workload == "random" and args.prefix_len:
        args.workload = "prefix"  # vLLM's --random-prefix-len: a fixed prefix before each prompt
    if args.prefix_len is None:
        args.prefix_len = 256
    r = args.random_range_ratio
    if not 0.0 <= r < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {r}")
    if r:
        def widen(spec: LenSpec | None) -> LenSpec | None:
            if spec is None or spec.lo != spec.hi:
                return spec
            return LenSpec(max(1, math.floor(spec.lo * (1 - r))), math.ceil(spec.lo * (1 + r)))

        args.input_len, args.output_len = widen(args.input_len), widen(args.output_len)


def _result_path(args, load: str) -> str | None:
    """Where ``--save-result`` writes: its path, or vLLM's folder and file naming."""
    if args.save_result is None:
        return None
    if args.save_result:
        return args.save_result
    import datetime
    from pathlib import Path

    name = args.result_filename
    if not name:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        model = (args.served_model_name or args.model).replace("/", "_")
        name = f"{args.label or 'tianxia-bench'}-{load}-{model}-{stamp}.json"
    return str(Path(args.result_dir or ".") / name)


def _no_success(results: list[dict]) -> str | None:
    """A message when not one request of a run succeeded (with the first error), else None."""
    summaries = [r["summary"] for r in results]
    if any(s["completed"] for s in summaries):
        return None
    failed = sum(s["failed"] for s in summaries)
    errors = [q.get("error") for r in results for q in r.get("requests", ()) if q.get("error")]
    errors += [e for s in summaries for e in s.get("errors", {})]  # a sweep keeps counts only
    first = errors[0] if errors else "unknown error"
    return f"no request succeeded ({failed} failed); the first error: {first}"


def _common(args, num_prompts: int):
    import json

    _vllm_names(args)

    from tianxia.bench.runner import WorkloadConfig, build_workload, load_bench_tokenizer
    from tianxia.bench.serve import ClientConfig

    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    wl = WorkloadConfig(name=args.workload, input_len=args.input_len, output_len=args.output_len,
                        prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                        dataset=args.dataset, max_input_len=args.max_input_len,
                        num_turns=args.num_turns)
    tok, tok_name = load_bench_tokenizer(args.tokenizer, args.model)
    if tok is None and args.workload in ("random", "prefix", "multi-turn"):
        raise ValueError(f"the {args.workload} workload builds N-token prompts and needs a "
                         f"tokenizer; --model {args.model!r} is not a local model: pass "
                         "--tokenizer (e.g. --tokenizer smollm2-135m or a .gguf path)")
    requests = build_workload(wl, tok, num_prompts, args.seed, args.endpoint)
    client = ClientConfig(
        base_url=args.base_url, model=args.served_model_name or args.model,
        endpoint=args.endpoint,
        request_rate=getattr(args, "request_rate", math.inf), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        temperature=args.temperature, timeout_s=args.timeout, api_key=args.api_key,
        seed=args.seed, save_text=args.save_text, extra_body=extra)
    client.url  # noqa: B018 - validates the endpoint
    return wl, tok, tok_name, requests, client


def cmd_serve(args) -> int:
    from tianxia.bench.report import format_table, save_json
    from tianxia.bench.runner import run_serve

    if args.num_prompts <= 0:
        raise ValueError("--num-prompts must be positive")
    wl, tok, tok_name, requests, client = _common(args, args.num_prompts)
    result = run_serve(client, requests, tokenizer=tok, tokenizer_name=tok_name, workload=wl,
                       label=args.label, slo=_slo(args) or None,
                       progress=not args.no_progress, warmup=args.warmup)
    print(format_table(result))
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    out = _result_path(args, f"{rate}qps" + (f"-c{args.max_concurrency}"
                                             if args.max_concurrency else ""))
    if out:
        print(f"result: {save_json(result, out)}", file=sys.stderr)
    if args.plot:
        from tianxia.bench.plot import plot_run

        print(f"plot: {plot_run(result, args.plot)}", file=sys.stderr)
    failure = _no_success([result])
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0


def cmd_sweep(args) -> int:
    from tianxia.bench.report import save_json, sweep_markdown
    from tianxia.bench.runner import run_sweep

    kind = "concurrency" if args.concurrency else "rate"
    loads = sorted(args.concurrency or args.request_rates)
    if kind == "concurrency":
        loads = [float(int(x)) for x in loads]

    def prompts_for(load: float) -> int:
        if args.num_prompts:
            return args.num_prompts
        return max(8, 4 * int(load)) if kind == "concurrency" else max(8, math.ceil(10 * load))

    need = max(prompts_for(x) for x in loads)
    wl, tok, tok_name, requests, client = _common(args, need)
    slo = _slo(args)

    def on_point(pt):
        s = pt["summary"]
        verdict = "" if not slo else ("  meets SLO" if pt["meets_slo"]
                                      else "  misses SLO: " + "; ".join(pt["slo_violations"]))
        print(f"{kind}={pt['load']}: {s['completed']} ok / {s['failed']} failed, "
              f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} tok/s, "
              f"p99 TTFT {s['ttft_ms']['p99'] or 0:.0f} ms, p99 TPOT {s['tpot_ms']['p99'] or 0:.1f} ms"
              f"{verdict}", file=sys.stderr, flush=True)

    sweep = run_sweep(client, requests, kind=kind, loads=loads, prompts_for=prompts_for,
                      slo_p99=slo, max_failed=args.slo_max_failed, stop_on_fail=args.stop_on_fail,
                      tokenizer=tok, tokenizer_name=tok_name, workload=wl, label=args.label,
                      progress=not args.no_progress, warmup=args.warmup, on_point=on_point)
    print(sweep_markdown(sweep))
    if slo:
        if sweep["best_load"] is None:
            print(f"\nno {kind} tried meets the SLO", flush=True)
        else:
            b = sweep["best_summary"]
            what = "peak concurrency supported" if kind == "concurrency" else "highest rate"
            print(f"\n{what} within the SLO: {sweep['best_load']} "
                  f"({b['request_throughput']:.2f} req/s, {b['output_throughput']:.1f} output tok/s, "
                  f"measured peak concurrency {b['peak_concurrency']})")
    out = _result_path(args, f"sweep-{kind}")
    if out:
        print(f"result: {save_json(sweep, out)}", file=sys.stderr)
    if args.plot:
        from tianxia.bench.plot import plot_sweep

        print(f"plot: {plot_sweep(sweep, args.plot)}", file=sys.stderr)
    failure = _no_success(sweep["points"])
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0


def cmd_compare(args) -> int:
    from tianxia.bench.report import apply_labels, compare_markdown, load_result

    results = [load_result(p) for p in args.results]
    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    apply_labels(results, labels)
    table = compare_markdown(results, baseline=args.baseline)
    print(table)
    if args.output:
        from pathlib import Path

        Path(args.output).write_text(table + "\n", encoding="utf-8")
        print(f"table: {args.output}", file=sys.stderr)
    if args.plot:
        from tianxia.bench.plot import plot_compare

        print(f"plot: {plot_compare(results, args.plot)}", file=sys.stderr)
    return 0
