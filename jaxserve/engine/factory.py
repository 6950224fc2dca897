"""From an EngineConfig to a running engine: load (and quantize) the model, size the KV cache, check the kernels,
and build one engine replica (scheduler, runner, speculation) per device group.

`LLM` is the user's API over what this builds (`EngineParts`); tests build `EngineParts` by hand over fake runners.
"""
from __future__ import annotations

import dataclasses
import logging
import tempfile
from contextlib import nullcontext

import jax
import jax.numpy as jnp

from jaxserve import multihost
from jaxserve.batching.engine_core import PLAN_LEAD_FACTOR, PLAN_LEAD_S, EngineCore
from jaxserve.batching.pools.data_parallel import DataParallel
from jaxserve.batching.pools.disaggregated import Disaggregated
from jaxserve.batching.scheduler import Scheduler
from jaxserve.batching.slo import SloController
from jaxserve.batching.token_budget import step_budgets
from jaxserve.buckets import MIN_TABLE_TOKENS, Buckets, geometric
from jaxserve.cache import HostTier, PageAllocator, PrefixCache, bytes_per_page, num_pages_for_budget, pages_needed
from jaxserve.engine.kv_budget import default_kv_budget, fitted_max_model_len
from jaxserve.engine.speculation import Speculators, load_speculators, proposer_for
from jaxserve.engine_config import EngineConfig
from jaxserve.lora.adapter import load_adapter
from jaxserve.lora.buffers import lora_bytes
from jaxserve.lora.slot_cache import HostAdapters, LoRASlots
from jaxserve.model.attention import resolve_attention_backend
from jaxserve.model.decoder import repeat_kv_heads
from jaxserve.pallas_kernels import page_head_dim_multiple
from jaxserve.parallel.mesh import check_tensor_parallel, device_groups, make_mesh
from jaxserve.paths import cache_dir
from jaxserve.quantize.apply import quantize_model
from jaxserve.runner.model_runner import ModelRunner, RunnerConfig
from jaxserve.tokenizer import Tokenizer, read_chat_template
from jaxserve.weights import LoadedModel, load_model, resolve_dtype
from jaxserve.weights.params import param_bytes

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class EngineParts:
    """What an LLM serves: the engine core (one replica, several behind DataParallel, or a prefill and a decode pool
    behind Disaggregated), its replicas, and what requests are checked against."""
    core: EngineCore | DataParallel | Disaggregated
    replicas: list[EngineCore]
    model_name: str
    vocab_size: int
    max_model_len: int
    tokenizer: Tokenizer | None = None
    model_config: object | None = None  # the ModelConfig (None for a fake model)
    runners: list = dataclasses.field(default_factory=list)  # every runner, a replica's target then its draft
    processes: multihost.LeaderFollower = dataclasses.field(
        default_factory=lambda: multihost.LeaderFollower(None, True))
    attention_backend: str = "reference"
    quantization: dict | None = None  # LoadedModel's: {"method", "group_size", "quantize_embeddings"}
    loras: HostAdapters | None = None  # the LoRA adapters on the host, shared by the replicas (None: not enabled)

    @property
    def role(self) -> str:
        """Its side of disaggregated prefill across servers: "prefill" or "decode", or "both" (the whole of a
        request, its own prefill and decode pools included)."""
        return "both" if isinstance(self.core, Disaggregated) else self.replicas[0].scheduler.role

    @classmethod
    def over(cls, replicas: list[EngineCore], vocab_size: int, max_model_len: int, tokenizer=None,
             model_name: str = "fake", loras: HostAdapters | None = None,
             decode: list[EngineCore] | None = None) -> "EngineParts":
        """An engine over replicas built by hand (tests: over fake runners); with decode replicas, the replicas
        are a prefill pool (disaggregated prefill)."""
        core: EngineCore | DataParallel | Disaggregated
        if decode:
            core = Disaggregated(replicas, decode)
        else:
            core = replicas[0] if len(replicas) == 1 else DataParallel(replicas)
        return cls(core, replicas + (decode or []), model_name, vocab_size, max_model_len, tokenizer, loras=loras)


