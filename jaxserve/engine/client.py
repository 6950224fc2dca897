"""What the HTTP server sees of an engine: the `EngineClient` protocol.

The server reads a model's facts (its name, context length, vocabulary, page size, tokenizer), its LoRA state, adds,
streams and aborts requests, and reads health and statistics; it knows nothing of schedulers, caches or runners, so
that what stands behind it can change without the server changing (`AsyncEngine` serves it; a test may give a fake).

The records crossing the seam for disaggregated prefill across servers live here too: `HandedOff` (a prefill
engine's request, its KV pages on the host, leaving for a decode server) and `Prefilled` (a decode engine's request,
with the pages fetched from there). `EngineDeadError` is what add_request raises once the engine has stopped.
"""
from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Protocol

from jaxserve.batching.engine_core import EngineDeadError
from jaxserve.batching.engine_stats import EngineStats
from jaxserve.cache.transfer import KVPages, kv_bytes
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["EngineClient", "EngineDeadError", "HandedOff", "Prefilled"]


@dataclasses.dataclass
class Prefilled:
    """A request prefilled on another engine, for a decode engine: the K/V of its first num_cached tokens (KVPages,
    host or device arrays) and the first token sampled there."""
    kv: KVPages
    num_cached: int
    first_token: int
    started: float  # time.perf_counter() when the pages' transfer began, for the transfer's seconds

    @property
    def num_bytes(self) -> int:
        return kv_bytes(self.kv)


@dataclasses.dataclass
class HandedOff:
    """A request a prefill engine ended after its first token, as it leaves for a decode engine: the K/V of its
    first num_cached tokens on the host (numpy, cut to those tokens' pages: the export's padding need not travel),
    its first token, and the prompt a decode server checks its own tokenization against."""
    request_id: str
    kv: KVPages
    num_cached: int
    first_token: int
    prompt_token_ids: list[int]


class EngineClient(Protocol):
    """An engine as the server drives it, from its event loop."""

    # Its side of disaggregated prefill across servers: "prefill" or "decode", else "both".
    role: str

    @property
    def model_name(self) -> str:
        """The loaded model's own name."""

    @property
    def model_path(self) -> str | None:
        """The model as it was asked for (a path or a hub id; None: the default model)."""

    @property
    def tokenizer(self):
        """The model's Tokenizer, or None for a model served by token ids only."""

    @property
    def max_model_len(self) -> int:
        """The most tokens a sequence may hold, prompt and output together."""

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size)."""

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""

    @property
    def max_num_seqs(self) -> int:
        """Sequences the engine runs at once: what the server's admission is sized from."""

    @property
    def enable_lora(self) -> bool:
        """Whether requests may run on LoRA adapters (add_lora / remove_lora / list_loras then work)."""

    async def add_request(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                          priority: int = 0, lora_request: LoRARequest | None = None,
                          prefilled: Prefilled | None = None) -> AsyncIterator[RequestOutput]:
        """Submits a request; its incremental outputs (deltas), the last finished. Bad input raises ValueError or
        TypeError here; a stopped engine EngineDeadError. Leaving the iteration early aborts the request."""

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its pages (no-op if it already finished)."""

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter onto the host ahead of its requests."""

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter; requests running on it finish on it."""

    async def list_loras(self) -> set[int]:
        """The ids of the adapters the host holds."""

    def pages_bytes(self, num_tokens: int) -> int:
        """Bytes the KV pages of num_tokens tokens take in the engine's cache (bounds a fetch of them)."""

    def handed_off(self, hand_off) -> HandedOff:
        """A prefill engine's hand-off (RequestOutput.handed_off) with its pages copied to the host. Blocks on the
        copy: call it off the event loop."""

    def alive(self) -> bool:
        """False once the engine has stopped (shut down, or every replica failed)."""

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""

    def shutdown(self, timeout: float | None = None) -> None:
        """Aborts whatever runs and stops the engine. Blocks: call it off the event loop."""
