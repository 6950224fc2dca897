"""Scoring a text with the model: next-token log-probabilities, for perplexity and quantization quality."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batching.batch_builder import Row, build_batch
from jaxserve.cache import init_kv_cache, pages_needed
from jaxserve.steps import steps_for


def next_token_logits(config, params, token_ids: list[int], dtype=jnp.float32, page_size: int = 16) -> np.ndarray:
    """Logits [len - 1, vocab] float32 predicting token_ids[1:], from one prefill of the whole text."""
    pages = list(range(1, 1 + pages_needed(len(token_ids), page_size)))
    batch = build_batch([Row(token_ids, 0, pages)], page_size, config.vocab_size, 1, len(token_ids), len(pages))
    cache = init_kv_cache(config, len(pages) + 1, page_size, dtype)
    logits, _ = steps_for(config, dtype).forward_logits(params, cache, batch)
    return np.asarray(logits[0, :-1])


def perplexity(logits: np.ndarray, token_ids: list[int]) -> float:
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    return float(np.exp(-logp[np.arange(len(token_ids) - 1), token_ids[1:]].mean()))
