"""Rotary position embeddings (HF rotate-half convention) and the RoPE scalings configs write: linear, llama3, YaRN
and dynamic NTK, each as transformers' `ROPE_INIT_FUNCTIONS` computes it (inverse frequencies and an attention
factor that multiplies cos and sin, so q.k scales by its square).

Dynamic NTK differs from HF on purpose. HF recomputes the frequencies from each forward's current length (longest
position + 1), so a token's rotation depends on how long its sequence has grown, and its cached keys were rotated
with older frequencies. A ragged batch holds sequences of every length in one step, so, as vLLM, jaxserve fixes the
base at the longest length the scaling allows (factor x max_position_embeddings, the derived max_model_len): equal
to HF at that length, and plain RoPE's frequencies differ from it below. Frequencies are computed in float64 and
rounded once (HF computes in float32; the two agree to float32 rounding).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxserve.config import rope_type


def rope_parameters(head_dim: int, theta: float, scaling, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies float32 [head_dim / 2], attention factor) of HF rope_scaling (a dict, its items, or
    None), as transformers' ROPE_INIT_FUNCTIONS[rope_type](config) returns them."""
    kind = rope_type(scaling)
    scaling = dict(scaling or ())
    if kind == "default":
        return _plain(head_dim, theta).astype(np.float32), 1.0
    if kind == "linear":
        return (_plain(head_dim, theta) / scaling["factor"]).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(head_dim, theta, scaling).astype(np.float32), 1.0
    if kind == "yarn":
        inv_freq, attention_factor = _yarn(head_dim, theta, scaling, max_position_embeddings)
        return inv_freq.astype(np.float32), attention_factor
    if kind == "dynamic":
        seq_len = scaling["factor"] * max_position_embeddings  # the base at the longest length it allows (see above)
        return _dynamic(head_dim, theta, scaling["factor"], max_position_embeddings, seq_len).astype(np.float32), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, yarn, dynamic)")


def inverse_frequencies(head_dim: int, theta: float, scaling, max_position_embeddings: int = 2048) -> np.ndarray:
    """The inverse frequencies of rope_parameters alone."""
    return rope_parameters(head_dim, theta, scaling, max_position_embeddings)[0]


def _plain(head_dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [head_dim / 2]


def _llama3(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended smoothly.
    inv_freq, factor = _plain(head_dim, theta), scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(wavelen > old_ctx / low, inv_freq / factor,
                    np.where(wavelen < old_ctx / high, inv_freq, blended))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """The YaRN paper's attention temperature, 0.1 * mscale * ln(scale) + 1 (1 for no scaling)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict, max_position_embeddings: int) -> float:
    """YaRN's factor on cos and sin: `attention_factor` if given, else from factor (and mscale / mscale_all_dim)."""
    factor = _yarn_factor(scaling, max_position_embeddings)
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_original_context(scaling, max_position_embeddings: int) -> int:
    """The pretraining context YaRN stretches (HF: max_position_embeddings where the config leaves it out)."""
    return dict(scaling).get("original_max_position_embeddings") or max_position_embeddings


def _yarn_factor(scaling: dict, max_position_embeddings: int) -> float:
    # A config without a factor (DeepSeek-V3 style) stretches the original context to max_position_embeddings.
    if scaling.get("factor") is None:
        return max_position_embeddings / yarn_original_context(scaling, max_position_embeddings)
    return scaling["factor"]


def _yarn(head_dim: int, theta: float, scaling: dict, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Frequencies that turn fewer than beta_slow times over the original context are interpolated (divided by
    factor), those that turn more than beta_fast times kept, and the dimensions between ramp linearly."""
    factor = _yarn_factor(scaling, max_position_embeddings)
    original = yarn_original_context(scaling, max_position_embeddings)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1  # HF: `or` (0 is unset)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    inv_freq = _plain(head_dim, theta)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), yarn_attention_factor(scaling, max_position_embeddings)


def _dynamic(head_dim: int, theta: float, factor: float, max_position_embeddings: int, seq_len: float) -> np.ndarray:
    """HF's dynamic NTK frequencies at sequence length seq_len (never below max_position_embeddings)."""
    seq_len = max(seq_len, max_position_embeddings)
    base = theta * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _plain(head_dim, base)


def apply_rope(x, positions, inv_freq, attention_factor: float = 1.0):
    """x: [..., heads, head_dim]; positions: [...]. attention_factor multiplies cos and sin (YaRN's), as HF's."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., head_dim / 2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
