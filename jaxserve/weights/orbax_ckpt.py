"""jaxserve's own checkpoint: params saved with orbax beside config and tokenizer; the fastest way to load."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.quant import is_quantized, restore_nodes

MARKER = "jaxserve_config.json"
QUANTIZATION = "jaxserve_quantization.json"  # present when the params were saved quantized


def is_orbax_checkpoint(path: Path) -> bool:
    return (path / MARKER).is_file()


def save_checkpoint(path: Path, config: ModelConfig, params, tokenizer, quantization: dict | None = None) -> None:
    import orbax.checkpoint as ocp
    path = path.absolute()
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} exists and is not empty; choose a new directory")
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "params", params)
    if tokenizer is not None:
        tokenizer.save(path)
    if quantization is not None:
        (path / QUANTIZATION).write_text(json.dumps(quantization))
    (path / MARKER).write_text(config.to_json())  # written last: its presence means the checkpoint is complete


def load_checkpoint(path: Path, dtype) -> tuple[ModelConfig, dict, dict | None]:
    """Returns config, params (float leaves cast to dtype; quantized nodes as saved) and the quantization."""
    import orbax.checkpoint as ocp
    config = ModelConfig.from_json((path / MARKER).read_text())
    quantization = json.loads((path / QUANTIZATION).read_text()) if (path / QUANTIZATION).is_file() else None
    with ocp.StandardCheckpointer() as ckpt:
        params = restore_nodes(ckpt.restore(path.absolute() / "params"))
    cast = lambda x: x if is_quantized(x) else jnp.asarray(x, dtype)  # noqa: E731
    return config, jax.tree.map(cast, params, is_leaf=is_quantized), quantization
