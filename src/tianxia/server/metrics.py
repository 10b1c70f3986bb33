"""Prometheus metrics under vLLM's names, so dashboards built for ``vllm serve`` work unchanged.

Gauges and cumulative counters are read from the engine's latest statistics when ``/metrics`` is
scraped; histograms are fed by the engine thread (see :class:`StatsListener`). Every series carries
a ``model_name`` label. tianxia's own series (``tianxia:...``) describe the batches: how many
sequences each engine step ran, so one can see that concurrent requests share steps.
"""

from __future__ import annotations

import time

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tianxia.engine.async_engine import RequestStats, StatsListener, StepStats

__all__ = ["CONTENT_TYPE_LATEST", "ModelMetrics", "ServerMetrics"]

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
_STEP_BUCKETS = [0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03,
                 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


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


@dataclass
class _EngineSource:
    stats: Callable[[], dict]
    info: dict[str, str]
    max_step_seqs: Callable[[], int]


class _EngineCollector(Collector):
    """Gauges and counters read from each loaded model's latest engine statistics at scrape
    time (one sample per model)."""

    def __init__(self, engines: dict[str, _EngineSource]) -> None:
        self.engines = engines

    def _family(self, kind, name: str, doc: str, values: dict[str, float]):
        f = kind(name, doc, labels=["model_name"])
        for model, value in values.items():
            f.add_metric([model], value)
        return f

    def _spec_decode(self, stats: dict[str, dict]):
        """vLLM's speculative-decoding counters, for the models that speculate."""
        spec = {m: s for m, s in stats.items() if "spec_decode_num_drafts" in s}
        if not spec:
            return
        counter = CounterMetricFamily
        for key, doc in (("spec_decode_num_drafts", "Number of spec decoding drafts."),
                         ("spec_decode_num_draft_tokens", "Number of draft tokens."),
                         ("spec_decode_num_accepted_tokens", "Number of accepted tokens.")):
            yield self._family(counter, f"vllm:{key}", doc, {m: float(s[key]) for m, s in spec.items()})
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=["model_name", "position"])
        for model, s in spec.items():
            for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                per_pos.add_metric([model, str(pos)], n)
        yield per_pos

    def _lora(self, stats: dict[str, dict]):
        """vLLM's ``lora_requests_info`` (one sample, its labels the adapters in use) and
        requests per adapter, for the models that serve adapters."""
        lora = {m: s for m, s in stats.items() if "lora_requests_total" in s}
        if not lora:
            return
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        total = CounterMetricFamily("tianxia:lora_requests", "Requests per LoRA adapter.",
                                    labels=["model_name", "lora_name"])
        for model, s in lora.items():
            info.add_metric([model, s["lora_running"], s["lora_waiting"], str(s["max_lora"])], time.time())
            for name, n in s["lora_requests_total"].items():
                total.add_metric([model, name], n)
        yield info
        yield total

    def collect(self):
        engines = dict(self.engines)  # models may load or unload while we scrape
        stats = {m: src.stats() for m, src in engines.items()}

        def per_model(key: str) -> dict[str, float]:
            return {m: float(s.get(key, 0)) for m, s in stats.items()}

        usage = per_model("kv_cache_usage")
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "vllm:num_requests_running",
                           "Number of requests in model execution batches.",
                           per_model("num_running"))
        yield self._family(gauge, "vllm:num_requests_waiting",
                           "Number of requests waiting to be processed.", per_model("num_waiting"))
        yield self._family(gauge, "vllm:kv_cache_usage_perc",
                           "KV-cache usage. 1 means 100 percent usage.", usage)
        yield self._family(
            gauge, "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage (older name of kv_cache_usage_perc).", usage,
        )
        yield self._family(counter, "vllm:prefix_cache_queries",
                           "Prefix cache queries, in terms of number of queried tokens.",
                           per_model("prefix_cache_queries"))
        yield self._family(counter, "vllm:prefix_cache_hits",
                           "Prefix cache hits, in terms of number of cached tokens.",
                           per_model("prefix_cache_hits"))
        yield self._family(counter, "vllm:prompt_tokens", "Number of prefill tokens processed.",
                           per_model("prompt_tokens"))
        yield self._family(counter, "vllm:generation_tokens",
                           "Number of generation tokens processed.", per_model("generation_tokens"))
        yield self._family(counter, "vllm:num_preemptions",
                           "Cumulative number of preemptions from the engine.",
                           per_model("num_preemptions"))
        yield self._family(gauge, "tianxia:kv_cache_bytes_per_token",
                           "KV cache bytes per token over all layers (K and V, --kv-cache-dtype).",
                           per_model("kv_cache_bytes_per_token"))
        yield self._family(gauge, "tianxia:kv_cache_capacity_tokens",
                           "Tokens the KV cache holds (its usable blocks x block size).",
                           per_model("kv_cache_capacity_tokens"))
        yield from self._spec_decode(stats)
        yield from self._lora(stats)
        yield self._family(gauge, "tianxia:step_num_seqs_max",
                           "Most sequences that ran together in one engine step since start.",
                           {m: src.max_step_seqs() for m, src in engines.items()})
        infos = [src.info for src in engines.values() if src.info]
        if infos:
            info = GaugeMetricFamily(
                "vllm:cache_config_info", "Information of the cache config.", labels=list(infos[0])
            )
            for values in infos:
                info.add_metric(list(values.values()), 1.0)
            yield info


