"""Deviceless ahead-of-time compilation: the real TPU and GPU compilers, run where there is neither.

With libtpu installed, `jax.experimental.topologies` describes compile-only TPU chips; with the CUDA plugin, a
GPU described by XLA's target config (below, H100 and H200 from their public specs). `jax.jit(f).lower(...)` on
`ShapeDtypeStruct`s placed on such a device runs the whole compiler, Mosaic and Triton included, so a program that
would not fit (VMEM, shared memory, HBM) fails here as it would on the chip. `compile_serving` compiles every
program serving runs, for one model config and engine shape, from abstract parameters: no weights are needed.

The install groups `tpu-aot` and `gpu-aot` bring the compilers (`scripts/aot_env.sh` puts them in a venv of
their own). GPU compilation also needs JAX_PLATFORMS=cpu and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before jax is
imported, and a second process using libtpu needs ALLOW_MULTIPLE_LIBTPU_LOAD=1 (`scripts/aot_check.py` sets all
three).
"""
from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.aot import hbm_audit
from jaxserve.aot.collectives import collective_census
from jaxserve.aot.head_programs import compile_head
from jaxserve.aot.step_programs import abstract_batch, step_and_write
from jaxserve.batch import RaggedRows
from jaxserve.buckets import Buckets
from jaxserve.cache import init_kv_cache, pages_needed
from jaxserve.config import FULL, SLIDING, ModelConfig
from jaxserve.model.decoder import declared_params
from jaxserve.model.head_config import HeadConfig
from jaxserve.model.quant import quantize_params
from jaxserve.pallas_kernels import page_head_dim_multiple, ragged_kernel_for
from jaxserve.parallel.layouts import param_formats
from jaxserve.parallel.mesh import check_tensor_parallel, make_mesh, replicated
from jaxserve.runner.steps import Steps


def _gpu_target(name: str, memory_bytes: int, bandwidth: int) -> str:
    """XLA's GpuTargetConfigProto (text) for a Hopper GPU: 132 SMs, 228 KB shared memory each (227 KB per block)."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {memory_bytes}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 3 }} device_description_str: "{name}"
"""


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s, the decode roofline
    peak_flops: float  # dense bf16, the compute side of the roofline
    gpu_target: str | None = None  # GPUs: the compiler's device description

    @property
    def platform(self) -> str:
        return "tpu" if self.gpu_target is None else "gpu"


# Public specs. TPU names are topologies ("v5e:2x2" is four v5e chips); the chip is what one program runs on.
CHIPS = {
    "v5e": Chip(16 << 30, 819e9, 197e12),
    "v6e": Chip(32 << 30, 1640e9, 918e12),
    "h100": Chip(80 * 10 ** 9, 3.35e12, 989e12,
                 _gpu_target("NVIDIA H100 80GB HBM3", 85_520_809_984, 3_352_320_000_000)),
    "h200": Chip(141 * 10 ** 9, 4.8e12, 989e12, _gpu_target("NVIDIA H200", 150_754_820_096, 4_800_000_000_000)),
}
TARGETS = ("v5e:2x2", "v6e:2x2", "h100", "h200")

# Model shapes to compile without their weights (HF's configs): the default model's (Llama, 3 KV heads of 64), Llama 3
# 8B's (8 of 128), Qwen3 8B's (8 of 128, QK-norm), Gemma 3 1B's (one KV head of 256, five sliding-window layers to one
# global) and Gemma 3 12B's (8 KV heads of 256; the text model of google/gemma-3-12b-it).
MODEL_CONFIGS = {
    "smollm2-135m": ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3-8b": ModelConfig("LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                              max_position_embeddings=131072),
    "gemma-3-1b": ModelConfig("Gemma3ForCausalLM", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                              num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
                              rope_theta=1_000_000.0, rope_local_theta=10_000.0, max_position_embeddings=32768,
                              tie_word_embeddings=True, sliding_window=512, hidden_activation="gelu_tanh",
                              qk_norm=True, sandwich_norm=True, embedding_multiplier=1152 ** 0.5,
                              query_pre_attn_scalar=256,
                              layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(26))),
    "qwen3-8b": ModelConfig("Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            rope_theta=1_000_000.0, max_position_embeddings=40960, qk_norm=True),
    "gemma-3-12b": ModelConfig("Gemma3ForCausalLM", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                               num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6,
                               rope_theta=1_000_000.0, rope_local_theta=10_000.0,
                               rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072,
                               tie_word_embeddings=True, sliding_window=1024, hidden_activation="gelu_tanh",
                               qk_norm=True, sandwich_norm=True, embedding_multiplier=3840 ** 0.5,
                               query_pre_attn_scalar=256,
                               layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(48))),
}


