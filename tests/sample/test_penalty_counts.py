"""The penalties' counts kept on device per slot (`jaxserve.sample.penalty_counts`, `jaxserve.runner.penalty_slots`)
against the history they replace (each row's tokens sent every step): the same logits on seeded random rows, the
same tokens from an engine over the tiny model; a row's history is sent once; no penalty, no counts."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import SamplingParams
from jaxserve.runner.batch_builder import Row, RowSampling, build_batch
from jaxserve.sample.penalty_counts import empty_counts
from jaxserve.sample.sampling import controlled, with_step_tokens

from tiny import make_llm, prompts

V, PAGE = 64, 4


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2 ** 31)


@jax.jit
def penalized_logits(logits, batch, state):
    """The step's logits after the penalties, and the counts after it (state None: from each row's past_tokens)."""
    p = with_step_tokens(batch.sampling.__class__(**{**vars(batch.sampling), "penalty_state": state}),
                         batch.token_ids, batch.rows, batch.logits_index[:, 0])
    return controlled(logits, p), p.penalty_state


def rows_of(seqs, upto, history: bool, init: bool):
    """Each sequence (tokens, prompt_len, penalties or None) as a row whose new tokens are tokens[start:upto[i]]:
    history sends its tokens before start; with slots (history False) each row counts in slot i."""
    rows = []
    for i, (tokens, prompt_len, pen, start) in enumerate(seqs):
        end = upto[i]
        sampling = RowSampling(prompt_len=prompt_len)
        if pen is not None:
            sampling = RowSampling(presence_penalty=pen[0], frequency_penalty=pen[1], repetition_penalty=pen[2],
                                   prompt_len=prompt_len, penalty_slot=-1 if history else i, penalty_init=init,
                                   past_tokens=np.array(tokens, np.int32) if history or init else None)
        pages = list(range(1 + 8 * i, 1 + 8 * i + -(-end // PAGE)))
        rows.append(Row(tokens[start:end], start, pages, sampling))
    return rows


def test_counts_per_slot_equal_the_history_step_after_step():
    """Rows with and without penalties, their first step (a prompt chunk or a decode after a prefix hit: the slot
    starts over from the history) then three decode steps that send none: each step's logits equal those counted
    from the whole history, bit for bit; a row without a penalty keeps its logits."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(6):
        alphabet = rng.choice(V, 10, replace=False)
        prompt_len = int(rng.integers(1, 12))
        tokens = rng.choice(alphabet, prompt_len + 3 + int(rng.integers(1, 6))).tolist()
        pen = None if i % 3 == 2 else (float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2)),
                                       float(rng.uniform(0.5, 2)))
        seqs.append((tokens, prompt_len, pen, int(rng.integers(0, len(tokens) - 3))))
    state = empty_counts(8, V)
    upto = [len(t) - 3 for t, *_ in seqs]
    for step in range(4):
        if step:
            seqs = [(t, n, pen, upto[i] - 1) for i, (t, n, pen, _) in enumerate(seqs)]  # decode: the token before
        logits = jnp.asarray(rng.normal(0, 3, (6, V)).astype(np.float32))
        old = build_batch(rows_of(seqs, upto, True, False), PAGE, V, 64, 6, 8)
        new = build_batch(rows_of(seqs, upto, False, step == 0), PAGE, V, 64, 6, 8)
        want, _ = penalized_logits(logits, old, None)
        got, state = penalized_logits(logits, new, state)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}, step {step}")
        for i, (*_, pen, _) in enumerate(seqs):
            if pen is None:
                np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(logits[i]), err_msg=f"seed {seed}")
        upto = [u + 1 for u in upto]


def test_engine_tokens_equal_the_history_and_history_is_sent_once(tiny_dir):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    ps = prompts(rng, [13, 5, 22, 9], vocab_size=24)  # a small alphabet: tokens repeat
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=0.7,
                             frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.6),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, presence_penalty=-0.5,
                             frequency_penalty=1.1, repetition_penalty=0.7)]
    llm = make_llm(tiny_dir)
    llm.generate(ps[2], params[2], use_tqdm=False)
    assert not np.any(np.asarray(llm.runner.penalties.state.generated)), "a step without a penalty counted"
    sent = []
    place = llm.runner.penalties.place

    def recording(rows, split=False):
        placed = place(rows, split)
        sent.extend(r.sampling.penalty_init for r in placed if r.sampling.penalty_slot >= 0)
        return placed
    llm.runner.penalties.place = recording
    llm.reset_prefix_cache()
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert sum(sent) == 3 and len(sent) > 3 * 12, (seed, sum(sent), len(sent))  # once per penalty sequence

    old = make_llm(tiny_dir)
    # Rows without slots (as rows made by hand are): every penalty counted from the history the step is sent.
    old.runner.penalties.place = lambda rows, split=False: [r if r.sampling.past_tokens is None else Row(
        **{**vars(r), "sampling": RowSampling(**{**vars(r.sampling), "penalty_slot": -1})}) for r in rows]
    want = [o.outputs[0].token_ids for o in old.generate(ps, params, use_tqdm=False)]
    assert not np.any(np.asarray(old.runner.penalties.state.generated))
    assert got == want, seed
