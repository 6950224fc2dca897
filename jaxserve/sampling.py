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
        token_mask [S, ceil(V / 32)] i32 (the tokens each row may sample at all: `jaxserve.token_mask`),
        and the logit controls (`controlled`): logit_bias_ids, logit_bias, the penalties, past_tokens, prompt_len.
    """
    # Logprobs are those of the model's own distribution, before any sampling transform (as vLLM reports them).
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = controlled(masked(ban(logits, p), p.token_mask), p)
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


def controlled(logits, p):
    """vLLM v1's order after the mask and bans: logit_bias, then the penalties."""
    return penalized(biased(logits, p), p)


def biased(logits, p):
    """logits [S, V] plus each row's logit_bias [S, MAX_LOGIT_BIAS] at logit_bias_ids (padded with V); free where no
    row has one."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]
    return jax.lax.cond(jnp.any(p.logit_bias_ids < V),
                        lambda x: x.at[rows, p.logit_bias_ids].add(p.logit_bias, mode="drop"), lambda x: x, logits)


def penalized(logits, p):
    """vLLM's penalties on logits [S, V]: a token among the row's prompt and generated tokens has its logit divided
    by repetition_penalty if positive, multiplied if not (HF's rule); then minus frequency_penalty per time it was
    generated and presence_penalty once if it was (OpenAI's). Counted from past_tokens [S, H], which must hold the
    row's tokens up to its last (`with_step_tokens`); positions >= prompt_len are generated. Free where no row has
    a penalty, and a row without one keeps its logits bit for bit."""
    S, V = logits.shape
    uses = _uses_penalties(p)

    def apply(x):
        rows = jnp.arange(S)[:, None]
        generated = (jnp.arange(p.past_tokens.shape[1]) >= p.prompt_len[:, None]).astype(jnp.float32)  # [S, H]
        counts = jnp.zeros((S, V), jnp.float32).at[rows, p.past_tokens].add(generated, mode="drop")  # [S, V]
        seen = jnp.zeros((S, V), bool).at[rows, p.past_tokens].set(True, mode="drop")  # [S, V]: prompt or generated
        r = p.repetition_penalty[:, None]
        y = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
        y = y - p.frequency_penalty[:, None] * counts - p.presence_penalty[:, None] * (counts > 0)
        return jnp.where(uses[:, None], y, x)
    return jax.lax.cond(jnp.any(uses), apply, lambda x: x, logits)


def _uses_penalties(p):
    return (p.presence_penalty != 0) | (p.frequency_penalty != 0) | (p.repetition_penalty != 1)  # [S]


def with_step_tokens(p, tokens, rows, last_index):
    """p with what only the device knows of each row's tokens (a chained decode row's input is the token the step
    before sampled, `jaxserve.steps.input_tokens`): the step's new tokens written into past_tokens at their
    positions, for the penalties; and the bad words whose other tokens the row's last token completes (the host
    matched all but that one: `jaxserve.logit_controls`), their last token cleared from its token mask.
    tokens [T]: the step's; rows: its `jaxserve.batch.RaggedRows`; last_index [S]: each row's last token in tokens
    (-1: none). Each part is free where no row needs it."""
    S, H = p.past_tokens.shape
    W = p.token_mask.shape[1]

    def write(past):
        positions = jnp.where((rows.positions >= 0) & (rows.positions < H), rows.positions, H)  # padding: dropped
        return past.at[rows.token_row, positions].set(tokens, mode="drop")

    last = jnp.where(last_index >= 0, tokens[jnp.maximum(last_index, 0)], -1)  # [S]
    trigger, banned = p.bad_word_bans[..., 0], p.bad_word_bans[..., 1]  # [S, N]; padding: trigger vocab_size
    hit = trigger == last[:, None]  # [S, N]

    def ban(mask):
        word = jnp.where(hit, banned // 32, W)  # [S, N]; W: not banned, dropped
        bit = jnp.left_shift(jnp.uint32(1), (banned % 32).astype(jnp.uint32))
        # The host sends each (trigger, banned) once, so a row's bits to clear are distinct: their sum is their OR.
        cleared = jnp.zeros((S, W), jnp.uint32).at[jnp.arange(S)[:, None], word].add(bit, mode="drop")
        kept = jax.lax.bitcast_convert_type(mask, jnp.uint32) & ~cleared
        return jax.lax.bitcast_convert_type(kept, jnp.int32)

    past = jax.lax.cond(jnp.any(_uses_penalties(p)), write, lambda x: x, p.past_tokens)
    mask = jax.lax.cond(jnp.any(hit), ban, lambda x: x, p.token_mask)
    return dataclasses.replace(p, past_tokens=past, token_mask=mask)


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