# per-core series of a data-parallel server: (stats key, name, doc, kind)
_CORE_SERIES = (
    ("num_running", "tianxia:engine_num_requests_running", "Requests running in this engine core.",
     GaugeMetricFamily),
    ("num_waiting", "tianxia:engine_num_requests_waiting", "Requests waiting in this engine core.",
     GaugeMetricFamily),
    ("kv_cache_usage", "tianxia:engine_kv_cache_usage_perc",
     "This engine core's KV-cache usage. 1 means 100 percent usage.", GaugeMetricFamily),
    ("prefix_cache_queries", "tianxia:engine_prefix_cache_queries",
     "This engine core's prefix cache queries, in tokens.", CounterMetricFamily),
    ("prefix_cache_hits", "tianxia:engine_prefix_cache_hits",
     "This engine core's prefix cache hits, in tokens.", CounterMetricFamily),
    ("generation_tokens", "tianxia:engine_generation_tokens",
     "Generation tokens this engine core processed.", CounterMetricFamily),
    ("routed", "tianxia:engine_routed_requests", "Requests the server sent to this engine core.",
     CounterMetricFamily),
    ("routed_by_prefix", "tianxia:engine_routed_by_prefix",
     "Requests sent to this engine core because it had served their prompt's prefix.",
     CounterMetricFamily),
)


class _CoreCollector(Collector):
    """The engine cores behind one model (``--data-parallel-size``), labelled ``engine``: their
    index, as vLLM labels its data-parallel ranks."""

    def __init__(self, model_name: str, per_core: Callable[[], list[dict[str, float]]]) -> None:
        self.model_name = model_name
        self.per_core = per_core

    def collect(self):
        cores = self.per_core()
        for key, name, doc, kind in _CORE_SERIES:
            family = kind(name, doc, labels=["model_name", "engine"])
            for index, stats in enumerate(cores):
                family.add_metric([self.model_name, str(index)], float(stats.get(key, 0)))
            yield family


