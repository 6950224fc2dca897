"""What the speculative heads' engine tests share: the proposals an engine made, and rows for a dense forward of a
whole sequence (the reference chains the proposals are checked against)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxserve.batch import RaggedRows


def dense_rows(n):
    """One row of n new tokens at positions 0 .. n-1, nothing cached."""
    zeros = jnp.zeros(n, jnp.int32)
    return RaggedRows(positions=jnp.arange(n, dtype=jnp.int32), token_row=zeros,
                      query_start=jnp.array([0, n], jnp.int32), cached_lens=jnp.zeros(1, jnp.int32),
                      page_table=jnp.zeros((1, 1), jnp.int32))


def recorded_proposals(llm, ps, sp) -> list[tuple[list[int], list[int]]]:
    """Generates ps with sp, recording every proposal the engine's proposer made: (the sequence's tokens then,
    the proposed tokens)."""
    seen = []
    propose = llm.core.proposer.propose

    def recording(batch):
        got = propose(batch)
        seen.extend((s.token_ids[:], list(p)) for s, p in got.tokens.items() if p)
        return got
    llm.core.proposer.propose = recording
    llm.generate(ps, sp, use_tqdm=False)
    return seen
