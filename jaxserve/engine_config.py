"""EngineConfig: every engine argument, validated once, shared by LLM, AsyncEngine, the server and the CLI.

The `jaxserve` command's engine flags are declared here too (`add_cli_args` / `from_cli_args`, vLLM's EngineArgs
pattern), so a new argument is a field and a flag in one place.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from jaxserve.attention import BACKENDS
from jaxserve.batching.scheduler import POLICIES
from jaxserve.cache import KV_CACHE_DTYPES, check_kv_cache_dtype
from jaxserve.multihost import AUTO_CLUSTER
from jaxserve.quant import QUANTIZATIONS
from jaxserve.spec_config import SpeculativeConfig
from jaxserve.tokenizer import read_chat_template
from jaxserve.weights import _DTYPES
from jaxserve.weights.default_model import DEFAULT_MODEL

DTYPES = ("auto", *_DTYPES)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The arguments of `LLM(...)` (and `AsyncEngine.from_args(...)`), checked before anything loads.

    model: None (SmolLM2-135M-Instruct, fetched once), a .gguf file, a HF directory or a jaxserve checkpoint.
    max_model_len: longest prompt + output (default: the model's context length).
    dtype: "auto" (float32 on CPU, bfloat16 on GPU/TPU), "float32", "bfloat16" or "float16".
    max_num_seqs: most sequences running together.
    max_num_batched_tokens: tokens computed per step, one per decoding sequence and the rest prompt chunks: the
        chunk size of chunked prefill, so the knob between TTFT (bigger) and TPOT under load (smaller).
    block_size: tokens per KV-cache page. kv_cache_memory_bytes: the KV budget per device (default: 2 GiB on CPU,
    gpu_memory_utilization of device memory less the weights on an accelerator).
    seed: seeds the sampling of requests that give no seed of their own.
    enable_prefix_caching: reuse the KV pages of prompt prefixes seen before.
    scheduling_policy: "fcfs", or "priority" (lower `priority` first; a better one may preempt a worse one).
    ttft_slo, tpot_slo: latency targets in seconds; with them the running batch is sized from measured step times
        (see jaxserve.batching.slo).
    attention_backend: "auto" (the Pallas kernels on GPU and TPU if they pass a start-up check, else and on CPU
        the jnp reference), "reference", or "pallas" / "pallas-gpu" / "pallas-tpu" (insist; on CPU the kernels run
        in Pallas interpret mode: correct, slow).
    quantization: weight-only, of every linear layer: None, "int8" (a scale per output channel), "int4" (a scale
        and minimum per group of input rows, two values a byte) or "awq" (int4 with activation-aware input scales
        calibrated on `calibration_text`, by default a text the package ships). A checkpoint written quantized
        (`jaxserve convert --quantization`) loads quantized without it.
    quantization_group_size: input rows per int4 group (default 32 for int4, llama.cpp's Q4_1; 128 for awq).
    quantize_embeddings: also the LM head (same method) and the embedding table (int8 rows).
    kv_cache_dtype: "auto" (the model's dtype) or "int8" (a float32 scale per token and KV head beside the pages:
        about twice the sequences in the same memory as bfloat16; dequantized as the attention reads them).
    speculative_config: speculative decoding, as vLLM's: {"method": "ngram" | "draft_model",
        "num_speculative_tokens": k, "model": DRAFT (draft_model), "prompt_lookup_max": 4, "prompt_lookup_min": 2
        (ngram), "adaptive": True (speculate only where measured acceptance and step costs say it pays)}, or a
        SpeculativeConfig; held parsed. The draft shares the KV budget (its pages beside the target's) and the dtype.
    warmup: compile every step bucket now rather than on first use.
    tensor_parallel_size: devices each model replica is split over (weights Megatron-style, the KV cache by KV
        heads); it must divide the attention heads (see jaxserve.distributed).
    data_parallel_size: model replicas, each running its own sequences.
    coordinator_address, num_processes, process_id: jax.distributed over several hosts ("host:port" of process 0,
        how many processes, this one's index); all three or none, or coordinator_address "auto" alone (JAX's own
        cluster detection: TPU pod slices, SLURM).
    coordinator_bind_address: "host:port" process 0's coordination service listens on (default: the host of
        coordinator_address, not every interface).
    coordinator_secret_file: a file holding the secret every process authenticates the leader's messages with
        (default: $JAXSERVE_COORDINATOR_SECRET); required unless the coordination service is reachable from this host
        only (see jaxserve.multihost).
    chat_template: a jinja chat template file to use instead of the model's own (or where the model has none).
    """

    model: str | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    attention_backend: str = "auto"
    quantization: str | None = None
    quantization_group_size: int | None = None
    quantize_embeddings: bool = False
    calibration_text: str | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: SpeculativeConfig | None = None
    warmup: bool = True
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    coordinator_bind_address: str | None = None
    coordinator_secret_file: str | None = None
    chat_template: str | None = None

    def __post_init__(self):
        # Nothing here may touch JAX's backends: jax.distributed must initialise before they start.
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        _check_type("model", self.model, str, optional=True)
        _check_int("max_model_len", self.max_model_len, 2, optional=True)  # the model's own limit: at load
        _check_choice("dtype", self.dtype, DTYPES)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
                     "data_parallel_size"):
            _check_int(name, getattr(self, name), 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence decodes a token per step")
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        _check_type("seed", self.seed, int)
        for name in ("enable_prefix_caching", "quantize_embeddings", "warmup"):
            _check_type(name, getattr(self, name), bool)
        _check_choice("scheduling_policy", self.scheduling_policy, POLICIES)
        for name in ("ttft_slo", "tpot_slo"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        _check_choice("attention_backend", self.attention_backend, BACKENDS)
        self._check_quantization()
        check_kv_cache_dtype(self.kv_cache_dtype)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        self._check_distributed()
        if isinstance(self.chat_template, os.PathLike):
            object.__setattr__(self, "chat_template", os.fspath(self.chat_template))
        _check_type("chat_template", self.chat_template, str, optional=True)
        if self.chat_template is not None:
            read_chat_template(self.chat_template)  # an unreadable file fails here, before the model loads

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS[1:]} or None, got {self.quantization!r}")
        _check_int("quantization_group_size", self.quantization_group_size, 1, optional=True)
        _check_type("calibration_text", self.calibration_text, str, optional=True)
        # Each of these would be silently ignored without the quantization it refines.
        if self.quantization_group_size is not None and self.quantization not in ("int4", "awq"):
            raise ValueError("a quantization group size applies to int4 and awq; int8 has a scale per output channel")
        if self.quantize_embeddings and self.quantization is None:
            raise ValueError("quantize_embeddings needs a quantization (int8, int4 or awq)")
        if self.calibration_text is not None and self.quantization != "awq":
            raise ValueError("calibration_text is what awq calibrates on; it needs quantization 'awq'")

    def _check_distributed(self) -> None:
        _check_type("coordinator_address", self.coordinator_address, str, optional=True)
        _check_int("num_processes", self.num_processes, 1, optional=True)
        _check_int("process_id", self.process_id, 0, optional=True)
        _check_type("coordinator_bind_address", self.coordinator_bind_address, str, optional=True)
        _check_type("coordinator_secret_file", self.coordinator_secret_file, str, optional=True)
        given = [v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)]
        if self.coordinator_address == AUTO_CLUSTER and any(given[1:]):
            raise ValueError(f"coordinator_address {AUTO_CLUSTER!r} finds the processes itself: give no num_processes "
                             "or process_id")
        if any(given) and not all(given) and self.coordinator_address != AUTO_CLUSTER:
            raise ValueError("coordinator_address, num_processes and process_id go together: give all three or none")
        if all(given) and self.process_id >= self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes = {self.num_processes}), got {self.process_id}")

    # ---- the command line ----

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
        """The engine flags of `jaxserve generate / chat` (serving=False: one prompt at a time) and `serve`."""
        # serve may take several models (an engine each); the others one.
        p.add_argument("--model", default=None, action="append" if serving else "store",
                       help=f"a .gguf file, a HF model directory, or a jaxserve checkpoint (default: {DEFAULT_MODEL}, "
                            "fetched once into ~/.cache/jaxserve or $JAXSERVE_CACHE)" + (
                                "; give it again to serve several models at once, an engine each" if serving else ""))
        p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="KV-cache budget per device, in bytes (default: 2 GiB on CPU, --gpu-memory-utilization of "
                            "device memory less the weights on an accelerator)" + (
                                ". With several --model it applies to each engine as given; without it each engine "
                                "gets an equal share: --gpu-memory-utilization / (number of models) of device memory "
                                "(less its own weights), or on CPU 2 GiB / (number of models)" if serving else ""))
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of each accelerator's memory for weights and KV cache (default 0.9)")
        p.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a jinja chat template file, used instead of the model's own")
        p.add_argument("--dtype", default="auto", choices=list(DTYPES),
                       help="parameter and activation dtype (auto: float32 on CPU, bfloat16 on GPU/TPU)")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's context length)")
        p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache page")
        add_quantization_cli_args(p)
        p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                       help="KV-cache pages: auto (the model's dtype) or int8 (about twice the sequences per byte)")
        _add_speculative_cli_args(p)
        if serving:
            p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences decoding together")
            p.add_argument("--max-num-batched-tokens", type=int, default=512,
                           help="tokens per step: one per decoding sequence, the rest prompt chunks")
            p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                           help="do not reuse the KV pages of prompt prefixes seen before")
            p.add_argument("--scheduling-policy", default="fcfs", choices=list(POLICIES))
            p.add_argument("--ttft-slo", type=float, default=None, help="time-to-first-token target, seconds")
            p.add_argument("--tpot-slo", type=float, default=None, help="time-per-output-token target, seconds")
            p.add_argument("--attention-backend", default="auto", choices=list(BACKENDS))
            p.add_argument("--no-warmup", dest="warmup", action="store_false",
                           help="compile shapes on first use instead of before serving")
        else:
            # One prompt at a time: a single decode row keeps the set of compiled programs (and start-up) small.
            p.set_defaults(max_num_seqs=1)
            p.add_argument("--warmup", action="store_true", help="compile every shape bucket before generating")
        p.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="devices each model replica is sharded over (weights and KV heads)")
        p.add_argument("--data-parallel-size", type=int, default=1,
                       help="model replicas, each running its own sequences")
        p.add_argument("--coordinator-address", default=None,
                       help="host:port of process 0, to run over several hosts (jax.distributed; with "
                            "--num-processes and --process-id), or 'auto' for JAX's cluster detection (TPU pod "
                            "slices, SLURM)")
        p.add_argument("--num-processes", type=int, default=None, help="processes in a multi-host run")
        p.add_argument("--process-id", type=int, default=None,
                       help="this process's index in a multi-host run, 0 to --num-processes - 1")
        p.add_argument("--coordinator-bind-address", default=None, metavar="HOST:PORT",
                       help="where process 0's coordination service listens (default: --coordinator-address's host, "
                            "not every interface)")
        p.add_argument("--coordinator-secret-file", default=None, metavar="FILE",
                       help="a file with the secret (16+ bytes, the same on every process) that authenticates process "
                            "0's messages; default $JAXSERVE_COORDINATOR_SECRET; required across hosts")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config from flags `add_cli_args` declared (a flag another command lacks keeps its default)."""
        # By name, not all of args: a command's other flags (generate's sampling --seed) are not engine arguments.
        given = {name: getattr(args, name) for name in _CLI_FIELDS if hasattr(args, name)}
        if isinstance(given.get("model"), list):  # serve's --model, which may be repeated
            if len(given["model"]) > 1:
                raise ValueError("several --model: one config per model is EngineConfig.per_model_from_cli_args")
            given["model"] = given["model"][0]
        return cls(**given, **quantization_from_cli_args(args), speculative_config=_speculative_config(args))

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
                from jaxserve.engine import _CPU_KV_CACHE_BYTES
                share["kv_cache_memory_bytes"] = _CPU_KV_CACHE_BYTES // len(models)
        return [dataclasses.replace(base, model=model, **share) for model in models]


_CLI_FIELDS = ("model", "kv_cache_memory_bytes", "gpu_memory_utilization", "dtype", "max_model_len", "block_size",
               "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "scheduling_policy",
               "ttft_slo", "tpot_slo",
               "attention_backend", "warmup", "tensor_parallel_size", "data_parallel_size", "coordinator_address",
               "num_processes", "process_id", "coordinator_bind_address", "coordinator_secret_file", "chat_template")


def add_quantization_cli_args(p: argparse.ArgumentParser) -> None:
    """The quantization flags (also `jaxserve convert`'s)."""
    p.add_argument("--quantization", default=None, choices=[q for q in QUANTIZATIONS if q],
                   help="weight-only quantization of the linear layers: int8 (a scale per output channel), int4 "
                        "(groups of input rows, two values a byte), awq (int4 with calibrated input scales)")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="input rows per int4 group (default: 32 for int4, as llama.cpp's Q4_1; 128 for awq)")
    p.add_argument("--quantize-embeddings", action="store_true",
                   help="also quantize the LM head and the embedding table")
    p.add_argument("--calibration-file", default=None,
                   help="text to calibrate awq on (default: a public-domain text the package ships)")