@dataclasses.dataclass
class _Models:
    """The loaded model and its draft or head, each as every pool's tensor parallelism holds it."""
    loaded: LoadedModel  # as loaded (and quantized): the target's own shapes
    speculators: Speculators  # a draft model split for the first pool's tensor parallelism
    split: dict[int, tuple]  # tensor parallelism -> the target's (config, params) split over it
    max_model_len: int  # asked, else the model's own (before it is fitted to the KV cache)


def build_engine(c: EngineConfig) -> EngineParts:
    runners: list[ModelRunner] = []  # every runner, in the order a multi-process leader names them
    processes = _start_processes(c, runners)
    pools = _pools(c, processes.multi_process)  # (role, tensor parallelism, device groups) per pool
    backend = resolve_attention_backend(c.attention_backend)
    if c.decode_context_parallel_size > 1:  # pages of d x block_size tokens to the host (parallel.context_parallel)
        c = dataclasses.replace(c, block_size=c.block_size * c.decode_context_parallel_size)
    _enable_compilation_cache()
    dtype = resolve_dtype(c.dtype)
    models = _load_models(c, pools, dtype)
    pages = _pages_per_pool(c, models, dtype, backend)
    max_model_len = models.max_model_len
    for num_pages in pages.values():  # a sequence of max_model_len fits every pool
        max_model_len = fitted_max_model_len(max_model_len, num_pages, c.block_size,
                                              asked=c.max_model_len is not None)
    ceiling = step_budgets(c.max_num_batched_tokens, c.max_num_seqs)[1]  # the steps a deep queue may take compile too
    buckets = Buckets.for_limits(c.max_num_seqs, ceiling, pages_needed(max_model_len, c.block_size),
                                 pages_needed(MIN_TABLE_TOKENS, c.block_size))
    by_role, backend = _build_pools(c, pools, models, pages, buckets, dtype, backend, processes, runners)
    replicas = [replica for pool in by_role.values() for replica in pool]
    core: EngineCore | DataParallel | Disaggregated
    if c.disaggregated:
        core = Disaggregated(by_role["prefill"], by_role["decode"])
    else:
        core = replicas[0] if len(replicas) == 1 else DataParallel(replicas)
    loaded, loras = models.loaded, _host_adapters(c, models.loaded, dtype, runners)
    parts = EngineParts(core, replicas, loaded.name, loaded.config.vocab_size, max_model_len, loaded.tokenizer,
                        loaded.config, runners, processes, backend, loaded.quantization, loras)
    _warm_up(c, parts)
    return parts


def _start_processes(c: EngineConfig, runners: list) -> multihost.LeaderFollower:
    """This process's part in a run over several (the leader, process 0, schedules and publishes each step; the
    others follow it, running `runners[index]` on each step published), or a single process's."""
    if c.coordinator_address is not None:  # before any backend starts
        multihost.initialize(c.coordinator_address, c.num_processes, c.process_id, c.coordinator_bind_address)
    processes = multihost.LeaderFollower.for_this_process(lambda index, batch: runners[index].run(batch),
                                                           c.coordinator_secret_file)
    if c.enable_lora and processes.multi_process:
        # A follower would have to load each adapter into the same slot as the leader, which needs a message of
        # its own (its arrays, or a path every host can read): not built yet.
        raise ValueError("enable_lora is not supported over several processes yet")
    return processes


