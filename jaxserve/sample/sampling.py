"""Sampling on device: one call turns a batch of logits into tokens (and logprobs) under per-row parameters.

Every function that reads the vocabulary takes an optional mesh axis name `axis`: given one, it runs inside a
shard_map on this device's slice [S, V / n] of logits split by vocabulary over that axis (the LM head's split:
`jaxserve.parallel.mesh.sample_over_vocab`), each token's controls apply to its own slice, and the devices exchange
only per-row values (maxima, counts and sums of the threshold searches, each device's probability mass, the token
drawn, their top MAX_LOGPROBS), never the logits. Without one (None) nothing changes: one device's whole rows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sample.penalty_counts import counted, row_counts
from jaxserve.sampling_params import MAX_LOGPROBS

# The token a row "samples" when its masks and bans leave it none (a grammar's next-token set disjoint from
# allowed_token_ids, EOS-only after min_tokens' ban, a grammar that failed): not a token id, so the host ends the
# sequence with finish reason "error" and takes nothing (`jaxserve.batching.output_processor`). -1 also stays a
# harmless index where the device reads it before the host does (a chained row's embedding, last_tokens).
NO_TOKEN = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
    """What sample() returns for S rows (a pytree: it leaves a jitted function as it is)."""
    tokens: jax.Array  # int32 [S] (NO_TOKEN where a row's masks and bans allow no token)
    logprobs: jax.Array  # float32 [S]: each token's under the model's own distribution (raw log_softmax)
    ranks: jax.Array  # int32 [S]: 1 is the most likely token
    top_ids: jax.Array  # int32 [S, MAX_LOGPROBS] (zeros unless a row wants them)
    top_logprobs: jax.Array  # float32 [S, MAX_LOGPROBS] (zeros unless a row wants them)


def skipped_sample(S: int) -> Sampled:
    """What S rows that sample nothing give (the first half of a split step: `jaxserve.runner.steps`): zeros."""
    return Sampled(tokens=jnp.zeros(S, jnp.int32), logprobs=jnp.zeros(S, jnp.float32), ranks=jnp.zeros(S, jnp.int32),
                   top_ids=jnp.zeros((S, MAX_LOGPROBS), jnp.int32),
                   top_logprobs=jnp.zeros((S, MAX_LOGPROBS), jnp.float32))


def sample(logits, p, axis: str | None = None) -> Sampled:
    """logits: [S, V] float32 (this device's [S, V / n] slice with a mesh axis: see the module's doc). p: a
    `jaxserve.batch.SamplingInput`, per-row arrays
        temperature [S] f32 (0: greedy), top_k [S] i32 (0: off), top_p [S] f32, min_p [S] f32,
        seed [S] u32, step [S] i32 (tokens generated so far; with seed it makes the draw reproducible),
        banned [S, B] i32 (token ids that may not be sampled while step < min_tokens [S]; padded with vocab_size),
        token_mask [S, ceil(V / 32)] i32 (the tokens each row may sample at all: `jaxserve.sample.token_mask`),
        and the logit controls (`controlled`): logit_bias_ids, logit_bias, the penalties, past_tokens, prompt_len.
    The result is the same on every device of the axis; a row whose masks and bans leave no token gets NO_TOKEN.
    """
    # Logprobs are those of the model's own distribution, before any sampling transform (as vLLM reports them).
    raw = logits
    logits = controlled(masked(ban(logits, p, axis), p.token_mask, axis), p, axis)
    # A row that may sample nothing is all -inf here (a bias or a penalty leaves -inf as it is), so its maximum,
    # which the greedy argmax needs anyway, says so. Found on device, not on the host where the grammar masks are
    # built: only the device sees every source of the mask together (min_tokens' ban and a bad word's ban depend
    # on a token that may still be in flight), and the answer rides back in the step's one existing copy (the
    # token itself), so it costs no device->host sync and no extra pass over the vocabulary.
    top = _max(logits, axis)  # [S, 1]
    greedy = first_argmax(logits, axis, top)

    sampled = jax.lax.cond(jnp.any(p.temperature > 0), lambda x, p: _sample_rows(x, p, axis), lambda x, p: greedy,
                           logits, p)
    empty = top[:, 0] == -jnp.inf
    # An empty row's draw is noise (probabilities of 0 / 0): token 0's logprob stands in, the same on every device.
    tokens = jnp.where(empty | (p.temperature == 0), greedy, sampled).astype(jnp.int32)
    # The draw's three reductions (u scaled by the total, the block by block sums, the place in the block by a
    # cumulative sum) round apart: a u within an ulp of a block's end may land on the next block's first token (or
    # the vocabulary's last), which can be one the masks forbid. Such a draw takes the greedy token instead.
    tokens = jnp.where(_at(logits, tokens, axis) == -jnp.inf, greedy, tokens)
    return Sampled(jnp.where(empty, NO_TOKEN, tokens), *token_logprobs(raw, tokens, p.want_top_logprobs, axis))


# The vocabulary split over a mesh axis (see the module's doc): V is always the local slice's size.
def _offset(V, axis):
    """The token id of this device's first logit."""
    return 0 if axis is None else jax.lax.axis_index(axis) * V


