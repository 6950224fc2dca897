"""Speculative verification on device (jaxserve.sample.verification.verify): plain rows are sample() exactly, greedy
rows are the greedy chain, sampled rows emit sample()'s own draws at each generated token number (so speculation
does not change a seeded text), their law is exactly the target's whatever the proposals (checked statistically,
and the check is shown to catch inexact verifiers), and a one-hot proposal x is accepted with probability p(x)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import chi2

from jaxserve.batch import SamplingInput
from jaxserve.runner.batch_builder import neutral_sampling
from jaxserve.sample import verification
from jaxserve.sample.sampling import draw, sample, step_keys
from jaxserve.sample.verification import verify
from jaxserve.sampling_params import MAX_BANNED_TOKENS

verify_jit = jax.jit(verify)
sample_jit = jax.jit(sample)

# Each statistical check makes several chi-square tests; their false-failure probability adds up to ~1e-4.
ALPHA = 2e-5


def rows(n, V, **overrides):
    p = {**vars(neutral_sampling(n, V)), "temperature": np.ones(n, np.float32), "seed": np.arange(n, dtype=np.uint32)}
    for k, v in overrides.items():
        p[k] = np.broadcast_to(np.asarray(v, p[k].dtype), p[k].shape).copy()
    return SamplingInput(**p)


def banned_ids(V, ids):
    b = np.full(MAX_BANNED_TOKENS, V, np.int32)
    b[:len(ids)] = ids
    return b


def mixed_rows(n, V, rng):
    """Rows with every kind of sampling parameter, bans in force for some."""
    banned = np.full((n, MAX_BANNED_TOKENS), V, np.int32)
    banned[:, :3] = rng.integers(0, V, (n, 3))
    return rows(n, V, temperature=np.where(rng.random(n) < 0.3, 0, rng.uniform(0.3, 2, n)),
                top_k=np.where(rng.random(n) < 0.5, 0, rng.integers(1, 40, n)),
                top_p=np.where(rng.random(n) < 0.5, 1, rng.uniform(0.2, 1, n)),
                min_p=np.where(rng.random(n) < 0.5, 0, rng.uniform(0, 0.3, n)),
                seed=rng.integers(0, 2 ** 32, n, dtype=np.uint32), step=rng.integers(0, 6, n),
                min_tokens=rng.integers(0, 8, n), banned=banned, want_top_logprobs=rng.random(n) < 0.5)


def target_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, banned=()):
    """The target's law at one position, normalised, by the definitions (numpy, float64): what sample() draws
    from. The test logits have no ties."""
    x = np.asarray(logits, np.float64).copy()
    x[list(banned)] = -np.inf
    if temperature == 0:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1
        return out
    x = x / temperature
    if top_k:
        x[x < np.sort(x)[::-1][top_k - 1]] = -np.inf
    order = np.argsort(-x)
    probs = np.exp(x[order] - x[order[0]])
    probs /= probs.sum()
    x[order[(np.cumsum(probs) - probs) >= top_p]] = -np.inf
    probs = np.exp(x - x.max())
    probs[probs < min_p * probs.max()] = 0
    return probs / probs.sum()


# ---- plain rows and greedy rows: exact equality

# Bit for bit where XLA reduces a row of the [S * Q, V] logits as it does a row of [S, V]: on XLA:CPU it does at
# these sizes, but not on small arrays (log_softmax of [8, 200] differs in the last bit from its rows in [24, 200]).
SIZES = [(24, 4, 1000), (8, 3, 49152)]


@pytest.mark.parametrize("S, Q, V", SIZES)
def test_plain_rows_are_sample_exactly(S, Q, V):
    seed = 1000 * V
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (S, Q, V)).astype(np.float32)
    p = mixed_rows(S, V, rng)
    draft = rng.integers(0, V, (S, Q - 1)).astype(np.int32)
    num_draft = np.where(np.arange(S) % 2 == 0, 0, rng.integers(0, Q, S)).astype(np.int32)  # plain rows among others
    got = verify_jit(logits, draft, num_draft, p)
    want = sample_jit(logits[:, 0], p)
    plain = num_draft == 0
    for k, v in vars(want).items():
        np.testing.assert_array_equal(np.asarray(getattr(got, k))[plain, 0], np.asarray(v)[plain],
                                      err_msg=f"{k}, seed {seed}")
    assert (np.asarray(got.num_tokens)[plain] == 1).all()


def test_every_row_plain_with_greedy_and_sorting_fast_paths_off():
    rng = np.random.default_rng(5)
    S, Q, V = 8, 3, 4096
    logits = rng.normal(0, 3, (S, Q, V)).astype(np.float32)
    draft, num_draft = np.zeros((S, Q - 1), np.int32), np.zeros(S, np.int32)
    for p in [rows(S, V, temperature=0.0), rows(S, V), rows(S, V, temperature=0.7, min_p=0.1)]:
        got, want = verify_jit(logits, draft, num_draft, p), sample_jit(logits[:, 0], p)
        for k, v in vars(want).items():
            np.testing.assert_array_equal(np.asarray(getattr(got, k))[:, 0], np.asarray(v), err_msg=k)


def test_greedy_rows_emit_the_greedy_chain():
    """Row r proposes the argmax at its first a positions and something else after: it keeps a proposals (or all
    num_draft) and emits the argmax after them. The ban applies per position: at a position still short of
    min_tokens the argmax is the best unbanned token, so proposing the raw argmax there is a mismatch."""
    rng = np.random.default_rng(7)
    S, Q, V = 40, 5, 64
    K = Q - 1
    logits = rng.normal(0, 3, (S, Q, V)).astype(np.float32)
    raw_best = logits.argmax(-1)  # [S, Q]
    step = rng.integers(0, 4, S)
    min_tokens = rng.integers(0, 8, S)
    banned = np.stack([banned_ids(V, [raw_best[s, 0], raw_best[s, 2]]) for s in range(S)])
    best = np.empty_like(raw_best)  # the greedy chain: argmax after the ban in force at each position
    for s in range(S):
        for j in range(Q):
            x = logits[s, j].copy()
            if step[s] + j < min_tokens[s]:
                x[[raw_best[s, 0], raw_best[s, 2]]] = -np.inf
            best[s, j] = np.argmax(x)
    match = rng.integers(0, K + 1, S)  # proposals agreeing with the chain before the first mismatch
    draft = np.where(np.arange(K)[None, :] < match[:, None], best[:, :K], (best[:, :K] + 1) % V)
    draft[::3] = raw_best[::3, :K]  # some rows propose the raw argmax, banned or not
    num_draft = rng.integers(0, K + 1, S).astype(np.int32)
    p = rows(S, V, temperature=0.0, step=step, min_tokens=min_tokens, banned=banned, want_top_logprobs=True)
    got = verify_jit(logits, draft.astype(np.int32), num_draft, p)
    tokens, n = np.asarray(got.tokens), np.asarray(got.num_tokens)
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for s in range(S):
        ok = draft[s, :num_draft[s]] == best[s, :num_draft[s]]
        accepted = num_draft[s] if ok.all() else int(np.argmin(ok))
        assert n[s] == accepted + 1, s
        np.testing.assert_array_equal(tokens[s, :n[s]], best[s, :n[s]], err_msg=f"row {s}")
        chosen = logprobs[s, np.arange(n[s]), tokens[s, :n[s]]]
        # logit - logsumexp: float32's rounding at the logits' magnitude, not the logprob's
        np.testing.assert_allclose(np.asarray(got.logprobs)[s, :n[s]], chosen, rtol=1e-6, atol=2e-6)
        ranks = 1 + (logprobs[s, :n[s]] > chosen[:, None]).sum(-1)
        np.testing.assert_array_equal(np.asarray(got.ranks)[s, :n[s]], ranks)
        np.testing.assert_array_equal(np.asarray(got.top_ids)[s, 0], np.argsort(-logits[s, 0])[:20])
    assert len(set(n.tolist())) > 2  # the rows did accept different numbers of proposals


def test_a_row_does_not_depend_on_the_others():
    rng = np.random.default_rng(11)
    S, Q, V = 16, 4, 100
    logits = rng.normal(0, 2, (S, Q, V)).astype(np.float32)
    p = mixed_rows(S, V, rng)
    draft = logits[:, :-1].argmax(-1).astype(np.int32)  # likely proposals: long accepted runs
    num_draft = rng.integers(0, Q, S).astype(np.int32)
    full = verify_jit(logits, draft, num_draft, p)
    perm = rng.permutation(S)
    shuffled = verify_jit(logits[perm], draft[perm], num_draft[perm], jax.tree.map(lambda a: a[perm], p))
    for k in ("tokens", "num_tokens", "logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(shuffled, k)), np.asarray(getattr(full, k))[perm], err_msg=k)


@pytest.mark.parametrize("S, Q, V", SIZES)
def test_rows_emit_sample_draws_up_to_the_first_miss(S, Q, V):
    """Position j of a row emits what sample() draws for its generated token number step + j (its key, its ban),
    and the row keeps its proposals while they equal those draws: the text of plain decoding, token for token."""
    seed = 7 * V
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (S, Q, V)).astype(np.float32)
    p = mixed_rows(S, V, rng)
    want = np.stack([np.asarray(sample_jit(logits[:, j], dataclasses.replace(p, step=p.step + j)).tokens)
                     for j in range(Q)], axis=1)  # [S, Q]
    match = np.arange(S) % Q  # proposals equal to the draws before the first miss
    draft = np.where(np.arange(Q - 1)[None, :] < match[:, None], want[:, :-1], (want[:, :-1] + 1) % V)
    num_draft = np.full(S, Q - 1, np.int32)
    num_draft[::4] = rng.integers(0, Q, len(num_draft[::4]))  # some rows propose fewer, or nothing
    got = verify_jit(logits, draft.astype(np.int32), num_draft, p)
    n = np.asarray(got.num_tokens)
    np.testing.assert_array_equal(n, np.minimum(match, num_draft) + 1, err_msg=f"seed {seed}")
    for s in range(S):
        np.testing.assert_array_equal(np.asarray(got.tokens)[s, :n[s]], want[s, :n[s]], err_msg=f"seed {seed}")
    assert (n == 1).any() and (n == Q).any()  # some rows kept nothing, some every proposal


# ---- sampled rows: the law of the emitted tokens

N = 20000  # rows, each with its own seed, verifying the same logits
V_SMALL = 20  # the least a vocabulary can be: sample() computes MAX_LOGPROBS top logprobs


def chi_square_pvalue(counts, probs):
    """Pearson's test of counts [C] against probs [C]; cells expecting fewer than 5 are pooled. A count where the
    law puts no mass fails outright."""
    counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * n
    big = expected >= 5
    small = ~big & (probs > 0)
    obs = np.append(counts[big], counts[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(chi2.sf(stat, len(obs) - 1)) if len(obs) > 1 else 1.0


def law_pvalues(tokens, num_tokens, p, rng):
    """tokens [N, Q], num_tokens [N]; p [Q, V] the target's law at each position (the test's target gives every
    position the same law whatever came before). Tokens past a row's num_tokens are drawn by numpy from p, as the
    next rounds would draw them; the completed rows must then be independent draws from p_0 x p_1 x ... .
    Returns the p-values of the first token's law, the first two tokens' joint law, and each later token's law."""
    Q, V = p.shape
    tokens = tokens.copy()
    for j in range(Q):
        missing = num_tokens <= j
        tokens[missing, j] = rng.choice(V, missing.sum(), p=p[j])
    out = {"t0": chi_square_pvalue(np.bincount(tokens[:, 0], minlength=V), p[0]),
           "t0,t1": chi_square_pvalue(np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V),
                                      np.outer(p[0], p[1]))}
    for j in range(2, Q):
        out[f"t{j}"] = chi_square_pvalue(np.bincount(tokens[:, j], minlength=V), p[j])
    return out


