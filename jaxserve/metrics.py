"""Prometheus metrics of a serving engine, named as vLLM's with a `jaxserve:` prefix.

Latency histograms are observed by the server as requests stream; engine-wide gauges and counters are read from
the engine's latest stats snapshot when Prometheus scrapes, so the engine loop never touches them.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds; vLLM's buckets, which span CPU and accelerator latencies alike.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, stats, model_name: str):
        """stats: a callable returning the engine's latest EngineStats."""
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds", "Time to the first generated token.",
                              ["model_name"], buckets=_TTFT_BUCKETS, registry=self.registry).labels(**label)
        self.itl = Histogram("jaxserve:time_per_output_token_seconds",
                             "Time between consecutive output tokens of a request (inter-token latency).",
                             ["model_name"], buckets=_TPOT_BUCKETS, registry=self.registry).labels(**label)
        self.e2e = Histogram("jaxserve:e2e_request_latency_seconds", "Arrival to last token.", ["model_name"],
                             buckets=_REQUEST_BUCKETS, registry=self.registry).labels(**label)
        self.queue = Histogram("jaxserve:request_queue_time_seconds", "Arrival to first scheduled.", ["model_name"],
                               buckets=_REQUEST_BUCKETS, registry=self.registry).labels(**label)
        self._success = Counter("jaxserve:request_success", "Finished completions, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.registry.register(_EngineCollector(stats, model_name))

    def finished(self, reason: str) -> None:
        self._success.labels(model_name=self._model_name, finished_reason=reason).inc()

    def observe_request(self, metrics) -> None:
        """A finished request's RequestMetrics (time.monotonic stamps). (TTFT is observed by the server as the first
        token reaches it.)"""
        if metrics.first_scheduled_time is not None:
            self.queue.observe(metrics.first_scheduled_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, stats, model_name: str):
        self._stats, self._model_name = stats, model_name

    def collect(self):
        s, labels = self._stats(), [self._model_name]

        def family(kind, name, doc, value):
            f = kind(f"jaxserve:{name}", doc, labels=["model_name"])
            f.add_metric(labels, value)
            return f
        yield family(GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.", s.num_running)
        yield family(GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV pages held by sequences (0-1).",
                     s.kv_cache_usage)
        yield family(CounterMetricFamily, "prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                     s.prompt_tokens)
        yield family(CounterMetricFamily, "generation_tokens", "Tokens generated.", s.generation_tokens)
        yield family(CounterMetricFamily, "num_preemptions", "Sequences preempted (to be recomputed).",
                     s.num_preemptions)
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     s.prefix_cache_queries)
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     s.prefix_cache_hits)
        yield family(CounterMetricFamily, "spec_decode_num_drafts", "Verifications of one or more proposals.",
                     s.spec_decode_num_drafts)
        yield family(CounterMetricFamily, "spec_decode_num_draft_tokens", "Proposed tokens verified.",
                     s.spec_decode_num_draft_tokens)
        yield family(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                     s.spec_decode_num_accepted_tokens)
        per_pos = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Proposed tokens accepted, by position in the proposal.",
                                      labels=["model_name", "position"])
        for position, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self._model_name, str(position)], n)
        yield per_pos
        yield family(GaugeMetricFamily, "spec_decode_acceptance_rate", "Accepted over proposed tokens (0-1).",
                     s.spec_decode_acceptance_rate)
        yield family(GaugeMetricFamily, "spec_decode_num_speculating",
                     "Sequences that speculated in the last step (0: speculation is off).",
                     s.spec_decode_num_speculating)
