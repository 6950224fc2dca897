"""Prometheus metrics of a serving engine, named as vLLM's with a `jaxserve:` prefix.

Latency histograms are observed by the server as requests stream; engine-wide gauges and counters are read from
the engine's latest stats snapshot when Prometheus scrapes, so the engine loop never touches them. A server of several
models has one series per engine (label `model_name`), all in one registry and exposition.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

# Seconds; vLLM's buckets, which span CPU and accelerator latencies alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


# The Gateway API Inference Extension's model-server protocol (its docs/proposals/003-model-server-protocol): what
# the endpoint picker reads -> our metric. Each is vLLM's with our prefix (vLLM's: `vllm:` + the part after ours);
# the picker is pointed at ours by its metric-name settings. BlockSize and NumGPUBlocks are cache_config_info's
# labels block_size and num_gpu_blocks; the LoRA info's labels are max_lora, running_lora_adapters and
# waiting_lora_adapters. Every series also carries model_name.
GATEWAY_METRICS = {
    "TotalQueuedRequests": "jaxserve:num_requests_waiting",
    "TotalRunningRequests": "jaxserve:num_requests_running",
    "KVCacheUtilization": "jaxserve:kv_cache_usage_perc",
    "LoRAInfo": "jaxserve:lora_requests_info",
    "CacheInfo": "jaxserve:cache_config_info",
}


class ServerMetrics:
    """A server's registry: for each engine, series labelled with its model_name, all in one exposition."""

    def __init__(self):
        self.registry = CollectorRegistry()
        # Each family once, with a child per model: Prometheus wants one family however many engines feed it.
        self._ttft = Histogram("jaxserve:time_to_first_token_seconds", "Time to the first generated token.",
                               ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry)
        self._itl = Histogram("jaxserve:time_per_output_token_seconds",
                              "Time between consecutive output tokens of a request (inter-token latency).",
                              ["model_name"], buckets=_TPOT_BUCKETS, registry=self.registry)
        self._e2e = Histogram("jaxserve:e2e_request_latency_seconds", "Arrival to last token.", ["model_name"],
                              buckets=REQUEST_BUCKETS, registry=self.registry)
        self._queue = Histogram("jaxserve:request_queue_time_seconds", "Arrival to first scheduled.", ["model_name"],
                                buckets=REQUEST_BUCKETS, registry=self.registry)
        self._success = Counter("jaxserve:request_success", "Finished completions, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        # vLLM has no per-adapter count (its lora_requests_info gauge names the adapters running and waiting): this
        # counts the requests each adapter served, under its base model's name.
        self._lora_requests = Counter("jaxserve:lora_requests", "Requests run with a LoRA adapter, by adapter.",
                                      ["model_name", "lora_name"], registry=self.registry)
        self._engines: dict = {}  # model_name -> its engine's stats callable, read at scrape
        self.registry.register(_EngineCollector(self._engines))

    def add_model(self, model_name: str, stats) -> "ModelMetrics":
        """The series of one engine; stats: a callable returning its latest EngineStats."""
        if model_name in self._engines:
            raise ValueError(f"model {model_name!r} already has metrics")
        self._engines[model_name] = stats
        return ModelMetrics(self, model_name)

    def add_cascade(self, cascade: str, tiers: list[str]) -> "CascadeMetrics":
        """A cascade's series (`jaxserve serve --cascade`), each at 0 from the start. Its families are made with the
        first cascade: a server without one exposes none of them."""
        if not hasattr(self, "_cascade_requests"):
            self._cascade_requests = Counter("jaxserve:cascade_requests",
                                             "Requests to a cascade, by the tier that answered them.",
                                             ["cascade", "tier"], registry=self.registry)
            self._cascade_escalations = Counter("jaxserve:cascade_escalations",
                                                "Requests to a cascade moved up by a tier that was asked and "
                                                "did not keep them, to the next tier asked or the one that "
                                                "answered.",
                                                ["cascade", "from_tier", "to_tier"], registry=self.registry)
            self._cascade_routing = Histogram("jaxserve:cascade_routing_seconds",
                                              "Seconds from a cascade request's arrival to the answering tier's "
                                              "taking it: scoring passes (before), answers escalated past (after).",
                                              ["cascade"], buckets=TTFT_BUCKETS, registry=self.registry)
        return CascadeMetrics(self, cascade, tiers)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """What the server observes for one model (its label's children of the shared families)."""

    def __init__(self, parent: ServerMetrics, model_name: str):
        self.model_name = model_name
        self.ttft = parent._ttft.labels(model_name=model_name)
        self.itl = parent._itl.labels(model_name=model_name)
        self.e2e = parent._e2e.labels(model_name=model_name)
        self.queue = parent._queue.labels(model_name=model_name)
        self._success = parent._success
        self._lora_requests = parent._lora_requests
        self._adapters: set[str] = set()  # those loaded: an adapter's series lives from its load to its unload

    def finished(self, reason: str) -> None:
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def add_adapter(self, lora_name: str) -> None:
        """An adapter's series, at 0 from its load (a counter that starts again at 0 if the name is loaded again
        after an unload: Prometheus's rate() reads that as a reset)."""
        self._adapters.add(lora_name)
        self._lora_requests.labels(model_name=self.model_name, lora_name=lora_name)

    def remove_adapter(self, lora_name: str) -> None:
        """Drops an unloaded adapter's series: else each name ever loaded stays in every scrape."""
        if lora_name in self._adapters:
            self._adapters.discard(lora_name)
            self._lora_requests.remove(self.model_name, lora_name)

    def lora_request(self, lora_name: str) -> None:
        """One engine request (a prompt of a batch) run with the adapter; not counted once it is unloaded (a request
        admitted as the adapter was unloaded would bring its series back)."""
        if lora_name in self._adapters:
            self._lora_requests.labels(model_name=self.model_name, lora_name=lora_name).inc()

    def observe_request(self, metrics) -> None:
        """A finished request's RequestMetrics (time.monotonic stamps). (TTFT is observed by the server as the first
        token reaches it.)"""
        if metrics.first_scheduled_time is not None:
            self.queue.observe(metrics.first_scheduled_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)


class CascadeMetrics:
    """What the server observes for one cascade: the tier each request went to, its moves up, the routing time."""

    def __init__(self, parent: ServerMetrics, cascade: str, tiers: list[str]):
        self.cascade, self.tiers = cascade, tiers
        self.requests = [parent._cascade_requests.labels(cascade=cascade, tier=t) for t in tiers]
        # Each next pair at 0 from the start; a move past a skipped tier (too long for it) makes its series then.
        self._escalations = parent._cascade_escalations
        for a, b in zip(tiers, tiers[1:]):
            self._escalations.labels(cascade=cascade, from_tier=a, to_tier=b)
        self.routing = parent._cascade_routing.labels(cascade=cascade)

    def routed(self, tier: int, escalations: list[tuple[int, int]], seconds: float) -> None:
        """One request answered by `tier` (index), having moved up from each tier that refused it ((from, to)
        indices: `policy.Route.escalations`). Called once the answering tier has taken the request."""
        self.requests[tier].inc()
        for a, b in escalations:
            self._escalations.labels(cascade=self.cascade, from_tier=self.tiers[a], to_tier=self.tiers[b]).inc()
        self.routing.observe(seconds)


class _EngineCollector:
    def __init__(self, engines: dict):
        self._engines = engines  # model_name -> stats callable (the server's, shared: models added later count)

    def collect(self):
        snapshots = [(name, stats()) for name, stats in self._engines.items()]

        def family(kind, name, doc, field):
            f = kind(f"jaxserve:{name}", doc, labels=["model_name"])
            for model_name, s in snapshots:
                f.add_metric([model_name], getattr(s, field))
            return f
        # Per sequence, as vLLM's: it runs a request of n sequences as n child requests, each queued on its own.
        yield family(GaugeMetricFamily, "num_requests_running", "Requests in the running batch (a request of n "
                     "sequences counts n, as vLLM's child requests).", "num_running")
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled, preempted ones "
                     "included (a request of n sequences counts n, as vLLM's child requests).", "num_waiting")
        yield family(GaugeMetricFamily, "num_replicas", "Data-parallel engine replicas.", "num_replicas")
        yield family(GaugeMetricFamily, "num_replicas_healthy",
                     "Replicas still serving (one stops after repeated failed steps; its requests fail).",
                     "num_replicas_healthy")
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV pages held by sequences (0-1; "
                     "cached prefixes no sequence holds count as free).", "kv_cache_usage")
        yield family(CounterMetricFamily, "prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                     "prompt_tokens")
        yield family(CounterMetricFamily, "generation_tokens", "Tokens generated.", "generation_tokens")
        yield family(CounterMetricFamily, "num_preemptions", "Sequences preempted (to be recomputed).",
                     "num_preemptions")
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     "prefix_cache_queries")
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     "prefix_cache_hits")
        yield family(CounterMetricFamily, "spec_decode_num_drafts", "Verifications of one or more proposals.",
                     "spec_decode_num_drafts")
        yield family(CounterMetricFamily, "spec_decode_num_draft_tokens", "Proposed tokens verified.",
                     "spec_decode_num_draft_tokens")
        yield family(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                     "spec_decode_num_accepted_tokens")
        per_pos = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Proposed tokens accepted, by position in the proposal.",
                                      labels=["model_name", "position"])
        for model_name, s in snapshots:
            for position, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([model_name, str(position)], n)
        yield per_pos
        yield family(GaugeMetricFamily, "spec_decode_acceptance_rate", "Accepted over proposed tokens (0-1).",
                     "spec_decode_acceptance_rate")
        yield family(GaugeMetricFamily, "spec_decode_num_speculating",
                     "Sequences that speculated in the last step (0: speculation is off).",
                     "spec_decode_num_speculating")
        yield from _disaggregated_families(snapshots)
        yield from _host_tier_families(snapshots)
        yield from _gateway_info_families(snapshots)


