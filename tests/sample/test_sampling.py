"""On-device sampling (jaxserve.sample.sampling.sample) and SamplingParams validation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.batch import SamplingInput
from jaxserve.runner.batch_builder import neutral_sampling
from jaxserve.sample import token_mask
from jaxserve.sample.sampling import NO_TOKEN, sample
from jaxserve.sample.verification import verify
from jaxserve.sampling_params import MAX_BANNED_TOKENS, MAX_LOGPROBS, SamplingParams

V = 50


def rows(n, vocab=V, **overrides):
    p = {**vars(neutral_sampling(n, vocab)), "temperature": np.ones(n, np.float32),
         "seed": np.arange(n, dtype=np.uint32),
         "min_tokens": np.ones(n, np.int32)}
    for k, v in overrides.items():
        p[k] = np.broadcast_to(np.asarray(v, p[k].dtype), p[k].shape).copy()
    return SamplingInput(**p)


sample_jit = jax.jit(sample)


def draw(logits, n, **overrides):
    """n draws from one row of logits, each with its own seed."""
    batch = np.tile(logits, (n, 1))
    return np.asarray(sample_jit(jnp.asarray(batch), rows(n, **overrides)).tokens)


@pytest.fixture
def logits():
    return np.random.default_rng().normal(0, 2, V).astype(np.float32)


def test_greedy_is_argmax(logits):
    assert set(draw(logits, 8, temperature=0.0)) == {int(np.argmax(logits))}


def test_top_k_keeps_only_the_k_best(logits):
    best3 = set(np.argsort(-logits)[:3].tolist())
    got = set(draw(logits, 400, top_k=3, temperature=5.0).tolist())
    assert got <= best3 and len(got) == 3


def test_top_p_keeps_the_smallest_set_reaching_p(logits):
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    allowed = set(order[mass_before < 0.6].tolist())
    got = set(draw(logits, 400, top_p=0.6).tolist())
    assert got <= allowed and len(got) >= min(2, len(allowed))


def test_min_p_drops_unlikely_tokens(logits):
    probs = np.exp(logits - logits.max())
    allowed = set(np.nonzero(probs >= 0.3)[0].tolist())
    assert set(draw(logits, 400, min_p=0.3).tolist()) <= allowed


def test_samples_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2] + [1e-9] * (V - 3), np.float32))
    counts = np.bincount(draw(logits, 4000), minlength=V)[:3] / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.04)


def test_same_seed_and_step_same_token_other_seed_differs(logits):
    flat = np.zeros(V, np.float32)  # uniform: any seed dependence shows
    a = draw(flat, 16, seed=7, step=3)
    assert len(set(a.tolist())) == 1
    assert len(set(draw(flat, 16, step=3).tolist())) > 1  # seeds 0..15


def test_banned_tokens_are_never_chosen(logits):
    top = int(np.argmax(logits))
    banned = np.full(MAX_BANNED_TOKENS, V, np.int32)
    banned[0] = top
    assert top not in draw(logits, 8, temperature=0.0, banned=banned)
    assert top not in draw(logits, 200, banned=banned)


def test_logprobs_are_the_models_and_ranks_count(logits):
    out = sample_jit(jnp.asarray(logits[None]), rows(1, temperature=0.0, want_top_logprobs=True))
    ref = jax.nn.log_softmax(jnp.asarray(logits))
    order = np.argsort(-logits)
    np.testing.assert_array_equal(out.top_ids[0], order[:MAX_LOGPROBS])
    np.testing.assert_allclose(out.top_logprobs[0], np.asarray(ref)[order[:MAX_LOGPROBS]], rtol=1e-5)
    assert int(out.ranks[0]) == 1
    np.testing.assert_allclose(out.logprobs[0], ref[order[0]], rtol=1e-5)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2.0), dict(n=0),
    dict(max_tokens=0), dict(min_tokens=5, max_tokens=2), dict(logprobs=MAX_LOGPROBS + 1), dict(stop=[""]),
    dict(stop_token_ids=[-1]), dict(seed="x"), dict(temperature="hot"),
])
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_unknown_sampling_param_is_rejected():
    with pytest.raises(TypeError):
        SamplingParams(length_penalty=1.0)  # not implemented: refused, never ignored


def test_two_level_inverse_cdf_and_argmax_match_the_plain_ones():
    from jaxserve.sample.sampling import first_argmax, inverse_cdf
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    probs = rng.random((16, 1000)).astype(np.float32) * (rng.random((16, 1000)) < 0.3)  # zeros, a ragged last block
    u = (rng.random(16) * probs.sum(axis=-1)).astype(np.float32)
    want = np.minimum((np.cumsum(probs.astype(np.float64), axis=-1) <= u[:, None]).sum(axis=-1), 999)
    np.testing.assert_array_equal(np.asarray(jax.jit(inverse_cdf)(probs, u)), want, err_msg=f"seed {seed}")
    x = rng.integers(0, 5, (16, 1000)).astype(np.float32)  # many ties: the first index wins, as np.argmax
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(x)), np.argmax(x, axis=-1), err_msg=f"seed {seed}")


def sorted_top_k_top_p(x, top_k, top_p, near=None):
    """The plain way, by sorting the vocabulary: what the bisection in jaxserve.sample.sampling must equal.
    near (bool like x, optional): set where a token's mass before it is within float32 rounding of top_p, the one
    place where sums in another order may decide otherwise."""
    V = x.shape[-1]
    order = np.argsort(-x, axis=-1, kind="stable")
    out = np.full_like(x, -np.inf)
    for r in range(x.shape[0]):
        k = min(top_k[r], V) if top_k[r] > 0 else V
        top = x[r, order[r, :k]].astype(np.float64)
        probs = np.exp(top - top.max()) / np.exp(top - top.max()).sum()
        before = np.cumsum(probs) - probs
        last = np.flatnonzero(before < top_p[r])[-1] if top_p[r] < 1 else k - 1
        out[r] = np.where(x[r] >= top[last], x[r], -np.inf)
        if near is not None and top_p[r] < 1:
            near[r, order[r, :k]] = np.abs(before - top_p[r]) < 1e-5
    return out


def test_top_k_top_p_cuts_where_sorting_would():
    from jaxserve.sample.sampling import _top_k_top_p
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    cut = jax.jit(_top_k_top_p)
    for V in (7, 300, 5000):
        x = rng.normal(0, rng.uniform(0.3, 6), (16, V)).astype(np.float32)  # distinct values: no ties to order
        x[:3, :V // 4] = -np.inf  # banned tokens
        top_k = rng.integers(0, V + 2, 16).astype(np.int32)
        top_k[::3] = 0
        top_p = rng.uniform(0.05, 1.0, 16).astype(np.float32)
        top_p[::4] = 1.0
        near = np.zeros(x.shape, bool)
        got, want = np.asarray(cut(x, top_k, top_p)), sorted_top_k_top_p(x, top_k, top_p, near)
        # Sums in another order may differ in the last bits where a token's mass before it is top_p itself (about
        # one row in 300 at V 5000): only there may the two cuts disagree.
        differ = np.isfinite(got) != np.isfinite(want)
        assert not (differ & ~near).any(), f"seed {seed}, V {V}: {np.argwhere(differ & ~near)[:4].tolist()}"


def test_token_mask_allows_only_its_tokens_and_leaves_logprobs_raw():
    """A row's mask (any allowed set, random per row) decides what it samples, greedy or not; unmasked rows in the
    same batch are untouched, and reported logprobs stay the model's own."""
    seed = int(np.random.default_rng().integers(2 ** 31))
    rng = np.random.default_rng(seed)
    n = 8
    logits = rng.normal(0, 2, (n, V)).astype(np.float32)
    allowed = [rng.choice(V, rng.integers(1, 6), replace=False) for _ in range(n)]
    masks = np.stack([token_mask.allowing(a, V) if i % 4 else token_mask.allow_all(V) for i, a in enumerate(allowed)])
    for i in range(n):
        expect = sorted(allowed[i]) if i % 4 else list(range(V))
        assert token_mask.allowed_ids(masks[i], V).tolist() == expect, f"seed {seed}"
    for temperature in (0.0, 1.0):
        out = sample_jit(jnp.asarray(logits), rows(n, temperature=temperature, token_mask=masks, min_tokens=0))
        tokens = np.asarray(out.tokens)
        plain = np.asarray(sample_jit(jnp.asarray(logits), rows(n, temperature=temperature, min_tokens=0)).tokens)
        for i in range(n):
            if i % 4:
                assert tokens[i] in allowed[i], f"seed {seed}, row {i}"
                if temperature == 0:
                    assert tokens[i] == allowed[i][np.argmax(logits[i, allowed[i]])], f"seed {seed}, row {i}"
            else:
                assert tokens[i] == plain[i], f"seed {seed}, row {i}: an unmasked row changed"
        raw = jax.nn.log_softmax(logits, axis=-1)[np.arange(n), tokens]
        np.testing.assert_allclose(np.asarray(out.logprobs), raw, rtol=1e-5, err_msg=f"seed {seed}")
    assert token_mask.allowed_ids(token_mask.forbidding(masks[1], allowed[1][:1]), V).tolist() == \
        sorted(allowed[1][1:]), f"seed {seed}"


