"""Pallas kernels: flash attention (prefill) and paged attention (decode, verification), each with its `jax.numpy`
reference beside it. `jaxserve.attention.attention` is where the model reaches them, by backend setting.

Backends: GPU through Pallas' Triton lowering (see paged_attention.py for why); on CPU the kernels run in Pallas
interpret mode (tests); TPU (Mosaic) versions are not written yet, so "pallas" is refused there.
"""
from jaxserve.pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from jaxserve.pallas_kernels.paged_attention import (MASKED, merge_attention, paged_attention,
                                                     paged_attention_reference)

# Block sizes per backend, in one place. gpu: 64 x 64 flash tiles and 8-page (128-token at page size 16) paged
# blocks fit an H100/H200 SM's shared memory at head_dim 128 in float32 accumulation; "interpret" keeps CPU tests
# crossing block boundaries at small sizes.
BLOCK_SIZES = {
    "gpu": {"flash_block_q": 64, "flash_block_k": 64, "paged_block_pages": 8},
    "interpret": {"flash_block_q": 16, "flash_block_k": 16, "paged_block_pages": 2},
}

__all__ = ["flash_attention", "flash_attention_reference", "paged_attention", "paged_attention_reference",
           "merge_attention", "MASKED", "BLOCK_SIZES"]
