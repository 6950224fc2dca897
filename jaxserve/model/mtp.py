"""The MTP head (multi-token prediction, DeepSeek-V3 style): a next-next-token layer that ships in the target's own
checkpoint, proposing tokens as an EAGLE-3 head does.

At head position i the input is token i + 1 and the target's final hidden state at i (`HeadConfig.feature_layers`
= (num_layers,): captured before the final norm; the target's final norm `norm` is applied here, since vLLM hands
the head the target's normed output). The embedding (`enorm`) and that state (`hnorm`) are normed, put side by side
as [embedding, hidden] and projected by `eh_proj` [2H -> H] to one hidden state, which one decoder layer of the
target's shape (its own K/V pages) transforms; the shared head, `shared_head_norm` and then the target's `lm_head`
over the full vocabulary, gives the logits. A chained proposal takes the head's own pre-norm output in place of the
target's state, as vLLM's DeepSeek MTP chain does. The embedding at position 0 is zeroed, as vLLM does for DeepSeek:
the checkpoints were trained without a token before the first. Names and the tensors they load from:
`jaxserve.weights.mtp`.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.model.decoder import DecoderLayer
from jaxserve.model.eagle3 import head_embeddings
from jaxserve.model.head_config import HeadConfig
from jaxserve.model.layers import Linear, RMSNorm
from jaxserve.parallel.mesh import model_size

# The target's params the head reads as its own (the same device arrays) when its checkpoint has no copy.
SHARED_WITH_TARGET = ("embed_tokens", "norm", "lm_head")


class MtpHead(nn.Module):
    config: HeadConfig
    dtype: Any = jnp.float32
    attention_backend: str = "reference"
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, token_ids, features, hidden, from_target, kv_cache, rows, logits_index=None):
        """As `jaxserve.model.eagle3.Eagle3Head`: token_ids [T] (at head position i: token i + 1); features
        [T, hidden], the target's final state (pre-norm) at each token's position; hidden [T, hidden], the head's
        own output at the position before (a chained token); from_target bool [T]; kv_cache [(k_pages, v_pages)];
        logits_index [S] or None (all tokens).

        Returns (logits [S or T, vocab_size] float32, each token's pre-norm output [T, H], [(k, v)])."""
        c, dt = self.config, self.dtype
        embeds = head_embeddings(self, c, dt, self.mesh, token_ids)  # [T, H]
        embeds = jnp.where(rows.positions[:, None] == 0, jnp.zeros_like(embeds), embeds)
        # The target's normed output, computed for chained tokens too (one row each), which then take `hidden`.
        target_state = RMSNorm(c.rms_norm_eps, dt, name="norm")(features.astype(dt))  # [T, H]
        h = jnp.where(from_target[:, None], target_state, hidden.astype(dt))
        x = jnp.concatenate([RMSNorm(c.rms_norm_eps, dt, name="enorm")(embeds),
                             RMSNorm(c.rms_norm_eps, dt, name="hnorm")(h)], axis=-1)  # [T, 2H]
        x = Linear(c.hidden_size, ("embed", "embed"), False, dt, name="eh_proj")(x)  # [T, H]
        out, kv = DecoderLayer(c.layer_config(), dt, self.attention_backend, self.mesh, name="layers_0")(
            x, kv_cache[0], rows)
        y = out if logits_index is None else out[logits_index]
        y = RMSNorm(c.rms_norm_eps, dt, name="shared_head_norm")(y)
        logits = Linear(c.vocab_size, ("embed", "vocab"), False, dt, model_size(self.mesh) == 1, name="lm_head")(y)
        return logits.astype(jnp.float32), out, [kv]