def test_a_row_left_no_token_samples_none():
    """A row whose mask allows nothing, or only what min_tokens bans (under a bias and penalties too), samples
    NO_TOKEN, greedy or not, never a token outside its mask (it sampled token 0); a ban that has lapsed frees the
    token again, and the rows beside them sample as they would alone. Verification reports it the same way."""
    seed = int(np.random.default_rng().integers(2 ** 31))
    rng = np.random.default_rng(seed)
    n = 6
    logits = rng.normal(0, 2, (n, V)).astype(np.float32)
    t = int(rng.integers(1, V))
    masks = np.stack([np.zeros(token_mask.num_words(V), np.int32), token_mask.allowing([t], V),
                      token_mask.allowing([t], V), token_mask.allow_all(V), np.zeros(token_mask.num_words(V), np.int32),
                      token_mask.allowing(rng.choice(V, 4, replace=False), V)])
    banned = np.full((n, MAX_BANNED_TOKENS), V, np.int32)
    banned[1:3, 0] = t
    bias_ids = np.full((n, 300), V, np.int32)
    bias_ids[4, :2] = [0, t]
    controls = dict(token_mask=masks, banned=banned, min_tokens=[0, 5, 2, 0, 0, 0], step=[0, 4, 2, 0, 0, 0],
                    logit_bias_ids=bias_ids, logit_bias=np.where(bias_ids < V, 50.0, 0.0).astype(np.float32),
                    repetition_penalty=[1, 1, 1, 1, 1.5, 1], frequency_penalty=[0, 0, 0, 0, -1.0, 0],
                    past_tokens=np.zeros((n, 1), np.int32), prompt_len=np.zeros(n, np.int32))
    for temperature in (0.0, 1.0):
        tokens = np.asarray(sample_jit(jnp.asarray(logits), rows(n, temperature=temperature, **controls)).tokens)
        assert tokens[[0, 1, 4]].tolist() == [NO_TOKEN] * 3, f"seed {seed}, temperature {temperature}: {tokens}"
        assert tokens[2] == t, f"seed {seed}"  # step 2 of min_tokens 2: no longer banned
        assert tokens[5] in token_mask.allowed_ids(masks[5], V), f"seed {seed}"
        alone = sample_jit(jnp.asarray(logits[3:4]), rows(1, temperature=temperature, seed=3, min_tokens=0))
        assert tokens[3] == int(alone.tokens[0]), f"seed {seed}"
    p = rows(n, temperature=0.0, **controls)
    v = jax.jit(verify)(jnp.asarray(np.repeat(logits[:, None], 2, axis=1)), jnp.full((n, 1), t, jnp.int32),
                        jnp.ones(n, jnp.int32), p)
    assert np.asarray(v.tokens)[[0, 4], 0].tolist() == [NO_TOKEN] * 2 and np.asarray(v.num_tokens)[0] == 1


