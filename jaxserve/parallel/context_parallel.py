"""Decode context parallelism (vLLM's `decode_context_parallel_size`): a sequence's KV cache split over the devices
of a tensor-parallel group by token, not by KV head.

Splitting the cache by KV heads (`jaxserve.parallel.mesh`) stops at one KV head a device: past that, every device
holds a copy of its head (SmolLM2's 3 KV heads at TP 3 are already one a device; Llama 3 8B's 8 at TP 16 would be
two copies of each), and one long sequence's cache must fit one device's share. With DCP over d devices each device
holds every KV head of 1/d of each sequence's tokens, interleaved (token t on rank t % d, so a decode's keys are
spread evenly whatever its length): per device, 1/d of the cache and no copies.

The host sees pages of d x page_size tokens: one page id names the same page on every rank, each holding its own
page_size of them, so the allocator, prefix cache and page table change nothing but the page size they are given.
The cache's page arrays are [num_pages, kv_heads, d * page_size, head_dim] split on the token axis: rank r holds
[r * page_size, (r + 1) * page_size) of it, host offset o of a page at local offset o // d on rank o % d (a
permutation within each page that nothing outside this module sees: pages move whole).

Attention over a mesh (`attention_over_tokens`), per layer, each rank: gathers the step's queries of every head
(an all-gather of [T, heads, head_dim]: the step's tokens, never the context), attends to its own cached keys (key
j at position j * d + rank) and the step's own new keys at its positions, giving a partial output and its
log-sum-exp; the partials are merged exactly by their log-sum-exps, each rank keeping its own heads (one
all-to-all of the partials by head). Each rank writes a step's new K/V of its own tokens only (`write_over_tokens`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.batch import RaggedRows
from jaxserve.cache.kv_cache import SCRATCH_PAGE, Int8Pages, write_pages
from jaxserve.parallel.mesh import HEADS, MODEL, model_size, shardings

# The attention backends whose partial attention (output and log-sum-exp) DCP can run: the blocked jnp path.
CONTEXT_PARALLEL_BACKENDS = ("reference",)


def check_context_parallel(config, tensor_parallel_size: int, decode_context_parallel_size: int,
                           attention_backend: str | None = None) -> None:
    """What DCP runs over: the whole tensor-parallel group (every device holds all KV heads of its tokens), so the
    attention heads must split over it; the resolved attention backend must be able to return log-sum-exps."""
    dcp, tp = decode_context_parallel_size, tensor_parallel_size
    if dcp == 1:
        return
    if dcp != tp:
        raise ValueError(f"decode_context_parallel_size {dcp} must be 1 or equal to tensor_parallel_size {tp}: "
                         "the KV cache is split by token over the whole tensor-parallel group")
    if config.num_heads % dcp:
        raise ValueError(f"decode_context_parallel_size {dcp} must divide the model's {config.num_heads} attention "
                         "heads")
    if attention_backend is not None and attention_backend not in CONTEXT_PARALLEL_BACKENDS:
        raise ValueError(f"decode_context_parallel_size {dcp} runs attention_backend 'reference' (jnp) only, not "
                         f"{attention_backend!r}: the Pallas kernels do not return the log-sum-exps its merge needs")


def pages_by_token_spec(kv_cache_dtype: str = "auto"):
    """One layer's K (or V) pages [num_pages, kv_heads, d * page_size, head_dim] split on the token axis (an int8
    cache's scales [num_pages, kv_heads, d * page_size] with them)."""
    pages = P(None, None, MODEL, None)
    return Int8Pages(pages, P(None, None, MODEL)) if kv_cache_dtype == "int8" else pages


