"""How much KV cache a replica gets, and the longest sequence it then holds."""
from __future__ import annotations

import logging

import jax

from jaxserve.options import CPU_KV_CACHE_BYTES

logger = logging.getLogger("jaxserve")


def fitted_max_model_len(max_model_len: int, num_pages: int, block_size: int, asked: bool) -> int:
    """A max_model_len sequence must fit the KV cache, or every request that leaves max_tokens unset (the OpenAI
    clients' default for chat) is refused while the model advertises the full length. As vLLM: an explicit
    max_model_len that does not fit is an error, the model's own context is lowered to what fits."""
    fits = (num_pages - 1) * block_size  # page 0 is scratch
    if max_model_len <= fits:
        return max_model_len
    if asked or fits < 2:
        raise ValueError(f"max_model_len {max_model_len} does not fit the KV cache, which holds {fits} "
                         "tokens: lower max_model_len or raise the KV budget (kv_cache_memory_bytes / "
                         "gpu_memory_utilization)")
    logger.warning("max_model_len lowered from the model's %d to %d tokens: the most one sequence can hold in "
                   "the KV cache (raise the KV budget for more)", max_model_len, fits)
    return fits


def default_kv_budget(weight_bytes: int, utilization: float) -> int:
    """The KV budget per device: CPU_KV_CACHE_BYTES on CPU (no memory limit to take a share of), else
    `utilization` of the device's memory less the weights, a tenth of it left for activations and programs."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return CPU_KV_CACHE_BYTES
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if not limit:
        return CPU_KV_CACHE_BYTES
    return int((limit * utilization - weight_bytes) * 0.9)
