"""The device mesh, and where every array of an engine lives on it.

One mesh, axes ("data", "model"). A row of it is a *device group*: the devices of one engine replica, over which
its weights and KV cache are split (tensor parallelism, Megatron's): column-parallel layers split their output
features, so each device computes whole attention heads and whole FFN rows; row-parallel layers split their input
features and end in one all-reduce; the embedding and the LM head split the vocabulary; norms are replicated. The
KV cache splits over KV heads, so attention runs per device on its own heads with no communication at all. Data
parallelism is several groups, each a whole engine.

Which dimension of which parameter splits is declared where the model makes the parameter: each names its
dimensions' *logical* axes (`("embed", "mlp")` for an FFN's up kernel, `("vocab", "embed")` for the embedding
table; see `jaxserve.model.layers`), quantized leaves take their float kernel's (`jaxserve.model.quant`), and `RULES`
below, the one table of the split, maps a logical axis to a mesh axis.
"""
from __future__ import annotations

import collections
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.cache.kv_cache import Int8Pages

logger = logging.getLogger("jaxserve")

DATA, MODEL = "data", "model"

# Logical axis -> the mesh axis it splits over (None: kept whole on every device). Attention heads and FFN features
# split (a device computes whole heads and whole FFN rows: q/k/v, gate and up split their outputs, o and down their
# inputs and end in one all-reduce), as does the vocabulary (embedding rows, LM head outputs); the hidden size
# ("embed", norms, residual stream) and a head's own dimensions are replicated. The KV cache splits with its heads.
RULES = {
    "embed": None,      # hidden size
    "heads": MODEL,     # attention heads (num_heads * head_dim, flattened in q_proj's outputs and o_proj's inputs)
    "kv_heads": MODEL,  # KV heads (k_proj and v_proj outputs, the cache's head axis)
    "head_dim": None,   # within one head (q_norm, k_norm)
    "mlp": MODEL,       # FFN features
    # A speculative head's captured hidden states (the target's steps keep them by slot): split by column, so the
    # head's fc reduces over them as down_proj does, and no device holds all of them.
    "features": MODEL,
    "vocab": MODEL,     # vocabulary
    "tokens": None, "pages": None, "page": None,  # activations and cache pages: every device has all of them
}


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A [data, model] mesh over the first tp x dp devices (of every process: jax.devices() is global)."""
    devices = list(jax.devices() if devices is None else devices)
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1:
        # Every group spans every process: the leader reads each step's (replicated) results from its own devices.
        if tensor_parallel_size % len(processes):
            raise ValueError(f"over {len(processes)} processes, tensor_parallel_size ({tensor_parallel_size}) must "
                             "be a multiple of the process count: each engine replica spans every process")
        local = {p: [d for d in devices if d.process_index == p] for p in processes}
        devices = [d for column in zip(*local.values()) for d in column]  # process-interleaved
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} x data_parallel_size {data_parallel_size} "
                         f"needs {need} devices; there are {len(devices)} ({devices[0].platform})")
    grid = np.array(devices[:need], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    # Auto axes: shardings propagate through the model's jnp code (jax 0.10's make_mesh defaults to Explicit).
    return Mesh(grid, (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def device_groups(mesh: Mesh) -> list[Mesh]:
    """Each data-parallel row of the mesh as a mesh of its own: the devices of one engine replica."""
    return [Mesh(mesh.devices[i:i + 1], mesh.axis_names, axis_types=mesh.axis_types)
            for i in range(mesh.devices.shape[0])]


def model_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[MODEL]


def check_tensor_parallel(config, tp: int, what: str = "the model") -> None:
    """Attention heads must split evenly; KV heads split, or are replicated when there are fewer than devices."""
    if config.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide {what}'s {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size {tp} and {what}'s {kv} KV heads must divide one another "
                         "(KV heads split over devices, or are replicated when there are fewer than devices)")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def features_sharding(mesh: Mesh, size: int) -> NamedSharding:
    """A speculative head's captured features [slots, size]: split by column where size divides (RULES)."""
    return NamedSharding(mesh, P(None, None if size % mesh.shape[MODEL] else MODEL))


def mesh_spec(logical: P) -> P:
    """Logical axis names (a PartitionSpec of them, None for a dimension with no name) -> mesh axes, by RULES."""
    return P(*[None if name is None else RULES[name] for name in logical])


def param_shardings(mesh: Mesh, params, axes):
    """A NamedSharding for every leaf of params. axes: the same tree with each leaf's logical axes in its place
    (`jaxserve.model.decoder.param_axes`). A dimension that does not divide by its mesh axis's size is left whole
    (correct, only less split: XLA partitions the computation around it)."""
    def sharding(logical, leaf):
        if len(logical) != leaf.ndim:
            raise ValueError(f"logical axes {logical} do not name the {leaf.ndim} dimensions of a {leaf.shape} leaf")
        spec = [None if axis is None or size % mesh.shape[axis] else axis
                for axis, size in zip(mesh_spec(logical), leaf.shape)]
        return NamedSharding(mesh, P(*spec))
    return jax.tree.map(sharding, axes, params, is_leaf=lambda x: isinstance(x, P))


def kv_pages_spec(kv_cache_dtype: str = "auto"):
    """One layer's K (or V) pages [num_pages, kv_heads, page_size, head_dim]: split over KV heads (an int8 cache's
    scales [num_pages, kv_heads, page_size] with them)."""
    pages = mesh_spec(P("pages", "kv_heads", "page", "head_dim"))
    return Int8Pages(pages, mesh_spec(P("pages", "kv_heads", "page"))) if kv_cache_dtype == "int8" else pages


