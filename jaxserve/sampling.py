"""Sampling on device: one call turns a batch of logits into tokens (and logprobs) under per-row parameters."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
    """What sample() returns for S rows (a pytree: it leaves a jitted function as it is)."""
    tokens: jax.Array  # int32 [S]
    logprobs: jax.Array  # float32 [S]: each token's under the model's own distribution (raw log_softmax)
    ranks: jax.Array  # int32 [S]: 1 is the most likely token
    top_ids: jax.Array  # int32 [S, MAX_LOGPROBS] (zeros unless a row wants them)
    top_logprobs: jax.Array  # float32 [S, MAX_LOGPROBS] (zeros unless a row wants them)


def sample(logits, p) -> Sampled:
    """logits: [S, V] float32. p: a `jaxserve.batch.SamplingInput`, per-row arrays
        temperature [S] f32 (0: greedy), top_k [S] i32 (0: off), top_p [S] f32, min_p [S] f32,
        seed [S] u32, step [S] i32 (tokens generated so far; with seed it makes the draw reproducible),
        banned [S, B] i32 (token ids that may not be sampled while step < min_tokens [S]; padded with vocab_size),
        token_mask [S, ceil(V / 32)] i32 (the tokens each row may sample at all: `jaxserve.token_mask`).
    """
    # Logprobs are those of the model's own distribution, before any sampling transform (as vLLM reports them).
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = masked(ban(logits, p), p.token_mask)
    greedy = first_argmax(logits)

    sampled = jax.lax.cond(jnp.any(p.temperature > 0), _sample_rows, lambda x, p: greedy, logits, p)
    tokens = jnp.where(p.temperature == 0, greedy, sampled).astype(jnp.int32)
    return Sampled(tokens, *token_logprobs(logprobs, tokens, p.want_top_logprobs))


def ban(logits, p):
    """logits [S, V] with each row's banned ids at -inf while its step < min_tokens."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]
    banned = jnp.where((p.step < p.min_tokens)[:, None], p.banned, V)
    return logits.at[rows, banned].set(-jnp.inf, mode="drop")


def masked(logits, token_mask):
    """logits [S, V] at -inf where a row's token_mask [S, ceil(V / 32)] forbids the token; free where no row has a
    mask (every word -1: the usual batch, whose unpacking is skipped)."""
    S, V = logits.shape

    def apply(x):
        bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]; -1 >> j is -1
        return jnp.where(bits.reshape(S, -1)[:, :V] == 1, x, -jnp.inf)
    return jax.lax.cond(jnp.any(token_mask != -1), apply, lambda x: x, logits)


def token_logprobs(logprobs, tokens, want_top_logprobs):
    """logprobs [S, V] (log_softmax), tokens [S] -> (the tokens' logprobs [S], ranks [S], the top MAX_LOGPROBS ids
    and logprobs [S, MAX_LOGPROBS]) (zeros unless a row wants them: the sort is skipped)."""
    S = logprobs.shape[0]
    top_logprobs, top_ids = jax.lax.cond(
        jnp.any(want_top_logprobs),
        lambda lp: tuple(jax.lax.top_k(lp, MAX_LOGPROBS)),
        lambda lp: (jnp.zeros((S, MAX_LOGPROBS), lp.dtype), jnp.zeros((S, MAX_LOGPROBS), jnp.int32)),
        logprobs)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)  # [S, 1]
    return chosen[:, 0], 1 + jnp.sum(logprobs > chosen, axis=-1), top_ids, top_logprobs


def _sample_rows(logits, p):
    return draw(processed_probs(logits, p), step_keys(p.seed, p.step))


def processed_probs(logits, p):
    """The distribution a sampled row draws from: logits [S, V] (banned already) through temperature, top-k,
    top-p and min-p. [S, V], not normalised: min-p zeroes tokens without renormalising (the draw scales its
    uniform by the sum instead)."""
    return filtered_probs(filtered_logits(logits, p), p.min_p)


def filtered_logits(logits, p):
    """logits [S, V] at the row's temperature, all but its top-k and top-p at -inf."""
    x = logits / jnp.maximum(p.temperature, 1e-6)[:, None]
    needs_sort = jnp.any((p.top_k > 0) | (p.top_p < 1.0))
    return jax.lax.cond(needs_sort, _top_k_top_p, lambda x, k, tp: x, x, p.top_k, p.top_p)


