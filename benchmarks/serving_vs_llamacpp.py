#!/usr/bin/env python
"""tianxia serve against llama.cpp's llama-server, same GGUF, same threads, same run.

For each engine in turn (never both at once: on a small machine they would fight for the cores):
start its HTTP server on a free local port, run the same random workload (default 128 prompt
tokens / 64 output tokens, exact lengths via ignore_eos) at each concurrency (default 1, 4, 16)
with ``tianxia bench``'s sweep (greedy unless ``--temperature``, ``--top-p``, ``--top-k`` or
``--min-p`` are given), stop the server. Then write the side-by-side table with ratios.

    benchmarks/build_llama_server.sh                       # once, builds /work/llama.cpp-build
    python benchmarks/serving_vs_llamacpp.py               # -> benchmarks/results/serving/<date>/
    python benchmarks/serving_vs_llamacpp.py --llama-np 4,16 --concurrency 1,4,16

llama-server runs with ``-t/-tb THREADS -np NP -cb -c NP*CTX_PER_SLOT``; tianxia with
``--threads THREADS --max-num-seqs MAX(NP)``. With several ``--llama-np`` values each is measured
and the table uses, per concurrency, the best llama.cpp throughput (and says which ``-np``).
Outputs: one sweep JSON per engine, ``serving_vs_llamacpp.md`` (tables), ``compare.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LLAMA = "/work/llama.cpp-build/bin/llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(cmd: list[str], port: int, log: Path, timeout: float = 300.0):
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}; see {log}:\n"
                                   + log.read_text()[-3000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"server not healthy after {timeout:.0f} s; see {log}")
            time.sleep(0.5)
        print(f"  healthy after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def llama_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30,
                             check=False)
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "version" in ln.lower()]
        return lines[0].strip() if lines else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="tianxia model spec of a GGUF file")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", DEFAULT_LLAMA))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--llama-np", default="16", help="llama-server -np values to try, e.g. 4,16")
    ap.add_argument("--ctx-per-slot", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-concurrency", type=int, default=4,
                    help="prompts per point = max(--min-prompts, this x concurrency)")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--out-dir", default=None, help="default: benchmarks/results/serving/<date-time>")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-tianxia", action="store_true")
    ap.add_argument("--tianxia-args", default="", help="extra args for tianxia serve")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature sent with every request (0 = greedy)")
    ap.add_argument("--top-p", type=float, default=None,
                    help="top_p sent with every request (default: not sent, the server's own)")
    ap.add_argument("--top-k", type=int, default=None,
                    help="top_k sent with every request (default: not sent, the server's own)")
    ap.add_argument("--min-p", type=float, default=None,
                    help="min_p sent with every request (default: not sent, the server's own)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure every engine this many times, alternating which goes first; "
                         "each point reports the best round (default: %(default)s)")
    args = ap.parse_args()

    from tianxia.bench.plot import plot_compare
    from tianxia.bench.report import compare_markdown, save_json
    from tianxia.bench.runner import WorkloadConfig, build_workload, host_info, run_sweep
    from tianxia.bench.serve import ClientConfig
    from tianxia.bench.workloads import LenSpec
    from tianxia.loader.hub import resolve_model
    from tianxia.loader.tokenizer import load_tokenizer

    conc = [int(x) for x in args.concurrency.split(",")]
    nps = [int(x) for x in args.llama_np.split(",")]
    gguf = resolve_model(args.model)
    if not gguf.is_file():
        raise SystemExit(f"{args.model} is not a GGUF file; llama-server needs one")
    if not args.skip_llama and not shutil.which(args.llama_server) and \
            not Path(args.llama_server).is_file():
        raise SystemExit(f"no llama-server at {args.llama_server}: run "
                         "benchmarks/build_llama_server.sh or pass --llama-server")
    out = Path(args.out_dir or REPO / "benchmarks" / "results" / "serving" /
               dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)

    tok = load_tokenizer(gguf, is_gguf=True)
    wl = WorkloadConfig(input_len=LenSpec(args.input_len, args.input_len),
                        output_len=LenSpec(args.output_len, args.output_len))

    def prompts_for(c: float) -> int:
        return max(args.min_prompts, args.prompts_per_concurrency * int(c))

    requests = build_workload(wl, tok, max(prompts_for(c) for c in conc), seed=0,
                              endpoint="completions")
    served_name = args.model

    truncation = {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k), ("min_p", args.min_p))
                  if v is not None}

    def sweep(label: str, base: str) -> dict:
        client = ClientConfig(base_url=base, model=served_name, endpoint="completions", seed=0,
                              temperature=args.temperature, extra_body=truncation)

        def on_point(pt):
            s = pt["summary"]
            print(f"  {label} c={pt['load']}: {s['completed']} ok / {s['failed']} failed, "
                  f"{s['output_throughput']:.1f} out tok/s, TTFT p50 "
                  f"{s['ttft_ms']['median'] or 0:.0f} ms, TPOT p50 {s['tpot_ms']['median'] or 0:.1f} ms",
                  file=sys.stderr, flush=True)

        return run_sweep(client, requests, kind="concurrency", loads=[float(c) for c in conc],
                         prompts_for=prompts_for, tokenizer=tok, tokenizer_name=str(gguf),
                         workload=wl, label=label, progress=True, warmup=2, on_point=on_point)

    engines: list[tuple[str, list[str], Path]] = []  # (label, command without the port, log)
    if not args.skip_llama:
        for np_ in nps:
            engines.append((f"llama.cpp -np {np_}", [
                args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
                "-t", str(args.threads), "-tb", str(args.threads), "-np", str(np_), "-cb",
                "-c", str(np_ * args.ctx_per_slot), "--alias", served_name], out / f"llama-np{np_}"))
    if not args.skip_tianxia:
        engines.append(("tianxia", [
            sys.executable, "-m", "tianxia.cli", "serve", str(gguf), "--host", "127.0.0.1",
            "--port", "{port}", "--threads", str(args.threads),
            "--max-num-seqs", str(max(nps + conc)), "--served-model-name", served_name,
            "--disable-log-stats", "--disable-access-log", *args.tianxia_args.split()],
            out / "tianxia"))
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "host": host_info(),
            "model": str(gguf), "threads": args.threads, "rounds": args.rounds,
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
            "load_before": loadavg(), "load_per_run": []}
    if not args.skip_llama:
        meta["llama_server"] = llama_version(args.llama_server)
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in engines}
    os.environ.pop("TIANXIA_API_KEY", None)  # the spawned tianxia must not require a key
    for rnd in range(args.rounds):
        # ABBA: alternate which engine goes first, so a drifting background load hits both alike
        order = engines if rnd % 2 == 0 else engines[::-1]
        for label, template, log in order:
            port = free_port()
            cmd = [x.replace("{port}", str(port)) for x in template]
            load0 = loadavg()
            with server(cmd, port, log.with_name(f"{log.name}-r{rnd}.log")) as base:
                res = sweep(f"{label}", base)
            res["server_cmd"], res["round"] = cmd, rnd
            meta["load_per_run"].append({"engine": label, "round": rnd, "before": load0,
                                         "after": loadavg()})
            save_json(res, out / f"{log.name}-r{rnd}.json")
            runs[label].append(res)
    results = [best_of(rs) for rs in runs.values() if rs]
    for r in results:
        save_json(r, out / f"{r['label'].replace(' ', '').replace('.', '')}-best.json")
    meta["load_after"] = loadavg()

    sampling = ("greedy" if args.temperature == 0 else f"temperature {args.temperature}"
                + "".join(f", {k} {v}" for k, v in truncation.items()))
    md = [(f"Model `{gguf.name}`, {args.input_len} prompt / {args.output_len} output tokens "
           f"(random, exact lengths), {sampling}, {args.threads} threads each, one engine at a time, "
           f"{args.rounds} rounds in ABBA order, best round per point. "
           f"{meta['host']['cpu']}, {meta['host']['cores']} cores. {meta['date']}. "
           f"Load average before/after: {meta['load_before']} / {meta['load_after']}.")]
    if meta.get("llama_server"):
        md.append(f"llama-server: {meta['llama_server']}.")
    md.append("")
    md.append(ratio_table(results, conc))
    md.append("")
    md.append("Output tokens/s of every round (the spread shows the background load):")
    md.append("")
    md.append(rounds_table(results, conc))
    md.append("")
    md.append("Best rounds in full:")
    md.append("")
    llama_labels = [r["label"] for r in results if r["label"].startswith("llama")]
    md.append(compare_markdown(results, baseline=llama_labels[-1] if llama_labels and any(
        r["label"] == "tianxia" for r in results) else None))
    text = "\n".join(md) + "\n"
    (out / "serving_vs_llamacpp.md").write_text(text)
    save_json(meta, out / "meta.json")
    plot_compare(results, out / "compare.png")
    print(text)
    print(f"results in {out}", file=sys.stderr)
    return 0


def best_of(rounds: list[dict]) -> dict:
    """One sweep per engine: at each load the round with the highest output throughput, with the
    other rounds' throughputs kept under ``rounds_output_throughput``."""
    best = json.loads(json.dumps(rounds[0]))
    best["points"] = []
    for i in range(len(rounds[0]["points"])):
        cands = [r["points"][i] for r in rounds if i < len(r["points"])]
        top = max(cands, key=lambda p: p["summary"]["output_throughput"] or 0.0)
        top = dict(top, rounds_output_throughput=[p["summary"]["output_throughput"] for p in cands])
        best["points"].append(top)
    best["rounds"] = len(rounds)
    return best


