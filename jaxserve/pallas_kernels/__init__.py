"""Pallas kernels: flash attention (prefill) and paged attention (decode, verification), for GPU (Triton lowering)
and TPU (Mosaic), each beside its `jax.numpy` reference. `jaxserve.attention.attention` reaches them through
`kernels_for`, by the resolved backend; on CPU they run in Pallas interpret mode (tests). Also weight-only int8 /
int4 matmuls that dequantize in the kernel (GPU; `quantized_matmul`).
"""
import functools

from jaxserve.pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from jaxserve.pallas_kernels.flash_attention_tpu import flash_attention_tpu
from jaxserve.pallas_kernels.paged_attention import (MASKED, merge_attention, paged_attention,
                                                     paged_attention_reference)
from jaxserve.pallas_kernels.paged_attention_tpu import paged_attention_tpu
from jaxserve.pallas_kernels.quantized_matmul import int4_matmul, int8_matmul

# Block sizes per backend, in one place. gpu: 64 x 64 flash tiles and 8-page (128 tokens at page size 16) paged
# blocks keep a head_dim-128 float32 accumulator within an SM's shared memory; tpu: 128 x 128 flash tiles match the
# MXU, and the paged kernel's block is one page by design. The interpret sizes keep CPU tests crossing blocks.
BLOCK_SIZES = {
    "gpu": {"flash_block_q": 64, "flash_block_k": 64, "paged_block_pages": 8},
    "gpu-interpret": {"flash_block_q": 16, "flash_block_k": 16, "paged_block_pages": 2},
    "tpu": {"flash_block_q": 128, "flash_block_k": 128},
    "tpu-interpret": {"flash_block_q": 16, "flash_block_k": 16},
}


def kernels_for(backend: str):
    """(paged, flash) attention functions for a resolved Pallas backend: pallas-gpu, pallas-tpu, + -interpret."""
    target = backend.removeprefix("pallas-")
    sizes = BLOCK_SIZES[target]
    interpret = target.endswith("interpret")
    if target.startswith("gpu"):
        paged = functools.partial(paged_attention, block_pages=sizes["paged_block_pages"], interpret=interpret)
        flash = flash_attention
    else:
        if interpret:
            from jax.experimental.pallas import tpu as pltpu
            interpret = pltpu.InterpretParams()  # the TPU interpreter: Mosaic semantics, checked
        paged = functools.partial(paged_attention_tpu, interpret=interpret)
        flash = flash_attention_tpu
    flash = functools.partial(flash, block_q=sizes["flash_block_q"], block_k=sizes["flash_block_k"],
                              interpret=interpret)
    return paged, flash


__all__ = ["flash_attention", "flash_attention_reference", "flash_attention_tpu", "paged_attention",
           "paged_attention_reference", "paged_attention_tpu", "merge_attention", "MASKED", "BLOCK_SIZES",
           "kernels_for", "int8_matmul", "int4_matmul"]
