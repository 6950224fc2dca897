"""Attention over a ragged batch and the paged KV cache: the one entry point the model calls, and its jnp versions.

Each of the step's T tokens belongs to one row (sequence) and attends to that row's keys: the ones cached before
the step (in its pages, positions 0 .. cached_len - 1) and the step's own new keys of the same row up to its own
position (not yet in the cache: the step writes them after the forward, see `jaxserve.runner.steps`).

`attention` picks the implementation by backend, resolved once (`resolve_attention_backend`): "reference" is
`ragged_attention` below (blocked jnp, the CPU path); "pallas" runs the ragged Pallas kernels; "dense" is
`ragged_attention_reference` (`jaxserve.pallas_kernels.reference`, the same function written as directly as
possible: the oracle for every other implementation in the tests; slow, but differentiable, which training needs).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxserve import pallas_kernels as pk
from jaxserve.batch import RaggedRows
from jaxserve.cache.kv_cache import Int8Pages, read_blocks, write_pages
from jaxserve.cpu_kernels import paged_attention as cpu_paged_attention
from jaxserve.options import ATTENTION_BACKENDS as BACKENDS
from jaxserve.pallas_kernels.reference import ragged_attention_reference

__all__ = ["BACKENDS", "attention", "blocked_attention", "partial_attention", "ragged_attention",
           "ragged_attention_reference", "resolve_attention_backend", "write_kv"]


def resolve_attention_backend(name: str, platform: str | None = None) -> str:
    """auto | reference | dense | pallas | pallas-gpu | pallas-tpu -> what runs: "reference", "dense", "pallas-gpu",
    "pallas-tpu", or on CPU "pallas-gpu-interpret" / "pallas-tpu-interpret" (the kernels interpreted: correct,
    slow)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    platform = platform or jax.devices()[0].platform
    if name == "auto":
        return "pallas-" + platform if platform in ("gpu", "tpu") else "reference"
    if name in ("reference", "dense"):
        return name
    if name == "pallas":
        name = "pallas-" + (platform if platform in ("gpu", "tpu") else "gpu")
    if platform == "cpu":
        return name + "-interpret"
    if name != "pallas-" + platform:
        raise ValueError(f"attention_backend {name!r} cannot run on {platform}")
    return name


def attention(q, k, v, k_pages, v_pages, rows: RaggedRows, *, sliding_window=None, backend="reference"):
    """Same arguments and result as `ragged_attention_reference`, by the resolved backend ("dense": that oracle
    itself, slow but differentiable, which training needs: the blocked path's dynamic loops are not)."""
    if backend == "dense":
        return ragged_attention_reference(q, k, v, k_pages, v_pages, rows, sliding_window=sliding_window)
    if backend == "reference":
        return ragged_attention(q, k, v, k_pages, v_pages, rows, sliding_window=sliding_window)
    return pk.ragged_kernel_for(backend)(q, k, v, k_pages, v_pages, rows, sliding_window=sliding_window)


def partial_attention(q, k, v, k_pages, v_pages, rows: RaggedRows, key_stride, key_offset, *, sliding_window=None,
                      backend="reference"):
    """Attention over a share of the keys, for decode context parallelism (`jaxserve.parallel.context_parallel`):
    cached key j of a row is at position j * key_stride + key_offset (rows.cached_lens counts this share's), and
    of the step's own keys only those at positions = key_offset mod key_stride are seen. Returns (out [T, H, D]
    float32, lse [T, H]): the attention over those keys and their log-sum-exp (about -1e30 where a token sees
    none), for an exact merge with the other shares'. The blocked jnp path only (backend "reference")."""
    if backend != "reference":
        raise ValueError(f"partial attention (decode context parallelism) runs the 'reference' backend, not "
                         f"{backend!r}")
    return blocked_attention(q, k, v, k_pages, v_pages, rows, sliding_window=sliding_window, key_stride=key_stride,
                             key_offset=key_offset, return_lse=True)