def _vocab_size(V, axis):
    return V if axis is None else V * jax.lax.axis_size(axis)


def _local_ids(ids, V, axis):
    """Token ids -> their index in this device's slice; V (dropped by a scatter's mode="drop") where another
    device holds them."""
    if axis is None:
        return ids
    local = ids - _offset(V, axis)
    return jnp.where((local >= 0) & (local < V), local, V)


def _sum(x, axis):
    """The sum over the (whole) vocabulary: x [S, V] -> [S]."""
    total = jnp.sum(x, axis=-1)
    return total if axis is None else jax.lax.psum(total, axis)


def _max(x, axis):
    """The max over the (whole) vocabulary: x [S, V] -> [S, 1]."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return m if axis is None else jax.lax.pmax(m, axis)


def _softmax(x, axis):
    if axis is None:
        return jax.nn.softmax(x, axis=-1)
    e = jnp.exp(x - _max(x, axis))
    return e / _sum(e, axis)[:, None]


def ban(logits, p, axis=None):
    """logits [S, V] with each row's banned ids at -inf while its step < min_tokens."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]
    banned = jnp.where((p.step < p.min_tokens)[:, None], p.banned, _vocab_size(V, axis))
    return logits.at[rows, _local_ids(banned, V, axis)].set(-jnp.inf, mode="drop")


def masked(logits, token_mask, axis=None):
    """logits [S, V] at -inf where a row's token_mask [S, ceil(vocab / 32)] forbids the token; free where no row has a
    mask (every word -1: the usual batch, whose unpacking is skipped)."""
    S, V = logits.shape

    def apply(x):
        bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]; -1 >> j is -1
        mine = jax.lax.dynamic_slice_in_dim(bits.reshape(S, -1), _offset(V, axis), V, axis=1)  # [S, V]
        return jnp.where(mine == 1, x, -jnp.inf)
    return jax.lax.cond(jnp.any(token_mask != -1), apply, lambda x: x, logits)


def controlled(logits, p, axis=None):
    """vLLM v1's order after the mask and bans: logit_bias, then the penalties."""
    return penalized(biased(logits, p, axis), p, axis)


