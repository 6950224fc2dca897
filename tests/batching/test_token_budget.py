"""The step's token budget by queue depth (jaxserve.batching.token_budget): few prompts waiting keep the small budget
(running decodes keep their TPOT), many take up to the ceiling (a wave of prompts passes in fewer steps), an explicit
max_num_batched_tokens is every step's budget (vLLM's meaning), and the larger steps are compiled at warm-up."""
import jax
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jaxserve import SamplingParams
from jaxserve.batching.token_budget import (
    DEFAULT_STEP_TOKENS,
    LARGE_QUEUE,
    MAX_STEP_TOKENS,
    SMALL_QUEUE,
    budget_for_queue,
    step_budgets,
)
from jaxserve.engine_config import EngineConfig

from fake_runner import fake_llm
from tiny import make_llm, prompts

LONG = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@given(base=st.integers(1, 4096), extra=st.integers(0, 8192), depths=st.lists(st.integers(0, 500), min_size=2))
def test_the_budget_grows_with_the_queue_between_base_and_ceiling(base, extra, depths):
    ceiling = base + extra
    budgets = [budget_for_queue(d, base, ceiling) for d in sorted(depths)]
    assert budgets == sorted(budgets), (base, ceiling, depths)  # a deeper queue never gets less
    assert all(base <= b <= ceiling for b in budgets), (base, ceiling, budgets)
    assert budget_for_queue(SMALL_QUEUE - 1, base, ceiling) == base  # few waiting: TTFT and TPOT first
    assert budget_for_queue(LARGE_QUEUE + 1, base, ceiling) == ceiling  # a wave: throughput first
    assert budget_for_queue(1000, base, base) == base  # a fixed budget stays fixed


@given(asked=st.integers(1, 10_000), seqs=st.integers(1, 4096))
def test_an_explicit_budget_is_every_steps_and_the_default_grows(asked, seqs):
    assert step_budgets(asked, seqs) == (asked, asked)  # vLLM's meaning: the ceiling of every step
    base, ceiling = step_budgets(None, seqs)
    assert base == max(DEFAULT_STEP_TOKENS, seqs) and ceiling == max(MAX_STEP_TOKENS, base)
    assert EngineConfig(max_num_seqs=seqs).max_num_batched_tokens is None  # the default is the growing one


def first_step_tokens(n_prompts: int, **replica) -> int:
    """Tokens of the first step a fake engine plans with n_prompts 16-token prompts waiting."""
    llm = fake_llm(max_num_seqs=64, num_pages=512, page_size=4, max_num_batched_tokens=64, async_scheduling=False,
                   **replica)
    for i in range(n_prompts):
        llm.add_request({"prompt_token_ids": [(i + j) % 60 for j in range(16)]}, LONG)
    llm.step()
    return sum(len(row.token_ids) for row in llm.replicas[0].runner.steps[0])


def test_a_deep_queue_takes_the_ceiling_and_a_shallow_one_the_base():
    assert first_step_tokens(5, max_step_tokens=256) == 64  # < SMALL_QUEUE: the base budget
    assert first_step_tokens(20, max_step_tokens=256) == 128  # SMALL..LARGE_QUEUE: twice the base
    assert first_step_tokens(60, max_step_tokens=256) == 256  # > LARGE_QUEUE: the ceiling
    assert first_step_tokens(60) == 64  # without a ceiling (an explicit max_num_batched_tokens): fixed


def test_a_deep_queue_gives_the_same_tokens_in_fewer_steps():
    rng = np.random.default_rng(0)
    ps = prompts(rng, rng.integers(4, 30, 60), vocab_size=60)
    runs = {}
    for ceiling in (None, 256):
        llm = fake_llm(max_num_seqs=64, num_pages=512, page_size=4, max_num_batched_tokens=64, max_step_tokens=ceiling)
        out = llm.generate(ps, LONG, use_tqdm=False)
        runs[ceiling] = [o.outputs[0].token_ids for o in out], len(llm.replicas[0].runner.steps)
    assert runs[256][0] == runs[None][0]
    assert runs[256][1] < runs[None][1], runs


def test_the_default_budget_compiles_its_ceiling_at_warm_up_and_nothing_while_serving(tiny_dir):
    """The steps a deep queue grows to are buckets warmed up at start: a wave of 60 prompts takes a 2048-token-bucket
    step, and serving compiles nothing."""
    llm = make_llm(tiny_dir, max_num_seqs=64, max_num_batched_tokens=None, warmup=True)
    runner = llm.runner
    assert runner.buckets.num_tokens[-1] == MAX_STEP_TOKENS
    compiled = runner.steps.num_compiled()
    sizes = []
    step = runner.steps.step_with_features

    def recording(params, kv_cache, last_tokens, features, batch, lora=None, **kw):
        sizes.append(batch.num_tokens)
        return step(params, kv_cache, last_tokens, features, batch, lora, **kw)

    runner.steps.step_with_features = recording
    compiles = []

    def on_compile(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))

    rng = np.random.default_rng(1)
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        llm.generate(prompts(rng, rng.integers(30, 60, 60)), SamplingParams(max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert compiles == [] and runner.steps.num_compiled() == compiled
    assert max(sizes) > DEFAULT_STEP_TOKENS, sizes  # the wave went through a step beyond the base budget