def _load_models(c: EngineConfig, pools: list[tuple[str, int, list]], dtype) -> _Models:
    """The model (quantized, with its chat template) and any draft, checked against each other and split for every
    pool. Over a mesh, weights are loaded (and quantized) in host memory and go from there to their shards: no
    accelerator ever holds the whole model."""
    on_host = pools[0][2][0] is not None
    with jax.default_device(jax.local_devices(backend="cpu")[0]) if on_host else nullcontext():
        loaded = load_model(c.model, dtype)
        loaded = dataclasses.replace(loaded, config=loaded.config.with_hf_overrides(c.hf_overrides))
        loaded = quantize_model(loaded, c.quantization, group_size=c.quantization_group_size,
                                quantize_embeddings=c.quantize_embeddings, calibration_text=c.calibration_text)
        if c.chat_template is not None:
            tokenizer = loaded.tokenizer
            if tokenizer is None:
                raise ValueError(f"chat_template {c.chat_template}: this model has no tokenizer to chat with")
            tokenizer.chat_template = read_chat_template(c.chat_template)
        limit = loaded.config.derived_max_model_len  # its context, stretched by any RoPE scaling (as vLLM's)
        if c.max_model_len is not None and c.max_model_len > limit:
            raise ValueError(f"max_model_len must be an integer in [2, {limit}] for this model, got "
                             f"{c.max_model_len!r}; RoPE scaling extends a model's context, e.g. hf_overrides="
                             "{'rope_scaling': {'rope_type': 'yarn', 'factor': 4.0, "
                             "'original_max_position_embeddings': N}}")
        max_model_len = c.max_model_len or limit
        speculators = load_speculators(c.speculative_config, loaded, dtype, max_model_len, c.tensor_parallel_size,
                                       c.model)
        # What the runners hold: over a mesh wider than the KV heads, each device gets a copy of the head it reads.
        split = {pool_tp: split_for(loaded.config, loaded.params, pool_tp, dcp=c.decode_context_parallel_size)
                 for _, pool_tp, _ in pools}
        if len({pool_config.num_kv_heads for pool_config, _ in split.values()}) > 1:
            raise ValueError(f"tensor_parallel_size {c.tensor_parallel_size} and decode_tensor_parallel_size "
                             f"{c.decode_tensor_parallel_size} hold different KV heads per page (over more devices "
                             f"than the model's {loaded.config.num_kv_heads} KV heads, each is repeated): the pools' "
                             "pages would not match; keep both at most the KV-head count, or equal")
        if (draft := speculators.draft) is not None:
            speculators.draft = dataclasses.replace(draft, **dict(zip(("config", "params"), split_for(
                draft.config, draft.params, c.tensor_parallel_size, "the draft", c.decode_context_parallel_size))))
    return _Models(loaded, speculators, split, max_model_len)


