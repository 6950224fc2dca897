"""Speculative verification on device: a row's k proposals, scored by the target in one step, accepted or not so
that the emitted tokens follow the target's own distribution exactly; beside `jaxserve.sampling.sample`.

Greedy rows accept a proposal while it is the target's argmax. Sampled rows use rejection sampling (Leviathan et
al. 2023; Chen et al. 2023): accept proposal x ~ q with probability min(1, p(x) / q(x)); on the first rejection
emit a draw from normalize(max(p - q, 0)) and stop; when every proposal is accepted emit a bonus draw from p.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sampling import ban, draw, filtered_logits, filtered_probs, first_argmax, step_keys, token_logprobs

# Folded into a position's key for its acceptance uniform: the position's own key is kept for its draw, which must
# be sample()'s draw for that step.
ACCEPT_STREAM = 1


def verify(logits, draft_tokens, num_draft, draft_probs, p):
    """logits: float32 [S, Q, V], the target's logits at a row's Q = K + 1 scored positions: position j predicts
    the row's generated token number p.step + j (position j > 0 assumes the proposals before it).
    draft_tokens: int32 [S, K] proposals (ignored where j >= num_draft).
    num_draft: int32 [S] in [0, K]; 0 is a plain row: exactly sample(logits[:, 0], p), random numbers included.
    draft_probs: float32 [S, K, V] or None: the (not necessarily normalised) distribution each proposal was drawn
        from, processed as sample() processes the target's; None: one-hot at draft_tokens (n-gram proposals, a
        greedy draft). The draft must draw with keys of its own, not `step_keys`: a proposal drawn with the
        uniform that corrects it would bias the correction.
    p: a `jaxserve.batch.SamplingInput` of S rows (step: the generated token number of position 0).

    Returns a dict of tokens int32 [S, Q] (the emitted ones first; junk after num_tokens), num_tokens int32 [S]
    (accepted + 1, in [1, num_draft + 1]), logprobs float32 [S, Q] and ranks int32 [S, Q] of each token under the
    target's raw log_softmax at its position, top_ids int32 [S, Q, MAX_LOGPROBS] and top_logprobs [S, Q,
    MAX_LOGPROBS] (zeros unless a row wants them), as sample() reports them.
    """
    S, Q, V = logits.shape
    K = Q - 1
    draft = jnp.clip(draft_tokens, 0, V - 1)  # [S, K]: junk past num_draft must still index safely
    pos = per_position(p, Q)  # S * Q rows, position j of row s at s * Q + j
    flat = logits.reshape(S * Q, V)
    logprobs = jax.nn.log_softmax(flat, axis=-1)  # [S * Q, V]
    banned = ban(flat, pos)  # [S * Q, V]: the ban decided per position, from its own generated token number
    greedy = first_argmax(banned).reshape(S, Q)

    accepted = _leading(greedy[:, :K] == draft, num_draft)  # [S]
    greedy_final = jnp.take_along_axis(greedy, accepted[:, None], axis=1)[:, 0]  # [S]
    sampled = lambda: _verify_sampled(banned.reshape(S, Q, V), draft, num_draft, draft_probs, p)
    accepted_s, final_s = jax.lax.cond(jnp.any(p.temperature > 0), sampled, lambda: (accepted, greedy_final))
    accepted = jnp.where(p.temperature == 0, accepted, accepted_s)  # [S]
    final = jnp.where(p.temperature == 0, greedy_final, final_s)  # [S]

    # A greedy row's accepted proposals are its argmaxes, so one rule serves both kinds of row.
    j = jnp.arange(Q)[None, :]
    proposals = jnp.pad(draft, ((0, 0), (0, 1)))  # [S, Q]
    tokens = jnp.where(j < accepted[:, None], proposals, final[:, None]).astype(jnp.int32)  # [S, Q]
    out = token_logprobs(logprobs, tokens.reshape(S * Q), pos.want_top_logprobs)
    out = {k: v.reshape(S, Q, *v.shape[1:]) for k, v in out.items()}
    return {"tokens": tokens, "num_tokens": (accepted + 1).astype(jnp.int32), **out}


def per_position(p, Q):
    """p of S rows as S * Q rows, one per scored position, each with its own generated token number."""
    flat = jax.tree.map(lambda a: jnp.repeat(a, Q, axis=0), p)
    step = (p.step[:, None] + jnp.arange(Q, dtype=p.step.dtype)[None, :]).reshape(-1)  # [S * Q]
    return dataclasses.replace(flat, step=step)


def _leading(ok, num_draft):
    """How many of the first num_draft [S] entries of ok [S, K] hold before the first that fails: [S]."""
    ok = ok & (jnp.arange(ok.shape[1])[None, :] < num_draft[:, None])
    return jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)


def _verify_sampled(logits, draft, num_draft, draft_probs, p):
    """logits [S, Q, V] banned. Returns accepted [S] (proposals kept) and the token drawn at that position [S]."""
    S, Q, V = logits.shape
    K = Q - 1
    pos = per_position(p, Q)
    x = filtered_logits(logits.reshape(S * Q, V), pos).reshape(S, Q, V)
    probs = filtered_probs(x.reshape(S * Q, V), pos.min_p).reshape(S, Q, V)  # unnormalised
    total = probs.sum(axis=-1)  # [S, Q]
    keys = step_keys(pos.seed, pos.step).reshape(S, Q)

    p_x = jnp.take_along_axis(probs[:, :K], draft[..., None], axis=2)[..., 0] / total[:, :K]  # [S, K]
    q_x = 1.0 if draft_probs is None else _prob_of(draft_probs, draft)  # [S, K]
    accept_keys = jax.vmap(lambda key: jax.random.fold_in(key, ACCEPT_STREAM))(keys[:, :K].reshape(-1))
    u = jax.vmap(lambda key: jax.random.uniform(key))(accept_keys).reshape(S, K)
    accepted = _leading(_accept(u, p_x, q_x), num_draft)  # [S]

    # Only S * K probabilities and the sums are needed at every position; the one where the row draws gets its
    # whole distribution, computed on [S, V] as sample() computes it.
    p_m = filtered_probs(jnp.take_along_axis(x, accepted[:, None, None], axis=1)[:, 0], p.min_p)  # [S, V]
    key_m = jnp.take_along_axis(keys, accepted[:, None], axis=1)[:, 0]  # [S]: sample()'s key for that step
    if K == 0:
        return accepted, draw(p_m, key_m)
    at = jnp.minimum(accepted, K - 1)  # [S]: the rejected proposal's position, where there is one
    if draft_probs is None:
        proposal = jnp.take_along_axis(draft, at[:, None], axis=1)  # [S, 1]
        q_m = (jnp.arange(V)[None, :] == proposal).astype(probs.dtype)  # [S, V]
    else:
        q_m = jnp.take_along_axis(draft_probs, at[:, None, None], axis=1)[:, 0]  # [S, V]
        q_m = q_m / q_m.sum(axis=-1, keepdims=True)
    residual = _residual(p_m / p_m.sum(axis=-1, keepdims=True), q_m)  # [S, V]
    # A rejection with an empty residual happens only through rounding (p = q); p is then the right law.
    rejected = (accepted < num_draft) & (residual.sum(axis=-1) > 0)  # [S]
    return accepted, draw(jnp.where(rejected[:, None], residual, p_m), key_m)


def _accept(u, p_x, q_x):
    """Accept x ~ q with probability min(1, p(x) / q(x)), given u uniform in [0, 1): u < p / q, as u * q < p."""
    return u * q_x < p_x


def _residual(p, q):
    """What a rejection draws from, unnormalised: max(p - q, 0), for p and q [S, V] normalised."""
    return jnp.maximum(p - q, 0.0)


def _prob_of(probs, tokens):
    """probs [S, K, V] (unnormalised), tokens [S, K] -> each token's normalised probability [S, K]."""
    return jnp.take_along_axis(probs, tokens[..., None], axis=2)[..., 0] / probs.sum(axis=-1)