def dirichlet(rng, V, concentration):
    return rng.dirichlet(np.full(V, concentration))


def scenario(name, seed):
    """Logits at Q = 3 positions, sampling parameters, and the proposer. A draft model's (q [K, V]) draws with the
    key of the target's draw it is checked against, as the engine's does: the proposals that lean hardest on the
    uniform deciding them. Returns (logits [Q, V], params, propose(rng, seeds [N], step) -> draft tokens [N, K])."""
    rng = np.random.default_rng(seed)
    V, Q, K = V_SMALL, 3, 2
    logits = rng.normal(0, 1.5, (Q, V)).astype(np.float32)
    params = {}
    if name.startswith("filtered"):  # every filter in play, so p has zeros that q does not
        params = dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05)
    if name == "banned":  # the ban holds at positions 0 and 1 (steps 3 and 4), not at 2 (step 5)
        params = dict(step=3, min_tokens=5, banned=banned_ids(V, logits[0].argsort()[-2:]))
    p = target_probs_all(logits, params)
    if name in ("bad", "filtered", "banned"):  # far from p: mass where p has little
        q = np.stack([dirichlet(rng, V, 0.3) for _ in range(K)])
    elif name == "good":
        q = 0.8 * p[:K] + 0.2 * np.stack([dirichlet(rng, V, 1.0) for _ in range(K)])
    else:
        q = None
    if q is not None:
        q = jnp.asarray(q, jnp.float32)  # [K, V]

        def propose(rng, seeds, step):
            steps = np.full(len(seeds), step, np.int32)
            return np.stack([np.asarray(draw(jnp.broadcast_to(q[j], (len(seeds), V)), step_keys(seeds, steps + j)))
                             for j in range(K)], axis=1)
    elif name in ("onehot_fixed", "filtered_onehot"):
        fixed = np.array([np.argsort(p[0])[-2], np.argsort(p[1])[-1]])  # a likely token, then the most likely

        def propose(rng, seeds, step):
            return np.broadcast_to(fixed, (len(seeds), K))
    else:  # "onehot_random": an n-gram's proposals, unrelated to p
        def propose(rng, seeds, step):
            return rng.integers(0, V, (len(seeds), K))
    return logits, params, propose


