"""Which module a speculative head runs, by its kind: the one place that chooses between EAGLE-3 and MTP.

Both take and return the same (`jaxserve.model.eagle3.Eagle3Head`), so the head's steps, runner and proposer serve
either unchanged; what differs is the module and which of the target's params it shares (read from the target's
tree, not loaded twice).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.batch import RaggedRows
from jaxserve.cache import init_kv_cache
from jaxserve.model.decoder import DeclaredParams
from jaxserve.model.eagle3 import Eagle3Head
from jaxserve.model.head_config import HeadConfig
from jaxserve.model.mtp import SHARED_WITH_TARGET, MtpHead


def head_module(config: HeadConfig, dtype=jnp.float32, attention_backend: str = "reference", mesh=None):
    """The Flax module of a head of config.kind."""
    cls = MtpHead if config.kind == "mtp" else Eagle3Head
    return cls(config, dtype, attention_backend, mesh)


def shared_params(config: HeadConfig) -> tuple[str, ...]:
    """The top-level params a head takes from its target's tree when its checkpoint has no copy of its own."""
    return SHARED_WITH_TARGET if config.kind == "mtp" else ("embed_tokens",)


def declared_head_params(config: HeadConfig, dtype=jnp.float32) -> DeclaredParams:
    """The head's params tree (shapes, each leaf's logical axes) as its layers declare them: what a loader must
    build (`jaxserve.weights.eagle3`, `jaxserve.weights.mtp`) and how a mesh splits it."""
    def init():
        one = jnp.zeros(1, jnp.int32)
        rows = RaggedRows(positions=one, token_row=one, query_start=jnp.zeros(2, jnp.int32), cached_lens=one,
                          page_table=jnp.zeros((1, 1), jnp.int32))
        return head_module(config, dtype).init(
            jax.random.key(0), one, jnp.zeros((1, config.feature_size), dtype),
            jnp.zeros((1, config.hidden_size), dtype), jnp.ones(1, bool),
            init_kv_cache(config.layer_config(), 2, 16, dtype), rows)
    boxed = jax.eval_shape(init)
    return DeclaredParams(nn.meta.unbox(boxed), nn.get_partition_spec(boxed))
