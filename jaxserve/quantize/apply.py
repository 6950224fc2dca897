"""Quantizing a loaded model's weights at load time (or for `jaxserve convert`): the method's dispatch, AWQ's
calibration text, the before/after bytes in the load log. The formats themselves are jaxserve.model.quant."""
from __future__ import annotations

import dataclasses
import logging
import time

from jaxserve.model.quant import DEFAULT_GROUP_SIZE, QUANTIZATIONS, quantize_params
from jaxserve.quantize.awq import CALIBRATION_TEXT, quantize_awq
from jaxserve.weights import LoadedModel
from jaxserve.weights.params import param_bytes

logger = logging.getLogger("jaxserve")


def quantize_model(loaded: LoadedModel, method: str | None, *, group_size: int | None = None,
                   quantize_embeddings: bool = False, calibration_text: str | None = None) -> LoadedModel:
    """method: None, "int8", "int4" or "awq" (int4 calibrated on calibration_text, by default the text the package
    ships). A model loaded already quantized (a checkpoint) is returned as it is, if it was quantized this way."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS[1:]} or None, got {method!r}")
    if group_size is not None and method == "int8":
        raise ValueError("a quantization group size applies to int4 and awq; int8 has a scale per output channel")
    group_size = group_size or DEFAULT_GROUP_SIZE.get(method)
    wanted = dict(method=method, group_size=group_size, quantize_embeddings=quantize_embeddings)
    if loaded.quantization is not None:
        if method is not None and wanted != loaded.quantization:
            raise ValueError(f"{loaded.name} is already quantized ({loaded.quantization}); load it without asking "
                             f"for {wanted}")
        return loaded
    if method is None:
        return loaded
    start = time.perf_counter()
    if method == "awq":
        if loaded.tokenizer is None:
            raise ValueError("awq needs the model's tokenizer to read its calibration text")
        token_ids = loaded.tokenizer.encode(calibration_text or CALIBRATION_TEXT.read_text())
        if len(token_ids) < 64:
            raise ValueError(f"awq calibration text is {len(token_ids)} tokens; give it at least 64")
        params = quantize_awq(loaded.config, loaded.params, token_ids[:loaded.config.max_position_embeddings],
                              group_size, quantize_embeddings)
    else:
        params = quantize_params(loaded.params, method, quantize_embeddings=quantize_embeddings,
                                 group_size=group_size)
    logger.info("%s%s weights: %.1f MB -> %.1f MB in %.1f s", method, f" (groups of {group_size})" if group_size
                else "", param_bytes(loaded.params) / 1e6, param_bytes(params) / 1e6, time.perf_counter() - start)
    return dataclasses.replace(loaded, params=params, quantization=wanted)
