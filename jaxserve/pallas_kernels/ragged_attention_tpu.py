"""Ragged paged attention for TPU (Pallas Mosaic): same arguments and result as
`jaxserve.pallas_kernels.reference.ragged_attention_reference`.

Each row's new tokens are cut into query blocks of `block_q` tokens; a block never spans two rows, so one program
of the grid (one per query block) serves one row. The wrapper lays the blocks out in a static number of slots
(T // block_q + S bound the blocks of any split of T tokens into S rows) and gathers queries and the step's own
keys into them; unused slots and the tail of a row's last block are masked. Per-row metadata (query starts,
cached lengths) and the block -> row map are prefetched scalars. The page table is not: [S, P] int32 is 2 MiB at
64 rows of 128K tokens (8192 pages of 16), and SMEM is 1 MiB on v5e and v6e (the compiler's RESOURCE_EXHAUSTED,
deviceless). It stays in HBM, and a program DMAs into SMEM only the entries its row's walk reads, in chunks of
TABLE_CHUNK (`_table_copies`): SMEM holds one row's table (32 KiB at 8192 pages), and a short row reads one chunk
however wide the table is. That DMA runs before the first page's (one more DMA latency a program, ~1-2 us, not
hidden across programs: prefetching the next program's entries would need the grid "arbitrary", in order).

The K/V cache stays in HBM (`memory_space=pl.ANY`): a program DMAs its row's pages, `pages_per_block` at a time,
into a double buffer in VMEM and folds them into an online softmax kept in VMEM scratch; then the row's own new
keys (causal), block by block the same way. Only blocks some query of the block can see are fetched (a sliding
window skips the ones before it). All query heads of a KV head are rows of one matrix (GQA without repeating K/V).
int8 pages (`Int8Pages`) bring their per-token scales along and are dequantized in VMEM, to the queries' dtype
as `read_pages` does.

The pages are head-major ([num_pages, KVH, page_size, D], `jaxserve.cache.kv_cache`) with D padded to 128 lanes
on TPU, so a head's [page_size, D] of a page is whole (8, 128) tiles and the kernel DMAs pages straight from the
cache (in the token-major layout, or at head_dim 64 unpadded, XLA copied the whole cache into Mosaic's tiling
around every call: 269 MB of temporaries per call at SmolLM2's shape, deviceless v5e). A program still fetches
every KV head of a page at once: each page is read once per query block, what a per-head grid would read too. A
per-KV-head DMA (`k_hbm.at[page, h]`) compiles in this layout (deviceless v5e, no temporaries) and would cut the
page buffers KVH-fold, but VMEM does not bind (`tpu_blocks`: at most ~6 MiB of 128) while each copy would shrink
KVH-fold (4 KB at 16 tokens x 128 lanes bf16), so whole pages stay.
Block sizes and the VMEM limit: `tpu_blocks`, from the shapes and the chip's VMEM.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.batch import RaggedRows
from jaxserve.pallas_kernels.query_blocks import num_slots, query_blocks, unblock
from jaxserve.pallas_kernels.softmax import (
    MASKED,
    dequantize,
    pad_head_dim,
    scores,
    softmax_block,
    softmax_result,
    split_pages,
)
from jaxserve.pallas_kernels.tpu_blocks import TABLE_CHUNK, TPU_VMEM, tpu_blocks


class _Scratch(NamedTuple):
    """The kernel's scratch (`_scratch_shapes`): page buffers [2, pages_per_block, KVH, page_size, D] (scales
    [..., page_size], None unless quantized), own-key buffers [2, KVH, block_q, D], the running softmax m_sc, l_sc
    [KVH, rows, 1] and acc_sc [KVH, rows, D] (float32) in VMEM; the row's page table [P'] int32 in SMEM; DMA
    semaphores [3, 2] ([cached | own | table, buffer])."""
    k_buf: Any
    v_buf: Any
    k_scale_buf: Any
    v_scale_buf: Any
    own_k_buf: Any
    own_v_buf: Any
    m_sc: Any
    l_sc: Any
    acc_sc: Any
    table: Any
    sems: Any


def _split_refs(refs, quantized):
    """The kernel's refs after the pages: (k_scale_hbm, v_scale_hbm (None unless quantized), o_ref, _Scratch)."""
    if quantized:
        k_scale_hbm, v_scale_hbm, o_ref, k_buf, v_buf, k_scale_buf, v_scale_buf, *refs = refs
    else:
        (o_ref, k_buf, v_buf, *refs), k_scale_buf, v_scale_buf = refs, None, None
        k_scale_hbm = v_scale_hbm = None
    return k_scale_hbm, v_scale_hbm, o_ref, _Scratch(k_buf, v_buf, k_scale_buf, v_scale_buf, *refs)


