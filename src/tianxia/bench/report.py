"""Result files, the end-of-run table, and ``bench compare``'s markdown."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SERVE_SCHEMA = "tianxia.bench.serve/1"
SWEEP_SCHEMA = "tianxia.bench.sweep/1"


def _f(v: Any, nd: int = 2) -> str:
    if v is None or (isinstance(v, float) and (math.isnan(v) or math.isinf(v))):
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{nd}f}"


def load_label(result: dict[str, Any]) -> str:
    """``c=4`` / ``rate=2.0/s`` / ``c=4, rate=2.0/s`` for a serve result's config."""
    cfg = result.get("config", {})
    parts = []
    if cfg.get("max_concurrency"):
        parts.append(f"c={cfg['max_concurrency']}")
    rate = cfg.get("request_rate")
    if rate not in (None, "inf") and not (isinstance(rate, float) and math.isinf(rate)):
        parts.append(f"rate={rate}/s")
    return ", ".join(parts) or "all at once"


def format_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    cfg = result["config"]
    w = cfg.get("workload", {})
    lines = []
    title = f" Serving benchmark: {result.get('label') or cfg.get('model')} "
    lines.append(title.center(60, "="))

    def row(name: str, val: Any, nd: int = 2) -> None:
        lines.append(f"{name:<42}{_f(val, nd) if not isinstance(val, str) else val:>18}")

    lines.append(f"Target: {cfg.get('base_url')} ({cfg.get('endpoint')}), model {cfg.get('model')}")
    row("Workload:", f"{w.get('name')} {w.get('input_len', '')}/{w.get('output_len', '')}")
    row("Load:", load_label(result))
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if "goodput" in s:
        row("Request goodput (req/s):", s["goodput"])
    row("Input token throughput (tok/s):", s["input_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    row("Peak concurrent requests:", s["peak_concurrency"])
    if s.get("cache_hit_rate") is not None:
        row("Cached prompt tokens:", s["total_cached_tokens"])
        row("Prefix cache hit rate (%):", 100 * s["cache_hit_rate"], 1)
    for key, name in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                      ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(name.center(60, "-"))
        st = s[f"{key}_ms"]
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} "
                f"{key.upper()} (ms):", st.get(stat))
    if s.get("errors"):
        lines.append("Errors".center(60, "-"))
        for msg, n in list(s["errors"].items())[:10]:
            lines.append(f"{n:>5} x {msg[:200]}")
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    lines.append("=" * 60)
    return "\n".join(lines)


def save_json(obj: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, default=_json_default) + "\n", encoding="utf-8")
    return p


