"""Both ragged kernels' query layout: each row's new tokens cut into blocks of `block_q` that never span two rows.

Worked out with jnp from `query_start` (no host round trip) over a static number of block slots: a row of n
tokens takes cdiv(n, block_q) <= n // block_q + 1 blocks, so T // block_q + S slots hold any split of T tokens
into S rows, and as a block holds a token at least, T slots do too (`num_slots`: the lesser; a decode-only step,
T <= S, takes T). Slots past the last block land on row S - 1 with nothing present: a kernel sees them as unused.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.batch import RaggedRows


class QueryBlocks(NamedTuple):
    query_start: jax.Array  # int32 [S + 1]
    num_new: jax.Array  # int32 [S]   new tokens of each row
    first_block: jax.Array  # int32 [S]   row r's blocks are slots first_block[r] ..
    block_row: jax.Array  # int32 [NB]   the row each slot serves
    local: jax.Array  # int32 [NB, block_q]   each place's token, counted from its row's first new token
    present: jax.Array  # bool [NB, block_q]   a token is there
    token: jax.Array  # int32 [NB, block_q]   its flat index (0 where none)


def num_slots(num_tokens: int, num_rows: int, block_q: int) -> int:
    """The static number of block slots for any split of num_tokens into num_rows rows."""
    return min(num_tokens, num_tokens // block_q + num_rows)


def query_blocks(rows: RaggedRows, num_tokens: int, block_q: int) -> QueryBlocks:
    S = rows.page_table.shape[0]
    query_start = rows.query_start.astype(jnp.int32)
    num_new = query_start[1:] - query_start[:-1]
    blocks_per_row = -(-num_new // block_q)
    first_block = jnp.cumsum(blocks_per_row) - blocks_per_row
    slot = jnp.arange(num_slots(num_tokens, S, block_q), dtype=jnp.int32)
    block_row = jnp.minimum(jnp.searchsorted(first_block + blocks_per_row, slot, side="right"), S - 1)
    block_row = block_row.astype(jnp.int32)
    local = (slot - first_block[block_row])[:, None] * block_q + jnp.arange(block_q)
    present = local < num_new[block_row][:, None]
    token = jnp.where(present, query_start[block_row][:, None] + local, 0)
    return QueryBlocks(query_start, num_new, first_block, block_row, local, present, token)


def unblock(out, blocks: QueryBlocks, rows: RaggedRows, dtype):
    """out [NB * block_q, H, D], token-major by slot -> [T, H, D] in the flat order, zeros for padding tokens."""
    T, block_q = rows.positions.shape[0], blocks.local.shape[1]
    row = rows.token_row.astype(jnp.int32)
    t_local = jnp.arange(T, dtype=jnp.int32) - blocks.query_start[row]
    mine = (rows.positions >= 0) & (t_local >= 0) & (t_local < blocks.num_new[row])  # padding tokens: no slot
    src = (blocks.first_block[row] + t_local // block_q) * block_q + t_local % block_q
    return jnp.where(mine[:, None, None], out[jnp.where(mine, src, 0)], 0).astype(dtype)
