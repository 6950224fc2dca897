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
from jaxserve.cpu_kernels.isa import NATIVE_BF16, cpu_features, has_native_bf16
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
    """"auto" is the fastest format whose quality check passes where it runs: bfloat16 on accelerators, and on a CPU
    with native bf16 products (avx512_bf16 or amx_bf16: see cpu_kernels.isa.NATIVE_BF16); float32 on other CPUs,
    where XLA:CPU widens bf16 in software. bfloat16's check: perplexity within 0.1% of float32's on the default model
    and Gemma 3 (scripts/eval_quality.py; docs/quantization.md)."""
    if dtype == "auto":
        chosen = auto_dtype(jax.default_backend(), cpu_features())
        logger.info("dtype auto: %s (%s)", jnp.dtype(chosen).name, _auto_reason(jax.default_backend()))
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def auto_dtype(backend: str, features: frozenset[str]):
    """What "auto" means on a backend; features: the CPU's /proc/cpuinfo flags (read only on "cpu")."""
    return jnp.bfloat16 if backend != "cpu" or has_native_bf16(features) else jnp.float32


def _auto_reason(backend: str) -> str:
    if backend != "cpu":
        return f"the {backend} backend"
    native = sorted(NATIVE_BF16 & cpu_features())
    return f"the CPU has {', '.join(native)}" if native else "the CPU has no native bfloat16 (no avx512_bf16, amx_bf16)"


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