def _stream(lo, hi, copies, compute):
    """Blocks [lo, hi) with double buffering: block i + 1's DMAs (`copies(i, slot)`) run while block i is
    computed."""
    @pl.when(lo < hi)
    def _():
        for c in copies(lo, 0):
            c.start()

    @pl.loop(lo, hi)
    def _(i):
        slot = (i - lo) % 2

        @pl.when(i + 1 < hi)
        def _():
            for c in copies(i + 1, 1 - slot):
                c.start()

        for c in copies(i, slot):
            c.wait()
        compute(i, slot)


def _table_copies(table_hbm, sc: _Scratch, row, first_page, end_page, chunk):
    """`copies("start")` / `copies("wait")`: the DMAs of the row's page-table entries [first_page, end_page) into
    the SMEM table, as the whole `chunk`s of entries that hold them: what the row's walk reads, never the rest of
    the table (a 128K row is 8192 pages; a short row's few pages are one chunk however wide the table is)."""
    lo, hi = first_page // chunk, pl.cdiv(end_page, chunk)

    def copies(action):
        @pl.loop(lo, hi)
        def _(c):
            part = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
            copy = pltpu.make_async_copy(table_hbm.at[row, part], sc.table.at[part], sc.sems.at[2, 0])
            copy.start() if action == "start" else copy.wait()
    return copies


def _page_copies(table_ref, i, slot, pairs, sems, pages_per_block, pages_per_row):
    """The DMAs of the row's cached block i into buffer `slot`: its pages (entries of the row's table, `table_ref`
    in SMEM), whole (all KV heads: see the module's doc), from each (HBM array, VMEM buffer) pair."""
    copies = []
    for p in range(pages_per_block):  # static: the block's pages, clamped inside the table (masked anyway)
        page = table_ref[jnp.minimum(i * pages_per_block + p, pages_per_row - 1)]
        copies += [pltpu.make_async_copy(src.at[page], dst.at[slot, p], sems.at[0, slot]) for src, dst in pairs]
    return copies


def _load_pages(buf, scale_buf, slot, h, dtype):
    """KV head h of the block in buffer `slot`: [block_kv, D] in dtype (int8 values times their scales)."""
    scale = scale_buf[slot, :, h, :][..., None] if scale_buf is not None else None  # [pages_per_block, page_size, 1]
    x = dequantize(buf[slot, :, h], scale, dtype)  # [pages_per_block, page_size, D]
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2])


def _attend(sc: _Scratch, q_ref, sm_scale, visible, load_k, load_v):
    """Every KV head with its query heads, on one block of keys (`load_k(h)`, `load_v(h)` [keys, D])."""
    for h in range(q_ref.shape[0]):
        m, l, acc = softmax_block(sc.m_sc[h], sc.l_sc[h], sc.acc_sc[h], scores(q_ref[h], load_k(h), sm_scale),
                                  visible, load_v(h))
        sc.m_sc[h], sc.l_sc[h], sc.acc_sc[h] = m, l, acc


