"""LLM: the offline API (vLLM-shaped). Requests in, finished outputs out.

`LLM(model, **engine_args)` builds its engine's parts with `jaxserve.engine.factory` and serves requests through
them: checked and made into sequences here, run by the engine core, answered as RequestOutputs built by the output
processor.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Iterable

from jaxserve.batching.engine_stats import EngineStats
from jaxserve.batching.output_processor import SequenceDelta, cached_prompt_tokens, completion_output, request_metrics
from jaxserve.batching.sequence import Sequence
from jaxserve.engine.factory import EngineParts, build_engine
from jaxserve.engine_config import EngineConfig
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slot_cache import HostAdapters, LoadedAdapter
from jaxserve.outputs import RequestOutput
from jaxserve.sample.logit_controls import check_first_token, resolve
from jaxserve.sampling_params import MAX_BANNED_TOKENS, SamplingParams
from jaxserve.structured_output import GrammarGate, compile_grammar, fill_masks
from jaxserve.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class Request:
    """A checked request, made into its n sequences (not yet submitted)."""
    request_id: str
    prompt: str | None  # its text, if it came as text
    prompt_token_ids: list[int]
    seqs: list[Sequence]


class LLM:
    """An engine over one model.

    LLM(model, **engine_args) or LLM.from_config(EngineConfig(...)): the arguments, their defaults and meanings are
    EngineConfig's (jaxserve.engine_config); an unknown one is a TypeError, a bad value a ValueError before anything
    loads. The config is kept as `engine_config`.

    generate / chat / stream run requests to the end, each on the base model or (enable_lora=True) on a LoRA adapter
    per prompt (`lora_request`; add_lora / remove_lora / list_loras manage the adapters the host holds). The request
    API under them (add_request or make_request + submit, step, abort_request, has_unfinished_requests, ...) drives
    the engine a step at a time, as AsyncEngine does.
    """

    def __init__(self, model: str | None = None, **engine_args):
        self.engine_config = EngineConfig(model=model, **engine_args)
        self._serve(build_engine(self.engine_config))

    @classmethod
    def from_config(cls, engine_config: EngineConfig) -> "LLM":
        return cls(**vars(engine_config))

    @classmethod
    def over(cls, parts: EngineParts, engine_config: EngineConfig | None = None) -> "LLM":
        """An LLM over an engine built by hand (tests: over fake runners)."""
        llm = cls.__new__(cls)
        s = parts.replicas[0].scheduler
        llm.engine_config = engine_config or EngineConfig(
            max_model_len=parts.max_model_len, max_num_seqs=s.max_num_seqs, block_size=s.page_size,
            max_num_batched_tokens=s.max_num_batched_tokens, data_parallel_size=len(parts.replicas),
            enable_lora=s.lora_slots is not None, max_loras=1 if s.lora_slots is None else s.lora_slots.num_slots)
        llm._serve(parts)
        return llm

    def _serve(self, parts: EngineParts) -> None:
        self.parts = parts
        self.core, self.replicas, self.processes = parts.core, parts.replicas, parts.processes
        self.model_name, self.tokenizer, self.max_model_len = parts.model_name, parts.tokenizer, parts.max_model_len
        self.vocab_size, self.role = parts.vocab_size, parts.role
        self.config = parts.model_config
        self.attention_backend, self.quantization = parts.attention_backend, parts.quantization
        self.speculative_config = self.engine_config.speculative_config
        self.kv_cache_dtype = self.engine_config.kv_cache_dtype
        # The first replica's (the only one without data parallelism): what tests and tools look into.
        self.runner, self.scheduler = self.replicas[0].runner, self.replicas[0].scheduler
        self._rng = random.Random(self.engine_config.seed)
        self._request_ids = itertools.count()

    @property
    def is_leader(self) -> bool:
        """Process 0 of a multi-process run, which schedules (True in a single process)."""
        return self.processes.is_leader

    # ---- requests in ----

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} prompts")
            floor = self.tokenizer.min_tokens(prompt)  # refused by its length alone: tokenizing 1 MB takes seconds
            if floor >= self.max_model_len:
                raise ValueError(f"the prompt has {len(prompt)} characters, at least {floor} tokens, but max_model_len "
                                 f"is {self.max_model_len}: it leaves no room to generate")
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        vocab_size = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                             "it leaves no room to generate")
        return text, list(ids)

    def _request(self, prompt, params: SamplingParams, priority: int = 0, request_id: str | None = None,
                 lora_request: LoRARequest | None = None) -> Request:
        if not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt)
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else []
        assert params.stop_token_ids is not None  # SamplingParams makes it a list
        ending = set(eos) | set(params.stop_token_ids)
        # Under a grammar min_tokens bans EOS even with ignore_eos (`Sequence.ending_token_ids`).
        bans_eos = not params.ignore_eos or params.structured_outputs is not None
        if params.min_tokens and bans_eos and len(ending) > MAX_BANNED_TOKENS:
            raise ValueError(f"min_tokens can hold back at most {MAX_BANNED_TOKENS} ending tokens; this model's "
                             f"{len(eos)} EOS ids and the stop_token_ids make {len(ending)}")
        controls = resolve(params, self.vocab_size, self.tokenizer)
        grammar = None
        # A grammar that starts after a reasoning end tag: the first token is free of it.
        starts_after = params.structured_outputs.starts_after if params.structured_outputs is not None else None
        if params.structured_outputs is not None:
            grammar = compile_grammar(params.structured_outputs, self.tokenizer, self.vocab_size)
            if (controls.token_mask is not None or params.min_tokens) and starts_after is None:
                check_first_token(params, controls, fill_masks([grammar.matcher()])[0], ending, self.vocab_size)
        lora = self._adapter(lora_request)  # last: loading from disk is the slowest check
        seqs = []
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            seed = (base_seed + i * 0x9E3779B1) % (1 << 32)  # distinct streams for the n samples of one seed
            seqs.append(Sequence(request_id, i, ids, params, seed, self.max_model_len, eos, detok, priority,
                                 controls, grammar.matcher() if grammar is not None else None, lora,
                                 GrammarGate(starts_after) if starts_after else None))
        return Request(request_id, text, ids, seqs)

    # ---- LoRA adapters (vLLM's names) ----

    def _host_adapters(self, lora_request: LoRARequest | None = None) -> HostAdapters:
        if self.parts.loras is None:
            named = f"LoRA adapter {lora_request.lora_name!r} asked, but " if lora_request is not None else ""
            raise ValueError(f"{named}this engine was started without enable_lora (LLM(enable_lora=True), "
                             "--enable-lora)")
        return self.parts.loras

    def _adapter(self, lora_request: LoRARequest | None) -> LoadedAdapter | None:
        """The request's adapter on the host (loaded now if it is not), or None for the base model. Raises
        ValueError without enable_lora, and LoRAError (a ValueError) for an adapter that does not load."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        return self._host_adapters(lora_request).get(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter onto the host ahead of its requests (True; already there: True too). Raises as a
        request naming it would (LoRAError for a bad adapter). Thread-safe."""
        self._adapter(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter the host holds (False if it holds none of that id). Requests made with it run to their
        end; a later request naming it loads it again from its path. Thread-safe."""
        return self._host_adapters().remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters the host holds."""
        return self._host_adapters().ids()

    # ---- the request API: what AsyncEngine drives, and generate / stream / chat under it ----

    def make_request(self, prompt, params: SamplingParams, priority: int = 0, request_id: str | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Checks a request and makes its n sequences without submitting them. Raises ValueError / TypeError on bad
        input (a prompt too long, a request that can never fit the KV cache, a grammar that does not compile: see
        `jaxserve.structured_output.compile_grammar`; a LoRA adapter without enable_lora, or one that does not load:
        LoRAError). Safe on another thread than the one stepping (AsyncEngine checks requests on its event loop, or
        on a thread when a grammar is to be compiled or an adapter loaded)."""
        request = self._request(prompt, params, priority, request_id, lora_request)
        for seq in request.seqs:
            self.scheduler.check_fits(seq)
        return request

    def submit(self, request: Request) -> None:
        """Queues a made request's sequences; they run from the next step. On the thread that steps."""
        for seq in request.seqs:
            self.core.add(seq)

    def add_request(self, prompt, params: SamplingParams, priority: int = 0, request_id: str | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """make_request, then submit."""
        request = self.make_request(prompt, params, priority, request_id, lora_request)
        self.submit(request)
        return request

    def step(self) -> list[SequenceDelta]:
        """Runs one engine step: what it added to each sequence that advanced (new text, tokens, logprobs; a finish
        reason if it ended). A failed step raises `StepError`: it holds what the step read back before it failed
        and the requests it ended (their pages are free; the engine goes on with the others)."""
        return self.core.step()

    def wait_for_step(self) -> None:
        """Blocks until the next step should be planned: a request added after this joins it. Without async
        scheduling, until the step in flight has run; with it, until that step is about to end (see
        `jaxserve.batching.engine_core`)."""
        self.core.wait_in_flight()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def abort_request(self, request_id: str) -> None:
        """Stops a request's sequences and frees their pages (no-op if it is not running)."""
        self.core.abort(request_id)

    def abort_all(self) -> None:
        self.core.abort_all()

    # ---- several processes (jaxserve.multihost) ----

    def follow(self) -> None:
        """On a multi-process follower: run the leader's steps until it shuts down (`jaxserve serve` on processes
        other than 0). The leader's `shutdown` ends it."""
        self.processes.follow()

    def shutdown(self) -> None:
        """On the leader of a multi-process run: tells the followers there are no more steps."""
        self.processes.shutdown()

    # ---- generation ----

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """prompts: a str, a {'prompt_token_ids': [...]} dict, or a list of them. Returns one output per prompt.

        All prompts are submitted at once and batched continuously. priority: one per prompt (with the "priority"
        scheduling policy; lower runs first). lora_request: the LoRA adapter of every prompt, or a list of one per
        prompt (None: the base model); needs enable_lora. Over several processes every process calls it (one script,
        run on every host): the leader's prompts run, and every process returns their outputs.
        """
        return self.processes.run(lambda: self._generate(prompts, sampling_params, use_tqdm, priority, lora_request))

    def _generate(self, prompts, sampling_params, use_tqdm: bool, priority, lora_request) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        # Validate every prompt before any runs, so a bad one never leaves others half-done.
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        requests = [self.make_request(p, sp, pr, lora_request=lr)
                    for p, sp, pr, lr in zip(prompts, params_list, priority, loras)]
        try:
            for request in requests:
                self.submit(request)
            self._run_until_done(sum(len(r.seqs) for r in requests), use_tqdm)
        except BaseException:
            self.abort_all()  # whatever failed (or was interrupted), the engine is clean for the next call
            raise
        return [RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [completion_output(s) for s in r.seqs],
                              True, request_metrics(r.seqs), r.seqs[0].output.prompt_logprobs,
                              num_cached_tokens=cached_prompt_tokens(r.seqs)) for r in requests]

    def _run_until_done(self, total: int, use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=total, desc="generating", unit="seq")
        while self.has_unfinished_requests():
            deltas = self.step()
            if bar is not None:
                bar.update(sum(d.finished for d in deltas))
        if bar is not None:
            bar.close()

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None) -> Iterable[str]:
        """Yields text pieces of one prompt's first completion as they are generated (on a multi-process
        follower: all of them once the leader's stream is over)."""
        return self.processes.stream(lambda: self._stream(prompt, sampling_params or SamplingParams(), lora_request))

    def _stream(self, prompt, params: SamplingParams, lora_request: LoRARequest | None) -> Iterable[str]:
        request_id = self.add_request(prompt, params, lora_request=lora_request).request_id
        try:
            while self.has_unfinished_requests():
                for d in self.step():
                    if d.seq.request_id == request_id and d.seq.index == 0 and d.completion.text:
                        yield d.completion.text
        finally:
            self.abort_request(request_id)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {'role', 'content'} dicts) or a list of conversations;
        lora_request as generate's (one per conversation, or one for all)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt) for c in conversations]
        # The template writes any BOS itself, so encoding must not add another.
        prompts = [{"prompt": t, "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix no running sequence holds (benchmarks: runs that must not share hits)."""
        for replica in self.replicas:
            replica.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """A snapshot: running and waiting sequences, pages, prefix-cache hit rate, preemptions, tokens/s."""
        return self.core.stats()


