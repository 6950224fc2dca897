"""Engines over the tiny random model, sized so tests cross page, chunk and batch boundaries."""
from jaxserve import LLM

TINY_PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 KV heads, head dim 16, float32


def make_llm(tiny_dir, **kw):
    args = dict(max_model_len=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, warmup=False)
    return LLM(tiny_dir, **{**args, **kw})


def prompts(rng, lengths, vocab_size=320):
    return [{"prompt_token_ids": rng.integers(0, vocab_size, n).tolist()} for n in lengths]
