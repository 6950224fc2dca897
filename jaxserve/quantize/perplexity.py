"""Scoring a text with the model: next-token log-probabilities, for perplexity and quantization quality."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache import init_kv_cache, pages_needed
from jaxserve.runner.batch_builder import Row, build_batch
from jaxserve.runner.steps import steps_for


def next_token_logits(config, params, token_ids: list[int], dtype=jnp.float32, page_size: int = 16,
                      kv_cache_dtype: str = "auto", chunk: int | None = None) -> np.ndarray:
    """Logits [len - 1, vocab] float32 predicting token_ids[1:].

    chunk=None: one prefill of the whole text (every key is this step's own, so the cache's format plays no
    part). chunk=n: prefills of n tokens one after another, each attending to the earlier ones through the cache,
    as a served sequence does.
    """
    n = len(token_ids)
    chunk = chunk or n
    pages = list(range(1, 1 + pages_needed(n, page_size)))
    cache = init_kv_cache(config, len(pages) + 1, page_size, dtype, kv_cache_dtype)
    steps = steps_for(config, dtype)
    out = []
    for start in range(0, n, chunk):
        row = Row(token_ids[start:start + chunk], start, pages)
        batch = build_batch([row], page_size, config.vocab_size, chunk, 1, len(pages))
        logits, cache = steps.forward_logits(params, cache, batch)
        out.append(np.asarray(logits[:len(row.token_ids)]))
    return np.concatenate(out)[:-1]


def perplexity(logits: np.ndarray, token_ids: list[int]) -> float:
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    return float(np.exp(-logp[np.arange(len(token_ids) - 1), token_ids[1:]].mean()))
