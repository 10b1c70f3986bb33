"""``tianxia bench serve | sweep | compare``."""

from __future__ import annotations

import argparse
import math
import re
import sys

from tianxia.bench.workloads import parse_len

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
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root or .../v1 (default: %(default)s)")
    g.add_argument("--model", required=True, help="model name sent in requests")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token")
    g.add_argument("--label", default=None, help="name of this engine/run in tables and plots")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", "--dataset-name", dest="workload",
                   choices=("random", "prefix", "file"), default="random")
    w.add_argument("--input-len", type=_len, default=parse_len(128),
                   help="prompt tokens, N or LO:HI (random); suffix tokens (prefix). Default 128")
    w.add_argument("--output-len", type=_len, default=None,
                   help="tokens to generate, N or LO:HI (default 64; file: the reference replies)")
    w.add_argument("--prefix-len", type=int, default=256, help="shared prefix tokens (prefix)")
    w.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (prefix)")
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

    o = p.add_argument_group("output")
    o.add_argument("--save-result", default=None, metavar="OUT.json", help="write the result JSON")
    o.add_argument("--save-text", action="store_true", help="keep generated text in the result")
    o.add_argument("--plot", default=None, metavar="OUT.png", help="write plots")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")

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


def _common(args, num_prompts: int):
    import json

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
                        dataset=args.dataset, max_input_len=args.max_input_len)
    tok, tok_name = load_bench_tokenizer(args.tokenizer, args.model)
    if tok is None and args.workload in ("random", "prefix"):
        raise ValueError(f"the {args.workload} workload builds N-token prompts and needs a "
                         f"tokenizer; --model {args.model!r} is not a local model: pass "
                         "--tokenizer (e.g. --tokenizer smollm2-135m or a .gguf path)")
    requests = build_workload(wl, tok, num_prompts, args.seed, args.endpoint)
    client = ClientConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint,
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
    if args.save_result:
        print(f"result: {save_json(result, args.save_result)}", file=sys.stderr)
    if args.plot:
        from tianxia.bench.plot import plot_run

        print(f"plot: {plot_run(result, args.plot)}", file=sys.stderr)
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
    if args.save_result:
        print(f"result: {save_json(sweep, args.save_result)}", file=sys.stderr)
    if args.plot:
        from tianxia.bench.plot import plot_sweep

        print(f"plot: {plot_sweep(sweep, args.plot)}", file=sys.stderr)
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
