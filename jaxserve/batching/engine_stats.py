"""What an engine replica reports about itself (`EngineCore.stats`): its queues, KV pages, prefix cache, tokens and
their recent rate, speculative decoding's counters (vLLM's names) and its KV transfers; the pools over replicas sum
these (`jaxserve.batching.pools`)."""
from __future__ import annotations

import collections
import dataclasses
import time

from jaxserve.batching.kv_handoff import KVTransfers
from jaxserve.batching.scheduler import Scheduler
from jaxserve.batching.speculation.controller import SpecController
from jaxserve.cache.host_tier import HostTier


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    pages_used: int
    pages_total: int
    kv_cache_usage: float  # fraction of pages held by sequences (evictable prefix pages count as free)
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, tokens found cached
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens: int  # prompt tokens computed (prefix hits excluded)
    generation_tokens: int
    generation_tokens_per_s: float  # over the last few seconds
    steps: int
    # Speculative decoding (vLLM's counters): verifications with proposals, proposals, accepted proposals, and
    # accepted proposals by position; accepted over proposed; sequences that speculated in the last step.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    spec_decode_acceptance_rate: float = 0.0
    spec_decode_num_speculating: int = 0
    # Replicas (data parallelism) and how many of them still serve (a replica stops after MAX_FAILED_STEPS).
    num_replicas: int = 1
    num_replicas_healthy: int = 1
    # KV transfers taken in (disaggregated prefill): how many have landed, their bytes, and their seconds from
    # export to landing here (polled once per step, so each is late by up to a step).
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    # Prefilled sequences admitted to decode, and their seconds waiting for a slot and pages (the decode queue).
    decode_admitted: int = 0
    decode_queue_seconds: float = 0.0
    # The host KV tier (kv_offloading_size): prompt tokens found there (counted in prefix_cache_hits too), pages and
    # bytes stored to it and loaded from it, their seconds from dispatch to landing (polled once per step), and the
    # bytes it holds.
    kv_offload_hits: int = 0
    kv_offload_stored_pages: int = 0
    kv_offload_stored_bytes: int = 0
    kv_offload_store_seconds: float = 0.0
    kv_offload_loaded_pages: int = 0
    kv_offload_loaded_bytes: int = 0
    kv_offload_load_seconds: float = 0.0
    kv_offload_used_bytes: int = 0
    # Per pool (disaggregated prefill): (pool, running, waiting).
    pools: tuple[tuple[str, int, int], ...] = ()
    # The KV cache's layout (the gateway's prefix-cache scorer reads it): tokens per page.
    page_size: int = 0
    # LoRA (the gateway's adapter affinity reads these): the adapters of the running and of the waiting sequences
    # (sorted names), and how many adapters can run at once (max_loras; 0: LoRA is not enabled).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # When this snapshot was taken (time.time()): vLLM's lora_requests_info carries it, the newest series wins.
    snapshot_time: float = 0.0


class StepCounters:
    """A replica's running counts: steps read back, prompt tokens computed (prefix hits excluded), tokens generated,
    and their recent rate."""

    def __init__(self, rate_window_s: float):
        self.steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.rate = TokenRate(rate_window_s)

    def generated(self, now: float, tokens: int) -> None:
        """A step read back at `now` (time.monotonic()) emitted `tokens`."""
        self.generation_tokens += tokens
        self.rate.add(now, tokens)


class TokenRate:
    """Tokens per second over the steps of the last `window_s` seconds."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        # (time, tokens) of recent steps, and their tokens in all: a step adds one and drops those past the window
        # (a list rebuilt each step was 0.25 ms of host time a step at batch 1).
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._tokens = 0

    def add(self, now: float, tokens: int) -> None:
        """A step emitted `tokens` at `now` (time.monotonic())."""
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._tokens -= self._recent.popleft()[1]
        self._recent.append((now, tokens))
        self._tokens += tokens

    def per_second(self) -> float:
        """The tokens after the window's first step over the time since it: 0 before two steps."""
        span = self._recent[-1][0] - self._recent[0][0] if len(self._recent) > 1 else 0.0
        return (self._tokens - self._recent[0][1]) / span if span > 0 else 0.0


def replica_stats(s: Scheduler, counters: StepCounters, transfers: KVTransfers, controller: SpecController | None,
                  healthy: bool, host: HostTier | None = None) -> EngineStats:
    cache = s.cache
    total = cache.allocator.num_usable
    used = total - cache.num_available
    return EngineStats(
        num_running=len(s.running), num_waiting=len(s.waiting), pages_used=used, pages_total=total,
        kv_cache_usage=used / total, prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits,
        prefix_cache_hit_rate=cache.hit_rate(), num_preemptions=s.num_preemptions,
        prompt_tokens=counters.prompt_tokens, generation_tokens=counters.generation_tokens,
        generation_tokens_per_s=counters.rate.per_second(), steps=counters.steps, num_replicas_healthy=int(healthy),
        kv_transfers=transfers.count, kv_transfer_bytes=transfers.num_bytes, kv_transfer_seconds=transfers.seconds,
        decode_admitted=s.num_prefilled_admitted, decode_queue_seconds=s.prefilled_wait_seconds,
        page_size=cache.page_size, running_lora_adapters=adapter_names(s.running),
        waiting_lora_adapters=adapter_names(s.waiting),
        max_lora=0 if s.lora_slots is None else s.lora_slots.num_slots, snapshot_time=time.time(),
        **spec_stats(controller), **host_stats(host, cache.host_hits))


def adapter_names(seqs) -> tuple[str, ...]:
    """The LoRA adapters these sequences run with, each once, sorted."""
    return tuple(sorted({q.lora_request.lora_name for q in seqs if q.lora is not None}))


def host_stats(t: HostTier | None, hits: int) -> dict:
    """EngineStats' host-tier fields (none without a tier)."""
    if t is None:
        return {}
    return dict(kv_offload_hits=hits, kv_offload_stored_pages=t.stored_pages, kv_offload_stored_bytes=t.stored_bytes,
                kv_offload_store_seconds=t.store_seconds, kv_offload_loaded_pages=t.loaded_pages,
                kv_offload_loaded_bytes=t.loaded_bytes, kv_offload_load_seconds=t.load_seconds,
                kv_offload_used_bytes=t.num_bytes)


def spec_stats(c: SpecController | None) -> dict:
    """EngineStats' speculative decoding fields, from the controller (none without speculation)."""
    if c is None:
        return {}
    return dict(spec_decode_num_drafts=c.num_drafts, spec_decode_num_draft_tokens=c.num_draft_tokens,
                spec_decode_num_accepted_tokens=c.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=tuple(c.num_accepted_tokens_per_pos),
                spec_decode_acceptance_rate=c.acceptance_rate, spec_decode_num_speculating=c.num_speculating)
