"""Loading a model from any source: the default model, a GGUF file, a HF directory, or a jaxserve checkpoint."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.quant import DEFAULT_GROUP_SIZE, QUANTIZATIONS, quantize_params
from jaxserve.weights.params import param_bytes, params_from_hf_tensors

logger = logging.getLogger("jaxserve")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    params: dict
    tokenizer: object | None  # jaxserve.tokenizer.Tokenizer
    quantization: dict | None = None  # {"method", "group_size", "quantize_embeddings"} when params are quantized


def resolve_dtype(dtype: str):
    if dtype == "auto":
        # XLA:CPU has no fast bf16 (decode is 5-10x slower than f32 there); accelerators want bf16.
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_model_path(model: str | None) -> Path:
    from jaxserve.weights.default_model import DEFAULT_MODEL, default_model_path
    if model is None or model == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"unknown model {model!r}: no such file or directory, and not a known model name "
                         f"(known: {DEFAULT_MODEL})")
    return path


def load_model(model: str | None, dtype, quantization: str | None = None, *, group_size: int | None = None,
               quantize_embeddings: bool = False, calibration_text: str | None = None) -> LoadedModel:
    """model: None (the default model), a known name, a .gguf file, a HF directory, or a jaxserve checkpoint.

    quantization (see jaxserve.quant): None, "int8", "int4" or "awq" (int4 calibrated on calibration_text, by
    default the text the package ships). A checkpoint written quantized loads as it was written.
    """
    from jaxserve.weights.orbax_ckpt import is_orbax_checkpoint, load_checkpoint
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS[1:]} or None, got {quantization!r}")
    path = resolve_model_path(model)
    start = time.perf_counter()
    saved = None
    if path.is_dir() and is_orbax_checkpoint(path):
        config, params, saved = load_checkpoint(path, dtype)
        tokenizer = _hf_tokenizer_or_none(path)
    elif path.is_dir():
        from jaxserve.weights.hf_dir import load_hf_dir
        config, tensors = load_hf_dir(path)
        params = params_from_hf_tensors(config, tensors, dtype)
        tokenizer = _hf_tokenizer_or_none(path)
    else:
        from jaxserve.weights.gguf import load_gguf
        config, tensors, tokenizer = load_gguf(path)
        params = params_from_hf_tensors(config, tensors, dtype)
    logger.info("loaded %s (%s, %d layers) in %.1f s: %.1f MB of %s parameters%s", path.name, config.architecture,
                config.num_layers, time.perf_counter() - start, param_bytes(params) / 1e6, jnp.dtype(dtype).name,
                f" ({saved['method']})" if saved else "")
    loaded = LoadedModel(path.name, config, params, tokenizer, saved)
    wanted = dict(method=quantization, group_size=group_size or DEFAULT_GROUP_SIZE.get(quantization),
                  quantize_embeddings=quantize_embeddings)
    if saved is not None:
        if quantization is not None and wanted != saved:
            raise ValueError(f"{path} is already quantized ({saved}); load it without asking for {wanted}")
        return loaded
    return quantize_model(loaded, quantization, group_size=group_size, quantize_embeddings=quantize_embeddings,
                          calibration_text=calibration_text)


def quantize_model(loaded: LoadedModel, method: str | None, *, group_size: int | None = None,
                   quantize_embeddings: bool = False, calibration_text: str | None = None) -> LoadedModel:
    if method is None:
        return loaded
    if group_size is not None and method == "int8":
        raise ValueError("a quantization group size applies to int4 and awq; int8 has a scale per output channel")
    group_size = group_size or DEFAULT_GROUP_SIZE.get(method)
    start = time.perf_counter()
    if method == "awq":
        from jaxserve.awq import CALIBRATION_TEXT, quantize_awq
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
    return dataclasses.replace(loaded, params=params, quantization=dict(
        method=method, group_size=group_size, quantize_embeddings=quantize_embeddings))


def _hf_tokenizer_or_none(path: Path):
    from jaxserve.tokenizer import Tokenizer
    if not (path / "tokenizer.json").is_file():
        logger.warning("%s has no tokenizer.json: only token-id prompts will work", path)
        return None
    return Tokenizer.from_hf_dir(path)
