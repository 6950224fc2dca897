"""AsyncEngine: the engine for asyncio code (the server). Requests in from any task, incremental outputs out.

The engine loop runs in one background thread (device calls block; the event loop must not), taking requests and
aborts from a queue between steps and handing each step's new tokens to the requests' asyncio queues.

One side of disaggregated prefill across servers (EngineConfig.role): a prefill engine's request ends once its
first token is out, its last output carrying the hand-off (its sequence and KV pages); a decode engine takes a
request prefilled elsewhere with its pages and first token (`add_request(..., prefilled=Prefilled(...))`) and
streams what follows that token.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import uuid
from typing import AsyncIterator

from jaxserve.batching.engine_core import MAX_FAILED_STEPS, EngineCore, EngineDeadError, StepError
from jaxserve.batching.engine_stats import EngineStats
from jaxserve.batching.kv_handoff import staged
from jaxserve.batching.output_processor import SequenceDelta, cached_prompt_tokens, request_metrics
from jaxserve.batching.pools.data_parallel import DataParallel
from jaxserve.batching.pools.disaggregated import Disaggregated
from jaxserve.cache import pages_needed
from jaxserve.cache.transfer import trimmed
from jaxserve.engine.client import HandedOff, Prefilled
from jaxserve.engine.llm import LLM, Request
from jaxserve.engine_config import EngineConfig
from jaxserve.kv_transfer.worker import import_executor
from jaxserve.lora.adapter import LOADS
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import CompletionOutput, RequestOutput, merged
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")

__all__ = ["AsyncEngine", "EngineDeadError", "MAX_FAILED_STEPS"]


# What the event loop tells the engine thread, between steps.
@dataclasses.dataclass
class _Add:
    request: Request
    prefilled: Prefilled | None = None


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Stop:
    pass


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop, request: Request):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request = request
        self.unfinished = len(request.seqs)
        # Prompt logprobs go with the first output: the first sequence collects them, and another's output that
        # comes earlier (its prompt a prefix-cache hit) is held until they are whole.
        self.unsent_prompt_logprobs = request.seqs[0].output.prompt_logprobs
        self.held: list[CompletionOutput] = []

    @property
    def awaits_prompt_logprobs(self) -> bool:
        scored = self.unsent_prompt_logprobs
        return scored is not None and len(scored) < len(self.request.prompt_token_ids)

    def take_prompt_logprobs(self):
        """The prompt logprobs if they are whole and not yet sent; then never again."""
        scored = self.unsent_prompt_logprobs
        if scored is None or len(scored) < len(self.request.prompt_token_ids):
            return None
        self.unsent_prompt_logprobs = None
        return scored

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # its event loop is closed: nobody is listening (the abort it sent is on its way)


class AsyncEngine:
    """The engine the server drives (it serves `jaxserve.engine.client.EngineClient`): an LLM stepped on a thread
    of its own, requests in and outputs out through the event loop."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stats = llm.stats()
        self._stopping = False
        self.role = llm.role  # "both", or one side of disaggregated prefill across servers
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str | None = None, **engine_args) -> "AsyncEngine":
        """An engine over LLM(model, **engine_args) (the arguments are EngineConfig's)."""
        return cls(LLM(model, **engine_args))

    @classmethod
    def from_config(cls, engine_config: EngineConfig) -> "AsyncEngine":
        return cls(LLM.from_config(engine_config))

    async def add_request(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                          priority: int = 0, lora_request: LoRARequest | None = None,
                          prefilled: Prefilled | None = None) -> AsyncIterator[RequestOutput]:
        """Submits a request (on a LoRA adapter: lora_request, needs enable_lora); returns an async iterator of its
        incremental outputs. prefilled: a decode engine's request, prefilled elsewhere (one sequence: n = 1); its
        outputs start after the first token.

        Each output holds, for the completions that advanced, only what is new (text, token ids, logprobs: vLLM's
        DELTA output kind); the last has finished=True. Bad input raises here, before anything is queued.
        Leaving the iteration early (a client gone) aborts the request.
        """
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        params = sampling_params or SamplingParams()
        if prefilled is not None and (self.role != "decode" or getattr(params, "n", 1) != 1):
            raise ValueError("a request prefilled elsewhere runs on a decode engine (role 'decode'), one sequence "
                             "(n = 1)")
        if getattr(params, "structured_outputs", None) is None and lora_request is None:
            request = self.llm.make_request(prompt, params, priority, request_id)  # (not a SamplingParams: it says so)
        else:  # compiling a grammar, or loading an adapter, may take up to a second: on a thread, so the event loop
            # serves the others
            request = await asyncio.get_running_loop().run_in_executor(
                None, self.llm.make_request, prompt, params, priority, request_id, lora_request)
            if request_id in self._streams:  # taken while it compiled
                raise ValueError(f"request id {request_id!r} is already running")
        if prefilled is not None:
            prefilled = await self._staged(request, prefilled)
            if request_id in self._streams:  # taken while its pages were staged
                raise ValueError(f"request id {request_id!r} is already running")
        stream = _Stream(asyncio.get_running_loop(), request)
        self._streams[request_id] = stream
        if self._stopping:  # shut down while this request was being checked
            self._streams.pop(request_id, None)
            raise EngineDeadError("the engine is shut down")
        self._commands.put(_Add(request, prefilled))
        return self._iterate(request_id, stream)

    async def _staged(self, request: Request, prefilled: Prefilled) -> Prefilled:
        """prefilled with its pages copied to the decode engine's devices and landed, on the KV import thread (below
        the engine thread's priority: `jaxserve.kv_transfer.worker`), so the engine thread only scatters them into
        its cache between steps (`kv_handoff.staged`). Pages that do not fit raise ValueError here, before anything
        is queued. A pool of replicas stages on the engine thread as before: which replica takes it is chosen there."""
        core = _one_pool(self.llm)
        if not isinstance(core, EngineCore):
            return prefilled
        kv = await asyncio.get_running_loop().run_in_executor(
            import_executor(), staged, core.runner, request.seqs[0], prefilled.kv, prefilled.num_cached,
            core.scheduler.page_size)
        return dataclasses.replace(prefilled, kv=kv)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter onto the host (on a thread: it reads files) ahead of its requests: LLM.add_lora. On
        LOADS, not the pool that checks requests and compiles grammars: loads queue there, one at a time."""
        return await asyncio.get_running_loop().run_in_executor(LOADS, self.llm.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """LLM.remove_lora: requests running on the adapter finish on it."""
        return self.llm.remove_lora(lora_int_id)

    async def list_loras(self) -> set[int]:
        return self.llm.list_loras()

    # ---- what the server reads of the model (EngineClient) ----

    @property
    def model_name(self) -> str:
        return self.llm.model_name

    @property
    def model_path(self) -> str | None:
        return self.llm.engine_config.model

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.vocab_size

    @property
    def page_size(self) -> int:
        return self.llm.scheduler.page_size

    @property
    def max_num_seqs(self) -> int:
        return self.llm.engine_config.max_num_seqs

    @property
    def enable_lora(self) -> bool:
        return self.llm.engine_config.enable_lora

    def pages_bytes(self, num_tokens: int) -> int:
        """In the first replica's cache: every replica's holds pages alike."""
        return self.llm.runner.pages_bytes(num_tokens)

    def handed_off(self, hand_off) -> HandedOff:
        """A HandOff (a prefill engine's last output of a request) with its pages on the host, cut to its cached
        tokens. Blocks on the export: off the event loop."""
        seq = hand_off.seq
        kv = trimmed(hand_off.kv, pages_needed(hand_off.num_cached, self.page_size))
        return HandedOff(seq.request_id, kv, hand_off.num_cached, seq.output_token_ids[0], seq.prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its pages before the next step (no-op if it already finished)."""
        self._commands.put(_Abort(request_id))

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    def shutdown(self, timeout: float | None = None) -> None:
        """Aborts whatever runs and stops the engine thread."""
        self._stopping = True
        self._commands.put(_Stop())
        self._thread.join(timeout)

    # ---- the engine thread ----

    def _run(self) -> None:
        while True:
            try:
                if self._loop_once():
                    return
            except StepError as e:  # its requests end; the engine goes on for the others while a replica serves
                logger.error("engine step failed; ending %d request(s)", len(e.failed), exc_info=e.cause)
                self._publish(e.changed)  # read back before the failure: these requests are owed their results
                self._stats = self.llm.stats()  # before anyone hears of the failure: /health and stats() tell it
                for request_id, error in e.failed.items():
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.put(error)
                if self._stats.num_replicas_healthy == 0:
                    # Not a bad request but a broken engine: say so (health turns 503) rather than fail forever.
                    logger.error("every engine replica failed %d steps in a row: the engine stops", MAX_FAILED_STEPS)
                    self._stopping = True
                    self._fail_all(EngineDeadError(f"the engine stopped after {MAX_FAILED_STEPS} failed steps: "
                                                   f"{e.cause}"))
                    return
            except Exception as e:  # noqa: BLE001 - outside a step (a command): state too broken to tell
                logger.exception("the engine loop failed; failing every request")
                self._fail_all(e)

    def _loop_once(self) -> bool:
        """Applies queued commands, then runs one step if there is work; True when told to stop."""
        llm = self.llm
        if llm.has_unfinished_requests():
            llm.wait_for_step()  # so that requests which came while the step in flight ran join the next
        block = not llm.has_unfinished_requests()  # wait for a command only when there is nothing to step
        try:
            while True:
                command = self._commands.get(block=block)
                block = False
                if isinstance(command, _Stop):
                    self._fail_all(EngineDeadError("the engine shut down"))
                    return True
                self._apply(command)
        except queue.Empty:
            pass
        if llm.has_unfinished_requests():
            self._publish(llm.step())
            if self.role == "prefill":
                self._hand_off(_one_pool(llm).take_handed_off())
        self._stats = llm.stats()
        return False

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Add):
            request_id = command.request.request_id
            if request_id not in self._streams:
                return  # failed or aborted before it was ever added
            try:
                if command.prefilled is None:
                    self.llm.submit(command.request)
                else:
                    p = command.prefilled
                    _one_pool(self.llm).add_prefilled(command.request.seqs[0], p.kv, p.num_cached,
                                                      first_token=p.first_token, started=p.started)
            except Exception as e:  # noqa: BLE001 - nowhere to run it (every replica stopped): this request fails
                self.llm.abort_request(request_id)  # any of its sequences already queued
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(e)
        else:
            self.llm.abort_request(command.request_id)
            stream = self._streams.pop(command.request_id, None)
            if stream is not None:
                r = stream.request
                stream.put(RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [], True))

    def _publish(self, deltas: list[SequenceDelta]) -> None:
        by_request: dict[str, list[CompletionOutput]] = {}
        for d in deltas:
            if d.seq.request_id in self._streams:  # else aborted since
                by_request.setdefault(d.seq.request_id, []).append(d.completion)
        for request_id, outputs in by_request.items():
            stream = self._streams[request_id]
            outputs, stream.held = stream.held + outputs, []
            if stream.awaits_prompt_logprobs:
                stream.held = outputs
                continue
            outputs = merged(outputs)
            stream.unfinished -= sum(o.finish_reason is not None for o in outputs)
            done = stream.unfinished == 0
            if done:
                del self._streams[request_id]
            r = stream.request
            metrics = request_metrics(r.seqs) if done else None
            stream.put(RequestOutput(request_id, r.prompt, r.prompt_token_ids, outputs, done, metrics,
                                     stream.take_prompt_logprobs(), num_cached_tokens=cached_prompt_tokens(r.seqs)))

    def _hand_off(self, hand_offs) -> None:
        """Each handed-off request ends here: its last output carries the hand-off (one sequence a request)."""
        for h in hand_offs:
            stream = self._streams.pop(h.seq.request_id, None)
            if stream is None:
                continue  # aborted meanwhile: its pages are free, the export is dropped
            r = stream.request
            stream.put(RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [], True, request_metrics(r.seqs),
                                     stream.take_prompt_logprobs(), handed_off=h,
                                     num_cached_tokens=cached_prompt_tokens(r.seqs)))

    def _fail_all(self, error: BaseException) -> None:
        # pop(.., None): a request being added on the event loop may take itself out at the same time.
        streams = [s for s in (self._streams.pop(r, None) for r in list(self._streams)) if s is not None]
        try:
            self.llm.abort_all()
        finally:  # the streams hear of it even if the abort fails
            for stream in streams:
                stream.put(error)


def _one_pool(llm: LLM) -> EngineCore | DataParallel:
    """A prefill or decode engine's core, which hands pages off or takes them in: one pool (only a "both" engine's
    core is a Disaggregated pair, and it keeps its pages to itself)."""
    core = llm.core
    assert not isinstance(core, Disaggregated), "a role engine's core is one pool"
    return core
