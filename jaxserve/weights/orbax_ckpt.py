"""jaxserve's own checkpoint: params saved with orbax beside config and tokenizer; the fastest way to load."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig

MARKER = "jaxserve_config.json"


def is_orbax_checkpoint(path: Path) -> bool:
    return (path / MARKER).is_file()


def save_checkpoint(path: Path, config: ModelConfig, params, tokenizer) -> None:
    import orbax.checkpoint as ocp
    path = path.absolute()
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} exists and is not empty; choose a new directory")
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "params", params)
    if tokenizer is not None:
        tokenizer.save(path)
    (path / MARKER).write_text(config.to_json())  # written last: its presence means the checkpoint is complete


def load_checkpoint(path: Path, dtype) -> tuple[ModelConfig, dict]:
    import orbax.checkpoint as ocp
    config = ModelConfig.from_json((path / MARKER).read_text())
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(path.absolute() / "params")
    return config, jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
