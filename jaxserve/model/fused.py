"""Fused projections: a layer's q/k/v kernels as one [hidden, q + k + v] kernel and gate/up as one [hidden, 2 * mlp],
so a step runs one dot per group where the checkpoint has three and two.

Each group reads the same input, so fusing changes no product, only how many dots a step dispatches: on XLA:CPU a
batch-1 decode step is many small dots, each with a fixed cost beyond its weight reads (`with_fused_projections`).
The params a model is loaded, saved, split and adapted as keep the checkpoint's names; only a runner on one device
serves the fused form (`jaxserve.runner.model_runner`), and `DecoderLayer` reads whichever its params have.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxserve.model.quant import Int4Weight, Int8Rows, Int8Weight

# Fused name -> the projections it holds, in the order of its outputs.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_kernels(kernels: list):
    """One kernel whose outputs are each kernel's outputs in turn (float, Int8Weight or Int4Weight of the same
    kind and layout), or None where they cannot be one: different dtypes or kinds, int4 groups of other sizes,
    or AWQ input scales that differ (each scales the shared input its own way)."""
    first = kernels[0]
    if any(type(k) is not type(first) for k in kernels):
        return None
    cat = lambda xs: jnp.concatenate(xs, axis=-1)  # noqa: E731  # every leaf's last axis is the outputs
    if isinstance(first, Int8Weight):
        return Int8Weight(values=cat([k.values for k in kernels]), scale=cat([k.scale for k in kernels]))
    if isinstance(first, Int4Weight):
        scales = [k.input_scale for k in kernels]
        same_scale = all(s is None for s in scales) or (
            all(s is not None for s in scales) and all(bool(jnp.array_equal(s, scales[0])) for s in scales))
        if not same_scale or any(k.packed.shape[0] != first.packed.shape[0] or k.group_size != first.group_size
                                 for k in kernels):
            return None
        return Int4Weight(packed=cat([k.packed for k in kernels]), scale=cat([k.scale for k in kernels]),
                          offset=cat([k.offset for k in kernels]), input_scale=first.input_scale)
    if isinstance(first, Int8Rows) or any(k.dtype != first.dtype for k in kernels):
        return None
    return cat(kernels)


def fuse_layer(layer: dict) -> dict:
    """A layer's params with each FUSED group as its fused projection (kernel, and bias where each has one), and a
    group that cannot fuse as it was."""
    out = dict(layer)
    for fused, names in FUSED.items():
        if not all(n in layer for n in names):
            continue
        parts = [layer[n] for n in names]
        kernel = fuse_kernels([p["kernel"] for p in parts])
        if kernel is None or any(set(p) != set(parts[0]) for p in parts):
            continue
        out[fused] = {"kernel": kernel}
        if "bias" in parts[0]:
            out[fused]["bias"] = jnp.concatenate([p["bias"] for p in parts], axis=-1)
        for n in names:
            del out[n]
    return out


def with_fused_projections(params: dict) -> dict:
    """params with every decoder layer's q/k/v and gate/up fused (`fuse_layer`); the rest as it was.

    The default model's batch-1 decode after a 500-token prompt, the two forms interleaved in one engine (AMD EPYC
    2 vCPU, 2026-12-04, BENCHMARKS.md): float32 33.4 -> 29.9 ms a token, int8 -3%, bfloat16 -2.5%; the same bytes.
    """
    p = params["params"]
    layers = {k: fuse_layer(v) if k.startswith("layers_") else v for k, v in p.items()}
    return {**params, "params": layers}