def _kernel(block_row_ref, first_block_ref, query_start_ref, cached_lens_ref,  # scalar prefetch (SMEM)
            q_pos_ref, q_ref, table_hbm, k_own_hbm, v_own_hbm, k_hbm, v_hbm, *refs,
            block_q, pages_per_block, pages_per_row, table_chunk, sliding_window, sm_scale, quantized):
    # q_pos_ref [rows, 1] (rows = block_q * G, token-major; -1: empty slot); q_ref [KVH, rows, D]
    # table_hbm [S, P'] int32 (P' = pages_per_row rounded up to whole table_chunks)
    # k_own_hbm, v_own_hbm [blocks, KVH, block_q, D]; k_hbm, v_hbm [num_pages, KVH, page_size, D] (int8 if quantized,
    # then k_scale_hbm, v_scale_hbm [num_pages, KVH, page_size] float32); o_ref [KVH, rows, D]; scratch: _Scratch
    k_scale_hbm, v_scale_hbm, o_ref, sc = _split_refs(refs, quantized)
    b = pl.program_id(0)
    block_kv = pages_per_block * k_hbm.shape[2]
    row = block_row_ref[b]
    j = b - first_block_ref[row]  # this block's place in its row
    num_new = query_start_ref[row + 1] - query_start_ref[row]
    cached_len = cached_lens_ref[row]
    first_local = j * block_q  # the block's first token, counted from the row's first new token
    used = first_local < num_new  # False: an empty slot past the last block
    q_pos = q_pos_ref[...]  # [rows, 1]

    def window_lo(first_key_pos):  # the first key position the block's earliest query can see
        if sliding_window is None:
            return jnp.int32(0)
        return jnp.maximum(cached_len + first_local - sliding_window + 1 - first_key_pos, 0)

    def in_window(visible, key_pos):
        return visible if sliding_window is None else visible & (key_pos > q_pos - sliding_window)

    # -- cached keys: pages of the row, pages_per_block at a time --
    pairs = [(k_hbm, sc.k_buf), (v_hbm, sc.v_buf)]
    if quantized:
        pairs += [(k_scale_hbm, sc.k_scale_buf), (v_scale_hbm, sc.v_scale_buf)]

    def visit_cached(i, slot):
        key_pos = i * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        visible = in_window((key_pos < cached_len) & (q_pos >= 0), key_pos)
        _attend(sc, q_ref, sm_scale, visible, lambda h: _load_pages(sc.k_buf, sc.k_scale_buf, slot, h, q_ref.dtype),
                lambda h: _load_pages(sc.v_buf, sc.v_scale_buf, slot, h, q_ref.dtype))

    lo, hi = window_lo(0) // block_kv, jnp.where(used, pl.cdiv(cached_len, block_kv), 0)
    table_copies = _table_copies(table_hbm, sc, row, lo * pages_per_block,
                                 jnp.minimum(hi * pages_per_block, pages_per_row), table_chunk)
    table_copies("start")  # its DMAs run while the softmax scratch is cleared
    sc.m_sc[...] = jnp.full(sc.m_sc.shape, MASKED, jnp.float32)
    sc.l_sc[...] = jnp.zeros(sc.l_sc.shape, jnp.float32)
    sc.acc_sc[...] = jnp.zeros(sc.acc_sc.shape, jnp.float32)
    table_copies("wait")
    _stream(lo, hi, lambda i, slot: _page_copies(sc.table, i, slot, pairs, sc.sems, pages_per_block, pages_per_row),
            visit_cached)

    # -- the step's own keys: the row's query blocks up to this one (causal) --
    def own_copies(i, slot):  # block i of the row: slot first_block[row] + i of the blocked layout
        src = first_block_ref[row] + i
        return [pltpu.make_async_copy(k_own_hbm.at[src], sc.own_k_buf.at[slot], sc.sems.at[1, slot]),
                pltpu.make_async_copy(v_own_hbm.at[src], sc.own_v_buf.at[slot], sc.sems.at[1, slot])]

    def visit_own(i, slot):
        local = i * block_q + jax.lax.broadcasted_iota(jnp.int32, (1, block_q), 1)
        key_pos = cached_len + local
        visible = in_window((local < num_new) & (key_pos <= q_pos) & (q_pos >= 0), key_pos)
        _attend(sc, q_ref, sm_scale, visible, lambda h: sc.own_k_buf[slot, h], lambda h: sc.own_v_buf[slot, h])

    _stream(window_lo(cached_len) // block_q, jnp.where(used, j + 1, 0), own_copies, visit_own)
    out, _ = softmax_result(sc.m_sc[...], sc.l_sc[...], sc.acc_sc[...])  # a query that saw nothing gets 0
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sliding_window", "block_q", "pages_per_block", "vmem", "table_chunk",
                                             "interpret"))