# Finite, so a query with nothing to attend to (padding) gives a harmless value instead of NaN.
_MASKED = -1e30
# Scores and weighted values of cached keys by the keys' rank: blocks head by head (`read_blocks`), shared by every
# token [KVH, keys, D] or each token's own [n, KVH, keys, D]: a batched dot over (token,) KV head reads them as they
# are, with no transpose of a block first.
_SCORES = {3: "tkgd,knd->tkgn", 4: "tkgd,tknd->tkgn"}
_VALUES = {3: "tkgn,knd->tkgd", 4: "tkgn,tknd->tkgd"}


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter new keys/values into their cache slots.

    k_pages, v_pages: [num_pages, kv_heads, page_size, head_dim] (or Int8Pages: quantized as they are written)
    k, v:             [T, kv_heads, head_dim]
    slot_mapping:     [T] flat slot (page * page_size + offset); padding tokens point into the scratch page 0.
    """
    return write_pages(k_pages, k, slot_mapping), write_pages(v_pages, v, slot_mapping)


def ragged_attention(q, k, v, k_pages, v_pages, rows: RaggedRows, *, sliding_window=None, block_pages=8,
                     num_groups=2, long_row_share=8, small_step=64, own_block=128):
    """`ragged_attention_reference` for XLA:CPU. Same arguments and result.

    A step of at most `small_step` tokens (decoding) runs on CPU as one kernel per layer that reads each token's
    cached keys from the pages in place (`jaxserve.cpu_kernels.paged_attention`); longer steps, other platforms and
    a machine where the kernel cannot be built take the blocked jnp path (`blocked_attention`). The default model's
    layer alone, jitted (2 vCPU AMD EPYC, 2026-12-06, interleaved, median of 30), ms blocked / kernel: 1 row after
    512 tokens 0.24 / 0.09, 16 rows after 512 2.03 / 1.63, 64 rows after 64 1.98 / 1.01. Inside a batch-1 engine
    step the gain was smaller (XLA fuses the blocked path's ops better there, and the kernel reads its pages cold):
    19.4 / 19.1 ms a step with the kernel's first version, whose calls took 120 us a layer in the step, 78 now.
    """
    blocked = functools.partial(blocked_attention, sliding_window=sliding_window, block_pages=block_pages,
                                num_groups=num_groups, long_row_share=long_row_share, small_step=small_step,
                                own_block=own_block)
    if q.shape[0] > small_step:
        return blocked(q, k, v, k_pages, v_pages, rows)
    in_place = functools.partial(_paged_attention_cpu, blocked, sliding_window)
    return jax.lax.platform_dependent(q, k, v, k_pages, v_pages, rows, cpu=in_place, default=blocked)


def _paged_attention_cpu(blocked, sliding_window, q, k, v, k_pages, v_pages, rows: RaggedRows):
    if not cpu_paged_attention.available():
        return blocked(q, k, v, k_pages, v_pages, rows)
    T, H, D = q.shape
    KVH = k.shape[1]
    row, pos = rows.token_row, rows.positions
    (k_stored, k_scale), (v_stored, v_scale) = ((p.values, p.scale) if isinstance(p, Int8Pages) else (p, None)
                                                for p in (k_pages, v_pages))
    out = cpu_paged_attention.paged_attention(
        q.reshape(T, KVH, H // KVH, D) * (D ** -0.5), k, v, row, pos, rows.cached_lens[row], rows.page_table[row],
        k_stored, v_stored, k_scale, v_scale, sliding_window, bf16_dots=q.dtype == jnp.bfloat16)  # [T, KVH, G, D]
    return out.reshape(T, H, D).astype(v.dtype)


class _BlockedCache(NamedTuple):
    """The paged cache as `blocked_attention` walks it: `block_pages` pages (`block` keys) a step, keys outside
    the sliding window (if any) masked."""
    k_pages: jax.Array  # [num_pages, KVH, page_size, D] (or Int8Pages)
    v_pages: jax.Array
    table: jax.Array  # [S, num_blocks * block_pages] the page table padded to whole blocks
    block_pages: int
    block: int  # block_pages * page_size
    head_dim: int
    sliding_window: int | None
    key_stride: int = 1  # cached key j is at position j * key_stride + key_offset (`partial_attention`)
    key_offset: Any = 0

    def read(self, pages, page_ids):  # page_ids [n, block_pages] -> [n, KVH, block, D] float32
        return read_blocks(pages, page_ids, jnp.float32, self.head_dim)

    def key_positions(self, i):  # [block]: the positions of block i's keys
        return (i * self.block + jnp.arange(self.block)) * self.key_stride + self.key_offset


def blocked_attention(q, k, v, k_pages, v_pages, rows: RaggedRows, *, sliding_window=None, block_pages=8,
                      num_groups=2, long_row_share=8, small_step=64, own_block=128, key_stride=1, key_offset=0,
                      return_lse=False):
    """`ragged_attention_reference` computed in parts, each with an online softmax, in jnp for XLA.

    Same arguments and result. Three parts, merged by log-sum-exp:
      - the step's own keys: a masked attention (same row, causal) over the flat tokens, in blocks of `own_block`
        queries that each see only the keys up to their block's end (`_own_keys`);
      - cached keys, per token: the tokens sorted by their row's cached length and cut into `num_groups` groups
        (the first as many tokens as the step has rows, the rest in equal parts), each walking only the blocks of
        `block_pages` pages its longest row needs (a dynamic trip count), so a decode row costs what its context
        holds and a fresh prompt's tokens cost nothing here (`_cached_per_token`);
      - cached keys of one long prompt chunk: the multi-token row with the longest cache, if its tokens are at least
        1/`long_row_share` of the step, reads its pages once for all its tokens (per token, a 512-token chunk
        after 4k cached tokens would gather 4k keys 512 times; `_long_row`).
    A step of at most `small_step` tokens takes one group and no long-row pass: per token, its cached keys cost at
    most what as many decode rows' do, and each loop adds ~1.5 s to a program's compile time.
    key_stride, key_offset, return_lse: `partial_attention`'s share of the keys, and (out float32, lse [T, H]).
    """
    T, H, D = q.shape
    _, KVH, page_size, _ = k_pages.shape
    num_blocks = -(-rows.page_table.shape[1] // block_pages)
    table = jnp.pad(rows.page_table, ((0, 0), (0, num_blocks * block_pages - rows.page_table.shape[1])))
    cache = _BlockedCache(k_pages, v_pages, table, block_pages, block_pages * page_size, D, sliding_window,
                          key_stride, key_offset)
    q = q.reshape(T, KVH, H // KVH, D) * (D ** -0.5)
    own = None if key_stride == 1 else rows.positions % key_stride == key_offset  # [T] the step's keys seen
    carry = _own_keys(q, k, v, rows, sliding_window, own_block, own)
    # Cached keys in float32, whatever the model's dtype: their dots have G query rows per batch, which XLA:CPU runs
    # as a slow loop on bf16 operands. bf16 model, engine steps (1025 pages, interleaved, 2026-12-02), bf16 / float32:
    # batch 1 35.3 / 33.7 ms, batch 16 94.0 / 90.4. (The step's own keys above stay in the model's dtype: a
    # 512-token prompt 228 ms bf16, 233 float32.)
    q = q.astype(jnp.float32)
    in_long, carry = _long_row(q, rows, cache, carry, long_row_share, small_step)
    out, lse = _cached_per_token(q, rows, cache, carry, in_long, num_groups, small_step)  # [T, KVH, G, (D)]
    out = jnp.where((rows.positions >= 0)[:, None, None, None], out, 0.0).reshape(T, H, D)
    return (out, lse.reshape(T, H)) if return_lse else out.astype(v.dtype)


def _masked_scores(q, keys, visible, key_pos, q_pos, sliding_window):
    """q [n, KVH, G, D]; keys [n, KVH, keys, D] (each token its own pages) or [KVH, keys, D] (pages shared by all
    tokens) -> scores [n, KVH, G, keys] float32, _MASKED where a key is not visible (visible [n, keys])."""
    s = jnp.einsum(_SCORES[keys.ndim], q, keys.astype(q.dtype), preferred_element_type=jnp.float32)
    if sliding_window is not None:
        visible &= key_pos > q_pos[:, None] - sliding_window
    return jnp.where(visible[:, None, None, :], s, _MASKED)  # [n, KVH, G, keys]


def _accumulate(carry, s, values):
    """One block of keys (scores s, values as `_VALUES` reads them) added to a running softmax (m, l, acc)."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    acc = acc * corr[..., None] + jnp.einsum(_VALUES[values.ndim], p.astype(values.dtype), values,
                                             preferred_element_type=jnp.float32)
    return m_new, l * corr + p.sum(-1), acc