def _json_default(o: Any):
    if isinstance(o, float) and math.isinf(o):
        return "inf"
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def load_result(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no such result file: {p}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not JSON: {e}") from None
    schema = obj.get("schema") if isinstance(obj, dict) else None
    if schema not in (SERVE_SCHEMA, SWEEP_SCHEMA):
        raise ValueError(f"{p} is not a tianxia bench result (schema {schema!r})")
    obj.setdefault("_path", str(p))
    return obj


def flatten(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Serve results as they are; each sweep point as a serve-like result of its sweep's label."""
    rows = []
    for r in results:
        if r.get("schema") == SWEEP_SCHEMA:
            for pt in r["points"]:
                rows.append({"schema": SERVE_SCHEMA, "label": r.get("label"),
                             "config": pt["config"], "summary": pt["summary"],
                             "_path": r.get("_path")})
        else:
            rows.append(r)
    return rows


def _load_key(r: dict[str, Any]) -> tuple:
    cfg = r.get("config", {})
    rate = cfg.get("request_rate")
    rate = math.inf if rate in (None, "inf") else float(rate)
    return (cfg.get("max_concurrency") or 0, rate)


COMPARE_COLUMNS = [
    ("req/s", lambda s: s["request_throughput"], 2),
    ("out tok/s", lambda s: s["output_throughput"], 1),
    ("TTFT p50 ms", lambda s: s["ttft_ms"]["median"], 0),
    ("TTFT p99 ms", lambda s: s["ttft_ms"]["p99"], 0),
    ("TPOT p50 ms", lambda s: s["tpot_ms"]["median"], 1),
    ("TPOT p99 ms", lambda s: s["tpot_ms"]["p99"], 1),
    ("ITL p50 ms", lambda s: s["itl_ms"]["median"], 1),
    ("E2E p50 ms", lambda s: s["e2el_ms"]["median"], 0),
]


def _hit_percent(s: dict[str, Any]) -> float | None:
    rate = s.get("cache_hit_rate")
    return None if rate is None else 100 * rate


def apply_labels(results: list[dict[str, Any]], labels: list[str] | None = None) -> None:
    """Give each loaded result a label: from ``labels``, its own, or its file name."""
    if labels and len(labels) != len(results):
        raise ValueError(f"{len(labels)} labels for {len(results)} result files")
    for i, r in enumerate(results):
        if labels:
            r["label"] = labels[i]
        elif not r.get("label"):
            r["label"] = Path(r.get("_path") or f"result{i}").stem


def compare_markdown(results: list[dict[str, Any]], baseline: str | None = None) -> str:
    """One row per (engine, load), grouped by load; ratios against ``baseline`` at the same load."""
    apply_labels(results)
    rows = flatten(results)
    engines = list(dict.fromkeys(r["label"] for r in rows))
    base = baseline if baseline is not None else (engines[0] if len(engines) > 1 else None)
    if base is not None and base not in engines:
        raise ValueError(f"baseline {base!r} is not one of {engines}")
    loads = sorted({_load_key(r) for r in rows})
    columns = list(COMPARE_COLUMNS)
    if any(r["summary"].get("cache_hit_rate") is not None for r in rows):
        columns.insert(2, ("cache hit %", _hit_percent, 1))
    header = ["engine", "load", "ok/failed", "peak conc"] + [c[0] for c in columns]
    if base is not None:
        header += [f"out tok/s vs {base}", f"TPOT p50 vs {base}", f"TTFT p50 vs {base}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for load in loads:
        at = [r for r in rows if _load_key(r) == load]
        ref = next((r for r in at if r["label"] == base), None)
        for r in sorted(at, key=lambda x: engines.index(x["label"])):
            s = r["summary"]
            cells = [r["label"], load_label(r), f"{s['completed']}/{s['failed']}",
                     str(s["peak_concurrency"])]
            cells += [_f(get(s), nd) for _, get, nd in columns]
            if base is not None:
                cells += _ratios(s, ref["summary"] if ref else None)
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def _ratios(s: dict[str, Any], ref: dict[str, Any] | None) -> list[str]:
    if ref is None:
        return ["-", "-", "-"]
    return [_ratio(s["output_throughput"], ref["output_throughput"]),
            _ratio(s["tpot_ms"]["median"], ref["tpot_ms"]["median"]),
            _ratio(s["ttft_ms"]["median"], ref["ttft_ms"]["median"])]


def sweep_markdown(sweep: dict[str, Any]) -> str:
    header = ["load", "ok/failed", "req/s", "out tok/s", "peak conc", "TTFT p99 ms",
              "TPOT p99 ms", "ITL p99 ms", "E2E p99 ms", "meets SLO"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for pt in sweep["points"]:
        s = pt["summary"]
        lines.append("| " + " | ".join([
            f"{'c' if sweep['load_kind'] == 'concurrency' else 'rate'}={pt['load']}",
            f"{s['completed']}/{s['failed']}", _f(s["request_throughput"]),
            _f(s["output_throughput"], 1), str(s["peak_concurrency"]),
            _f(s["ttft_ms"]["p99"], 0), _f(s["tpot_ms"]["p99"], 1), _f(s["itl_ms"]["p99"], 1),
            _f(s["e2el_ms"]["p99"], 0),
            ("yes" if pt["meets_slo"] else "no: " + "; ".join(pt["slo_violations"]))
            if pt.get("meets_slo") is not None else "-",
        ]) + " |")
    return "\n".join(lines)
