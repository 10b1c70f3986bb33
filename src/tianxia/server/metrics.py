"""Prometheus metrics under vLLM's names, so dashboards built for ``vllm serve`` work unchanged.

Gauges and cumulative counters are read from the engine's latest statistics when ``/metrics`` is
scraped; histograms are fed by the engine thread (see :class:`StatsListener`). Every series carries
a ``model_name`` label. tianxia's own series (``tianxia:...``) describe the batches: how many
sequences each engine step ran, so one can see that concurrent requests share steps.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tianxia.engine.async_engine import RequestStats, StatsListener, StepStats

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

# vLLM's buckets
_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
_SEQS_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def _token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


def _pow2_buckets(max_value: int) -> list[int]:
    out, v = [1], 8
    while v <= max_value:
        out.append(v)
        v *= 2
    return out


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's latest statistics at scrape time."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], dict],
        info: dict[str, str],
        max_step_seqs: Callable[[], int],
    ) -> None:
        self.model_name = model_name
        self.stats = stats
        self.info = info
        self.max_step_seqs = max_step_seqs

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def _spec_decode(self, s: dict):
        """vLLM's speculative-decoding counters (only when speculation is configured)."""
        yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                            s["spec_decode_num_drafts"])
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                            s["spec_decode_num_draft_tokens"])
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                            s["spec_decode_num_accepted_tokens"])
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=["model_name", "position"])
        for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos

    def collect(self):
        s = self.stats()
        usage = float(s.get("kv_cache_usage", 0.0))
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.get("num_running", 0),
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.get("num_waiting", 0),
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage
        )
        yield self._gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage (older name of kv_cache_usage_perc).",
            usage,
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.get("prefix_cache_queries", 0),
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.get("prefix_cache_hits", 0),
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", s.get("prompt_tokens", 0)
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            s.get("generation_tokens", 0),
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemptions from the engine.",
            s.get("num_preemptions", 0),
        )
        if "spec_decode_num_drafts" in s:
            yield from self._spec_decode(s)
        yield self._gauge(
            "tianxia:step_num_seqs_max",
            "Most sequences that ran together in one engine step since start.",
            self.max_step_seqs(),
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the cache config.", labels=list(self.info)
        )
        info.add_metric(list(self.info.values()), 1.0)
        yield info


class ServerMetrics(StatsListener):
    """The ``/metrics`` registry of one server; also the engine's stats listener."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        stats: Callable[[], dict],
        max_step_seqs: Callable[[], int],
        cache_info: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.registry.register(_EngineCollector(model_name, stats, cache_info or {}, max_step_seqs))

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self.tpot = hist(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (older name of inter-token latency).",
            _ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            _LATENCY_BUCKETS,
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _LATENCY_BUCKETS,
        )
        self.inference_time = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _LATENCY_BUCKETS,
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _LATENCY_BUCKETS,
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _LATENCY_BUCKETS,
        )
        token_buckets = _token_buckets(max_model_len)
        self.req_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.req_gen_tokens = hist(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.req_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.req_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _pow2_buckets(max(max_model_len, 16384)),
        )
        self.step_seqs = hist(
            "tianxia:step_num_seqs",
            "Histogram of the number of sequences that ran together in one engine step.",
            _SEQS_BUCKETS,
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self.http_requests = Counter(
            "tianxia:http_requests",
            "HTTP requests answered, by status code.",
            labels + ["endpoint", "status"],
            registry=reg,
        )
        self.rejected = Counter(
            "tianxia:requests_rejected",
            "Requests turned away with 503 because the waiting queue was full.",
            labels,
            registry=reg,
        ).labels(model_name)
        self.draining = Gauge(
            "tianxia:server_draining",
            "1 while the server shuts down gracefully.",
            labels,
            registry=reg,
        ).labels(model_name)

    # --- StatsListener (engine thread) -------------------------------------------------------

    def on_step(self, step: StepStats) -> None:
        self.iteration_tokens.observe(step.num_tokens)
        self.step_seqs.observe(step.num_seqs)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_inter_token(self, latency_s: float, num_tokens: int) -> None:
        self.itl.observe(latency_s)
        self.tpot.observe(latency_s)

    def on_request_done(self, st: RequestStats) -> None:
        if st.finished is None:
            return
        reason = st.finish_reason or "abort"
        self.success.labels(self.model_name, reason).inc()
        if reason == "abort":
            return
        self.e2e.observe(st.finished - st.arrival)
        if st.scheduled is not None:
            self.queue_time.observe(st.scheduled - st.arrival)
            self.inference_time.observe(st.finished - st.scheduled)
            if st.first_token is not None:
                self.prefill_time.observe(st.first_token - st.scheduled)
                self.decode_time.observe(st.finished - st.first_token)
        self.req_prompt_tokens.observe(st.num_prompt_tokens)
        self.req_gen_tokens.observe(st.num_generation_tokens)
        if st.max_tokens is not None:
            self.req_max_tokens.observe(st.max_tokens)
        self.req_n.observe(st.n)

    # --- scrape ------------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)
