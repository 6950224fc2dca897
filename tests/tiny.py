"""Engines over the tiny random model, sized so tests cross page, chunk and batch boundaries."""
import numpy as np

from jaxserve import LLM
from jaxserve.runner.batch_builder import Row, build_batch

TINY_PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 KV heads, head dim 16, float32


def make_llm(tiny_dir, **kw):
    # float32 on any CPU (auto is bfloat16 where the CPU has native bf16): the tests hold the engine to float32
    # references (jnp, HF) and TINY_PAGE_BYTES counts float32 pages.
    args = dict(dtype="float32", max_model_len=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                warmup=False)
    return LLM(tiny_dir, **{**args, **kw})


def prompts(rng, lengths, vocab_size=320):
    return [{"prompt_token_ids": rng.integers(0, vocab_size, n).tolist()} for n in lengths]


def step_logits(llm, token_ids, cached: int = 0):
    """float32 logits of token_ids[cached:] in one step, through the engine's runner (its params, cache and mesh),
    the first `cached` of them read from the cache (where an earlier call put them)."""
    r = llm.runner
    pages = list(range(1, 1 + -(-len(token_ids) // r.page_size)))
    batch = build_batch([Row(token_ids[cached:], cached, pages)], r.page_size, r.config.vocab_size, 32, 1,
                        r.buckets.pages_per_row)
    logits, r.kv_cache = r.steps.forward_logits(r.params, r.kv_cache, batch)
    return np.asarray(logits)[:len(token_ids) - cached]