def quantization_from_cli_args(args: argparse.Namespace) -> dict:
    text = Path(args.calibration_file).read_text() if args.calibration_file else None
    return dict(quantization=args.quantization, quantization_group_size=args.quantization_group_size,
                quantize_embeddings=args.quantize_embeddings, calibration_text=text)


def _add_speculative_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-method", default=None, choices=["ngram", "draft_model"],
                   help="speculative decoding: ngram (prompt lookup, no model) or draft_model (--draft-model)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="tokens proposed per verification (default 4 with a speculative method)")
    p.add_argument("--draft-model", default=None,
                   help="the draft for draft_model: a model sharing the target's tokenizer (.gguf, HF dir, checkpoint; "
                        "scripts/train_draft.py distills one for the default model)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: the longest suffix looked up")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: the shortest suffix looked up")
    p.add_argument("--no-adaptive-speculation", dest="adaptive_speculation", action="store_false",
                   help="speculate for every sequence every step, not only where measured acceptance and step "
                        "costs say it pays")


def _speculative_config(args: argparse.Namespace) -> dict | None:
    method = args.speculative_method or ("draft_model" if args.draft_model else None)
    if method is None:
        if args.num_speculative_tokens is not None:
            raise ValueError("--num-speculative-tokens needs --speculative-method (or --draft-model)")
        return None
    config = dict(method=method, num_speculative_tokens=4 if args.num_speculative_tokens is None
                  else args.num_speculative_tokens, adaptive=args.adaptive_speculation)
    if method == "ngram":
        config.update(prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
    elif args.draft_model:
        config["model"] = args.draft_model
    return config


def _check_int(name: str, value, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")


def _check_type(name: str, value, kind: type, optional: bool = False) -> None:
    if not (isinstance(value, kind) or (optional and value is None)):
        raise TypeError(f"{name} must be a {kind.__name__}{' or None' if optional else ''}, got {value!r}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
