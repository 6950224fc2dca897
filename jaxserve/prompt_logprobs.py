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
from jaxserve.sampling_params import MAX_LOGPROBS

# Logits (float32 elements) one block of the loop holds: 64 MB.
BLOCK_ELEMENTS = 1 << 24


def block_size(num_tokens: int, vocab_size: int, block_elements: int = BLOCK_ELEMENTS) -> int:
    """Tokens per block: the largest power of two whose [block, V] logits fit block_elements, at most num_tokens."""
    b = 1
    while 2 * b <= min(num_tokens, block_elements // vocab_size):
        b *= 2
    return b


def score_targets(hidden, targets, head, vocab_size: int, block_elements: int = BLOCK_ELEMENTS) -> PromptScores:
    """hidden [T, H]: the final hidden states (before the final norm); targets [T]: the token whose logprob each
    position reports (-1: none); head(h [B, H]) -> logits [B, V] float32. Returns the scores packed (see
    `jaxserve.batch.PromptScores`)."""
    T = targets.shape[0]
    B = block_size(T, vocab_size, block_elements)
    nb = -(-T // B)
    wanted = targets >= 0
    order = jnp.nonzero(wanted, size=nb * B, fill_value=0)[0]  # [nb * B]: the asking tokens first, in order
    num_blocks = (jnp.sum(wanted) + B - 1) // B

    def block(i, acc):
        idx = jax.lax.dynamic_slice(order, (i * B,), (B,))  # [B]
        logprobs = jax.nn.log_softmax(head(hidden[idx]), axis=-1)  # [B, V]
        target = jnp.maximum(targets[idx], 0)
        chosen = jnp.take_along_axis(logprobs, target[:, None], axis=1)  # [B, 1]
        rank = 1 + jnp.sum(logprobs > chosen, axis=-1)  # [B]
        top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)  # [B, K]
        new = (chosen[:, 0], rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_logprobs)
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, x, i * B, axis=0) for a, x in zip(acc, new))

    acc = (jnp.zeros(nb * B, jnp.float32), jnp.zeros(nb * B, jnp.int32),
           jnp.zeros((nb * B, MAX_LOGPROBS), jnp.int32), jnp.zeros((nb * B, MAX_LOGPROBS), jnp.float32))
    logprobs, ranks, top_ids, top_logprobs = jax.lax.fori_loop(0, num_blocks, block, acc)
    return PromptScores(logprobs[:T], ranks[:T], top_ids[:T], top_logprobs[:T])
