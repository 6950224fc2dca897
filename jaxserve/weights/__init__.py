"""Loading a model from any source: the default model, a GGUF file, a HF directory, or a jaxserve checkpoint."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.weights.params import param_bytes, params_from_hf_tensors

if TYPE_CHECKING:  # imported where a tokenizer is loaded: the model alone needs none
    from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger("jaxserve")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    params: dict
    tokenizer: Tokenizer | None
    quantization: dict | None = None  # {"method", "group_size", "quantize_embeddings"} when params are quantized


def resolve_dtype(dtype: str):
    if dtype == "auto":
        # XLA:CPU has no fast bf16 (decode is 5-10x slower than f32 there); accelerators want bf16.
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_model_path(model: str | None) -> Path:
    from jaxserve.weights.default_model import DEFAULT_MODEL, KNOWN_MODELS, known_model_path
    if model is None:
        model = DEFAULT_MODEL
    if model in KNOWN_MODELS:
        return known_model_path(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"unknown model {model!r}: no such file or directory, and not a known model name "
                         f"(known: {', '.join(KNOWN_MODELS)})")
    return path


def load_model(model: str | None, dtype) -> LoadedModel:
    """model: None (the default model), a known name, a .gguf file, a HF directory, or a jaxserve checkpoint (which
    may hold quantized weights: they load as they were written; see jaxserve.quantize.apply)."""
    from jaxserve.weights.orbax_ckpt import is_orbax_checkpoint, load_checkpoint
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
    return LoadedModel(path.name, config, params, tokenizer, saved)


def _hf_tokenizer_or_none(path: Path):
    from jaxserve.tokenizer import Tokenizer
    if not (path / "tokenizer.json").is_file():
        logger.warning("%s has no tokenizer.json: only token-id prompts will work", path)
        return None
    return Tokenizer.from_hf_dir(path)