def _own_keys(q, k, v, rows: RaggedRows, sliding_window, own_block, own=None):
    """The running softmax (m, l [T, KVH, G], acc [T, KVH, G, D] float32) over the step's own keys.

    First of the parts: every real token sees at least itself, so the running max starts finite. A row's tokens
    lie in order, so a token sees none after it in the flat array: blocks of `own_block` queries attend to the keys
    up to their block's end only (about half the [T, T] work for a long chunk). Head-major operands, made once:
    queries [KVH, T * G, D] against keys [KVH, T, D], a batched dot per block that XLA:CPU runs as it is (the
    token-major einsum transposed each block's operands and recomputed what produced them, RoPE included). A
    512-token prompt's forward, default model, interleaved (2026-12-02, loaded 2 vCPU): float32 990 -> 884 ms,
    bf16 496 -> 422. own [T]: which of the step's keys are seen (None: all; a token that sees none starts from a
    running max of _MASKED, which the first key it sees replaces).
    """
    T, KVH, G, D = q.shape
    qh = q.transpose(1, 0, 2, 3).reshape(KVH, T * G, D)  # [KVH, T * G, D]
    kh, vh = k.transpose(1, 0, 2).astype(q.dtype), v.transpose(1, 0, 2)  # [KVH, T, D]
    parts = [_own_block(qh, kh, vh, rows, lo, min(lo + own_block, T), sliding_window, own)
             for lo in range(0, T, own_block)]
    return tuple(jnp.concatenate(x) for x in zip(*parts))