def rounds_table(results: list[dict], conc: list[int]) -> str:
    lines = ["| engine | " + " | ".join(f"c={c}" for c in conc) + " |",
             "|---|" + "---|" * len(conc)]
    for r in results:
        cells = []
        for c in conc:
            p = next((p for p in r["points"] if p["load"] == c), None)
            vals = (p or {}).get("rounds_output_throughput") or []
            cells.append(", ".join(f"{v:.1f}" for v in vals) or "-")
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(results: list[dict], conc: list[int]) -> str:
    """Per concurrency: tianxia vs the best llama.cpp -np, output tok/s, TTFT, TPOT, E2E."""
    tx = next((r for r in results if r["label"] == "tianxia"), None)
    llamas = [r for r in results if r["label"].startswith("llama")]

    def point(res, c):
        return next((p for p in res["points"] if p["load"] == c), None) if res else None

    head = ["concurrency", "tianxia out tok/s", "llama.cpp out tok/s", "tianxia / llama.cpp",
            "TTFT p50 ms (tx / lc)", "TPOT p50 ms (tx / lc)", "E2E p50 ms (tx / lc)",
            "req/s (tx / lc)", "failed (tx / lc)", "best -np"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def g(p, key, stat=None):
        if p is None:
            return None
        v = p["summary"][key]
        return v[stat] if stat else v

    def f(v, nd=1):
        return "-" if v is None else f"{v:.{nd}f}"

    for c in conc:
        pt = point(tx, c)
        cands = [(point(r, c), r["label"]) for r in llamas if point(r, c)]
        best, blabel = max(cands, key=lambda x: x[0]["summary"]["output_throughput"] or 0,
                           default=(None, "-"))
        a, b = g(pt, "output_throughput"), g(best, "output_throughput")
        ratio = f"{a / b:.2f}x" if a and b else "-"
        lines.append("| " + " | ".join([
            str(c), f(a), f(b), ratio,
            f"{f(g(pt, 'ttft_ms', 'median'), 0)} / {f(g(best, 'ttft_ms', 'median'), 0)}",
            f"{f(g(pt, 'tpot_ms', 'median'))} / {f(g(best, 'tpot_ms', 'median'))}",
            f"{f(g(pt, 'e2el_ms', 'median'), 0)} / {f(g(best, 'e2el_ms', 'median'), 0)}",
            f"{f(g(pt, 'request_throughput'), 2)} / {f(g(best, 'request_throughput'), 2)}",
            f"{g(pt, 'failed') if pt else '-'} / {g(best, 'failed') if best else '-'}",
            blabel.replace("llama.cpp ", ""),
        ]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
