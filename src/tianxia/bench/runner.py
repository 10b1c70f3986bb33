"""``bench serve`` and ``bench sweep`` as functions: build the workload, run it, summarise."""

from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tianxia.bench import serve as _serve
from tianxia.bench.metrics import slo_report, summarize
from tianxia.bench.report import SERVE_SCHEMA, SWEEP_SCHEMA
from tianxia.bench.workloads import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    BenchRequest,
    LenSpec,
    file_workload,
    multi_turn_workload,
    prefix_workload,
    random_workload,
)

logger = logging.getLogger(__name__)


@dataclass
class WorkloadConfig:
    name: str = "random"  # random | prefix | multi-turn | file
    input_len: LenSpec = field(default_factory=lambda: LenSpec(DEFAULT_INPUT_LEN, DEFAULT_INPUT_LEN))
    output_len: LenSpec | None = None  # None: 64, or the file's reference replies
    prefix_len: int = 256
    num_prefixes: int = 1
    dataset: str | None = None
    max_input_len: int | None = None
    num_turns: int = 4  # multi-turn

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name}
        if self.name in ("random", "prefix", "multi-turn"):
            d["input_len"] = self.input_len.to_json()
        d["output_len"] = self.output_len.to_json() if self.output_len else (
            DEFAULT_OUTPUT_LEN if self.name != "file" else "from file")
        if self.name in ("prefix", "multi-turn"):
            d["prefix_len"], d["num_prefixes"] = self.prefix_len, self.num_prefixes
        if self.name == "multi-turn":
            d["num_turns"] = self.num_turns
        if self.name == "file":
            d["dataset"] = self.dataset
        return d


def load_bench_tokenizer(spec: str | None, model: str | None):
    """The tokenizer for ``spec`` (a tianxia model spec or HF tokenizer dir); ``spec=None`` tries
    ``model``, quietly giving ``None`` when it does not resolve locally. ``"none"`` disables it."""
    if spec is not None and spec.lower() == "none":
        return None, None
    from tianxia.loader.hub import resolve_model
    from tianxia.loader.tokenizer import load_tokenizer

    target = spec or model
    if not target:
        return None, None
    try:
        path = resolve_model(target, pull_missing=spec is not None)
    except Exception as e:
        p = Path(target).expanduser()
        if p.is_dir() and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(p)), str(p)
        if spec is not None:
            raise ValueError(f"cannot load tokenizer {spec!r}: {e}") from e
        logger.info("model %r does not resolve to a local model; no tokenizer", model)
        return None, None
    return load_tokenizer(path, is_gguf=path.is_file()), str(path)


def build_workload(wl: WorkloadConfig, tokenizer, num_prompts: int, seed: int,
                   endpoint: str) -> list[BenchRequest]:
    out_len = wl.output_len or LenSpec(DEFAULT_OUTPUT_LEN, DEFAULT_OUTPUT_LEN)
    if wl.name == "random":
        reqs = random_workload(tokenizer, num_prompts, wl.input_len, out_len, seed)
    elif wl.name == "prefix":
        reqs = prefix_workload(tokenizer, num_prompts, wl.prefix_len, wl.input_len, out_len, seed,
                               wl.num_prefixes)
    elif wl.name == "multi-turn":
        # the prompts grow with the replies: their lengths come from the server's usage
        return multi_turn_workload(tokenizer, num_prompts, wl.num_turns, wl.prefix_len,
                                   wl.input_len, out_len, seed, wl.num_prefixes)
    elif wl.name == "file":
        if not wl.dataset:
            raise ValueError("the file workload needs --dataset PATH")
        reqs = file_workload(wl.dataset, tokenizer, num_prompts, wl.output_len, seed,
                             max_input_len=wl.max_input_len)
    else:
        raise ValueError(f"unknown workload {wl.name!r}: random, prefix, multi-turn or file")
    if endpoint == "chat" and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        for r in reqs:  # what the server should see after applying the chat template
            try:
                ids = tokenizer.apply_chat_template(r.chat_messages(), add_generation_prompt=True,
                                                    tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                r.input_len = len(ids)
            except Exception:  # noqa: BLE001 - a template that needs other inputs
                break
    return reqs


def host_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "platform": platform.platform(),
            "python": platform.python_version()}


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def run_serve(client: _serve.ClientConfig, requests: list[BenchRequest], *, tokenizer=None,
              tokenizer_name: str | None = None, workload: WorkloadConfig | None = None,
              label: str | None = None, slo: dict[str, float] | None = None,
              progress: bool = True, warmup: int = 1, desc: str | None = None) -> dict[str, Any]:
    """Run one benchmark and return its result (see :mod:`tianxia.bench` for the schema)."""
    from tianxia import __version__

    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    records, duration, notes, start = _serve.run(client, requests, progress=progress, warmup=warmup,
                                          desc=desc or label or "bench")
    _serve.count_output_tokens(records, tokenizer, keep_text=client.save_text)
    summary = summarize(records, duration, slo=slo)
    short = [r.index for r in records if r.success and r.output_tokens < r.expected_output_tokens]
    if short:
        notes = [*notes, (f"{len(short)} requests generated fewer tokens than asked for "
                          "(EOS or a length limit: the server may ignore ignore_eos/min_tokens)")]
    if slo:
        ok, why = slo_report(summary, slo)
        summary["meets_slo_p99"], summary["slo_violations"] = ok, why
    return {
        "schema": SERVE_SCHEMA,
        "label": label,
        "date": started,
        # where each request's start_s counts from, on the host's monotonic clock (a server on the
        # same host logs its times at --log-level debug on that clock)
        "start_monotonic_s": round(start, 6),
        "tianxia_version": __version__,
        "host": host_info(),
        "config": {
            "base_url": client.base_url, "endpoint": client.endpoint, "model": client.model,
            "tokenizer": tokenizer_name,
            "workload": (workload or WorkloadConfig()).to_json(),
            "num_prompts": len(requests), "request_rate": _rate_json(client.request_rate),
            "burstiness": "inf" if math.isinf(client.burstiness) else client.burstiness,
            "max_concurrency": client.max_concurrency, "seed": client.seed,
            "temperature": client.temperature, "ignore_eos": client.ignore_eos,
            "warmup": warmup, "extra_body": client.extra_body,
        },
        "notes": notes,
        "summary": summary,
        "requests": [r.to_json() for r in records],
    }