def test_a_draw_at_a_rounding_edge_never_takes_a_masked_token(monkeypatch):
    """The draw's reductions round apart: a uniform at the top of its range, or one an ulp below a block's end,
    lands past the last allowed token, on the vocabulary's last id or the next block's first (it sampled them with
    their logits at -inf). The draw is pinned at those edges; every row samples a token its mask allows."""
    from jaxserve.sample import sampling
    seed = int(np.random.default_rng().integers(2 ** 31))
    rng = np.random.default_rng(seed)
    n, vocab = 32, 600  # blocks of 256: 0-255, 256-511, 512-599
    masks = np.stack([token_mask.forbidding(token_mask.allow_all(vocab), [255, 256, 511, 512, vocab - 1])] * n)

    def edge_draw(probs, keys, axis=None):
        top = jnp.float32(1 - 2 ** -24) * jnp.sum(probs, axis=-1)  # jax.random.uniform's largest, times the mass
        block_end = jnp.nextafter(jnp.sum(probs[:, :256], axis=-1), jnp.float32(0))
        return sampling.inverse_cdf(probs, jnp.where(jnp.arange(probs.shape[0]) % 2 == 0, top, block_end))

    monkeypatch.setattr(sampling, "draw", edge_draw)
    logits = rng.normal(0, 2, (n, vocab)).astype(np.float32)
    tokens = np.asarray(jax.jit(sample)(jnp.asarray(logits), rows(n, vocab, token_mask=masks)).tokens)
    assert all(masks[0].view(np.uint32)[t // 32] >> (t % 32) & 1 for t in tokens.tolist()), \
        f"seed {seed}: {tokens}"


def test_a_batch_without_masks_copies_none(tiny_dir):
    """No row has a mask: the batch holds the shared constant, and every step reuses one device copy of it."""
    from jaxserve.batch import is_constant
    from jaxserve.runner.batch_builder import Row, RowSampling, build_batch

    from tiny import make_llm
    plain = build_batch([Row([1, 2], 0, [1])], 4, V, 8, 2, 4)
    assert is_constant(plain.sampling.token_mask)
    masked = build_batch([Row([1, 2], 0, [1], RowSampling(token_mask=token_mask.allowing([3], V)))], 4, V, 8, 2, 4)
    assert not is_constant(masked.sampling.token_mask)
    assert token_mask.allowed_ids(masked.sampling.token_mask[0], V).tolist() == [3]
    assert token_mask.allowed_ids(masked.sampling.token_mask[1], V).tolist() == list(range(V))
    steps = make_llm(tiny_dir).runner.steps
    first, second = steps.put_batch(plain), steps.put_batch(build_batch([Row([3], 0, [1])], 4, V, 8, 2, 4))
    assert first.sampling.token_mask is second.sampling.token_mask


def every_control(S, V, rng, greedy=False):
    """S rows, each with its own mix of every sampling control (random ids anywhere in the vocabulary, so over a
    mesh they fall on every device's slice)."""
    p = vars(neutral_sampling(S, V, max_len=24))
    p = {k: v if v is None else np.array(v) for k, v in p.items()}  # penalty_state None: penalties from histories
    p["temperature"] = np.zeros(S, np.float32) if greedy else rng.uniform(0.3, 2.0, S).astype(np.float32)
    p["temperature"][::5] = 0.0  # greedy rows among sampled ones
    p["top_k"] = np.where(rng.random(S) < 0.5, rng.integers(1, V, S), 0).astype(np.int32)
    p["top_p"] = np.where(rng.random(S) < 0.5, rng.uniform(0.2, 1.0, S), 1.0).astype(np.float32)
    p["min_p"] = np.where(rng.random(S) < 0.3, rng.uniform(0.0, 0.3, S), 0.0).astype(np.float32)
    p["seed"], p["step"] = rng.integers(0, 2**32, S).astype(np.uint32), rng.integers(0, 50, S).astype(np.int32)
    p["min_tokens"] = np.where(rng.random(S) < 0.5, 100, 0).astype(np.int32)
    p["banned"][:, :10] = rng.integers(0, V, (S, 10))
    p["want_top_logprobs"] = rng.random(S) < 0.7
    for i in range(0, S, 3):
        p["token_mask"][i] = token_mask.allowing(rng.choice(V, rng.integers(1, V // 3), replace=False), V)
    p["token_mask"][1] = 0  # a row left no token: NO_TOKEN on every device alike
    p["logit_bias_ids"][:, :30] = np.where(rng.random((S, 30)) < 0.5, rng.integers(0, V, (S, 30)), V)
    p["logit_bias"][:, :30] = rng.normal(0, 3, (S, 30))
    p["presence_penalty"] = np.where(rng.random(S) < 0.4, rng.uniform(-1, 1, S), 0).astype(np.float32)
    p["frequency_penalty"] = np.where(rng.random(S) < 0.4, rng.uniform(-1, 1, S), 0).astype(np.float32)
    p["repetition_penalty"] = np.where(rng.random(S) < 0.4, rng.uniform(0.5, 2, S), 1).astype(np.float32)
    p["past_tokens"] = rng.integers(0, V, (S, 24)).astype(np.int32)
    p["prompt_len"] = rng.integers(0, 24, S).astype(np.int32)
    return SamplingInput(**p)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
def test_sampling_over_a_vocab_split_mesh_is_one_devices():
    """Each device samples from its own slice of the logits (jaxserve.parallel.mesh.sample_over_vocab): the same
    tokens as one device for greedy and seeded random rows under every control, the same ranks and top ids, and
    the same logprobs up to the order of the vocabulary's sums; the same for speculative verification. The program
    gathers no [rows, vocab] array."""
    from jaxserve.aot.collectives import collective_census
    from jaxserve.parallel.mesh import make_mesh, sample_over_vocab
    from jaxserve.sample.verification import verify
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    # 4 devices of 250 tokens: neither the token mask's 32-bit words nor the draw's 256-token blocks align with a
    # device's slice.
    mesh, V, S, Q = make_mesh(4), 1000, 16, 3
    sharded = jax.jit(lambda x, p: sample_over_vocab(sample, mesh, x, p)).lower(
        jax.ShapeDtypeStruct((S, V), jnp.float32), every_control(S, V, rng)).compile()
    assert not [c for c in collective_census(sharded.as_text()) if any(V in dims for _, dims in c.arrays)], \
        "the program gathers [rows, vocab] values"
    for greedy in (True, False):
        logits = rng.normal(0, 2, (S, V)).astype(np.float32)
        p = every_control(S, V, rng, greedy)
        want, got = sample_jit(logits, p), sharded(logits, p)
        wanted = np.asarray(p.want_top_logprobs)
        err = f"seed {seed}, greedy {greedy}"
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens), err_msg=err)
        assert int(got.tokens[1]) == NO_TOKEN, err
        np.testing.assert_array_equal(np.asarray(got.ranks), np.asarray(want.ranks), err_msg=err)
        np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=1e-5, atol=1e-5,
                                   err_msg=err)
        np.testing.assert_array_equal(np.asarray(got.top_ids)[wanted], np.asarray(want.top_ids)[wanted], err_msg=err)
        np.testing.assert_allclose(np.asarray(got.top_logprobs)[wanted], np.asarray(want.top_logprobs)[wanted],
                                   rtol=1e-5, atol=1e-5, err_msg=err)

    logits = rng.normal(0, 2, (S, Q, V)).astype(np.float32)
    logits[:, 1:] = logits[:, :1] + rng.normal(0, 0.2, (S, Q - 1, V))  # close: some proposals are accepted
    p = every_control(S, V, rng)
    drafts = np.asarray(sample_jit(logits[:, 0], p).tokens)[:, None].repeat(Q - 1, axis=1).astype(np.int32)
    num_draft = rng.integers(0, Q, S).astype(np.int32)
    want = jax.jit(verify)(logits, drafts, num_draft, p)
    got = jax.jit(lambda *a: sample_over_vocab(verify, mesh, *a))(logits, drafts, num_draft, p)
    np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens), err_msg=f"seed {seed}")