def filtered_probs(x, min_p):
    """softmax(x [S, V]) with the tokens under min_p [S] times the most likely one's probability at 0."""
    probs = jax.nn.softmax(x, axis=-1)
    return jnp.where(probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), probs, 0.0)


def step_keys(seed, step):
    """The key of each row's draw of its generated token number `step`: seed [S] u32, step [S] i32 -> keys [S].
    A draft model's proposal for that token is drawn with the same key (see `jaxserve.verification`)."""
    return jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(seed, step)


def draw(probs, keys):
    """One token per row from probs [S, V] (unnormalised), with keys [S]."""
    # Inverse-CDF draw: one uniform number per row (Gumbel noise over the vocabulary costs a random number per
    # token, which dominated small decode steps on CPU).
    u = jax.vmap(lambda key: jax.random.uniform(key))(keys) * probs.sum(axis=-1)
    return inverse_cdf(probs, u)


def first_argmax(x):
    """argmax over the last axis (the first index on ties), as two plain reductions: XLA:CPU's argmax (one
    reduction over value-index pairs) took 7 ms on [64, 49152] where these take 2.6."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == m, jnp.arange(x.shape[-1]), x.shape[-1]), axis=-1)


def inverse_cdf(probs, u, block: int = 256):
    """The first index whose cumulative probability exceeds u: probs [S, V] (unnormalised), u [S] in [0, sum).

    Two levels (a cumulative sum over blocks of `block` tokens, then inside the one block holding u) instead of a
    cumulative sum over the whole vocabulary, which XLA:CPU computes slowly: 0.4 ms against 18 ms on [64, 49152].
    """
    S, V = probs.shape
    nb = -(-V // block)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * block - V))).reshape(S, nb, block)  # [S, nb, block]
    sums = blocks.sum(axis=-1)  # [S, nb]
    cum = jnp.cumsum(sums, axis=-1)
    j = jnp.minimum(jnp.sum(cum <= u[:, None], axis=-1), nb - 1)  # [S]: the block holding the draw
    before = jnp.take_along_axis(cum - sums, j[:, None], axis=1)  # [S, 1]: mass of the blocks before it
    inner = before + jnp.cumsum(jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0], axis=-1)  # [S, block]
    return jnp.minimum(j * block + jnp.sum(inner <= u[:, None], axis=-1), V - 1)


def _top_k_top_p(x, top_k, top_p):
    """Mask all but the top-k, then all but the smallest set whose probability reaches top_p (as vLLM orders them).

    Each cut is a threshold found by bisection over the bits of the values (32 passes of a compare and a sum over
    the vocabulary), not by sorting it: on [64, 49152] XLA:CPU takes ~45 ms for both cuts against ~510 ms to sort,
    and a verification step has k + 1 such rows per sequence.
    """
    V = x.shape[-1]
    keys = _order_keys(x)  # uint32 [S, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    # The k-th largest value: the largest threshold that still keeps k tokens (ties with it are kept too).
    x = jnp.where(keys >= _largest_threshold(keys, lambda kept: jnp.sum(kept, axis=-1) >= k)[:, None], x, -jnp.inf)
    probs = jax.nn.softmax(x, axis=-1)  # [S, V], over the top-k
    # The smallest value of the smallest set reaching top_p: the largest threshold whose kept mass reaches it.
    cut = _largest_threshold(keys, lambda kept: jnp.sum(jnp.where(kept, probs, 0.0), axis=-1) >= top_p)
    cut = jnp.where(top_p < 1.0, cut, 0)  # top_p = 1 keeps all, whatever rounding does to the total
    return jnp.where(keys >= cut[:, None], x, -jnp.inf)


def _order_keys(x):
    """float32 [S, V] -> uint32 [S, V] in the same order (the IEEE bits; a negative's are flipped)."""
    bits = jax.lax.bitcast_convert_type(x + 0.0, jnp.uint32)  # + 0.0: -0.0 becomes 0.0, its equal
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys, holds):
    """Per row, the largest t (uint32 [S]) for which holds(keys >= t) [S] is true, given it is true at 0 and
    stays false once false as t grows: set from the highest bit down."""
    def try_bit(b, t):
        candidate = t | jnp.left_shift(jnp.uint32(1), (31 - b).astype(jnp.uint32))
        return jnp.where(holds(keys >= candidate[:, None]), candidate, t)
    return jax.lax.fori_loop(0, 32, try_bit, jnp.zeros(keys.shape[0], jnp.uint32))