def run_sweep(client: _serve.ClientConfig, requests: list[BenchRequest], *, kind: str,
              loads: list[float], prompts_for, slo_p99: dict[str, float] | None = None,
              max_failed: int = 0, stop_on_fail: bool = False, tokenizer=None,
              tokenizer_name: str | None = None, workload: WorkloadConfig | None = None,
              label: str | None = None, progress: bool = True, warmup: int = 1,
              keep_requests: bool = False, on_point=None) -> dict[str, Any]:
    """The same workload at each load (a concurrency or a request rate); the best load meeting the
    p99 SLOs is ``best_load``. ``prompts_for(load)`` gives the number of prompts per point."""
    import dataclasses

    if kind not in ("concurrency", "rate"):
        raise ValueError("kind must be 'concurrency' or 'rate'")
    points = []
    best = None
    for load in loads:
        n = prompts_for(load)
        c = dataclasses.replace(
            client,
            max_concurrency=int(load) if kind == "concurrency" else client.max_concurrency,
            request_rate=float(load) if kind == "rate" else client.request_rate)
        res = run_serve(c, requests[:n], tokenizer=tokenizer, tokenizer_name=tokenizer_name,
                        workload=workload, label=label, slo=slo_p99, progress=progress,
                        warmup=warmup if not points else 0,
                        desc=f"{label or 'sweep'} {'c' if kind == 'concurrency' else 'rate'}={load:g}")
        s = res["summary"]
        ok, why = slo_report(s, slo_p99 or {}, max_failed=max_failed)
        pt = {"load": int(load) if kind == "concurrency" else load, "config": res["config"],
              "start_monotonic_s": res["start_monotonic_s"],
              "summary": s, "notes": res["notes"], "meets_slo": ok, "slo_violations": why}
        if keep_requests:
            pt["requests"] = res["requests"]
        points.append(pt)
        if on_point is not None:
            on_point(pt)
        if ok and (best is None or load > best):
            best = load
        if stop_on_fail and not ok:
            break
    best_pt = next((p for p in points if p["load"] == best), None)
    return {
        "schema": SWEEP_SCHEMA,
        "label": label,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": host_info(),
        "load_kind": kind,
        "config": points[0]["config"] if points else {},
        "slo_p99_s": slo_p99 or {},
        "max_failed": max_failed,
        "points": points,
        "best_load": best_pt["load"] if best_pt else None,
        "best_summary": {
            "request_throughput": best_pt["summary"]["request_throughput"],
            "output_throughput": best_pt["summary"]["output_throughput"],
            "peak_concurrency": best_pt["summary"]["peak_concurrency"],
        } if best_pt else None,
    }