def _gateway_info_families(snapshots):
    """vLLM's info gauges, which the gateway's endpoint picker reads: the KV cache's layout (value 1), and with LoRA
    enabled (vLLM has no series without) the adapters running and waiting (value: the snapshot's unix time, so the
    picker can take the newest series). Data-parallel replicas: pages and max_lora add up, adapters are any
    replica's."""
    cache = GaugeMetricFamily("jaxserve:cache_config_info", "The KV cache's layout, as vLLM's: tokens per page "
                              "(block_size) and pages (num_gpu_blocks).",
                              labels=["model_name", "block_size", "num_gpu_blocks"])
    for model_name, s in snapshots:
        cache.add_metric([model_name, str(s.page_size), str(s.pages_total)], 1)
    yield cache
    lora = [(model_name, s) for model_name, s in snapshots if s.max_lora]
    if lora:
        f = GaugeMetricFamily("jaxserve:lora_requests_info", "LoRA adapters of the running and of the waiting "
                              "requests (comma-separated) and how many can run at once (max_lora); the value is "
                              "when they were read (unix seconds).",
                              labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        for model_name, s in lora:
            f.add_metric([model_name, str(s.max_lora), ",".join(s.running_lora_adapters),
                          ",".join(s.waiting_lora_adapters)], s.snapshot_time)
        yield f


def _host_tier_families(snapshots):
    """The host KV tier (kv_offloading_size; zeros without one): its hits, and pages moved each way as summaries of
    bytes and of seconds from dispatch to landing (count: pages moved), and the bytes it holds."""
    hits = CounterMetricFamily("jaxserve:kv_offload_hits", "Prompt tokens found in the host KV tier (counted in "
                               "prefix_cache_hits too).", labels=["model_name"])
    used = GaugeMetricFamily("jaxserve:kv_offload_usage_bytes", "Bytes of KV pages held in the host tier.",
                             labels=["model_name"])
    for model_name, s in snapshots:
        hits.add_metric([model_name], s.kv_offload_hits)
        used.add_metric([model_name], s.kv_offload_used_bytes)
    yield hits
    yield used
    for way, pages in (("store", "stored"), ("load", "loaded")):
        to = "to host memory" if way == "store" else "back to the device"
        for unit, field in (("bytes", f"kv_offload_{pages}_bytes"), ("seconds", f"kv_offload_{way}_seconds")):
            f = SummaryMetricFamily(f"jaxserve:kv_offload_{way}_{unit}", f"KV-cache pages moved {to}: their {unit} "
                                    "(count: pages; seconds polled once per engine step).", labels=["model_name"])
            for model_name, s in snapshots:
                f.add_metric([model_name], count_value=getattr(s, f"kv_offload_{pages}_pages"),
                             sum_value=getattr(s, field))
            yield f


def _disaggregated_families(snapshots):
    """Disaggregated prefill: the KV transfers into decode engines and the decode queue (count and sum: a mean per
    transfer or sequence), and each pool's running and waiting sequences (label `pool`; none without pools). The
    prefill pool's queue time is request_queue_time_seconds (a request is first scheduled there)."""
    transfers = [("kv_transfer_bytes", "KV-cache bytes moved from prefill to decode, per transfer.",
                  "kv_transfer_bytes"),
                 ("kv_transfer_seconds", "Seconds from a KV export to its landing on the decode devices, per "
                  "transfer (polled once per engine step).", "kv_transfer_seconds"),
                 ("decode_queue_time_seconds", "Seconds a prefilled sequence waited for a decode slot and pages.",
                  "decode_queue_seconds")]
    for name, doc, field in transfers:
        f = SummaryMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
        for model_name, s in snapshots:
            count = s.decode_admitted if field == "decode_queue_seconds" else s.kv_transfers
            f.add_metric([model_name], count_value=count, sum_value=getattr(s, field))
        yield f
    for i, what in ((1, "running"), (2, "waiting")):
        f = GaugeMetricFamily(f"jaxserve:pool_num_requests_{what}", f"Sequences {what}, by pool.",
                              labels=["model_name", "pool"])
        for model_name, s in snapshots:
            for pool in s.pools:
                f.add_metric([model_name, pool[0]], pool[i])
        yield f
