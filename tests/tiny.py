"""Engines over the tiny random model, sized so tests cross page, chunk and batch boundaries."""
import contextlib

from jaxserve import LLM

TINY_PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 KV heads, head dim 16, float32


def make_llm(tiny_dir, **kw):
    args = dict(max_model_len=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, warmup=False)
    return LLM(tiny_dir, **{**args, **kw})


def prompts(rng, lengths, vocab_size=320):
    return [{"prompt_token_ids": rng.integers(0, vocab_size, n).tolist()} for n in lengths]


@contextlib.contextmanager
def first_decode_fails(runner, message="device lost"):
    """Within the block the runner's next dispatch of a step with a decode row raises RuntimeError(message); later
    ones run."""
    dispatch, failed = runner.dispatch, []

    def failing(plan):
        if not failed and plan.decode:
            failed.append(1)
            raise RuntimeError(message)
        return dispatch(plan)

    runner.dispatch = failing
    try:
        yield
    finally:
        runner.dispatch = dispatch
