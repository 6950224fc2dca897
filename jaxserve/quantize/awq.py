"""Activation-aware int4 (AWQ, Lin et al. 2023): per input channel scales found from calibration activations.

Input channels that carry large activations matter most to a layer's output. Scaling a weight row up by s before
rounding (and its input down by s, see `Int4Weight.input_scale`) leaves the product unchanged but shrinks that
row's rounding error relative to its contribution. Per layer, s = mean|x|^alpha with alpha chosen on a grid to
minimise the layer's output error on the calibration activations; alpha = 0 is plain rounding, so on the
calibration set AWQ is never worse than it.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.layers import Linear
from jaxserve.model.quant import matmul, quantize_int4, quantize_params
from jaxserve.quantize.perplexity import next_token_logits

logger = logging.getLogger("jaxserve")

# Chapter IV of Alice's Adventures in Wonderland (Lewis Carroll, 1865; public domain): ~1.5k tokens of English prose.
CALIBRATION_TEXT = Path(__file__).parents[1] / "data" / "calibration.txt"
ALPHA_GRID = 20
MAX_ROWS = 256  # activation rows the output error is measured on (mean |x| uses all of them)


def linear_inputs(config, params, token_ids: list[int]) -> dict[tuple, jax.Array]:
    """Every Linear's input over one prefill of token_ids: {("params", "layers_0", "q_proj"): [tokens, in]}."""
    captured = {}

    def capture(next_fun, args, kwargs, context):
        if isinstance(context.module, Linear) and context.method_name == "__call__":
            x = args[0]
            captured[("params",) + tuple(context.module.path)] = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        return next_fun(*args, **kwargs)

    # Eagerly, so the captured activations are arrays rather than tracers of a jitted step.
    with jax.disable_jit(), nn.intercept_methods(capture):
        next_token_logits(config, params, token_ids)
    return captured


@functools.partial(jax.jit, static_argnames="group_size")
def search_input_scale(x, w, group_size: int):
    """x: [tokens, in] activations, w: [in, out] kernel -> (input_scale [in], output error per alpha [grid])."""
    mean_abs = jnp.mean(jnp.abs(x), axis=0)  # [in]
    rows = x[:: max(1, x.shape[0] // MAX_ROWS)]
    reference = rows @ w

    def input_scale(alpha):
        s = jnp.maximum(mean_abs ** alpha, 1e-4)
        return jnp.sqrt(s.max() * s.min()) / s  # 1 / s, normalised so the scales straddle 1

    def error(alpha):
        q = quantize_int4(w, group_size, input_scale(alpha))
        return jnp.mean((matmul(rows, q) - reference) ** 2)

    alphas = jnp.arange(ALPHA_GRID, dtype=jnp.float32) / ALPHA_GRID
    errors = jax.lax.map(error, alphas)
    return input_scale(alphas[jnp.argmin(errors)]), errors


def find_input_scales(config, params, token_ids: list[int], group_size: int, with_lm_head: bool = False) -> dict:
    """{module path: input_scale [in]} for every linear layer (and the LM head if it is to be quantized)."""
    inputs = linear_inputs(config, params, token_ids)
    scales, gains = {}, []
    for path, x in inputs.items():
        if path[-1] == "lm_head" and not with_lm_head:
            continue
        node = params
        for key in path:
            node = node[key]
        scales[path], errors = search_input_scale(x, node["kernel"].astype(jnp.float32), group_size)
        errors = np.asarray(errors)
        gains.append(errors[0] / max(errors.min(), 1e-30))
    logger.info("AWQ: %d layers calibrated on %d tokens; output error vs plain int4: x%.2f lower (median)",
                len(scales), len(token_ids), float(np.median(gains)))
    return scales


def quantize_awq(config, params, token_ids: list[int], group_size: int, quantize_embeddings: bool = False) -> dict:
    scales = find_input_scales(config, params, token_ids, group_size, with_lm_head=quantize_embeddings)
    return quantize_params(params, "awq", quantize_embeddings=quantize_embeddings, group_size=group_size,
                           input_scales=scales)
