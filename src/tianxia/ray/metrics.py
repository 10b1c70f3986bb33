"""A replica's engine statistics through Ray's metrics, so one Prometheus scrape of the Ray
cluster (each node's metrics agent) sees every replica.

Under vLLM's names with ``_`` for ``:`` (Ray refuses ``:``; Ray prefixes ``ray_`` and counters
end in ``_total`` when exported: ``ray_vllm_num_requests_running``,
``ray_vllm_prefix_cache_hits_total``), as Ray's own vLLM deployments export them.
``ray.serve.metrics`` tags each series with its ``deployment``, ``replica`` and ``application``;
``model_name`` is the served model. The engine's statistics are sampled every ``period_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ray.serve.metrics import Counter, Gauge

# (engine stats key, metric name, description)
_GAUGES = (
    ("num_running", "vllm_num_requests_running", "Requests in this replica's engine batches."),
    ("num_waiting", "vllm_num_requests_waiting", "Requests waiting in this replica's engine."),
    ("kv_cache_usage", "vllm_kv_cache_usage_perc",
     "This replica's KV-cache usage. 1 means 100 percent usage."),
)
_COUNTERS = (
    ("prompt_tokens", "vllm_prompt_tokens", "Prefill tokens this replica processed."),
    ("generation_tokens", "vllm_generation_tokens", "Tokens this replica generated."),
    ("prefix_cache_queries", "vllm_prefix_cache_queries",
     "Prompt tokens this replica looked up in its prefix cache."),
    ("prefix_cache_hits", "vllm_prefix_cache_hits",
     "Prompt tokens this replica served from its prefix cache (cached prompt tokens)."),
    ("num_preemptions", "vllm_num_preemptions", "Preemptions in this replica's engine."),
)


class ReplicaMetrics:
    """``stats()`` gives each served model's latest engine statistics (``ServerMetrics``'
    sources, the numbers the replica's own ``/metrics`` shows)."""

    def __init__(self, stats: Callable[[], dict[str, dict]]) -> None:
        self._stats = stats
        tags = ("model_name",)
        self._gauges = [(key, Gauge(name, description=doc, tag_keys=tags))
                        for key, name, doc in _GAUGES]
        self._counters = [(key, Counter(name, description=doc, tag_keys=tags))
                          for key, name, doc in _COUNTERS]
        self._totals: dict[tuple[str, str], float] = {}  # the engine's cumulative counts

    def record(self) -> None:
        for model, stats in self._stats().items():
            tags = {"model_name": model}
            for key, gauge in self._gauges:
                gauge.set(float(stats.get(key, 0)), tags)
            for key, counter in self._counters:
                # Ray's counters take increments; the engine keeps totals
                total = float(stats.get(key, 0))
                delta = total - self._totals.get((model, key), 0.0)
                if delta > 0:
                    counter.inc(delta, tags)
                self._totals[(model, key)] = total

    async def run(self, period_s: float = 1.0) -> None:
        while True:
            self.record()
            await asyncio.sleep(period_s)