def biased(logits, p, axis=None):
    """logits [S, V] plus each row's logit_bias [S, MAX_LOGIT_BIAS] at logit_bias_ids (padded with the vocabulary
    size); free where no row has one."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]
    ids = _local_ids(p.logit_bias_ids, V, axis)
    return jax.lax.cond(jnp.any(p.logit_bias_ids < _vocab_size(V, axis)),
                        lambda x: x.at[rows, ids].add(p.logit_bias, mode="drop"), lambda x: x, logits)


def penalized(logits, p, axis=None):
    """vLLM's penalties on logits [S, V]: a token among the row's prompt and generated tokens has its logit divided
    by repetition_penalty if positive, multiplied if not (HF's rule); then minus frequency_penalty per time it was
    generated and presence_penalty once if it was (OpenAI's). Counted from the device's counts per slot
    (p.penalty_state, `jaxserve.sample.penalty_counts`) where the runner keeps them, else from past_tokens [S, H],
    which must hold the row's tokens up to its last (`with_step_tokens`); positions >= prompt_len are generated.
    Free where no row has a penalty, and a row without one keeps its logits bit for bit."""
    S, V = logits.shape
    uses = _uses_penalties(p)

    def from_history(x):
        rows = jnp.arange(S)[:, None]
        generated = (jnp.arange(p.past_tokens.shape[1]) >= p.prompt_len[:, None]).astype(jnp.float32)  # [S, H]
        past = _local_ids(p.past_tokens, V, axis)  # [S, H]
        counts = jnp.zeros((S, V), jnp.float32).at[rows, past].add(generated, mode="drop")  # [S, V]
        return counts, jnp.zeros((S, V), bool).at[rows, past].set(True, mode="drop")  # [S, V]: prompt or generated

    def apply(x):
        if p.penalty_state is None:
            counts, seen = from_history(x)
        else:  # kept on device per slot: no history to count, but for a row without a slot (made by hand)
            counts, seen = row_counts(p.penalty_state, p.penalty_slot, _offset(V, axis), V)
            slotless = uses & (p.penalty_slot < 0)  # [S]
            hc, hs = jax.lax.cond(jnp.any(slotless), from_history,
                                  lambda x: (jnp.zeros((S, V), jnp.float32), jnp.zeros((S, V), bool)), x)
            counts, seen = counts + hc, seen | hs  # a slotless row's kept counts are zeros
        r = p.repetition_penalty[:, None]
        y = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
        y = y - p.frequency_penalty[:, None] * counts - p.presence_penalty[:, None] * (counts > 0)
        return jnp.where(uses[:, None], y, x)
    return jax.lax.cond(jnp.any(uses), apply, lambda x: x, logits)


def _uses_penalties(p):
    return (p.presence_penalty != 0) | (p.frequency_penalty != 0) | (p.repetition_penalty != 1)  # [S]


def last_input_tokens(tokens, last_index):
    """Each row's last input token [S] (-1: none) of the step's tokens [T]; last_index [S] (-1: none)."""
    return jnp.where(last_index >= 0, tokens[jnp.maximum(last_index, 0)], -1)


def with_words_banned(p, last):
    """p.token_mask [S, W] less the last token of each bad word whose other tokens the row's last token `last` [S]
    completes (the host matched all but that one: `jaxserve.sample.logit_controls`); free where none does."""
    S, W = p.token_mask.shape
    trigger, banned = p.bad_word_bans[..., 0], p.bad_word_bans[..., 1]  # [S, N]; padding: trigger vocab_size
    hit = trigger == last[:, None]  # [S, N]

    def ban(mask):
        word = jnp.where(hit, banned // 32, W)  # [S, N]; W: not banned, dropped
        bit = jnp.left_shift(jnp.uint32(1), (banned % 32).astype(jnp.uint32))
        # The host sends each (trigger, banned) once, so a row's bits to clear are distinct: their sum is their OR.
        cleared = jnp.zeros((S, W), jnp.uint32).at[jnp.arange(S)[:, None], word].add(bit, mode="drop")
        kept = jax.lax.bitcast_convert_type(mask, jnp.uint32) & ~cleared
        return jax.lax.bitcast_convert_type(kept, jnp.int32)

    return jax.lax.cond(jnp.any(hit), ban, lambda x: x, p.token_mask)


def with_step_tokens(p, tokens, rows, last_index):
    """p with what only the device knows of each row's tokens (a chained decode row's input is the token the step
    before sampled, `jaxserve.runner.steps.input_tokens`): the step's new tokens written into past_tokens at their
    positions, for the penalties (or, where the device keeps their counts, p.penalty_state: counted into each row's
    slot, `jaxserve.sample.penalty_counts.counted`); and the bad words whose other tokens the row's last token
    completes (the host matched all but that one: `jaxserve.sample.logit_controls`), their last token cleared from
    its token mask.
    tokens [T]: the step's; rows: its `jaxserve.batch.RaggedRows`; last_index [S]: each row's last token in tokens
    (-1: none). Each part is free where no row needs it."""
    S, H = p.past_tokens.shape

    def write(past):
        positions = jnp.where((rows.positions >= 0) & (rows.positions < H), rows.positions, H)  # padding: dropped
        return past.at[rows.token_row, positions].set(tokens, mode="drop")

    mask = with_words_banned(p, last_input_tokens(tokens, last_index))
    uses = _uses_penalties(p)
    if p.penalty_state is not None:  # the slots' counts take the step's tokens; a row without a slot, its history
        state = counted(p.penalty_state, p, tokens, rows, uses)
        past = jax.lax.cond(jnp.any(uses & (p.penalty_slot < 0)), write, lambda x: x, p.past_tokens)
        return dataclasses.replace(p, penalty_state=state, past_tokens=past, token_mask=mask)
    past = jax.lax.cond(jnp.any(uses), write, lambda x: x, p.past_tokens)
    return dataclasses.replace(p, past_tokens=past, token_mask=mask)


def token_logprobs(logits, tokens, want_top_logprobs, axis=None):
    """logits [S, V] (finite), tokens [S] -> (the tokens' logprobs under log_softmax(logits) [S], ranks [S], the top
    MAX_LOGPROBS ids and logprobs [S, MAX_LOGPROBS]) (zeros unless a row wants them: the sort is skipped).

    Each logprob is its logit less the row's logsumexp: no [S, V] array of logprobs is made (XLA:CPU wrote one out
    at every step, ~5 ms of a 64-row step over a 49k vocabulary), and a rank compares logits, as log_softmax keeps
    their order."""
    S, V = logits.shape
    m = _max(logits, axis)  # [S, 1]
    lse = m[:, 0] + jnp.log(_sum(jnp.exp(logits - m), axis))  # [S]

    def top(x):  # the top logits are the top logprobs
        values, ids = _top_logprobs(x, axis)
        return values - lse[:, None], ids

    top_logprobs, top_ids = jax.lax.cond(
        jnp.any(want_top_logprobs), top,
        lambda x: (jnp.zeros((S, MAX_LOGPROBS), x.dtype), jnp.zeros((S, MAX_LOGPROBS), jnp.int32)),
        logits)
    picked = _at(logits, tokens, axis)  # [S]
    return picked - lse, 1 + _sum(logits > picked[:, None], axis), top_ids, top_logprobs


def _at(x, tokens, axis=None):
    """x [S, V] at each row's token [S] (over a mesh axis: from the device that holds it, the others adding 0)."""
    if axis is None:
        return jnp.take_along_axis(x, tokens[:, None], axis=1)[:, 0]
    V = x.shape[-1]
    local = _local_ids(tokens, V, axis)
    picked = jnp.take_along_axis(x, jnp.minimum(local, V - 1)[:, None], axis=1)[:, 0]  # [S]
    return jax.lax.psum(jnp.where(local < V, picked, 0.0), axis)