def target_probs_all(logits, params):
    """target_probs at each position, with the ban in force where step + j < min_tokens."""
    step, min_tokens = params.get("step", 0), params.get("min_tokens", 0)
    kw = {k: params[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in params}
    banned = [b for b in params.get("banned", ()) if b < logits.shape[-1]]
    return np.stack([target_probs(x, banned=banned if step + j < min_tokens else (), **kw)
                     for j, x in enumerate(logits)])


def run_scenario(name, seed, verifier=verify_jit):
    """Returns the tokens a row continues with [N, Q] (its kept proposals, then the emitted token; junk after
    num_tokens), num_tokens [N], the target's law [Q, V], and the rng for law_pvalues."""
    logits, params, propose = scenario(name, seed)
    Q, V = logits.shape
    rng = np.random.default_rng(seed + 1)
    seeds = (np.arange(N) + 7919 * seed).astype(np.uint32)
    draft = propose(rng, seeds, params.get("step", 0)).astype(np.int32)
    num_draft = np.full(N, Q - 1, np.int32)
    num_draft[:N // 10] = rng.integers(0, Q, N // 10)  # some rows propose fewer, or nothing
    out = verifier(np.broadcast_to(logits, (N, Q, V)), draft, num_draft, rows(N, V, seed=seeds, **params))
    tokens, num_tokens = np.asarray(out.tokens), np.asarray(out.num_tokens)
    # What the row continues with is its kept proposals (already in its KV cache), then the emitted token.
    kept = np.arange(Q)[None, :] < num_tokens[:, None] - 1
    continued = np.where(kept, np.pad(draft, ((0, 0), (0, 1))), tokens)
    return continued, tokens, num_tokens, num_draft, target_probs_all(logits, params), rng


SCENARIOS = ["bad", "good", "onehot_fixed", "onehot_random", "filtered", "filtered_onehot", "banned"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_emitted_tokens_follow_the_target_law(name):
    seed = SCENARIOS.index(name) + 1
    continued, tokens, num_tokens, num_draft, p, rng = run_scenario(name, seed)
    assert ((num_tokens >= 1) & (num_tokens <= num_draft + 1)).all()
    np.testing.assert_array_equal(continued, tokens)  # a kept proposal is the token emitted there
    pvalues = law_pvalues(tokens, num_tokens, p, rng)
    assert min(pvalues.values()) > ALPHA, f"scenario {name}, seed {seed}: p-values {pvalues}"
    # Not a vacuous pass: some rows accepted every proposal, some none.
    assert (num_tokens == 1).any() and (num_tokens == 3).any(), f"scenario {name}, seed {seed}"


def test_the_ban_holds_per_position():
    _, tokens, num_tokens, _, p, _ = run_scenario("banned", 7)
    banned = set(scenario("banned", 7)[1]["banned"][:2].tolist())
    for j in (0, 1):
        assert not banned & set(tokens[num_tokens > j, j].tolist())
    assert banned & set(tokens[num_tokens > 2, 2].tolist())  # step 5: no longer banned


def one_key_for_every_position(p, Q):
    return jax.tree.map(lambda a: jnp.repeat(a, Q, axis=0), p)


INEXACT = {
    "one key for every position": ("per_position", one_key_for_every_position),
    "accept every proposal": ("_leading", lambda ok, num_draft: num_draft),
}


@pytest.mark.parametrize("variant, name", [(v, n) for v in INEXACT for n in ("bad", "onehot_fixed")])
def test_the_check_catches_inexact_verifiers(monkeypatch, variant, name):
    attr, wrong = INEXACT[variant]
    seed = 1 + SCENARIOS.index(name)
    monkeypatch.setattr(verification, attr, wrong)
    continued, _, num_tokens, _, p, rng = run_scenario(name, seed, jax.jit(functools.partial(verify)))  # traced anew
    pvalues = law_pvalues(continued, num_tokens, p, rng)
    assert min(pvalues.values()) < ALPHA, f"{variant}, scenario {name}, seed {seed}: p-values {pvalues}"


# ---- acceptance

@pytest.mark.parametrize("params", [{}, dict(temperature=0.8, top_k=8, top_p=0.95, min_p=0.02)])
def test_a_one_hot_proposal_is_accepted_with_its_probability(params):
    """An n-gram's proposal x is accepted with probability p(x), as rejection sampling accepts it (min(1, p / 1)):
    coupling the proposal to the target's draw costs prompt lookup nothing."""
    seed = 31 + len(params)
    rng = np.random.default_rng(seed)
    V, n = V_SMALL, N
    logits = rng.normal(0, 1.5, (2, V)).astype(np.float32)
    p0 = target_probs_all(logits, params)[0]
    for x in np.argsort(p0)[::-1][:3]:  # the three likeliest tokens
        seeds = (np.arange(n) + n * int(x) + seed).astype(np.uint32)
        out = verify_jit(np.broadcast_to(logits, (n, 2, V)), np.full((n, 1), x, np.int32), np.ones(n, np.int32),
                         rows(n, V, seed=seeds, **params))
        rate = float((np.asarray(out.num_tokens) == 2).mean())
        tolerance = 5 * np.sqrt(p0[x] * (1 - p0[x]) / n)  # five standard errors: a false failure ~1e-6
        assert abs(rate - p0[x]) < tolerance, f"seed {seed}, token {x}: accepted {rate:.4f}, p(x) = {p0[x]:.4f}"