def with_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
    """The config with only num_layers layers (each layer compiles to the same program as its kind's others); a model
    with global and sliding layers keeps one global layer among them."""
    types = config.layer_types
    if num_layers >= config.num_layers:
        return config
    if types is not None:
        types = types[:num_layers - 1] + ((FULL,) if FULL in types else types[num_layers - 1:num_layers])
    return dataclasses.replace(config, num_layers=num_layers, layer_types=types)


def chip_of(target: str) -> Chip:
    return CHIPS[target.split(":")[0]]


def target_devices(target: str) -> list:
    """Compile-only devices of a target: a TPU topology ("v5e:2x2") or a GPU name with an optional count
    ("h100", "h100:8")."""
    from jax.experimental import topologies
    name, _, count = target.partition(":")
    if name not in CHIPS:
        raise ValueError(f"unknown target {target!r}; known chips: {', '.join(CHIPS)}")
    chip = CHIPS[name]
    if chip.gpu_target is None:
        return topologies.get_topology_desc(target, "tpu").devices
    return topologies.get_topology_desc("cuda", "cuda", target_config=chip.gpu_target,
                                         topology=f"1x1x{int(count or 1)}").devices


@dataclasses.dataclass
class Compiled:
    """One program compiled for one device (or each device of a tensor-parallel mesh: the sizes are per device):
    its HBM use, on TPU the compiler's own cost model, and over a mesh its collectives."""
    program: str  # "step", "cache write" or "ragged attention"
    shape: str  # e.g. "512 tokens x 64 rows"
    error: str | None = None
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs that reuse a donated argument's memory
    temp_bytes: int = 0
    # The TPU compiler's counts for the XLA part (Pallas kernels count as nothing; both sides of a cond count).
    # Its own time estimate is left out: it comes back negative for programs with loops or custom calls.
    flops: float | None = None
    bytes_accessed: float | None = None
    compile_seconds: float = 0.0
    tensor_parallel_size: int = 1
    # kind -> count ("all-reduce": 5, ...), async forms included; and every one as "kind dtype[dims]".
    collectives: dict = dataclasses.field(default_factory=dict)
    collective_ops: list = dataclasses.field(default_factory=list)
    largest_all_gather_bytes: int = 0
    census: list = dataclasses.field(default_factory=list, repr=False, compare=False)  # the Collective records
    # What it writes to HBM beyond what it must (jaxserve.aot.hbm_audit): weight- or cache-sized copies, relayouts,
    # converts, materialised fusions; and their bytes.
    traffic: list = dataclasses.field(default_factory=list, repr=False, compare=False)  # the Traffic records
    traffic_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def compile_program(program: str, shape: str, fn, args, device, *, mesh=None, arg_shardings=None,
                    roles=()) -> Compiled:
    """Lowers and compiles fn(*args) (a pytree of ShapeDtypeStructs) for `device`; a compiler error is recorded.
    mesh: compile for a tensor-parallel mesh instead, each arg placed on its sharding in arg_shardings (a tree of
    NamedShardings (or `Format`s of a layout and a sharding) matching args; without a mesh, arg_shardings may give
    args' `Format`s on `device`, None for an arg on its default layout. roles: per arg, "weights", "cache" or None:
    the HBM audit looks for copies of the first two's arrays (as each device holds them)."""
    if mesh is None:
        mesh = jax.sharding.Mesh(np.array([device]), ("model",))
        single = jax.sharding.SingleDeviceSharding(device)
        arg_shardings = tuple(jax.tree.map(lambda _: single, a) if s is None else s
                              for a, s in zip(args, arg_shardings or (None,) * len(args)))
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), args, arg_shardings)
    tp = mesh.shape.get("model", 1) if mesh.devices.size > 1 else 1
    start = time.perf_counter()
    try:
        # The mesh tells Pallas' Mosaic lowering which chip it compiles for (else it asks the default backend).
        with jax.set_mesh(mesh):
            # A jitted step keeps its own options (the cache write's donation); anything else is jitted here.
            compiled = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*placed).compile()
    except Exception as e:  # noqa: BLE001 - the compiler's verdict is the result
        return Compiled(program, shape, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}",
                        compile_seconds=time.perf_counter() - start, tensor_parallel_size=tp)
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    text = compiled.as_text()
    census = collective_census(text) if tp > 1 else []
    audited = [b for arg, role in zip(placed, roles) if role
               for b in hbm_audit.buffers(arg, cache=role == "cache")]
    traffic = hbm_audit.audit(text, audited) if audited else []
    gathers = [c.bytes for c in census if c.kind == "all-gather"]
    return Compiled(program, shape, argument_bytes=memory.argument_size_in_bytes,
                    output_bytes=memory.output_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
                    temp_bytes=memory.temp_size_in_bytes, flops=cost.get("flops"),
                    bytes_accessed=cost.get("bytes accessed"),
                    compile_seconds=time.perf_counter() - start, tensor_parallel_size=tp,
                    collectives=dict(collections.Counter(c.kind for c in census)),
                    collective_ops=[str(c) for c in census],
                    largest_all_gather_bytes=max(gathers, default=0), census=census, traffic=traffic,
                    traffic_bytes=sum(t.bytes for t in traffic))