def _top_logprobs(logprobs, axis):
    """The top MAX_LOGPROBS (values [S, K], ids [S, K]) of logprobs [S, V] (or of the logits: the same order, less
    each row's logsumexp): over a mesh axis, each device's own top
    K, gathered in vocabulary order and cut again (top_k keeps the first of equals, so ties go to the lower id as on
    one device)."""
    if axis is None:
        return tuple(jax.lax.top_k(logprobs, MAX_LOGPROBS))
    values, ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logprobs.shape[-1]))
    values = jax.lax.all_gather(values, axis, axis=1, tiled=True)  # [S, n * K]
    ids = jax.lax.all_gather(ids + _offset(logprobs.shape[-1], axis), axis, axis=1, tiled=True)
    values, j = jax.lax.top_k(values, MAX_LOGPROBS)
    return values, jnp.take_along_axis(ids, j, axis=1)


def _sample_rows(logits, p, axis=None):
    return draw(processed_probs(logits, p, axis), step_keys(p.seed, p.step), axis)


def processed_probs(logits, p, axis=None):
    """The distribution a sampled row draws from: logits [S, V] (banned already) through temperature, top-k,
    top-p and min-p. [S, V], not normalised: min-p zeroes tokens without renormalising (the draw scales its
    uniform by the sum instead)."""
    return filtered_probs(filtered_logits(logits, p, axis), p.min_p, axis)


def filtered_logits(logits, p, axis=None):
    """logits [S, V] at the row's temperature, all but its top-k and top-p at -inf."""
    x = logits / jnp.maximum(p.temperature, 1e-6)[:, None]
    needs_sort = jnp.any((p.top_k > 0) | (p.top_p < 1.0))
    return jax.lax.cond(needs_sort, lambda x, k, tp: _top_k_top_p(x, k, tp, axis), lambda x, k, tp: x,
                        x, p.top_k, p.top_p)


def filtered_probs(x, min_p, axis=None):
    """softmax(x [S, V]) with the tokens under min_p [S] times the most likely one's probability at 0."""
    probs = _softmax(x, axis)
    return jnp.where(probs >= min_p[:, None] * _max(probs, axis), probs, 0.0)


