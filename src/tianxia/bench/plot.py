"""PNG plots with matplotlib's Agg backend: one run, a sweep, or several engines side by side."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install 'matplotlib>=3.8'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110, format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return p


def plot_run(result: dict[str, Any], path: str | Path) -> Path:
    """Latency distributions (TTFT, TPOT, ITL, E2E) and output tokens/s and requests over time."""
    from tianxia.bench.metrics import RequestRecord, inflight_over_time, tokens_over_time

    plt = _plt()
    recs = [RequestRecord.from_json(d) for d in result.get("requests", [])]
    ok = [r for r in recs if r.success]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    title = f"{result.get('label') or result['config'].get('model')}  " \
            f"({result['summary']['completed']} ok, {result['summary']['failed']} failed)"
    fig.suptitle(title)
    dists = [
        ("TTFT (ms)", [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
        ("TPOT (ms)", [r.tpot_s * 1000 for r in ok if r.tpot_s is not None]),
        ("ITL (ms)", [x * 1000 for r in ok for x in r.itl_s]),
        ("E2E latency (ms)", [r.e2e_s * 1000 for r in ok if r.e2e_s is not None]),
    ]
    for ax, (name, vals) in zip(axes.flat[:4], dists):
        ax.set_title(name)
        if vals:
            ax.hist(vals, bins=min(50, max(5, len(vals) // 2)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "-"), (99, "--")):
                v = float(np.percentile(vals, q))
                ax.axvline(v, color="tab:red", linestyle=style, label=f"p{q} {v:.1f}")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel("count")
    ax = axes.flat[4]
    x, y = tokens_over_time(recs)
    ax.set_title("output tokens/s over time")
    if len(x):
        ax.plot(x, y, color="tab:green")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens/s")
    ax = axes.flat[5]
    x, y = inflight_over_time(recs)
    ax.set_title("requests in flight")
    ax.plot(x, y, color="tab:purple")
    ax.set_xlabel("time since start (s)")
    return _save(fig, path)


def plot_sweep(sweep: dict[str, Any], path: str | Path) -> Path:
    """Saturation curve: throughput and p99 latencies against load, SLO lines and the best load."""
    plt = _plt()
    pts = sweep["points"]
    loads = [p["load"] for p in pts]
    kind = sweep["load_kind"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    fig.suptitle(f"{sweep.get('label') or sweep['config'].get('model')}: sweep over {kind}")

    def series(key, stat):
        return [p["summary"][f"{key}_ms"][stat] for p in pts]

    ax = axes[0]
    ax.plot(loads, [p["summary"]["output_throughput"] for p in pts], "o-", label="output tok/s")
    ax.set_xlabel(kind)
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(loads, [p["summary"]["request_throughput"] for p in pts], "s--", color="tab:orange",
             label="req/s")
    ax2.set_ylabel("requests/s")
    ax.set_title("throughput")
    for ax, key in ((axes[1], "ttft"), (axes[2], "tpot")):
        ax.plot(loads, _nan(series(key, "median")), "o-", label="p50")
        ax.plot(loads, _nan(series(key, "p99")), "s-", label="p99")
        lim = (sweep.get("slo_p99_s") or {}).get(key)
        if lim is not None:
            ax.axhline(lim * 1000, color="tab:red", linestyle="--", label="SLO p99")
        ax.set_title(f"{key.upper()} (ms)")
        ax.set_xlabel(kind)
        ax.legend(fontsize=8)
    best = sweep.get("best_load")
    if best is not None:
        for ax in axes:
            ax.axvline(best, color="tab:green", linestyle=":", alpha=0.8)
    if kind == "concurrency" and len(loads) > 1 and min(loads) > 0 and max(loads) / min(loads) >= 8:
        for ax in axes:
            ax.set_xscale("log", base=2)
    return _save(fig, path)


def _nan(v: list) -> list:
    return [math.nan if x is None else x for x in v]


def plot_compare(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Grouped bars per load: output tok/s, TTFT p50, TPOT p50 and E2E p50, one colour per engine."""
    from tianxia.bench.report import _load_key, flatten, load_label

    plt = _plt()
    rows = flatten(results)
    engines = list(dict.fromkeys(r.get("label") or f"result{i}" for i, r in enumerate(rows)))
    loads = sorted({_load_key(r) for r in rows})
    load_names = {}
    for r in rows:
        load_names.setdefault(_load_key(r), load_label(r))
    metrics = [("output tokens/s", lambda s: s["output_throughput"]),
               ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["median"]),
               ("TPOT p50 (ms)", lambda s: s["tpot_ms"]["median"]),
               ("E2E p50 (ms)", lambda s: s["e2el_ms"]["median"])]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 4.5))
    width = 0.8 / max(1, len(engines))
    xs = np.arange(len(loads))
    for ax, (name, get) in zip(axes, metrics):
        for k, eng in enumerate(engines):
            vals = []
            for ld in loads:
                r = next((r for r in rows if (r.get("label") or "") == eng and _load_key(r) == ld),
                         None)
                v = get(r["summary"]) if r else None
                vals.append(math.nan if v is None else v)
            ax.bar(xs + (k - (len(engines) - 1) / 2) * width, vals, width, label=eng)
        ax.set_xticks(xs)
        ax.set_xticklabels([load_names[ld] for ld in loads], fontsize=8)
        ax.set_title(name)
    axes[0].legend(fontsize=8)
    return _save(fig, path)
