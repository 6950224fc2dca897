"""The split step of structured output (`jaxserve.batching.engine_core`): a constrained batch's next forward is
dispatched before the step in flight is read back, its grammar masks filled after and joined on device, and the
outputs are token for token those of the synchronous path (async scheduling off, every mask filled before its
step)."""
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.runner.batch_builder import Row, RowSampling
from jaxserve.sampling_params import StructuredOutputsParams as Structured

from tiny import make_llm

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["a", "bc", "def"]},
    "name": {"type": "string", "maxLength": 6}}, "required": ["id", "tag", "name"], "additionalProperties": False}
GRAMMARS = [Structured(json=SCHEMA), Structured(regex=r"[a-z]{2,6}-[0-9]{1,4}"), Structured(json_object=True),
            Structured(choice=["yes", "no", "maybe not"])]


def requests(seed: int):
    """Constrained requests (greedy and seeded random draws, some with penalties) beside plain ones, with prompts of
    several lengths so that prefill chunks and constrained decode rows share steps."""
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(8):
        prompts.append({"prompt_token_ids": rng.integers(0, 300, int(rng.integers(2, 20))).tolist()})
        temperature = 0.0 if i % 3 == 0 else 1.0
        grammar = GRAMMARS[i % len(GRAMMARS)] if i % 4 != 3 else None
        params.append(SamplingParams(temperature=temperature, seed=seed + i, max_tokens=24, ignore_eos=grammar is None,
                                     structured_outputs=grammar, logprobs=2 if i == 1 else None,
                                     # penalties counted on device per slot, through the split step's two halves too
                                     presence_penalty=0.7 if i % 2 == 0 else 0.0, frequency_penalty=0.4 * (i == 2),
                                     repetition_penalty=1.3 if i == 5 else 1.0))
    return prompts, params


class Recorder:
    """The runner's calls, in order: ("dispatch", split?), ("fetch",), ("join",)."""

    def __init__(self, runner):
        self.events: list[tuple] = []
        dispatch, fetch, join = runner.dispatch, runner.fetch, runner.join_masks

        def dispatched(rows, *a, masks_later=False, **kw):
            self.events.append(("dispatch", masks_later))
            return dispatch(rows, *a, masks_later=masks_later, **kw)

        def fetched(handle):
            assert handle.output is not None, "a split step was read back before its masks were joined"
            self.events.append(("fetch",))
            return fetch(handle)

        def joined(handle, masks):
            self.events.append(("join",))
            return join(handle, masks)
        runner.dispatch, runner.fetch, runner.join_masks = dispatched, fetched, joined


@pytest.fixture(scope="module")
def llms(tiny_tokenized_dir):
    kw = dict(max_model_len=96, max_num_seqs=6, max_num_batched_tokens=24)
    return make_llm(tiny_tokenized_dir, async_scheduling=False, **kw), make_llm(tiny_tokenized_dir, **kw)


def test_split_steps_write_what_the_synchronous_path_writes(llms):
    sync, split = llms
    seed = int(np.random.default_rng().integers(1 << 20))
    prompts, params = requests(seed)
    want = sync.generate(prompts, params, use_tqdm=False)
    recorder = Recorder(split.runner)
    got = split.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), f"seed {seed}"
        if w.logprobs:
            assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs], f"seed {seed}"
    assert ("dispatch", True) in recorder.events, f"seed {seed}: no step was split"
    assert not any(e == ("dispatch", True) for e in Recorder(sync.runner).events)
    split.core.assert_idle_and_clean()


def test_a_constrained_batch_dispatches_its_next_forward_before_reading_back(llms):
    """Each split step: its forward dispatched, then the step before read back, then its masks joined; the device
    never waits for the host's read-back and mask fill to begin the next forward."""
    _, split = llms
    recorder = Recorder(split.runner)
    prompts, params = requests(7)
    params = [SamplingParams(temperature=0, max_tokens=16, structured_outputs=GRAMMARS[0])] * 3
    split.generate(prompts[:3], params, use_tqdm=False)
    events = recorder.events
    splits = [i for i, e in enumerate(events) if e == ("dispatch", True)]
    assert len(splits) >= 10, events  # every decode step after the first holds constrained rows
    for i in splits:
        assert events[i + 1:i + 3] == [("fetch",), ("join",)], events[i - 2:i + 4]
    split.core.assert_idle_and_clean()


@pytest.mark.parametrize("rows", [1, 6])  # the few-row sampler and the used-rows head (more than HEAD_ROWS[0] rows)
def test_a_split_step_bans_the_bad_words_its_rows_last_tokens_complete(llms, rows):
    """A bad word's last token is banned on device when the row's last input token completes the rest of it
    (`with_step_tokens`): a split step's sampling half bans it too, as a whole step does."""
    _, split = llms
    runner = split.runner
    seed = int(np.random.default_rng().integers(1 << 20))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 300, 4).tolist() for _ in range(rows)]  # 24 tokens at most: the largest bucket
    pages = [[1 + 2 * i, 2 + 2 * i] for i in range(rows)]

    def step(split_it, bans=None):
        batch = [Row(p, 0, pg, RowSampling(bad_word_bans=(bans[i],) if bans else ()), slot=i)
                 for i, (p, pg) in enumerate(zip(prompts, pages))]
        handle = runner.dispatch(batch, masks_later=split_it)
        runner.join_masks(handle, None)
        return runner.fetch(handle).tokens[:, 0].tolist()

    greedy = step(True)
    assert greedy == step(False), f"seed {seed}"
    bans = [(p[-1], g) for p, g in zip(prompts, greedy)]  # each row's greedy pick, completed by its last token
    banned = step(True, bans)
    assert banned == step(False, bans), f"seed {seed}"
    assert all(b != g for b, g in zip(banned, greedy)), f"seed {seed}"
    split.core.assert_idle_and_clean()