def step_keys(seed, step):
    """The key of each row's draw of its generated token number `step`: seed [S] u32, step [S] i32 -> keys [S].
    A draft model's proposal for that token is drawn with the same key (see `jaxserve.sample.verification`)."""
    return jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(seed, step)


def draw(probs, keys, axis=None):
    """One token per row from probs [S, V] (unnormalised), with keys [S]."""
    # Inverse-CDF draw: one uniform number per row (Gumbel noise over the vocabulary costs a random number per
    # token, which dominated small decode steps on CPU).
    u = jax.vmap(lambda key: jax.random.uniform(key))(keys) * _sum(probs, axis)
    return inverse_cdf(probs, u, axis=axis)


def first_argmax(x, axis=None, m=None):
    """argmax over the last axis (the first index on ties), as two plain reductions: XLA:CPU's argmax (one
    reduction over value-index pairs) took 7 ms on [S, V] = [64, 49152] where these take 2.6. Over a mesh axis
    ([S, V] slices): the lowest id among every device's first. m: x's maximum [S, 1] where the caller has it."""
    V = x.shape[-1]
    m = _max(x, axis) if m is None else m
    first = jnp.min(jnp.where(x == m, jnp.arange(V) + _offset(V, axis), _vocab_size(V, axis)), axis=-1)
    return first if axis is None else jax.lax.pmin(first, axis)


def inverse_cdf(probs, u, block: int = 256, axis=None):
    """The first index whose cumulative probability exceeds u: probs [S, V] (unnormalised), u [S] in [0, sum).

    Two levels (a cumulative sum over blocks of `block` tokens, then inside the one block holding u) instead of a
    cumulative sum over the whole vocabulary, which XLA:CPU computes slowly: 0.4 ms against 18 ms on [64, 49152].
    Over a mesh axis, one more level above them: the devices' masses (gathered, [S, n]) pick the device holding u,
    which draws from its own slice.
    """
    S, V = probs.shape
    if axis is not None:
        sums = jax.lax.all_gather(jnp.sum(probs, axis=-1), axis, axis=1)  # [S, n]
        cum = jnp.cumsum(sums, axis=-1)
        d = jnp.minimum(jnp.sum(cum <= u[:, None], axis=-1), sums.shape[1] - 1)  # [S]: the device holding the draw
        # [S]: the mass of the devices before it, at most u (so the device's own u is never negative)
        before = jnp.take_along_axis(jnp.pad(cum, ((0, 0), (1, 0))), d[:, None], axis=1)[:, 0]
        mine = d == jax.lax.axis_index(axis)
        token = inverse_cdf(probs, u - before, block) + _offset(V, axis)
        return jax.lax.psum(jnp.where(mine, token, 0), axis)
    nb = -(-V // block)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * block - V))).reshape(S, nb, block)  # [S, nb, block]
    sums = blocks.sum(axis=-1)  # [S, nb]
    cum = jnp.cumsum(sums, axis=-1)
    j = jnp.minimum(jnp.sum(cum <= u[:, None], axis=-1), nb - 1)  # [S]: the block holding the draw
    before = jnp.take_along_axis(cum - sums, j[:, None], axis=1)  # [S, 1]: mass of the blocks before it
    inner = before + jnp.cumsum(jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0], axis=-1)  # [S, block]
    return jnp.minimum(j * block + jnp.sum(inner <= u[:, None], axis=-1), V - 1)


def _top_k_top_p(x, top_k, top_p, axis=None):
    """Mask all but the top-k, then all but the smallest set whose probability reaches top_p (as vLLM orders them).

    Each cut is a threshold found by bisection over the bits of the values (32 passes of a compare and a sum over
    the vocabulary), not by sorting it: on [64, 49152] XLA:CPU takes ~45 ms for both cuts against ~510 ms to sort,
    and a verification step has k + 1 such rows per sequence.
    """
    V = _vocab_size(x.shape[-1], axis)
    keys = _order_keys(x)  # uint32 [S, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    # The k-th largest value: the largest threshold that still keeps k tokens (ties with it are kept too).
    x = jnp.where(keys >= _largest_threshold(keys, lambda kept: _sum(kept, axis) >= k)[:, None], x, -jnp.inf)
    probs = _softmax(x, axis)  # [S, V], over the top-k
    # The smallest value of the smallest set reaching top_p: the largest threshold whose kept mass reaches it.
    cut = _largest_threshold(keys, lambda kept: _sum(jnp.where(kept, probs, 0.0), axis) >= top_p)
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