def pages_by_token(mesh, kv_cache_dtype: str = "auto", platform: str | None = None):
    """Where one layer's K (or V) pages live: split by token (`pages_by_token_spec`), and on TPU in row-major layout.
    XLA:TPU lays a [num_pages, kv_heads, page_size, head_dim] array out pages-minor when its two minor dimensions
    are under a (8, 128) tile (SmolLM2's [.., 16, 64]), and the jnp attention's page gathers then relayout every
    layer's whole page array each step (the HBM audit's 1.6 GB a 2-layer step at 128K); row-major, they read pages
    in place, at the price of head_dim padded to 128 lanes in HBM where it is smaller."""
    placed = shardings(mesh, pages_by_token_spec(kv_cache_dtype))
    if platform != "tpu":
        return placed
    return jax.tree.map(lambda s: Format(Layout(major_to_minor=tuple(range(len(s.spec)))), s), placed,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def whole_kv_heads(axes):
    """Params' logical axes (`jaxserve.model.decoder.param_axes`) with the KV-head axis kept whole: every rank
    writes and reads every KV head of its own tokens, so each computes all of k and v (small projections) rather
    than gathering them, or the kernels split across a head, every layer."""
    return jax.tree.map(lambda a: P(*[None if name == "kv_heads" else name for name in a]), axes,
                        is_leaf=lambda x: isinstance(x, P))


def local_rows(rows: RaggedRows, d: int, rank) -> RaggedRows:
    """rows as rank sees its own share of the cache: each row's cached tokens at positions = rank mod d, in the same
    pages (cached_lens counted in them)."""
    cached = jnp.maximum(rows.cached_lens - rank + d - 1, 0) // d  # [S]
    return RaggedRows(rows.positions, rows.token_row, rows.query_start, cached, rows.page_table)


def local_slots(slot_mapping, host_page_size: int, d: int, rank):
    """Host slots [T] (page * d * page_size + offset) -> rank's own slots in its pages of page_size: its tokens
    (offset = rank mod d) at offset // d, the others' in the scratch page."""
    page, offset = slot_mapping // host_page_size, slot_mapping % host_page_size
    mine = offset % d == rank
    return jnp.where(mine, page * (host_page_size // d) + offset // d, SCRATCH_PAGE * (host_page_size // d))


def merge_partials(out, lse, axis: str):
    """Each rank's partial attention -> rank's own heads of the exact result, by log-sum-exp.

    out [T, H, D] float32 over this rank's keys, lse [T, H] their log-sum-exp (a very negative finite number
    where it has none) -> [T, H / d, D]: out_r weighted by exp(lse_r - lse) and summed over ranks. Each rank sends
    each other rank that rank's heads (an all-to-all: a reduce-scatter's bytes), and sums what it receives: XLA:TPU
    cannot lower a reduce-scatter over an odd number of devices (3: SmolLM2's 9 heads) inside a fusion."""
    lse_all = jax.lax.all_gather(lse, axis)  # [d, T, H]
    top = lse_all.max(0)  # [T, H]
    weight = jnp.exp(lse - top) / jnp.exp(lse_all - top).sum(0)  # [T, H]
    T, H, D = out.shape
    d = lse_all.shape[0]
    mine = out * weight[..., None]  # [T, H, D]
    # [T, d, H / d, D]: heads chunk j to rank j; received, axis 1 is the sending rank
    return jax.lax.all_to_all(mine.reshape(T, d, H // d, D), axis, 1, 1).sum(1)


def attention_over_tokens(attend, mesh, q, k, v, k_pages, v_pages, rows: RaggedRows):
    """attend(q, k, v, k_pages, v_pages, rows, key_stride, key_offset) -> (out [T, H, D] float32, lse [T, H]) run
    by each rank over every head and its own keys (cached key j at position j * key_stride + key_offset, the step's
    keys at positions = key_offset mod key_stride), merged (`merge_partials`). q: [T, heads, head_dim] split by
    heads as the model computes it; k, v: [T, kv_heads, head_dim] whole; pages split by token
    (`pages_by_token_spec`). Returns [T, heads, head_dim] split by heads, as `attention_over_heads`."""
    d = model_size(mesh)

    def local(q, k, v, k_pages, v_pages, rows):
        rank = jax.lax.axis_index(MODEL)
        q_all = jax.lax.all_gather(q, MODEL, axis=1, tiled=True)  # [T, H, D]
        out, lse = attend(q_all, k, v, k_pages, v_pages, local_rows(rows, d, rank), d, rank)
        return merge_partials(out, lse, MODEL).astype(q.dtype)  # [T, H / d, D]

    pages = pages_by_token_spec("int8" if isinstance(k_pages, Int8Pages) else "auto")
    return jax.shard_map(local, mesh=mesh, in_specs=(HEADS, P(), P(), pages, pages, P()), out_specs=HEADS,
                         check_vma=False)(q, k, v, k_pages, v_pages, rows)


def write_over_tokens(mesh, kv_cache, new_kv, slot_mapping):
    """The step's new K/V (per layer (k, v) [T, kv_heads, head_dim], whole on every rank) written by each rank into
    its own slots of the token-split cache (`local_slots`)."""
    d = model_size(mesh)
    int8 = isinstance(kv_cache[0][0], Int8Pages)
    host_page_size = kv_cache[0][0].shape[2]

    def local(kv_cache, new_kv, slot_mapping):
        slots = local_slots(slot_mapping, host_page_size, d, jax.lax.axis_index(MODEL))
        return [(write_pages(k_pages, k, slots), write_pages(v_pages, v, slots))
                for (k_pages, v_pages), (k, v) in zip(kv_cache, new_kv)]

    pages = [(pages_by_token_spec("int8" if int8 else "auto"),) * 2] * len(kv_cache)
    return jax.shard_map(local, mesh=mesh, in_specs=(pages, P(), P()), out_specs=pages,
                         check_vma=False)(kv_cache, new_kv, slot_mapping)