def _pages_per_pool(c: EngineConfig, models: _Models, dtype, backend: str) -> dict[int, int]:
    """KV pages per device group, by tensor parallelism. The budget is per device, as gpu_memory_utilization is; the
    weights and the pages split over tp devices. The LoRA slots too: 8 slots of rank 64 on Llama 3 8B are 2.7 GB,
    half of what the budget leaves free."""
    config, speculators = models.split[c.tensor_parallel_size][0], models.speculators
    adapters = lora_bytes(config, c.max_loras, c.max_lora_rank, dtype) if c.enable_lora else 0
    # (pages padded for the kernel that reads them: the backend before its start-up check, which can only fall
    # back to unpadded pages, so the count errs on the safe side)
    lanes = page_head_dim_multiple(backend)

    def pool_pages(pool_tp: int) -> int:
        pool_params = models.split[pool_tp][1]
        kv_budget = c.kv_cache_memory_bytes or default_kv_budget(
            (param_bytes(pool_params) + speculators.param_bytes() + adapters) // pool_tp, c.gpu_memory_utilization)
        # The draft's (or head's) pages are the target's page ids in a second cache: a page costs both.
        n = num_pages_for_budget(config, c.block_size, dtype, kv_budget * pool_tp, c.kv_cache_dtype,
                                 speculators.page_bytes(c.block_size, dtype, c.kv_cache_dtype, lanes), lanes)
        # Never more pages than max_num_seqs full-length sequences can use (+1 for the scratch page).
        return min(n, c.max_num_seqs * pages_needed(models.max_model_len, c.block_size) + 1)
    return {pool_tp: pool_pages(pool_tp) for pool_tp in models.split}


def _build_pools(c: EngineConfig, pools: list[tuple[str, int, list]], models: _Models, pages: dict[int, int],
                 buckets: Buckets, dtype, backend: str, processes: multihost.LeaderFollower,
                 runners: list) -> tuple[dict[str, list[EngineCore]], str]:
    """Each pool's replicas by role, and the attention backend they run (the Pallas kernels only if they passed
    their start-up check)."""
    spec = c.speculative_config
    config = models.split[c.tensor_parallel_size][0]
    lanes = page_head_dim_multiple(backend)
    by_role: dict[str, list[EngineCore]] = {}
    for role, pool_tp, pool_groups in pools:
        num_pages = pages[pool_tp]
        logger.info("KV cache%s: %d pages of %d tokens (%.1f MB, %s)", "" if role == "both" else f" ({role})",
                    num_pages, c.block_size,
                    num_pages * bytes_per_page(config, c.block_size, dtype, c.kv_cache_dtype, lanes) / 1e6,
                    "int8" if c.kv_cache_dtype == "int8" else jnp.dtype(dtype).name)
        serving = dict(num_pages=num_pages, pages_per_seq=buckets.pages_per_row, max_num_seqs=c.max_num_seqs,
                       max_tokens=buckets.num_tokens[-1])
        backend = checked_backend(backend, c.attention_backend, config, c.block_size, dtype, serving,
                                  c.kv_cache_dtype)
        runner_config = RunnerConfig(dtype, num_pages, c.block_size, buckets, c.max_num_seqs, backend,
                                     c.kv_cache_dtype, spec.num_speculative_tokens if spec else 0,
                                     *((c.max_loras, c.max_lora_rank) if c.enable_lora else (0, 0)),
                                     kv_transfer=c.disaggregated or role != "both" or bool(c.kv_offloading_size),
                                     decode_context_parallel_size=c.decode_context_parallel_size,
                                     capture=models.speculators.capture)
        # One engine replica per device group: its own runner, KV cache and scheduler (see batching.data_parallel).
        pool_config, pool_params = models.split[pool_tp]
        by_role[role] = [_replica(c, runner_config, pool_config, pool_params, models.speculators, group, processes,
                                  runners, role) for group in pool_groups]
    return by_role, backend


def _host_adapters(c: EngineConfig, loaded: LoadedModel, dtype, runners: list) -> HostAdapters | None:
    """The LoRA adapters on the host, checked against the model's own shapes (a runner splits them as it splits the
    model), each runner's slot arrays built where one is loaded; None without enable_lora."""
    if not c.enable_lora:
        return None
    with_slots = [r for r in runners if getattr(r, "lora", None) is not None]  # not a draft model's

    def prepare(adapter) -> None:
        for runner in with_slots:
            runner.prepare_lora(adapter)
    return HostAdapters(lambda request: load_adapter(request, loaded.config, c.max_lora_rank, dtype),
                        c.max_cpu_loras or c.max_loras, prepare)


def _warm_up(c: EngineConfig, parts: EngineParts) -> None:
    """Compiles every step (and, disaggregated, every page transfer) before serving, on every process. The
    controller (and a host tier, with a transfer's) weighs step times measured at warm-up, so speculation warms up
    even if asked not to."""
    timed = (c.speculative_config is not None and c.speculative_config.adaptive) or (c.warmup and c.kv_offloading_size)
    if not (c.warmup or timed):
        return

    def warm_up():
        for runner in parts.runners:
            runner.warmup(time_steps=timed)
        if c.disaggregated:
            parts.core.warm_up_transfers()
        for host in [r.host for r in parts.replicas if r.host is not None]:
            host.calibrate()
    parts.processes.run(warm_up)


def _pools(c: EngineConfig, multi_process: bool) -> list[tuple[str, int, list]]:
    """(role, tensor parallelism, device groups (None: the default device)) of each pool of replicas: one pool
    (role c.role) without disaggregated prefill, else a prefill pool on the first devices and a decode pool on the
    next."""
    tp, dp = c.tensor_parallel_size, c.data_parallel_size
    if not c.disaggregated:
        return [(c.role, tp, device_groups(make_mesh(tp, dp)) if tp * dp > 1 or multi_process else [None])]
    dtp = c.decode_tensor_parallel_size or tp
    devices = jax.devices()
    split = c.prefill_replicas * tp
    need = split + c.decode_replicas * dtp
    if need > len(devices):
        raise ValueError(f"prefill_replicas {c.prefill_replicas} x tensor_parallel_size {tp} + decode_replicas "
                         f"{c.decode_replicas} x decode_tensor_parallel_size {dtp} needs {need} devices; there are "
                         f"{len(devices)} ({devices[0].platform})")
    return [("prefill", tp, device_groups(make_mesh(tp, c.prefill_replicas, devices[:split]))),
            ("decode", dtp, device_groups(make_mesh(dtp, c.decode_replicas, devices[split:need])))]


def _replica(c: EngineConfig, runner_config: RunnerConfig, config, params, speculators: Speculators, mesh,
             processes: multihost.LeaderFollower, runners: list, role: str = "both") -> EngineCore:
    """An engine on one device group (mesh None: the default device); its runners join `runners`, whose index is
    how a multi-process leader names them to the followers."""
    spec = c.speculative_config

    def add_runner(make):
        runners.append(runner := make(len(runners)))
        return runner
    runner = add_runner(lambda index: ModelRunner(config, params, runner_config, mesh,
                                                  processes if processes.is_leader else None, index))
    slo = None
    if c.ttft_slo is not None or c.tpot_slo is not None:
        slo = SloController(geometric(1, c.max_num_seqs), c.max_num_seqs, tpot_slo=c.tpot_slo, ttft_slo=c.ttft_slo)
    tier = HostTier(int(c.kv_offloading_size * 2**30) // c.data_parallel_size) if c.kv_offloading_size else None
    cache = PrefixCache(PageAllocator(runner_config.num_pages), c.block_size, c.enable_prefix_caching, tier)
    # Each replica's runner has its own adapter slots; a draft model has none (its proposals are only proposals).
    lora_slots = LoRASlots(c.max_loras, runner.load_lora) if c.enable_lora else None
    base, ceiling = step_budgets(c.max_num_batched_tokens, c.max_num_seqs)  # the step's budget grows by queue depth
    scheduler = Scheduler(cache, c.max_num_seqs, base, runner_config.buckets.num_tokens, c.scheduling_policy, slo,
                          lora_slots, role, max_step_tokens=ceiling)
    # By default on CPU a server plans each step once the one before is read back (its requests' first tokens a
    # step sooner, measured better there), while stepping at once overlaps (BENCHMARKS.md, issue 28).
    overlap = c.async_scheduling is not False
    lead = None if c.async_scheduling is None and jax.default_backend() == "cpu" else (PLAN_LEAD_FACTOR, PLAN_LEAD_S)
    if spec is None:
        return EngineCore(scheduler, runner, async_scheduling=overlap, plan_lead=lead, host_tier=tier)
    proposer, controller = proposer_for(spec, speculators, runner, runner_config, add_runner,
                                        ceiling, c.max_num_seqs)
    return EngineCore(scheduler, runner, proposer=proposer, controller=controller, adaptive=spec.adaptive,
                      async_scheduling=overlap, plan_lead=lead, host_tier=tier)


def split_for(config, params, tp: int, what: str = "the model", dcp: int = 1):
    """(config, params) as a tensor-parallel group of tp devices holds them: checked to split, KV heads repeated
    up to one per device where there are fewer (none with decode context parallelism, dcp = tp: see Steps)."""
    if dcp == 1:
        check_tensor_parallel(config, tp, what)
    return repeat_kv_heads(config, params, 1 if dcp > 1 else max(1, tp // config.num_kv_heads))

def checked_backend(backend: str, asked: str, config, page_size: int, dtype, serving: dict | None = None,
                    kv_cache_dtype: str = "auto") -> str:
    """The Pallas kernels only if they compile and agree with their references here (see self_check)."""
    if not backend.startswith("pallas-") or backend.endswith("interpret"):  # no kernel of its own to check
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
    """Keep compiled steps on disk, so a second start skips most compilation (unless the user chose a cache). A
    cache directory that cannot be written (a read-only container) costs only the speed-up: no cache, no noise."""
    if jax.config.jax_compilation_cache_dir is None:  # type: ignore[attr-defined]  # jax's flags are set at runtime
        directory = cache_dir() / "xla"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as e:
            logger.info("compilation cache off: %s is not writable (%s)", directory, e)
            return
        jax.config.update("jax_compilation_cache_dir", str(directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
