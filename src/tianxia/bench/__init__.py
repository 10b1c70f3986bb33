"""Serving benchmarks against any OpenAI-compatible server (``tianxia bench``).

``tianxia bench serve`` sends a workload (``random``, ``prefix``, ``multi-turn`` or ``file``) to
``/v1/completions`` or ``/v1/chat/completions`` with streaming, times every chunk, and reports
throughput, peak concurrency, TTFT / TPOT / ITL / E2E latency and failures; ``bench sweep`` repeats
it over concurrencies or request rates and finds the highest load meeting p99 SLOs; ``bench
compare`` tabulates several result files. Metric definitions: :mod:`tianxia.bench.metrics`.

Modules: ``workloads`` (prompts), ``serve`` (async client), ``metrics`` (records, summaries),
``runner`` (serve / sweep as functions), ``report`` (tables, JSON I/O), ``plot``, ``cli``.

Result JSON (``--save-result``), schema ``"tianxia.bench.serve/1"``::

    {
      "schema": "tianxia.bench.serve/1",
      "label": str | null,              # engine / run name (--label)
      "date": ISO-8601 UTC, "tianxia_version": str,
      "start_monotonic_s": float,       # the host's monotonic clock when the requests began
      "host": {"cpu": str, "cores": int, "platform": str, "python": str},   # the client machine
      "config": {
        "base_url", "endpoint": "completions"|"chat", "model", "tokenizer": path | null,
        "workload": {"name": "random"|"prefix"|"multi-turn"|"file", "input_len": N | [lo, hi],
                     "output_len": N | [lo, hi] | "from file", "prefix_len", "num_prefixes",
                     "num_turns", "dataset"},
        "num_prompts": int, "request_rate": float | "inf", "burstiness": float | "inf",
        "max_concurrency": int | null, "seed", "temperature", "ignore_eos": bool,
        "warmup": int, "extra_body": {}
      },
      "notes": [str],                   # e.g. "server rejected 'min_tokens' ...; sent without it"
      "summary": {
        "num_requests", "completed", "failed", "duration_s",
        "total_input_tokens", "total_output_tokens", "total_expected_output_tokens",
        "request_throughput", "input_throughput", "output_throughput",
        "total_token_throughput",       # per second, over duration_s
        "peak_concurrency": int, "mean_concurrency": float,
        "ttft_ms" | "tpot_ms" | "itl_ms" | "e2el_ms":
            {"mean", "std", "median", "p90", "p99", "min", "max", "count"},  # null when no data
        "output_tokens_source": {"usage"|"tokenizer"|"chunks": count},
        "total_cached_tokens",          # usage.prompt_tokens_details.cached_tokens, summed
        "cache_hit_rate",               # / those requests' prompt tokens (null: not reported)
        "errors": {message: count},
        # with --slo-*: "slo_s", "good_requests", "goodput", "meets_slo_p99", "slo_violations"
      },
      "requests": [{                    # one per request, in workload order
        "index", "success", "error", "http_status",
        "start_s",                      # send time after the benchmark start
        "ttft_s", "e2e_s", "tpot_s", "itl_s": [s, ...], "num_chunks",
        "expected_input_tokens",        # our tokenizer (chat: after the chat template)
        "usage_prompt_tokens", "usage_cached_tokens", "input_tokens",
        "expected_output_tokens",       # max_tokens asked for
        "usage_completion_tokens", "counted_output_tokens",   # server's usage / re-tokenized text
        "output_tokens", "output_tokens_source", "finish_reason", "dropped_fields",
        "text"                          # only with --save-text
      }]
    }

Sweep JSON (``bench sweep --save-result``), schema ``"tianxia.bench.sweep/1"``::

    {"schema", "label", "date", "host", "load_kind": "concurrency"|"rate", "config",
     "slo_p99_s": {"ttft"|"tpot"|"itl"|"e2el": seconds}, "max_failed": int,
     "points": [{"load", "config", "start_monotonic_s", "summary", "notes", "meets_slo": bool,
                 "slo_violations": [str]}],
     "best_load": number | null,        # highest load whose p99s meet every SLO
     "best_summary": {"request_throughput", "output_throughput", "peak_concurrency"} | null}

``bench compare`` reads both kinds (each sweep point becomes a row).
"""

from tianxia.bench.metrics import RequestRecord, summarize
from tianxia.bench.report import SERVE_SCHEMA, SWEEP_SCHEMA, load_result

__all__ = ["SERVE_SCHEMA", "SWEEP_SCHEMA", "RequestRecord", "load_result", "summarize"]
