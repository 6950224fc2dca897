"""Speculative verification on device: a row's k proposals, scored by the target in one step, accepted or not so
that the emitted tokens are exactly the ones plain sampling would emit; beside `jaxserve.sample.sampling.sample`.

At each scored position the target draws its token as sample() would for that generated-token number (its key
`step_keys(seed, step + j)`, its bans and filters); a proposal is accepted while it equals that draw, and the
first draw that differs (or the bonus draw after the last proposal) is emitted after the accepted ones. A
sequence's text is then the same, token for token, whether it speculates or not, so the same seed gives the same
text whatever else is batched (whether a sequence speculates depends on the batch). Greedy rows are the case of a
deterministic draw: a proposal is accepted while it is the argmax.

A one-hot proposal x (prompt lookup) is accepted with probability p(x), as in rejection sampling (Leviathan et al.
2023). A draft model draws its proposal for generated token number n with the same key as the target's draw of
n (an inverse-CDF draw from its own distribution q with the same uniform), so the two agree where their
cumulative distributions put that uniform on the same token; that coupling is not the maximal one (rejection
sampling's acceptance, the sum of min(p, q)), and BENCHMARKS.md measures what it gives up.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sample.sampling import Sampled, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified(Sampled):
    """What verify() returns for S rows of Q scored positions: sample()'s fields with a [S, Q] lead (tokens int32
    [S, Q], the emitted ones first, junk after num_tokens; logprobs, ranks; top_ids, top_logprobs [S, Q,
    MAX_LOGPROBS]), and how many tokens each row emits."""
    num_tokens: jax.Array  # int32 [S]: accepted proposals + 1, in [1, num_draft + 1]


def verify(logits, draft_tokens, num_draft, p, axis: str | None = None) -> Verified:
    """logits: float32 [S, Q, V], the target's logits at a row's Q = K + 1 scored positions: position j predicts
    the row's generated token number p.step + j (position j > 0 assumes the proposals before it).
    draft_tokens: int32 [S, K] proposals (ignored where j >= num_draft). A draft model's proposal for generated
        token number n is drawn with step_keys(seed, n), the key of the target's draw it is checked against.
    num_draft: int32 [S] in [0, K]; 0 is a plain row: exactly sample(logits[:, 0], p), random numbers included.
    p: a `jaxserve.batch.SamplingInput` of S rows (step: the generated token number of position 0).
    axis: a mesh axis that splits the vocabulary, as sample()'s (logits [S, Q, V / n] this device's slice).

    Returns each position's draw as sample() reports it (logprobs and ranks under the target's raw log_softmax at
    its position) and each row's number of emitted tokens: a `Verified`.
    """
    S, Q, V = logits.shape
    # Position j of row s is row s * Q + j of one sample() call, each with its own generated token number.
    drawn = sample(logits.reshape(S * Q, V), per_position(p, Q), axis)
    drawn = jax.tree.map(lambda v: v.reshape(S, Q, *v.shape[1:]), drawn)
    accepted = _leading(drawn.tokens[:, :Q - 1] == draft_tokens, num_draft)  # [S]
    # An accepted proposal is the draw at its position, so the emitted tokens are the draws up to the first miss.
    return Verified(**vars(drawn), num_tokens=(accepted + 1).astype(jnp.int32))


def per_position(p, Q):
    """p of S rows as S * Q rows, one per scored position, each with its own generated token number."""
    # The penalties' counts are by slot, not by row: each position reads its row's (penalty_slot, repeated).
    flat = jax.tree.map(lambda a: jnp.repeat(a, Q, axis=0), dataclasses.replace(p, penalty_state=None))
    step = (p.step[:, None] + jnp.arange(Q, dtype=p.step.dtype)[None, :]).reshape(-1)  # [S * Q]
    return dataclasses.replace(flat, step=step, penalty_state=p.penalty_state)


def _leading(ok, num_draft):
    """How many of the first num_draft [S] entries of ok [S, K] hold before the first that fails: [S]."""
    ok = ok & (jnp.arange(ok.shape[1])[None, :] < num_draft[:, None])
    return jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
