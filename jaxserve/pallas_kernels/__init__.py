"""Pallas kernels: ragged paged attention for GPU (Triton lowering; `ragged_attention`) and TPU (Mosaic;
`ragged_attention_tpu`), both with the arguments and result of their plain-jnp oracle, `ragged_attention_reference`
(`reference`). `jaxserve.model.attention.attention` reaches them through `ragged_kernel_for`, by the resolved backend;
on CPU they run in Pallas interpret mode (tests). Also weight-only int4 matmuls that dequantize in the kernel (GPU
and TPU; `quantized_matmul`, run by `jaxserve.model.quant.matmul`), and the multi-LoRA term (`lora`: `lora_delta_gpu`,
`lora_delta_tpu`, with `reference.lora_delta_reference`'s arguments and result).
"""
import functools

from jaxserve.pallas_kernels.gpu_blocks import HOPPER_CORES, HOPPER_SHARED_MEMORY
from jaxserve.pallas_kernels.lora import lora_delta_gpu, lora_delta_tpu
from jaxserve.pallas_kernels.quantized_matmul import int4_matmul, int4_matmul_tpu
from jaxserve.pallas_kernels.ragged_attention import ragged_attention_gpu

# Block sizes per backend, in one place. gpu: 16 tokens per program in prefill and mixed steps (16 / G in
# decode-only ones), the rest derived per shape from the chip's shared memory (H100 / H200) by
# `gpu_blocks.gpu_blocks`, and rows' cached keys split over programs until the grid fills the chip's SMs
# (`gpu_blocks.key_splits`); tpu: 16 tokens per program in prefill and mixed steps (8 / gcd(G, 8) in decode-only ones),
# pages per key block and the VMEM limit derived per shape from the chip's VMEM by `tpu_blocks.tpu_blocks` (the
# chip's own capacity where Mosaic knows the target: `_tpu_vmem`). The interpret sizes are small so that CPU tests, on
# small shapes, still cross query, key and page blocks, and split a few-row decode step's keys.
BLOCK_SIZES = {
    "gpu": {"block_q": 16, "shared_memory": HOPPER_SHARED_MEMORY, "cores": HOPPER_CORES},
    "gpu-interpret": {"block_q": 4, "block_k": 4, "block_pages": 2, "cores": 16},
    "tpu": {"block_q": 16},
    "tpu-interpret": {"block_q": 4, "pages_per_block": 2},
}


# The multiple a backend's pages store head_dim at (`jaxserve.cache.kv_cache`). TPU tiles an array's two minor
# dimensions by (8, 128): a head's [page_size, head_dim] of a page is whole tiles, which Mosaic DMAs in place, only
# when head_dim is a multiple of 128. Else XLA relays the whole cache out around every kernel call (deviceless,
# SmolLM2's head_dim 64: 269 MB of temporaries per call against 50 MB of K pages); padding costs 2x its pages.
PAGE_HEAD_DIM_MULTIPLE = {"tpu": 128, "tpu-interpret": 128}


def page_head_dim_multiple(backend: str) -> int:
    """What the pages of a resolved backend (reference, dense, pallas-gpu, pallas-tpu, + -interpret) round head_dim
    up to."""
    return PAGE_HEAD_DIM_MULTIPLE.get(backend.removeprefix("pallas-"), 1)


def ragged_kernel_for(backend: str):
    """The ragged attention kernel of a resolved Pallas backend (pallas-gpu, pallas-tpu, + -interpret), as a function
    with `ragged_attention_reference`'s signature: (q, k, v, k_pages, v_pages, rows, *, sliding_window=None)."""
    target = backend.removeprefix("pallas-")
    sizes = BLOCK_SIZES[target]
    interpret = target.endswith("interpret")
    if target.startswith("gpu"):
        return functools.partial(ragged_attention_gpu, interpret=interpret, **sizes)
    # Imported here, so the GPU and reference paths never depend on the TPU module.
    from jaxserve.pallas_kernels.ragged_attention_tpu import ragged_attention_tpu
    if interpret:
        from jax.experimental.pallas import tpu as pltpu
        interpret = pltpu.InterpretParams()  # the TPU interpreter: Mosaic semantics, checked
    return functools.partial(ragged_attention_tpu, interpret=interpret, **sizes, **({} if interpret else _tpu_vmem()))


def _tpu_vmem() -> dict:
    """{"vmem": bytes of VMEM a core} of the TPU the caller traces for (the chip at hand, or a deviceless compile's
    target under its mesh); {} (`tpu_blocks.TPU_VMEM`, v5e's and v6e's) when none is known."""
    from jax.experimental.pallas import tpu as pltpu
    try:
        return {"vmem": pltpu.get_tpu_info().vmem_capacity_bytes}
    except (ValueError, RuntimeError):  # not a TPU: tracing for export, or a test on CPU
        return {}


__all__ = ["ragged_attention_gpu", "BLOCK_SIZES", "PAGE_HEAD_DIM_MULTIPLE", "page_head_dim_multiple",
           "ragged_kernel_for", "int4_matmul", "int4_matmul_tpu", "lora_delta_gpu", "lora_delta_tpu"]