def _own_block(qh, kh, vh, rows: RaggedRows, lo, hi, sliding_window, own):
    """Queries lo..hi - 1 against the step's keys 0..hi - 1: their (m, l, acc), token-major."""
    KVH, _, D = kh.shape
    G = qh.shape[1] // kh.shape[1]
    pos, row = rows.positions, rows.token_row
    visible = ((row[None, :hi] == row[lo:hi, None]) & (pos[None, :hi] >= 0)
               & (pos[None, :hi] <= pos[lo:hi, None]))  # [hi - lo, hi]
    if sliding_window is not None:
        visible &= pos[None, :hi] > pos[lo:hi, None] - sliding_window
    if own is not None:
        visible &= own[None, :hi]
    s = jax.lax.dot_general(qh[:, lo * G:hi * G], kh[:, :hi], (((2,), (2,)), ((0,), (0,))),
                            preferred_element_type=jnp.float32).reshape(KVH, hi - lo, G, hi)
    s = jnp.where(visible[None, :, None, :], s, _MASKED)  # [KVH, hi - lo, G, hi]
    m_own = s.max(-1)  # [KVH, hi - lo, G]
    p = jnp.exp(s - m_own[..., None])
    acc_own = jax.lax.dot_general(p.reshape(KVH, (hi - lo) * G, hi).astype(vh.dtype), vh[:, :hi],
                                  (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    # [KVH, n, ...] -> [n, KVH, ...]
    return (jnp.moveaxis(m_own, 0, 1), jnp.moveaxis(p.sum(-1), 0, 1),
            jnp.moveaxis(acc_own.reshape(KVH, hi - lo, G, D), 0, 1))


def _long_row(q, rows: RaggedRows, cache: _BlockedCache, carry, long_row_share, small_step):
    """(in_long [T], carry): the long row's tokens, and the running softmax with its cached keys added (its
    cached_len then counts as 0 for the per-token part). No row qualifies in a step of at most `small_step`.

    Head-major inside the loop, as `_own_keys`: queries [KVH, T * G, D] made once, a batched dot per block of keys,
    the running softmax [KVH, T * G] (moved to and from the token-major carry once, outside the loop). Token-major,
    XLA:CPU transposed the queries in every block (and recomputed what produced them): a 2048-token chunk after 2048
    cached tokens, the default model's layer alone (2026-12-07, 2 vCPU Xeon, loaded): 647 -> 269 ms; after 6144
    cached, 1625 -> 482 ms.
    """
    T, KVH, G, D = q.shape
    pos, row = rows.positions, rows.token_row
    new_tokens = rows.query_start[1:] - rows.query_start[:-1]  # [S]
    eligible = (new_tokens > 1) & (new_tokens * long_row_share >= T) & (T > small_step)
    long_row = jnp.argmax(jnp.where(eligible, rows.cached_lens, -1))
    long_len = jnp.where(eligible[long_row], rows.cached_lens[long_row], 0)
    in_long = (row == long_row) & eligible[long_row]  # [T]
    if T <= small_step:
        return in_long, carry
    qh = q.transpose(1, 0, 2, 3).reshape(KVH, T * G, D)  # [KVH, T * G, D]
    batched = (((2,), (1,)), ((0,), (0,)))  # [KVH, n, keys] x [KVH, keys, D]

    def visit(i, carry):
        m, l, acc = carry  # [KVH, T * G] (acc [KVH, T * G, D])
        pages = jax.lax.dynamic_slice_in_dim(cache.table[long_row], i * cache.block_pages, cache.block_pages)[None]
        keys, values = cache.read(cache.k_pages, pages)[0], cache.read(cache.v_pages, pages)[0]  # [KVH, block, D]
        key_index = i * cache.block + jnp.arange(cache.block)
        visible = (key_index < long_len)[None, :] & in_long[:, None]  # [T, block]
        if cache.sliding_window is not None:
            visible &= cache.key_positions(i)[None, :] > pos[:, None] - cache.sliding_window
        s = jax.lax.dot_general(qh, keys.astype(qh.dtype), (((2,), (2,)), ((0,), (0,))),
                                preferred_element_type=jnp.float32).reshape(KVH, T, G, cache.block)
        s = jnp.where(visible[None, :, None, :], s, _MASKED).reshape(KVH, T * G, cache.block)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        acc = acc * corr[..., None] + jax.lax.dot_general(p.astype(values.dtype), values, batched,
                                                           preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(-1), acc

    m, l, acc = carry  # token-major: [T, KVH, G] (acc [T, KVH, G, D])
    heads = (m.transpose(1, 0, 2).reshape(KVH, T * G), l.transpose(1, 0, 2).reshape(KVH, T * G),
             acc.transpose(1, 0, 2, 3).reshape(KVH, T * G, D))
    m, l, acc = jax.lax.fori_loop(0, -(-long_len // cache.block), visit, heads)
    return in_long, (m.reshape(KVH, T, G).transpose(1, 0, 2), l.reshape(KVH, T, G).transpose(1, 0, 2),
                     acc.reshape(KVH, T, G, D).transpose(1, 0, 2, 3))


def _cached_per_token(q, rows: RaggedRows, cache: _BlockedCache, carry, in_long, num_groups, small_step):
    """The attention's result [T, KVH, G, D] float32 and its log-sum-exp [T, KVH, G]: each token's cached keys
    added to its running softmax, which is then normalised.

    Per token, in groups sorted by cached length (longest first), each walking only the blocks it needs. The first
    group holds as many tokens as the step has rows, so a step's decode tokens (one per row) can fill it and leave
    the prompt tokens, which mostly have little or nothing cached, to the others.
    """
    T = q.shape[0]
    pos, row = rows.positions, rows.token_row
    m, l, acc = carry
    token_len = jnp.where(in_long | (pos < 0), 0, rows.cached_lens[row])  # [T]
    order = jnp.argsort(-token_len)
    S = rows.page_table.shape[0]
    bounds = [0, T]
    if T > small_step and num_groups > 1 and S < T:
        bounds = [0] + [S + (T - S) * g // (num_groups - 1) for g in range(num_groups)]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        idx = order[lo:hi]
        group = q[idx], token_len[idx], row[idx], pos[idx]
        parts.append(_walk_group(*group, cache, (m[idx], l[idx], acc[idx])))
    # The groups hold the tokens in `order`: back to the step's order by a gather of the inverse permutation, which
    # XLA:CPU copies row by row (a scatter per group went element by element; the 512-token prompt's forward:
    # float32 920 -> 857 ms, bf16 428 -> 408).
    inverse = jnp.zeros(T, jnp.int32).at[order].set(jnp.arange(T, dtype=jnp.int32))  # [T]
    out = jnp.concatenate([acc_g / l_g[..., None] for _, l_g, acc_g in parts])[inverse]  # [T, KVH, G, D]
    return out, jnp.concatenate([m_g + jnp.log(l_g) for m_g, l_g, _ in parts])[inverse]


def _walk_group(q_g, g_len, g_row, g_pos, cache: _BlockedCache, carry):
    """One group's running softmax with its tokens' cached keys added, for as many blocks as its first (longest)
    token needs. q_g [n, KVH, G, D]; g_len [n] cached keys; g_row [n] their rows; g_pos [n]."""
    def visit(i, carry):
        # The block's columns of the table first, then each token's row of them: a token's whole row of the table
        # would be [n, width], at 128K a 2048-token chunk's 64 MB per layer.
        pages = jax.lax.dynamic_slice_in_dim(cache.table, i * cache.block_pages, cache.block_pages, axis=1)[g_row]
        key_index = i * cache.block + jnp.arange(cache.block)
        s = _masked_scores(q_g, cache.read(cache.k_pages, pages), key_index[None, :] < g_len[:, None],
                           jnp.broadcast_to(cache.key_positions(i), (len(g_len), cache.block)), g_pos,
                           cache.sliding_window)
        return _accumulate(carry, s, cache.read(cache.v_pages, pages))

    return jax.lax.fori_loop(0, -(-g_len[0] // cache.block), visit, carry)
