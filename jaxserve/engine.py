"""LLM: the offline API (vLLM-shaped). Requests in, finished outputs out."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from contextlib import nullcontext
from typing import Iterable

import jax
import jax.numpy as jnp

from jaxserve import multihost
from jaxserve.attention import resolve_attention_backend
from jaxserve.batching.data_parallel import DataParallel
from jaxserve.batching.draft_proposer import DraftProposer
from jaxserve.batching.engine_core import EngineCore, EngineStats
from jaxserve.batching.model_runner import ModelRunner
from jaxserve.batching.scheduler import Scheduler
from jaxserve.batching.sequence import Sequence
from jaxserve.batching.ngram_proposer import NgramProposer
from jaxserve.batching.slo import SloController
from jaxserve.batching.spec_controller import SpecController
from jaxserve.buckets import Buckets, geometric
from jaxserve.cache import PageAllocator, PrefixCache, bytes_per_page, num_pages_for_budget, pages_needed
from jaxserve.distributed import check_tensor_parallel, device_groups, make_mesh
from jaxserve.engine_config import EngineConfig
from jaxserve.model.decoder import repeat_kv_heads
from jaxserve.outputs import RequestMetrics, RequestOutput
from jaxserve.quantize import quantize_model
from jaxserve.sampling_params import MAX_BANNED_TOKENS, SamplingParams
from jaxserve.spec_config import check_draft
from jaxserve.tokenizer import IncrementalDetokenizer, read_chat_template
from jaxserve.weights import load_model, resolve_dtype
from jaxserve.weights.params import param_bytes

logger = logging.getLogger("jaxserve")

_CPU_KV_CACHE_BYTES = 2 << 30


class LLM:
    """An engine over one model.

    LLM(model, **engine_args) or LLM.from_config(EngineConfig(...)): the arguments, their defaults and meanings are
    EngineConfig's (jaxserve.engine_config); an unknown one is a TypeError, a bad value a ValueError before anything
    loads. The config is kept as `engine_config`.

    generate / chat / stream run requests to the end. The request API under them (add_request or make_request +
    submit, step, abort_request, has_unfinished_requests, ...) drives the engine a step at a time, as AsyncEngine does.
    """

    def __init__(self, model: str | None = None, **engine_args):
        c = self.engine_config = EngineConfig(model=model, **engine_args)
        if c.coordinator_address is not None:  # before any backend starts
            multihost.initialize(c.coordinator_address, c.num_processes, c.process_id, c.coordinator_bind_address)
        # Several processes: the leader (process 0) schedules and publishes each step; the others follow it.
        self.channel = None
        if jax.process_count() > 1:
            self.channel = multihost.StepChannel(multihost.shared_secret(c.coordinator_secret_file))
        self.is_leader = multihost.is_leader()
        self._in_collective = False
        tp, dp = c.tensor_parallel_size, c.data_parallel_size
        groups = device_groups(make_mesh(tp, dp)) if tp * dp > 1 or self.channel else [None]
        model, max_model_len, max_num_seqs, block_size = c.model, c.max_model_len, c.max_num_seqs, c.block_size
        max_num_batched_tokens, kv_cache_dtype = c.max_num_batched_tokens, c.kv_cache_dtype
        spec = self.speculative_config = c.speculative_config
        backend = resolve_attention_backend(c.attention_backend)
        self.kv_cache_dtype = kv_cache_dtype
        _enable_compilation_cache()
        dtype = resolve_dtype(c.dtype)
        # Over a mesh, weights are loaded (and quantized) in host memory and go from there to their shards: no
        # accelerator ever holds the whole model.
        with jax.default_device(jax.local_devices(backend="cpu")[0]) if groups[0] is not None else nullcontext():
            loaded = quantize_model(load_model(model, dtype), c.quantization, group_size=c.quantization_group_size,
                                    quantize_embeddings=c.quantize_embeddings, calibration_text=c.calibration_text)
            self.model_name, self.config, self.tokenizer = loaded.name, loaded.config, loaded.tokenizer
            if c.chat_template is not None:
                if self.tokenizer is None:
                    raise ValueError(f"chat_template {c.chat_template}: this model has no tokenizer to chat with")
                self.tokenizer.chat_template = read_chat_template(c.chat_template)
            self.quantization, params = loaded.quantization, loaded.params
            limit = self.config.max_position_embeddings
            if max_model_len is not None and max_model_len > limit:
                raise ValueError(f"max_model_len must be an integer in [2, {limit}] for this model, got "
                                 f"{max_model_len!r}")
            self.max_model_len = max_model_len or limit
            draft = None
            if spec is not None and spec.method == "draft_model":
                draft = load_model(spec.model, dtype)
                check_draft(draft.config, self.config, self.max_model_len)
                _check_same_tokenizer(draft.tokenizer, self.tokenizer)
            # What the runners hold: over a mesh wider than the KV heads, each device gets a copy of the head it
            # reads.
            config, params = split_for(self.config, params, tp)
            if draft is not None:
                draft = dataclasses.replace(draft, **dict(zip(("config", "params"),
                                                              split_for(draft.config, draft.params, tp, "the draft"))))
        # The budget is per device, as gpu_memory_utilization is; the weights and the pages split over tp devices.
        kv_bytes = c.kv_cache_memory_bytes or _default_kv_budget(
            (param_bytes(params) + (param_bytes(draft.params) if draft else 0)) // tp, c.gpu_memory_utilization)
        # The draft's pages are the target's page ids in a second cache: a page costs both.
        num_pages = num_pages_for_budget(config, block_size, dtype, kv_bytes * tp, kv_cache_dtype,
                                         draft.config if draft else None)
        # Never more pages than max_num_seqs full-length sequences can use (+1 for the scratch page).
        num_pages = min(num_pages, max_num_seqs * pages_needed(self.max_model_len, block_size) + 1)
        self._check_one_sequence_fits(num_pages, block_size, asked=max_model_len is not None)
        logger.info("KV cache: %d pages of %d tokens (%.1f MB, %s)", num_pages, block_size,
                    num_pages * bytes_per_page(config, block_size, dtype, kv_cache_dtype) / 1e6,
                    "int8" if kv_cache_dtype == "int8" else jnp.dtype(dtype).name)
        buckets = Buckets.for_limits(max_num_seqs, max_num_batched_tokens, pages_needed(self.max_model_len, block_size))
        serving = dict(num_pages=num_pages, pages_per_seq=buckets.pages_per_row, max_num_seqs=max_num_seqs,
                       max_tokens=buckets.num_tokens[-1])
        self.attention_backend = _checked_backend(backend, c.attention_backend, self.config, block_size, dtype, serving,
                                                 kv_cache_dtype)
        # One engine replica per device group: its own runner, KV cache and scheduler (see batching.data_parallel).
        shape = dict(config=config, params=params, draft=draft, dtype=dtype, num_pages=num_pages, buckets=buckets)
        self.replicas = [self._replica(group, **shape) for group in groups]
        self.core = self.replicas[0] if len(self.replicas) == 1 else DataParallel(self.replicas)
        # The first replica's (the only one without data parallelism): what tests and tools look into.
        self.runner, self.scheduler = self.replicas[0].runner, self.replicas[0].scheduler
        self._runners = [r for core in self.replicas for r in (core.runner, core.runner.draft) if r is not None]
        if self.channel is not None and self.is_leader:
            for i, runner in enumerate(self._runners):
                runner.channel, runner.channel_index = self.channel, i
        # The controller weighs step times measured at warm-up, so speculation warms up even if asked not to.
        timed = spec is not None and spec.adaptive
        if c.warmup or timed:
            def warm_up():
                for runner in self._runners:
                    runner.warmup(time_steps=timed)
            self._collectively(warm_up)
        self._rng = random.Random(c.seed)
        self._request_ids = itertools.count()

    def _replica(self, mesh, *, config, params, draft, dtype, num_pages: int, buckets: Buckets) -> EngineCore:
        """An engine on one device group (mesh None: the default device)."""
        c, spec = self.engine_config, self.speculative_config
        block_size, max_num_seqs, kv_cache_dtype = c.block_size, c.max_num_seqs, c.kv_cache_dtype
        k = spec.num_speculative_tokens if spec else 0
        runner = ModelRunner(config, params, dtype, num_pages, block_size, buckets, max_num_seqs,
                             self.attention_backend, kv_cache_dtype, num_speculative_tokens=k, mesh=mesh)
        slo = None
        if c.ttft_slo is not None or c.tpot_slo is not None:
            slo = SloController(geometric(1, max_num_seqs), max_num_seqs, tpot_slo=c.tpot_slo, ttft_slo=c.ttft_slo)
        cache = PrefixCache(PageAllocator(num_pages), block_size, c.enable_prefix_caching)
        scheduler = Scheduler(cache, max_num_seqs, c.max_num_batched_tokens, buckets.num_tokens,
                              c.scheduling_policy, slo)
        draft_runner = proposer = controller = None
        if draft is not None:
            draft_runner = ModelRunner(draft.config, draft.params, dtype, num_pages, block_size, buckets,
                                       max_num_seqs, self.attention_backend, kv_cache_dtype, mesh=mesh)
            runner.draft = draft_runner
            proposer = DraftProposer(draft_runner, c.max_num_batched_tokens, max_num_seqs)
        elif spec is not None:
            proposer = NgramProposer(k, spec.prompt_lookup_max, spec.prompt_lookup_min)
        if spec is not None:  # its step times are the runners', filled in at warm-up
            controller = SpecController(k, buckets.num_tokens, runner.step_times,
                                        draft_runner.step_times if draft_runner else None)
        return EngineCore(scheduler, runner, proposer=proposer, controller=controller,
                          adaptive=spec is None or spec.adaptive)

    @classmethod
    def from_config(cls, engine_config: EngineConfig) -> "LLM":
        return cls(**vars(engine_config))

    def _check_one_sequence_fits(self, num_pages: int, block_size: int, asked: bool) -> None:
        """A max_model_len sequence must fit the KV cache, or every request that leaves max_tokens unset (the
        OpenAI clients' default for chat) is refused while the model advertises the full length. As vLLM: an
        explicit max_model_len that does not fit is an error, the model's own context is lowered to what fits."""
        fits = (num_pages - 1) * block_size  # page 0 is scratch
        if self.max_model_len <= fits:
            return
        if asked or fits < 2:
            raise ValueError(f"max_model_len {self.max_model_len} does not fit the KV cache, which holds {fits} "
                             "tokens: lower max_model_len or raise the KV budget (kv_cache_memory_bytes / "
                             "gpu_memory_utilization)")
        logger.warning("max_model_len lowered from the model's %d to %d tokens: the most one sequence can hold in "
                       "the KV cache (raise the KV budget for more)", self.max_model_len, fits)
        self.max_model_len = fits

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
        if not all(isinstance(t, int) and 0 <= t < self.config.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                             "it leaves no room to generate")
        return text, list(ids)

    def _sequences(self, prompt, params: SamplingParams, priority: int = 0,
                   request_id: str | None = None) -> tuple[str, str | None, list[Sequence]]:
        if not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt)
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else []
        ending = set(eos) | set(params.stop_token_ids)
        if params.min_tokens and not params.ignore_eos and len(ending) > MAX_BANNED_TOKENS:
            raise ValueError(f"min_tokens can hold back at most {MAX_BANNED_TOKENS} ending tokens; this model's "
                             f"{len(eos)} EOS ids and the stop_token_ids make {len(ending)}")
        seqs = []
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            seed = (base_seed + i * 0x9E3779B1) % (1 << 32)  # distinct streams for the n samples of one seed
            seqs.append(Sequence(request_id, i, ids, params, seed, self.max_model_len, eos, detok, priority))
        return request_id, text, seqs

    # ---- the request API: what AsyncEngine drives, and generate / stream / chat under it ----

    def make_request(self, prompt, params: SamplingParams, priority: int = 0,
                     request_id: str | None = None) -> tuple[str, str | None, list[Sequence]]:
        """Validates a request and builds its n sequences without submitting them: (request_id, prompt text,
        sequences). Raises ValueError / TypeError on bad input (a prompt too long, a request that can never fit the
        KV cache). Safe on another thread than the one stepping (AsyncEngine validates on its event loop)."""
        request_id, text, seqs = self._sequences(prompt, params, priority, request_id)
        for seq in seqs:
            self.scheduler.check_fits(seq)
        return request_id, text, seqs

    def submit(self, seqs: list[Sequence]) -> None:
        """Queues a made request's sequences; they run from the next step. On the thread that steps."""
        for seq in seqs:
            self.core.add(seq)

    def add_request(self, prompt, params: SamplingParams, priority: int = 0,
                    request_id: str | None = None) -> tuple[str, str | None, list[Sequence]]:
        """make_request, then submit."""
        request = self.make_request(prompt, params, priority, request_id)
        self.submit(request[2])
        return request

    def step(self) -> list[tuple[Sequence, str]]:
        """Runs one engine step: the sequences that advanced, each with its new text (their new tokens, logprobs and
        finish reasons are on the sequence). A failed step raises `StepError`: it holds what the step read back
        before it failed and the requests it ended (their pages are free; the engine goes on with the others)."""
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def abort_request(self, request_id: str) -> None:
        """Stops a request's sequences and frees their pages (no-op if it is not running)."""
        self.core.abort(request_id)

    def abort_all(self) -> None:
        self.core.abort_all()

    # ---- several processes (jaxserve.multihost) ----

    def _collectively(self, fn):
        """fn's device work on every process: the leader runs fn and publishes each step it takes, the followers
        run those steps; every process returns fn's result (the leader's, sent to the followers) or raises its
        error. One process: just fn()."""
        if self.channel is None or self._in_collective:  # one phase: a generate inside another's fn is part of it
            return fn()
        if not self.is_leader:
            return self._follow()
        self._in_collective = True
        try:
            result = fn()
        except BaseException as e:
            self.channel.send(("error", e))
            raise
        finally:
            self._in_collective = False
        self.channel.send(("end", result))
        return result

    def _follow(self, until_shutdown: bool = False):
        """A follower's part: run the leader's steps as they come, to the end of its current collective phase
        (or, until_shutdown, of all of them: a server's followers)."""
        while True:
            kind, *rest = self.channel.receive()
            if kind == "step":
                index, batch = rest
                jax.block_until_ready(self._runners[index].run(batch))  # in step with the leader, not queued
            elif kind == "shutdown":
                return None
            elif kind == "abort":  # the leader failed a step this process ran: the processes are out of step
                multihost.exit_now(1, f"jaxserve: error: {rest[0]}")
            elif until_shutdown:
                continue
            elif kind == "end":
                return rest[0]
            else:
                raise rest[0]

    def follow(self) -> None:
        """On a multi-process follower: run the leader's steps until it shuts down (`jaxserve serve` on processes
        other than 0). The leader's `shutdown` ends it."""
        if self.channel is None or self.is_leader:
            raise RuntimeError("follow() is for processes other than 0 of a multi-process run")
        self._follow(until_shutdown=True)

    def shutdown(self) -> None:
        """On the leader of a multi-process run: tells the followers there are no more steps."""
        if self.channel is not None and self.is_leader:
            self.channel.send(("shutdown",))
            self.channel.close()

    # ---- generation ----

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a str, a {'prompt_token_ids': [...]} dict, or a list of them. Returns one output per prompt.

        All prompts are submitted at once and batched continuously. priority: one per prompt (with the "priority"
        scheduling policy; lower runs first). Over several processes every process calls it (one script, run on
        every host): the leader's prompts run, and every process returns their outputs.
        """
        return self._collectively(lambda: self._generate(prompts, sampling_params, use_tqdm, priority))

    def _generate(self, prompts, sampling_params, use_tqdm: bool, priority) -> list[RequestOutput]:
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
        requests = [self.make_request(p, sp, pr) for p, sp, pr in zip(prompts, params_list, priority)]
        try:
            for _, _, seqs in requests:
                self.submit(seqs)
            self._run_until_done(sum(len(s) for _, _, s in requests), use_tqdm)
        except BaseException:
            self.abort_all()  # whatever failed (or was interrupted), the engine is clean for the next call
            raise
        return [RequestOutput(rid, text, seqs[0].prompt_token_ids, [s.completion_output() for s in seqs], True,
                              request_metrics(seqs)) for rid, text, seqs in requests]

    def _run_until_done(self, total: int, use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=total, desc="generating", unit="seq")
        while self.has_unfinished_requests():
            changed = self.step()
            if bar is not None:
                bar.update(sum(1 for s, _ in changed if s.finish_reason is not None))
        if bar is not None:
            bar.close()

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterable[str]:
        """Yields text pieces of one prompt's first completion as they are generated (on a multi-process
        follower: all of them once the leader's stream is over)."""
        if self.channel is not None and not self.is_leader:
            yield from self._follow()
            return
        params = sampling_params or SamplingParams()
        pieces = []
        try:
            request_id, _, _ = self.add_request(prompt, params)
            try:
                while self.has_unfinished_requests():
                    for seq, delta in self.step():
                        if seq.request_id == request_id and seq.index == 0 and delta:
                            pieces.append(delta)
                            yield delta
            finally:
                self.abort_request(request_id)
        finally:
            if self.channel is not None:
                self.channel.send(("end", pieces))

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {'role', 'content'} dicts) or a list of conversations."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt) for c in conversations]
        # The template writes any BOS itself, so encoding must not add another.
        prompts = [{"prompt": t, "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix no running sequence holds (benchmarks: runs that must not share hits)."""
        for replica in self.replicas:
            replica.scheduler.cache.reset()

    def stats(self) -> EngineStats:
        """A snapshot: running and waiting sequences, pages, prefix-cache hit rate, preemptions, tokens/s."""
        return self.core.stats()


def split_for(config, params, tp: int, what: str = "the model"):
    """(config, params) as a tensor-parallel group of tp devices holds them: checked to split, KV heads repeated
    up to one per device where there are fewer."""
    check_tensor_parallel(config, tp, what)
    return repeat_kv_heads(config, params, max(1, tp // config.num_kv_heads))


def _check_same_tokenizer(draft, target) -> None:
    probe = "Speculative decoding: 42 tokens, café, 日本語 and\n    def f(x): return x"
    if draft is not None and target is not None and draft.encode(probe) != target.encode(probe):
        raise ValueError("the draft model's tokenizer is not the target's: a draft must share the target's tokenizer")


def request_metrics(seqs: list[Sequence]) -> RequestMetrics:
    """One request's timestamps, over its n sequences: the first start and first token, the last finish."""
    def first(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None
    finished = [s.finish_time for s in seqs]
    return RequestMetrics(seqs[0].arrival_time, first(s.first_scheduled_time for s in seqs),
                          first(s.first_token_time for s in seqs),
                          None if None in finished else max(finished), sum(s.num_preemptions for s in seqs))


def _checked_backend(backend: str, asked: str, config, page_size: int, dtype, serving: dict | None = None,
                     kv_cache_dtype: str = "auto") -> str:
    """The Pallas kernels only if they compile and agree with their references here (see self_check)."""
    if backend == "reference" or backend.endswith("interpret"):
        return backend
    from jaxserve.pallas_kernels.self_check import check_kernels
    problem = check_kernels(backend, config.num_heads, config.num_kv_heads, config.head_dim, page_size, dtype,
                            config.sliding_window, serving, kv_cache_dtype=kv_cache_dtype)
    if problem is None:
        logger.info("attention: %s kernels", backend)
        return backend
    if asked != "auto":
        raise RuntimeError(f"the {backend} attention kernels failed their start-up check: {problem}")
    logger.warning("attention: the %s kernels failed their start-up check (%s); using the jnp reference", backend,
                   problem)
    return "reference"


def _enable_compilation_cache() -> None:
    """Keep compiled steps on disk, so a second start skips most compilation (unless the user chose a cache)."""
    if jax.config.jax_compilation_cache_dir is None:
        from jaxserve.weights.default_model import cache_dir
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _default_kv_budget(weight_bytes: int, utilization: float) -> int:
    device = jax.devices()[0]
    if device.platform == "cpu":
        return _CPU_KV_CACHE_BYTES
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if not limit:
        return _CPU_KV_CACHE_BYTES
    # Leave a tenth of the remainder for activations and compiled programs.
    return int((limit * utilization - weight_bytes) * 0.9)