def abstract_params(config: ModelConfig, dtype, quantization: str | None = None, **quantize_options) -> dict:
    """The params pytree's shapes and dtypes (as the loaders build it), without any weights. quantization: "int8"
    or "int4", the tree `jaxserve.model.quant.quantize_params` makes of it (its options, e.g. group_size, passed on)."""
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), declared_params(config, dtype).shapes)
    if quantization is None:
        return params
    if quantization not in ("int8", "int4"):
        raise ValueError(f"abstract params quantize as int8 or int4, not {quantization!r} (awq is int4's layout)")
    return jax.eval_shape(lambda p: quantize_params(p, quantization, **quantize_options), params)


def tensor_parallel_config(config: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The config a tensor-parallel engine runs: as `jaxserve.model.decoder.repeat_kv_heads` makes it when there are
    more devices than KV heads (each KV head repeated tp // kv_heads times), for abstract params to be built from."""
    check_tensor_parallel(config, tensor_parallel_size)
    kv = config.num_kv_heads
    if tensor_parallel_size <= kv:
        return config
    return dataclasses.replace(config, num_kv_heads=kv * (tensor_parallel_size // kv))


def compile_serving(config: ModelConfig, dtype, device, *, max_num_seqs: int, max_num_batched_tokens: int,
                    max_model_len: int, num_pages: int, page_size: int = 16, kv_cache_dtype: str = "auto",
                    params=None, only_extremes: bool = False, num_speculative_tokens: int = 0,
                    tensor_parallel_size: int = 1, attention_backend: str | None = None,
                    decode_context_parallel_size: int = 1, kernel_only: bool = False,
                    head: HeadConfig | None = None) -> list[Compiled]:
    """Every program an engine of this shape runs, compiled for `device` with its Pallas attention kernel: the step
    (forward + sampling) of each token bucket and its cache write, and the ragged attention kernel alone at the
    largest step. only_extremes: of the buckets, only the smallest, the largest that can be all decode rows
    (tokens = rows = max_num_seqs) and the largest (the same programs at other sizes, for a quicker check).
    num_speculative_tokens: also the verification step (k + 1 scored tokens a row, verified on device) of each
    bucket but the one-token one.

    tensor_parallel_size > 1: `device` is a list of (at least that many) compile-only devices, of which the first
    tp make the [data=1, model=tp] mesh (e.g. 3 of a v5e:2x4's 8 chips, all on its first host); the steps compile
    as the engine runs them there (weights split as `Steps.param_shardings` says, the cache over KV heads, the
    batch replicated; KV heads repeated as `repeat_kv_heads` does when tp exceeds them: `params`, if given, must
    be of that config), each record with its collectives. The attention kernel alone is compiled at one device's
    shapes (its heads), as shard_map runs it.
    attention_backend: default the device's Pallas kernel (DCP: the jnp one, pages of tp x page_size; "reference").
    head: a speculative head (EAGLE-3) the engine runs: the target's steps then capture its features, and the
    head's own programs compile at each bucket (`jaxserve.aot.head_programs`).
    kernel_only: only the attention kernel alone, at every shape (its scalar memory, VMEM or shared memory at a long
    max_model_len's page tables, in seconds where the steps take minutes)."""
    tp = tensor_parallel_size
    devices = list(device) if isinstance(device, (list, tuple)) else [device]
    device = devices[0]
    backend = attention_backend or ("reference" if decode_context_parallel_size > 1 else "pallas-" + device.platform)
    k = num_speculative_tokens
    mesh = None
    if tp > 1:
        config = config if decode_context_parallel_size > 1 else tensor_parallel_config(config, tp)
        mesh = make_mesh(tp, 1, devices[:tp])
    capture = head.feature_layers if head is not None else ()
    steps = Steps(config, dtype, backend, k, mesh, kv_cache_dtype, device.platform, decode_context_parallel_size,
                  capture)
    params = abstract_params(config, dtype) if params is None else params
    lanes = page_head_dim_multiple(backend)
    kv = jax.eval_shape(lambda: init_kv_cache(config, num_pages, page_size, dtype, kv_cache_dtype, lanes))
    buckets = Buckets.for_limits(max_num_seqs, max_num_batched_tokens, pages_needed(max_model_len, page_size))
    last_tokens = jax.ShapeDtypeStruct((max_num_seqs + 1,), jnp.int32)
    shapes = step_shapes(buckets, only_extremes)
    compile_ = _compiler(device, mesh)
    # The params as the runner places them (the embedding table row-major: jaxserve.parallel.layouts).
    where = (jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), params) if mesh is None
             else steps.param_shardings(params))
    step_shardings = (param_formats(params, where), None if mesh is None else steps.cache_sharding, None, None,
                      None, None if mesh is None or head is None else steps.features_sharding)
    # With a head: the target's captured features [pages x page_size, F] (split by column), the steps' last argument.
    features = None if head is None else jax.ShapeDtypeStruct((num_pages * page_size, head.feature_size), dtype)
    write_shardings = (None, None, None) if mesh is None else (steps.cache_sharding, steps.new_kv_sharding, None)
    results = []
    for tokens, rows in [] if kernel_only else shapes:
        batch = abstract_batch(page_size, config.vocab_size, tokens, rows, buckets.pages_per_row)
        shape = f"{tokens} tokens x {rows} rows"
        results += step_and_write(compile_, "", shape, steps, steps._forward, (params, kv, last_tokens, batch, None,
                                                                              features), step_shardings,
                                  write_shardings)
        if k and tokens > 1:
            batch = abstract_batch(page_size, config.vocab_size, tokens, rows, buckets.pages_per_row, k + 1)
            results.append(compile_("verify step", shape, steps._verify, (params, kv, last_tokens, batch, None,
                                                                          features), step_shardings,
                                    ("weights", "cache")))
    if head is not None and not kernel_only:
        results += compile_head(head, dtype, shapes, compile_, device=device, mesh=mesh, platform=device.platform,
                                attention_backend=backend, num_pages=num_pages, page_size=page_size,
                                pages_per_row=buckets.pages_per_row, max_num_seqs=max_num_seqs,
                                kv_cache_dtype=kv_cache_dtype, lanes=lanes)
    if not backend.startswith("pallas"):
        return results
    local = config if tp == 1 else dataclasses.replace(config, num_heads=config.num_heads // tp,
                                                       num_kv_heads=config.num_kv_heads // tp)
    pages = jax.eval_shape(lambda: init_kv_cache(local, num_pages, page_size, dtype, kv_cache_dtype, lanes))[0][0]
    return results + [_compile_kernel(local, dtype, device, backend, pages, tokens, rows, buckets.pages_per_row)
                      for tokens, rows in (shapes if kernel_only else shapes[-1:])]


def step_shapes(buckets: Buckets, only_extremes: bool) -> list[tuple[int, int]]:
    """The (tokens, rows) to compile: every bucket, or only the smallest, the largest that can be all decode rows
    and the largest."""
    shapes = list(buckets.shapes())
    if only_extremes:
        decode = [s for s in shapes if s[0] == s[1]][-1:]
        shapes = sorted(set(shapes[:1] + decode + shapes[-1:]))
    return shapes


def _compiler(device, mesh):
    """compile_(program, shape, fn, args, arg_shardings, roles): compile_program for device, or over mesh, where an
    arg's sharding None means replicated (every leaf of it)."""
    if mesh is None:
        def compile_(program, shape, fn, args, arg_shardings, roles):
            return compile_program(program, shape, fn, args, device, arg_shardings=arg_shardings, roles=roles)
        return compile_
    rep = replicated(mesh)

    def compile_mesh(program, shape, fn, args, arg_shardings, roles):
        arg_shardings = tuple(jax.tree.map(lambda _: rep, a) if s is None else s for a, s in zip(args, arg_shardings))
        return compile_program(program, shape, fn, args, device, mesh=mesh, arg_shardings=arg_shardings, roles=roles)
    return compile_mesh


def _compile_kernel(config, dtype, device, backend, pages, tokens, rows, pages_per_row) -> Compiled:
    """The ragged attention kernel alone (its own temporaries and compile errors apart from the step's)."""
    kernel = ragged_kernel_for(backend)
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    H, KVH, D = config.num_heads, config.num_kv_heads, config.head_dim
    ragged = RaggedRows(sds((tokens,), i32), sds((tokens,), i32), sds((rows + 1,), i32), sds((rows,), i32),
                        sds((rows, pages_per_row), i32))
    new = sds((tokens, KVH, D), dtype)

    def run(q, k, v, k_pages, v_pages, ragged):
        return kernel(q, k, v, k_pages, v_pages, ragged, sliding_window=config.sliding_window)
    return compile_program("ragged attention", f"{tokens} tokens x {rows} rows", run,
                           (sds((tokens, H, D), dtype), new, new, pages, pages, ragged), device,
                           roles=(None, None, None, "cache", "cache"))


def compile_lora_kernel(device, tokens: int, d_in: int, d_out: int, num_slots: int, rank: int,
                        dtype=jnp.bfloat16) -> Compiled:
    """The multi-LoRA term as the model's layers compute it (`jaxserve.model.lora.lora_delta`: the device's
    platform's Pallas kernels, `jaxserve.pallas_kernels.lora`) for one projection: x [tokens, d_in], A [num_slots,
    d_in, rank], B [num_slots, rank, d_out], one slot a token. The HBM audit looks for copies of A and B (a relayout
    of A would be one: `lora_delta_tpu` reads it through a free transpose)."""
    from jaxserve.model.lora import lora_delta as kernel
    sds = jax.ShapeDtypeStruct
    args = (sds((tokens, d_in), dtype), sds((num_slots, d_in, rank), dtype), sds((num_slots, rank, d_out), dtype),
            sds((tokens,), jnp.int32))
    return compile_program("lora", f"{tokens} tokens, {d_in} -> {d_out}, {num_slots} slots of rank {rank}",
                           kernel, args, device, roles=(None, "weights", "weights", None))
