"""The router's own Prometheus metrics (prefix `jaxserve_router:`): requests and failures per pool and server,
retries, the KV transfers the decode servers report, and latency as the router's clients see it."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from jaxserve.openai.metrics import REQUEST_BUCKETS, TTFT_BUCKETS

_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RouterMetrics:
    def __init__(self, pools):
        self.registry = CollectorRegistry()
        self.requests = Counter("jaxserve_router:requests", "Requests sent to a server, by pool and server.",
                                ["pool", "server"], registry=self.registry)
        self.failures = Counter("jaxserve_router:failures",
                                "Requests a server failed (kind: connect, timeout, disconnect, http_5xx, stream_error, "
                                "bad_answer).",
                                ["pool", "server", "kind"], registry=self.registry)
        self.retries = Counter("jaxserve_router:retries", "Requests retried on another server of the pool.",
                               ["pool"], registry=self.registry)
        self.kv_transfer = Histogram("jaxserve_router:kv_transfer_seconds",
                                     "KV pages fetch time per request, as the decode server reports it.",
                                     buckets=_TRANSFER_BUCKETS, registry=self.registry)
        self.kv_transfer_bytes = Counter("jaxserve_router:kv_transfer_bytes",
                                         "KV bytes moved to decode servers, as they report them.",
                                         registry=self.registry)
        self.ttft = Histogram("jaxserve_router:time_to_first_token_seconds",
                              "Receipt to the first token sent to the client.", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("jaxserve_router:e2e_request_latency_seconds", "Receipt to the response's end.",
                             buckets=REQUEST_BUCKETS, registry=self.registry)
        self.registry.register(_PoolCollector(pools))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    """Per server, read when scraped: requests in flight and health."""

    def __init__(self, pools):
        self._pools = pools

    def collect(self):
        in_flight = GaugeMetricFamily("jaxserve_router:requests_in_flight", "Requests in flight per server.",
                                      labels=["pool", "server"])
        healthy = GaugeMetricFamily("jaxserve_router:server_healthy", "1 while the server is healthy.",
                                    labels=["pool", "server"])
        for pool in self._pools:
            for b in pool.backends:
                in_flight.add_metric([pool.role, b.url], b.in_flight)
                healthy.add_metric([pool.role, b.url], float(b.healthy))
        yield in_flight
        yield healthy
