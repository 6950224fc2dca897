"""EngineConfig: every engine argument, validated once, shared by LLM, AsyncEngine, the server and the CLI.

The `jaxserve` command's engine flags are declared on the fields too (`flag(...)`: help, choices, metavar in each
field's metadata; see jaxserve.cli_flags); `add_cli_args` makes the argparse flags from them and `from_cli_args`
reads them back (vLLM's EngineArgs pattern), so a new option is one field, written once.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from jaxserve.cache import KV_CACHE_DTYPES, check_kv_options
from jaxserve.cli_flags import FlagGroup, add_flags, flag, read_flags
from jaxserve.config import check_hf_overrides, hf_overrides_from_json
from jaxserve.model.quant import QUANTIZATIONS
from jaxserve.multihost.cluster_env import GROUP_SIZE_ENV, WORKER_INDEX_ENV, lws_port
from jaxserve.options import (
    ATTENTION_BACKENDS,
    AUTO_CLUSTER,
    CPU_KV_CACHE_BYTES,
    DTYPES,
    LWS_CLUSTER,
    LWS_DEFAULT_PORT,
    ROLES,
    SCHEDULING_POLICIES,
    check_choice,
    check_int,
    check_type,
)
from jaxserve.spec_config import (
    SpeculativeConfig,
    add_speculative_cli_args,
    check_speculation_with,
    speculative_config_from_args,
)
from jaxserve.tokenizer import read_chat_template
from jaxserve.weights.default_model import DEFAULT_MODEL


def _read_file(path: str | None) -> str | None:
    return Path(path).read_text() if path else None


def _add_hf_overrides_cli_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-overrides", metavar="JSON", help="a JSON object of HF config keys that replace the model's "
                   "(vLLM's): rope_scaling / rope_parameters, rope_theta, max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The arguments of `LLM(...)` (and `AsyncEngine.from_args(...)`), checked before anything loads.

    model: None (SmolLM2-135M-Instruct, fetched once), a .gguf file, a HF directory or a jaxserve checkpoint.
    max_model_len: longest prompt + output (default: the model's context length, stretched by RoPE scaling).
    hf_overrides: HF config keys that replace the model's, as vLLM's (e.g. {"rope_scaling": {"rope_type": "yarn",
        "factor": 4.0, "original_max_position_embeddings": 8192}}); see jaxserve.config.HF_OVERRIDABLE.
    dtype: "auto" (bfloat16 on GPU/TPU and on CPUs with native bf16, avx512_bf16 or amx_bf16; float32 on other
        CPUs), "float32", "bfloat16" or "float16".
    max_num_seqs: most sequences running together.
    max_num_batched_tokens: tokens computed per step, one per decoding sequence and the rest prompt chunks: the
        chunk size of chunked prefill, so the knob between TTFT (bigger) and TPOT under load (smaller). None (the
        default): 512, growing to 2048 while many prompts wait (jaxserve.batching.token_budget); given, every
        step's budget, as vLLM's.
    block_size: tokens per KV-cache page. kv_cache_memory_bytes: the KV budget per device (default: 2 GiB on CPU,
    gpu_memory_utilization of device memory less the weights on an accelerator).
    seed: seeds the sampling of requests that give no seed of their own.
    enable_prefix_caching: reuse prompt prefixes' KV pages; kv_offloading_size: GiB of host memory for evicted ones.
    scheduling_policy: "fcfs", or "priority" (lower `priority` first; a better one may preempt a worse one).
    ttft_slo, tpot_slo: latency targets in seconds; with them the running batch is sized from measured step times
        (see jaxserve.batching.slo).
    async_scheduling: plan step N+1 before step N is read back (vLLM's name): the device never waits for the host
        between steps; a server plans N+1 as N is about to end, so a request that arrives while N runs still joins
        N+1 unless it comes in the last moments (see jaxserve.batching.engine_core). None (the default): on for GPU
        and TPU; on CPU on for generate() and stepping at once, while a server plans each step after reading the
        one before back (its clients' first tokens measured sooner: BENCHMARKS.md, issue 28).
    attention_backend: "auto" (the Pallas kernels on GPU and TPU if they pass a start-up check, else and on CPU
        the jnp reference), "reference", "dense" (the oracle itself: slow, differentiable), or "pallas" /
        "pallas-gpu" / "pallas-tpu" (insist; on CPU the kernels run in Pallas interpret mode: correct, slow).
    quantization: of every linear layer's weights: None, "int8" (a scale per output channel; on CPU its dot takes
        the activations as int8 too, two digits a value: the fastest CPU format), "int4" (a scale
        and minimum per group of input rows, two values a byte) or "awq" (int4 with activation-aware input scales
        calibrated on `calibration_text`, by default a text the package ships). A checkpoint written quantized
        (`jaxserve convert --quantization`) loads quantized without it.
    quantization_group_size: input rows per int4 group (default 32 for int4, llama.cpp's Q4_1; 128 for awq).
    quantize_embeddings: also the LM head (same method) and the embedding table (int8 rows).
    kv_cache_dtype: "auto" (the model's dtype) or "int8" (a float32 scale per token and KV head beside the pages:
        about twice the sequences in the same memory as bfloat16; dequantized as the attention reads them).
    speculative_config: speculative decoding, as vLLM's: {"method": "ngram" | "draft_model" | "eagle3" | "mtp",
        "num_speculative_tokens": k, "model": DRAFT (draft_model) or HEAD (eagle3: a checkpoint directory; mtp:
        none, the target checkpoint's own MTP layer),
        "prompt_lookup_max": 4, "prompt_lookup_min": 2
        (ngram), "adaptive": True (speculate only where measured acceptance and step costs say it pays)}, or a
        SpeculativeConfig; held parsed. The draft shares the KV budget (its pages beside the target's) and the dtype.
    warmup: compile every step bucket now rather than on first use.
    tensor_parallel_size: devices each model replica is split over (weights Megatron-style, the KV cache by KV
        heads); it must divide the attention heads (see jaxserve.parallel.mesh).
    data_parallel_size: model replicas, each running its own sequences.
    prefill_replicas, decode_replicas: disaggregated prefill in one engine (see jaxserve.batching.pools.disaggregated):
        replicas that only prefill and replicas that only decode, each on its own device group
        (tensor_parallel_size devices for a prefill replica, decode_tensor_parallel_size (default: the same) for a
        decode one); both 0 (the default): every replica does both. Not with data_parallel_size > 1, speculative
        decoding, LoRA or several processes.
    role: "both" (the default), or "prefill" / "decode": this engine is one side of disaggregated prefill across
        servers (`jaxserve serve --role`): a prefill engine hands every sequence off after its first token, a
        decode engine takes sequences prefilled elsewhere (EngineCore.add_prefilled).
    coordinator_address, num_processes, process_id: jax.distributed over several hosts ("host:port" of process 0,
        how many processes, this one's index); all three or none, or coordinator_address alone: "auto" (JAX's own
        cluster detection: TPU pod slices, SLURM), or "lws" / "lws:PORT" (a Kubernetes LeaderWorkerSet group: its
        LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX, port 8476 unless given; see
        jaxserve.multihost.cluster_env).
    coordinator_bind_address: "host:port" process 0's coordination service listens on (default: the host of
        coordinator_address, not every interface; with "lws", every interface when LWS_LEADER_ADDRESS is a name).
    coordinator_secret_file: a file holding the secret every process authenticates the leader's messages with
        (default: $JAXSERVE_COORDINATOR_SECRET); required by every multi-process run (see jaxserve.multihost).
    chat_template: a jinja chat template file to use instead of the model's own (or where the model has none).
    enable_lora: serve PEFT LoRA adapters beside the base model (a request names one with a LoRARequest).
    max_loras: adapters in one step (their device slots); max_lora_rank: the highest adapter rank they hold (an
        adapter of higher rank is refused); max_cpu_loras: adapters kept loaded in host memory (None: max_loras;
        at least max_loras). As vLLM's; each needs enable_lora.
    """

    model: str | None = flag(
        f"a .gguf file, a HF model directory, or a jaxserve checkpoint (default: {DEFAULT_MODEL}, fetched once into "
        "~/.cache/jaxserve or $JAXSERVE_CACHE)", repeat_in_serve=True,
        serve_help="; give it again to serve several models at once, an engine each")
    max_model_len: int | None = flag("longest prompt + output in tokens (default: the model's context length)")
    hf_overrides: dict | None = dataclasses.field(default=None, metadata={"cli": FlagGroup(
        _add_hf_overrides_cli_arg, lambda args: hf_overrides_from_json(getattr(args, "hf_overrides", None)))})
    dtype: str = flag("parameter and activation dtype (auto: bfloat16 on GPU/TPU and on CPUs with avx512_bf16 or "
                      "amx_bf16, else float32)", default="auto", choices=DTYPES)
    max_num_seqs: int = flag("most sequences decoding together", default=64, serve_only=True, offline_default=1)
    max_num_batched_tokens: int | None = flag(
        "tokens per step: one per decoding sequence, the rest prompt chunks (default: 512, up to 2048 while many "
        "prompts wait)", serve_only=True)
    block_size: int = flag("tokens per KV-cache page", default=16)
    kv_cache_memory_bytes: int | None = flag(
        "KV-cache budget per device, in bytes (default: 2 GiB on CPU, --gpu-memory-utilization of device memory less "
        "the weights on an accelerator)",
        serve_help=". With several --model it applies to each engine as given; without it each engine gets an equal "
                   "share: --gpu-memory-utilization / (number of models) of device memory (less its own weights), or "
                   "on CPU 2 GiB / (number of models)")
    gpu_memory_utilization: float = flag("fraction of each accelerator's memory for weights and KV cache (default 0.9)",
                                         default=0.9)
    seed: int = 0  # no flag: generate's --seed seeds its sampling, not the engine
    enable_prefix_caching: bool = flag("do not reuse the KV pages of prompt prefixes seen before", default=True,
                                       serve_only=True)
    scheduling_policy: str = flag(None, default="fcfs", choices=SCHEDULING_POLICIES, serve_only=True)
    ttft_slo: float | None = flag("time-to-first-token target, seconds", serve_only=True)
    tpot_slo: float | None = flag("time-per-output-token target, seconds", serve_only=True)
    async_scheduling: bool | None = flag(
        "plan each step before the one in flight is read back: no host gap between steps (default: on for "
        "GPU/TPU; on CPU a server plans after the read-back)", serve_only=True)
    attention_backend: str = flag(None, default="auto", choices=ATTENTION_BACKENDS, serve_only=True)
    quantization: str | None = flag(
        "quantization of the linear layers' weights: int8 (a scale per output channel; the fastest format on CPU), "
        "int4 (groups of input rows, two values a byte), awq (int4 with calibrated input scales)",
        choices=QUANTIZATIONS[1:])
    quantization_group_size: int | None = flag(
        "input rows per int4 group (default: 32 for int4, as llama.cpp's Q4_1; 128 for awq)")
    quantize_embeddings: bool = flag("also quantize the LM head and the embedding table", default=False)
    calibration_text: str | None = flag("text to calibrate awq on (default: a public-domain text the package ships)",
                                        name="calibration-file", read_value=_read_file)
    kv_cache_dtype: str = flag("KV-cache pages: auto (the model's dtype) or int8 (about twice the sequences per byte)",
                               default="auto", choices=KV_CACHE_DTYPES)
    kv_offloading_size: float | None = flag("GiB of host RAM for evicted prefix-cache pages (0: off)", serve_only=True)
    speculative_config: SpeculativeConfig | None = dataclasses.field(
        default=None, metadata={"cli": FlagGroup(add_speculative_cli_args, speculative_config_from_args)})
    warmup: bool = flag("compile shapes on first use instead of before serving", default=True,
                        offline_default=False, offline_help="compile every shape bucket before generating")
    tensor_parallel_size: int = flag("devices each model replica is sharded over (weights and KV heads)", default=1)
    decode_context_parallel_size: int = flag("1 or --tensor-parallel-size: KV by token", default=1, aliases=("-dcp",))
    data_parallel_size: int = flag("model replicas, each running its own sequences", default=1)
    prefill_replicas: int = flag("replicas that only prefill (disaggregated prefill, with --decode-replicas; 0: "
                                 "every replica prefills and decodes)", default=0, serve_only=True)
    decode_replicas: int = flag("replicas that only decode, taking the prefill replicas' KV pages", default=0,
                                serve_only=True)
    decode_tensor_parallel_size: int | None = flag("devices each decode replica is sharded over (default: "
                                                   "--tensor-parallel-size)", serve_only=True)
    role: str = flag("this server's part in disaggregated prefill across servers: prefill (hands sequences off after "
                     "their first token) or decode (takes them)", default="both", choices=ROLES, serve_only=True)
    coordinator_address: str | None = flag(
        "host:port of process 0, to run over several hosts (jax.distributed; with --num-processes and --process-id); "
        f"'{AUTO_CLUSTER}' for JAX's cluster detection (TPU pod slices, SLURM); or '{LWS_CLUSTER}' / "
        f"'{LWS_CLUSTER}:PORT' for a Kubernetes LeaderWorkerSet group (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, "
        f"LWS_WORKER_INDEX; port {LWS_DEFAULT_PORT} unless given)")
    num_processes: int | None = flag("processes in a multi-host run")
    process_id: int | None = flag("this process's index in a multi-host run, 0 to --num-processes - 1")
    coordinator_bind_address: str | None = flag(
        "where process 0's coordination service listens (default: --coordinator-address's host, not every "
        f"interface; with '{LWS_CLUSTER}', every interface of the pod when LWS_LEADER_ADDRESS is a name)",
        metavar="HOST:PORT")
    coordinator_secret_file: str | None = flag(
        "a file with the secret (16+ bytes, the same on every process) that authenticates process 0's messages; "
        "default $JAXSERVE_COORDINATOR_SECRET; required by every multi-process run", metavar="FILE")
    chat_template: str | None = flag("a jinja chat template file, used instead of the model's own", metavar="FILE")
    enable_lora: bool = flag("serve LoRA adapters (PEFT directories) beside the base model", default=False)
    max_loras: int = flag("LoRA adapters in one step (device slots)", default=1)
    max_lora_rank: int = flag("the highest LoRA rank the slots hold", default=16)
    max_cpu_loras: int | None = flag("LoRA adapters kept in host memory (default: --max-loras)")

    def __post_init__(self):
        # Nothing here may touch JAX's backends: jax.distributed must initialise before they start.
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        check_type("model", self.model, str, optional=True)
        check_int("max_model_len", self.max_model_len, 2, optional=True)  # the model's own limit: at load
        check_hf_overrides(self.hf_overrides)
        check_choice("dtype", self.dtype, DTYPES)
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "data_parallel_size",
                     "decode_context_parallel_size"):
            check_int(name, getattr(self, name), 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        if self.decode_context_parallel_size not in (1, self.tensor_parallel_size):
            raise ValueError(f"decode_context_parallel_size must be 1 or tensor_parallel_size "
                             f"({self.tensor_parallel_size}), got {self.decode_context_parallel_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence decodes a token per step")
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        check_type("seed", self.seed, int)
        for name in ("enable_prefix_caching", "quantize_embeddings", "warmup"):
            check_type(name, getattr(self, name), bool)
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        check_type("async_scheduling", self.async_scheduling, bool, optional=True)
        for name in ("ttft_slo", "tpot_slo"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        self._check_quantization()
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        check_speculation_with(self)
        check_kv_options(self)
        self._check_distributed()
        self._check_lora()
        self._check_disaggregated()
        if isinstance(self.chat_template, os.PathLike):
            object.__setattr__(self, "chat_template", os.fspath(self.chat_template))
        check_type("chat_template", self.chat_template, str, optional=True)
        if self.chat_template is not None:
            read_chat_template(self.chat_template)  # an unreadable file fails here, before the model loads

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS[1:]} or None, got {self.quantization!r}")
        check_int("quantization_group_size", self.quantization_group_size, 1, optional=True)
        check_type("calibration_text", self.calibration_text, str, optional=True)
        # Each of these would be silently ignored without the quantization it refines.
        if self.quantization_group_size is not None and self.quantization not in ("int4", "awq"):
            raise ValueError("a quantization group size applies to int4 and awq; int8 has a scale per output channel")
        if self.quantize_embeddings and self.quantization is None:
            raise ValueError("quantize_embeddings needs a quantization (int8, int4 or awq)")
        if self.calibration_text is not None and self.quantization != "awq":
            raise ValueError("calibration_text is what awq calibrates on; it needs quantization 'awq'")

    def _check_lora(self) -> None:
        check_type("enable_lora", self.enable_lora, bool)
        check_int("max_loras", self.max_loras, 1)
        check_int("max_lora_rank", self.max_lora_rank, 1)
        check_int("max_cpu_loras", self.max_cpu_loras, 1, optional=True)
        if not self.enable_lora:  # each would be silently ignored
            given = [name for name, default in (("max_loras", 1), ("max_lora_rank", 16), ("max_cpu_loras", None))
                     if getattr(self, name) != default]
            if given:
                raise ValueError(f"{', '.join(given)} need enable_lora=True")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                             "an adapter in a device slot is also held in host memory")

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode pools in this engine."""
        return self.prefill_replicas > 0

    def _check_disaggregated(self) -> None:
        check_int("prefill_replicas", self.prefill_replicas, 0)
        check_int("decode_replicas", self.decode_replicas, 0)
        check_int("decode_tensor_parallel_size", self.decode_tensor_parallel_size, 1, optional=True)
        check_choice("role", self.role, ROLES)
        if (self.prefill_replicas > 0) != (self.decode_replicas > 0):
            raise ValueError(f"prefill_replicas ({self.prefill_replicas}) and decode_replicas "
                             f"({self.decode_replicas}) go together: both at least 1 (disaggregated prefill), or "
                             "both 0")
        if self.decode_tensor_parallel_size is not None and not self.disaggregated:
            raise ValueError("decode_tensor_parallel_size sizes the decode replicas: it needs prefill_replicas and "
                             "decode_replicas")
        if not self.disaggregated and self.role == "both":
            return
        what = ("prefill_replicas/decode_replicas" if self.disaggregated else f"role {self.role!r}")
        if self.disaggregated and self.role != "both":
            raise ValueError(f"role {self.role!r} is one side of disaggregated prefill across servers; "
                             "prefill_replicas/decode_replicas run both sides in this engine: give one or the other")
        if self.disaggregated and self.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size ({self.data_parallel_size}) does not apply with {what}: the "
                             "replicas are the pools' (prefill_replicas, decode_replicas)")
        if self.speculative_config is not None:
            raise ValueError(f"speculative decoding is not supported with {what} yet")
        if self.enable_lora:
            raise ValueError(f"LoRA adapters are not supported with {what} yet")
        if self.coordinator_address is not None:
            raise ValueError(f"{what} runs in one process (one host): not with coordinator_address")

    def _check_distributed(self) -> None:
        check_type("coordinator_address", self.coordinator_address, str, optional=True)
        check_int("num_processes", self.num_processes, 1, optional=True)
        check_int("process_id", self.process_id, 0, optional=True)
        check_type("coordinator_bind_address", self.coordinator_bind_address, str, optional=True)
        check_type("coordinator_secret_file", self.coordinator_secret_file, str, optional=True)
        given = [v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)]
        if self.coordinator_address == AUTO_CLUSTER and any(given[1:]):
            raise ValueError(f"coordinator_address {AUTO_CLUSTER!r} finds the processes itself: give no num_processes "
                             "or process_id")
        lws = lws_port(self.coordinator_address) is not None  # a bad port is a ValueError here
        if lws and any(given[1:]):
            raise ValueError(f"coordinator_address {self.coordinator_address!r} reads the processes from "
                             f"LeaderWorkerSet's {GROUP_SIZE_ENV} and {WORKER_INDEX_ENV}: give no num_processes or "
                             "process_id")
        if any(given) and not all(given) and not lws and self.coordinator_address != AUTO_CLUSTER:
            raise ValueError("coordinator_address, num_processes and process_id go together: give all three or none")
        if all(given) and self.process_id >= self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes = {self.num_processes}), got {self.process_id}")

    # ---- the command line (the flags are declared on the fields: see Flag) ----

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
        """The engine flags of `jaxserve generate / chat` (serving=False: one prompt at a time) and `serve`."""
        add_flags(EngineConfig, p, serving)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config from flags `add_cli_args` declared (a flag another command lacks keeps its default)."""
        # By field, not all of args: a command's other flags (generate's sampling --seed) are not engine arguments.
        given = read_flags(cls, args)
        if isinstance(given.get("model"), list):  # serve's --model, which may be repeated
            if len(given["model"]) > 1:
                raise ValueError("several --model: one config per model is EngineConfig.per_model_from_cli_args")
            given["model"] = given["model"][0]
        return cls(**given)

    @classmethod
    def per_model_from_cli_args(cls, args: argparse.Namespace) -> list["EngineConfig"]:
        """One config per --model (serve repeats it; no --model: the default model), every other flag applying to
        each.

        The KV budget of several models: --kv-cache-memory-bytes, if given, is each engine's (per device). Otherwise
        each gets an equal share of what one model would get: gpu_memory_utilization / n of device memory, less its
        own weights (the engine's default budget is that share less the weights, so it does not matter that engines
        are built one after another: none looks at what the others already hold, and together they stay within
        gpu_memory_utilization); on a device without a memory limit (CPU) the default 2 GiB budget is split in n.
        Why equal shares rather than in proportion to weight size: the weights are known only once each model loads,
        and a KV page of a bigger model costs more anyway, so equal shares need no guess; a model whose weights pass
        its share fails to start, saying so, and --kv-cache-memory-bytes (or fewer models per device) is the answer.

        Several models run in one process: not with --coordinator-address (multi-process runs serve one model).
        """
        models = args.model if isinstance(args.model, list) else [args.model]
        if len(models) <= 1:
            return [cls.from_cli_args(args)]
        if args.coordinator_address is not None:
            raise ValueError("several --model run in one process: a multi-process run (--coordinator-address) "
                             "serves one model")
        base = cls.from_cli_args(argparse.Namespace(**{**vars(args), "model": None}))  # checks the shared flags once
        share = {}
        if base.kv_cache_memory_bytes is None:
            share["gpu_memory_utilization"] = base.gpu_memory_utilization / len(models)
            # Touching the JAX backend is fine here: no jax.distributed to initialise first (refused above).
            import jax
            device = jax.devices()[0]
            if device.platform == "cpu" or not (device.memory_stats() or {}).get("bytes_limit"):
                share["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES // len(models)
        return [dataclasses.replace(base, model=model, **share) for model in models]


_QUANTIZATION_FIELDS = ("quantization", "quantization_group_size", "quantize_embeddings", "calibration_text")


def add_quantization_cli_args(p: argparse.ArgumentParser) -> None:
    """The quantization flags alone (`jaxserve convert`'s)."""
    add_flags(EngineConfig, p, False, _QUANTIZATION_FIELDS)


def quantization_from_cli_args(args: argparse.Namespace) -> dict:
    """{quantization, quantization_group_size, quantize_embeddings, calibration_text} from those flags."""
    return read_flags(EngineConfig, args, _QUANTIZATION_FIELDS)