class _Bins:
    """One model's inter-token latency counts, bucket by bucket (``le`` of each bound, then +Inf)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe_many(self, samples: list[tuple[float, int]]) -> None:
        bounds, counts, total = self.bounds, self.counts, 0.0
        for value, _ in samples:
            counts[bisect_left(bounds, value)] += 1
            total += value
        self.sum += total


class _InterTokenLatency(Collector):
    """vLLM's inter-token latency histogram, written out under both of its names (the older one
    is ``time_per_output_token``). It takes one sample per streamed token, the most of any
    series, so a step's samples are binned together into plain counts (a prometheus_client
    ``Histogram`` takes a lock per bucket and sum, and two of them did so twice per token)."""

    _NAMES = (
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
        ("vllm:time_per_output_token_seconds",
         "Histogram of time per output token in seconds (older name of inter-token latency)."),
    )

    def __init__(self, buckets: list[float]) -> None:
        self.bounds = [float(b) for b in buckets]
        self.models: dict[str, _Bins] = {}

    def bins(self, model_name: str) -> _Bins:
        return self.models.setdefault(model_name, _Bins(self.bounds))

    def collect(self):
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        rows = [(model, list(accumulate(b.counts)), b.sum) for model, b in self.models.items()]
        for name, doc in self._NAMES:
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            for model, cumulative, total in rows:
                family.add_metric([model], list(zip(les, cumulative)), sum_value=total)
            yield family


class ModelMetrics(StatsListener):
    """One model's histograms and counters (the server's series, labelled with its name); the
    stats listener of its engine."""

    def __init__(self, server: ServerMetrics, model_name: str) -> None:
        self.model_name = model_name
        for attr, family in server.families.items():
            setattr(self, attr, family.labels(model_name))
        self.itl = server.inter_token.bins(model_name)
        self.success = server.success

    # --- StatsListener (engine thread) -------------------------------------------------------

    def on_step(self, step: StepStats) -> None:
        self.iteration_tokens.observe(step.num_tokens)
        self.step_seqs.observe(step.num_seqs)
        self.step_duration.observe(step.duration_s)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_inter_token(self, latency_s: float, num_tokens: int) -> None:
        self.itl.observe_many([(latency_s, num_tokens)])

    def on_inter_tokens(self, samples: list[tuple[float, int]]) -> None:
        self.itl.observe_many(samples)

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


class ServerMetrics(ModelMetrics):
    """The ``/metrics`` registry of one server. Built with ``stats``, it is the listener of the
    server's one model (``model_name``); a server with several models calls :meth:`add_model`
    for each one it loads (``model_name`` then labels the server's own series)."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        stats: Callable[[], dict] | None = None,
        max_step_seqs: Callable[[], int] | None = None,
        cache_info: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry
        self.engines: dict[str, _EngineSource] = {}
        self.registry.register(_EngineCollector(self.engines))
        self.inter_token = _InterTokenLatency(_ITL_BUCKETS)
        self.registry.register(self.inter_token)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        token_buckets = _token_buckets(max_model_len)
        self.families: dict[str, Histogram] = {
            "ttft": hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", _TTFT_BUCKETS),
            "e2e": hist("vllm:e2e_request_latency_seconds",
                        "Histogram of end to end request latency in seconds.", _LATENCY_BUCKETS),
            "queue_time": hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               _LATENCY_BUCKETS),
            "inference_time": hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   _LATENCY_BUCKETS),
            "prefill_time": hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 _LATENCY_BUCKETS),
            "decode_time": hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                _LATENCY_BUCKETS),
            "req_prompt_tokens": hist("vllm:request_prompt_tokens",
                                      "Number of prefill tokens processed.", token_buckets),
            "req_gen_tokens": hist("vllm:request_generation_tokens",
                                   "Number of generation tokens processed.", token_buckets),
            "req_max_tokens": hist("vllm:request_params_max_tokens",
                                   "Histogram of the max_tokens request parameter.", token_buckets),
            "req_n": hist("vllm:request_params_n", "Histogram of the n request parameter.",
                          [1, 2, 5, 10, 20]),
            "iteration_tokens": hist("vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.",
                                     _pow2_buckets(max(max_model_len, 16384))),
            "step_seqs": hist(
                "tianxia:step_num_seqs",
                "Histogram of the number of sequences that ran together in one engine step.",
                _SEQS_BUCKETS,
            ),
            # its sum against the wall clock is how busy the engine was (a served run's steps
            # against the same workload's offline ones)
            "step_duration": hist(
                "tianxia:step_duration_seconds",
                "Histogram of the time one engine step took (schedule, forward, sample, update) "
                "in seconds.",
                _STEP_BUCKETS,
            ),
        }
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self.model_name = model_name
        if stats is not None:  # the one model's listener is this object
            super().__init__(self, model_name)
            self.add_model(model_name, stats, max_step_seqs or (lambda: 0), cache_info)
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

    def add_model(
        self,
        model_name: str,
        stats: Callable[[], dict],
        max_step_seqs: Callable[[], int],
        cache_info: dict[str, str] | None = None,
    ) -> ModelMetrics:
        """Report a loaded model's engine; returns its stats listener."""
        self.engines[model_name] = _EngineSource(stats, cache_info or {}, max_step_seqs)
        return self if model_name == self.model_name else ModelMetrics(self, model_name)

    def add_engine_cores(
        self, model_name: str, per_core: Callable[[], list[dict[str, float]]]
    ) -> None:
        """Report each engine core of a data-parallel model on its own (``engine`` label)."""
        self.registry.register(_CoreCollector(model_name, per_core))

    def remove_model(self, model_name: str) -> None:
        """An unloaded model's gauges go; its counters and histograms stay (they are totals)."""
        self.engines.pop(model_name, None)

    # --- scrape ------------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)