# q [tokens, heads, head_dim], and k or v [tokens, kv_heads, head_dim]: heads and KV heads split alike (RULES).
HEADS = mesh_spec(P("tokens", "heads", "head_dim"))


def shardings(mesh: Mesh, specs):
    """PartitionSpecs (any pytree of them) -> NamedShardings on mesh."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def place(tree, sharding_tree):
    """Puts every leaf on its sharding (or `Format`: a layout and a sharding, `jaxserve.parallel.layouts`) from the
    host: each device is handed only its slice, so no device of the group ever holds the whole array (and each process
    only copies what its own devices hold)."""
    def put(x, s):
        x = np.asarray(x)  # a loader's array on its default device comes through the host (once, at load)
        return jax.make_array_from_callback(x.shape, s, lambda index: x[index])
    return jax.tree.map(put, tree, sharding_tree)


def bytes_per_device(tree) -> dict:
    """Bytes of tree's arrays held by each (addressable) device."""
    held = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return dict(held)


def log_placement(what: str, tree) -> None:
    held = bytes_per_device(tree)
    logger.info("%s: %.1f MB per device over %d devices (%.1f MB in all)", what, max(held.values()) / 1e6,
                len(held), sum(held.values()) / 1e6)


def attention_over_heads(attend, mesh: Mesh | None, q, k, v, k_pages, v_pages, rows):
    """attend(q, k, v, k_pages, v_pages, rows) run by each device on its own heads: heads never meet in attention,
    so the split needs no communication, and the kernels (Pallas calls, which XLA cannot partition) see local
    arrays. q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; pages as the cache holds them."""
    if model_size(mesh) == 1:
        return attend(q, k, v, k_pages, v_pages, rows)
    pages = kv_pages_spec("int8" if isinstance(k_pages, Int8Pages) else "auto")
    return jax.shard_map(attend, mesh=mesh, in_specs=(HEADS, HEADS, HEADS, pages, pages, P()), out_specs=HEADS,
                         check_vma=False)(q, k, v, k_pages, v_pages, rows)


def embed_over_vocab(lookup, mesh: Mesh | None, table, token_ids):
    """lookup(table, token_ids) -> [T, hidden] over a table split by vocabulary rows: each device looks up the ids
    in its own rows (zeros for the others) and one all-reduce of [T, hidden] sums them. Left to the partitioner, a
    gather from a split table may all-gather the whole table instead (XLA:GPU does at one token: 1 GB at Llama 3
    8B's shapes, found by the deviceless compile of `jaxserve.aot.deviceless`)."""
    tp = model_size(mesh)
    rows = jax.tree.leaves(table)[0].shape[0]
    if tp == 1 or rows % tp:  # a table that does not split is replicated (param_shardings)
        return lookup(table, token_ids)

    def local(table, token_ids):
        own = jax.tree.leaves(table)[0].shape[0]
        ids = token_ids - jax.lax.axis_index(MODEL) * own
        mine = (ids >= 0) & (ids < own)
        x = lookup(table, jnp.where(mine, ids, 0))
        return jax.lax.psum(jnp.where(mine[:, None], x, jnp.zeros_like(x)), MODEL)
    specs = jax.tree.map(lambda leaf: P(MODEL, *[None] * (leaf.ndim - 1)), table)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)(table, token_ids)


def head_over_vocab(score, head, mesh: Mesh | None, params, specs):
    """A function (h [B, hidden], targets [B]) -> score(head(params, h), targets): the LM head's logits [B, V]
    scored (`jaxserve.sample.prompt_logprobs`). Over a mesh whose model axis splits the head's vocabulary (specs: each
    of params' leaves' PartitionSpec), each device computes and scores its own slice (`score(local logits, targets,
    axis)`): left to the partitioner, the [B, V] logits would be gathered whole for every block."""
    if model_size(mesh) == 1 or not any(
            MODEL in spec for spec in jax.tree.leaves(specs["params"]["lm_head"], is_leaf=lambda x: isinstance(x, P))):
        return lambda h, targets: score(head(params, h), targets)
    head_params = {"params": {"norm": params["params"]["norm"], "lm_head": params["params"]["lm_head"]}}
    head_specs = {"params": {"norm": specs["params"]["norm"], "lm_head": specs["params"]["lm_head"]}}

    def local(p, h, targets):
        return score(head(p, h), targets, MODEL)
    run = jax.shard_map(local, mesh=mesh, in_specs=(head_specs, P(), P()), out_specs=P(), check_vma=False)
    return lambda h, targets: run(head_params, h, targets)


def sample_over_vocab(sampler, mesh: Mesh | None, logits, *args):
    """sampler(logits, *args, axis=MODEL) run by each device on its own slice of logits [..., V] split by vocabulary
    (the LM head's split, `RULES`): it exchanges per-row values, never the logits (`jaxserve.sample.sampling`); left to
    the partitioner, sampling would gather the [rows, V] logits whole. args (sampling parameters) are replicated,
    and so is what sampler returns. Without a split (one device, or a vocabulary that does not divide: the head is
    then replicated, and each device has the whole logits) sampler(logits, *args)."""
    tp = model_size(mesh)
    if tp == 1 or logits.shape[-1] % tp:
        return sampler(logits, *args)
    vocab = P(*[None] * (logits.ndim - 1), MODEL)
    return jax.shard_map(lambda x, *a: sampler(x, *a, axis=MODEL), mesh=mesh, in_specs=(vocab,) + (P(),) * len(args),
                         out_specs=P(), check_vma=False)(logits, *args)