def ragged_attention_tpu(q, k, v, k_pages, v_pages, rows: RaggedRows, *, sliding_window=None, block_q=16,
                         pages_per_block=None, vmem=TPU_VMEM, table_chunk=TABLE_CHUNK, interpret=False):
    """Arguments and result as `ragged_attention_reference`: q [T, H, D], k, v [T, KVH, D], pages
    [num_pages, KVH, page_size, D'] (or Int8Pages; D' >= D, stored padded to TPU's 128 lanes) -> [T, H, D];
    padding tokens give zeros.

    block_q: new tokens of one row per program (its queries are block_q * H / KVH rows of the MXU matmuls) in
      steps with more tokens than rows; a decode-only step packs 8 / gcd(G, 8) (`tpu_blocks.decode_block_q`).
    pages_per_block: pages per DMA'd block of cached keys; by default derived by `tpu_blocks` from the page's
      bytes and `vmem` (bytes of VMEM a core: the chip's), which also sets the kernel's VMEM limit.
    table_chunk: page-table entries per DMA into SMEM, a multiple of 128 on a TPU (the table's tiles); the table is
      padded to whole chunks.
    """
    T, H, head_dim = q.shape
    _, KVH, page_size, D = k_pages.shape
    q, k, v = pad_head_dim(D, q, k, v)  # the queries and new keys as wide as the pages (zeros score nothing)
    G = H // KVH
    S, P = rows.page_table.shape
    (k_values, k_scale), (v_values, v_scale) = split_pages(k_pages), split_pages(v_pages)
    quantized = k_scale is not None
    derived = tpu_blocks(T, S, P, G, KVH, D, page_size, q.dtype.itemsize, k_values.dtype.itemsize, quantized, vmem,
                         block_q, pages_per_block)
    block_q, pages_per_block = derived.block_q, derived.pages_per_block
    NB = num_slots(T, S, block_q)  # static bound on the query blocks of any ragged split of T tokens into S rows

    # Which row each block slot serves, and which of its tokens (see query_blocks).
    blocks = query_blocks(rows, T, block_q)
    query_start, first_block, block_row, present, token = (blocks.query_start, blocks.first_block,
                                                           blocks.block_row, blocks.present, blocks.token)

    def blocked(x):  # [T, KVH, n, D] -> [NB, KVH, block_q * n, D], token-major within a block
        n = x.shape[2]
        return x[token].transpose(0, 2, 1, 3, 4).reshape(NB, KVH, block_q * n, D)

    q_blocks = blocked(q.reshape(T, KVH, G, D))
    k_own, v_own = blocked(k[:, :, None]), blocked(v[:, :, None])  # [NB, KVH, block_q, D]
    q_pos = jnp.where(present, rows.positions[token], -1).astype(jnp.int32)
    q_pos = jnp.repeat(q_pos, G, axis=1)[:, :, None]  # [NB, block_q * G, 1], one per sublane

    rows_g = block_q * G  # query rows of a block: its tokens x the query heads of one KV head
    pages = [k_values, v_values] + ([k_scale, v_scale] if quantized else [])
    # The page table stays in HBM: a program DMAs the entries its row's walk reads into SMEM (`_table_copies`).
    # As a scalar prefetch it was all of SMEM's business: [S * P] int32 is 2 MiB at 64 rows of 8192 pages (128K
    # tokens), over v5e's 1 MiB of SMEM.
    chunk = table_chunk
    table = rows.page_table.astype(jnp.int32)
    if P % chunk:  # [S, P'] whole chunks: a DMA's offset is a whole number of (128-lane) tiles
        table = jnp.pad(table, ((0, 0), (0, chunk - P % chunk)))
    scratch = _scratch_shapes(pages_per_block, KVH, page_size, D, block_q, rows_g, k_values.dtype, k.dtype,
                              quantized, table.shape[1])

    kernel = functools.partial(_kernel, block_q=block_q, pages_per_block=pages_per_block, pages_per_row=P,
                               table_chunk=chunk, sliding_window=sliding_window, sm_scale=head_dim ** -0.5,
                               quantized=quantized)
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,  # block_row [NB], first_block [S], query_start [S + 1], cached_lens [S]
        grid=(NB,),
        in_specs=[pl.BlockSpec((None, rows_g, 1), lambda b, *_: (b, 0, 0)),
                  pl.BlockSpec((None, KVH, rows_g, D), lambda b, *_: (b, 0, 0, 0)),
                  any_space, any_space, any_space] + [any_space] * len(pages),
        out_specs=pl.BlockSpec((None, KVH, rows_g, D), lambda b, *_: (b, 0, 0, 0)),
        scratch_shapes=scratch,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((NB, KVH, rows_g, D), q.dtype),
        # Each program owns its buffers and waits for every DMA it starts: blocks can split across cores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=derived.vmem_limit_bytes),
        interpret=interpret,
        name="ragged_attention_tpu",
    )(block_row, first_block.astype(jnp.int32), query_start, rows.cached_lens.astype(jnp.int32),
      q_pos, q_blocks, table, k_own, v_own, *pages)

    # Back to the flat tokens: token t sits in slot first_block[row] + local // block_q at local % block_q.
    out = out.reshape(NB, KVH, block_q, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * block_q, H, D)
    return unblock(out[..., :head_dim], blocks, rows, q.dtype)


def _scratch_shapes(pages_per_block, KVH, page_size, D, block_q, rows_g, page_dtype, own_dtype, quantized,
                    table_width):
    """Scratch in `_Scratch`'s order (the page scales only when quantized)."""
    scratch = [pltpu.VMEM((2, pages_per_block, KVH, page_size, D), page_dtype)] * 2
    if quantized:
        scratch += [pltpu.VMEM((2, pages_per_block, KVH, page_size), jnp.float32)] * 2
    scratch += [pltpu.VMEM((2, KVH, block_q, D), own_dtype)] * 2
    scratch += [pltpu.VMEM((KVH, rows_g, 1), jnp.float32)] * 2 + [pltpu.VMEM((KVH, rows_g, D), jnp.float32)]
    scratch += [pltpu.SMEM((table_width,), jnp.int32)]  # 32 KiB at 8192 pages a row
    scratch += [pltpu.SemaphoreType.DMA((3, 2))]  # [cached | own | table, buffer]
    return scratch
