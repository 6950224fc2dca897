"""Prompt logprobs on device: the logprob (and rank, and the top MAX_LOGPROBS) of each prompt token under the
model's distribution at the position before it, for the tokens of a step that ask.

The ragged step computes logits only where a row samples; a prompt's every position needs the LM head too, which at
T = 2048 tokens and a 262k vocabulary would be a 2 GB [T, V] float32 array. So the tokens that ask are packed to the
front and the head runs over them in blocks of a fixed size, in a loop whose trip count is their number: a step
where nobody asks runs it zero times, and a step's memory for it is one block's logits, whatever T.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.batch import PromptScores
from jaxserve.sample.sampling import token_logprobs
from jaxserve.sampling_params import MAX_LOGPROBS

# Logits (float32 elements) one block of the loop holds: 64 MB.
BLOCK_ELEMENTS = 1 << 24


def block_size(num_tokens: int, vocab_size: int, block_elements: int = BLOCK_ELEMENTS) -> int:
    """Tokens per block: the largest power of two whose [block, V] logits fit block_elements, at most num_tokens."""
    b = 1
    while 2 * b <= min(num_tokens, block_elements // vocab_size):
        b *= 2
    return b


def score_targets(hidden, targets, want_top, score_block, vocab_size: int,
                  block_elements: int = BLOCK_ELEMENTS) -> PromptScores:
    """hidden [T, H]: the final hidden states (before the final norm); targets [T]: the token whose logprob each
    position reports (-1: none); want_top [T] bool: whether a position's top MAX_LOGPROBS are wanted too (a block
    where none is skips the top-k: its top ids and logprobs are zeros); score_block(h [B, H], (targets [B], want
    scalar bool)) -> (logprobs [B], ranks [B], top ids and logprobs [B, MAX_LOGPROBS]): `block_scores` of the head's
    logits (of each device's slice over a vocabulary-split head). Returns the scores packed (see
    `jaxserve.batch.PromptScores`)."""
    T = targets.shape[0]
    B = block_size(T, vocab_size, block_elements)
    # One block more than T needs, never used: were one block to span all of `order`, its slice would not depend on
    # the loop index, and XLA would hoist the block (head, log-softmax, top-k) out of the loop and run it every step,
    # whether a token asks or not (a 256-token step 5 s instead of 0.6 s on CPU). A cond around the loop avoids that
    # too, but costs a relayout of the head's weight on TPU.
    nb = -(-T // B) + 1
    if T == 1:
        # A gather from one row does not depend on its index, so the spare block would not keep the block in its
        # loop: XLA hoisted it (a log-softmax and a sort of the vocabulary) into every batch-1 decode step. A second
        # row, never read (the only real index is 0), makes the index matter.
        hidden = jnp.concatenate([hidden, jnp.zeros_like(hidden)])  # [2, H]
    want_top = want_top & (targets >= 0)
    wanted = targets >= 0
    order = jnp.nonzero(wanted, size=nb * B, fill_value=0)[0]  # [nb * B]: the asking tokens first, in order
    count = jnp.sum(wanted)
    num_blocks = (count + B - 1) // B

    def block(i, acc):
        idx = jax.lax.dynamic_slice(order, (i * B,), (B,))  # [B]
        # The last block's padding points at token 0: were token 0 to want its top-n, it must not make the block's.
        real = i * B + jnp.arange(B) < count  # [B]
        new = score_block(hidden[idx], (jnp.maximum(targets[idx], 0), jnp.any(want_top[idx] & real)))
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, x, i * B, axis=0) for a, x in zip(acc, new))

    acc = (jnp.zeros(nb * B, jnp.float32), jnp.zeros(nb * B, jnp.int32),
           jnp.zeros((nb * B, MAX_LOGPROBS), jnp.int32), jnp.zeros((nb * B, MAX_LOGPROBS), jnp.float32))
    logprobs, ranks, top_ids, top_logprobs = jax.lax.fori_loop(0, num_blocks, block, acc)
    return PromptScores(logprobs[:T], ranks[:T], top_ids[:T], top_logprobs[:T])


def block_scores(logits, asked, axis=None):
    """logits [B, V] float32, asked (targets [B], want_top: a scalar bool) -> (the targets' logprobs [B], ranks [B],
    top ids and logprobs [B, K]: zeros unless want_top, the top-k skipped: a scoring pass that reads only its
    prompt's own logprobs, `jaxserve.cascade.features`, pays for no top-k at each position). Over a mesh axis (in a
    shard_map) logits are this device's slice of the vocabulary: the devices exchange per-token scalars and their
    top K, never the [B, V] logits (`jaxserve.sample.sampling.token_logprobs`)."""
    targets, want_top = asked
    chosen, rank, top_ids, top_logprobs = token_logprobs(logits, targets, want_top, axis)
    return chosen, rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_logprobs
