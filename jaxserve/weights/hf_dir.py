"""A HF model directory: config.json + *.safetensors (single or sharded) + tokenizer.json."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json, so it is not a HF model directory")
    try:
        config = ModelConfig.from_hf_config(json.loads(config_file.read_text()))
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file} is not a usable model config: {e!r}") from None
    return config, read_safetensors(path)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a directory's *.safetensors files (one or sharded) as numpy arrays, by name."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors weights")
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights file {f}: {e}") from None
    # bf16 has no numpy dtype of its own; ml_dtypes' bfloat16 arrays convert to float32 like any other.
    return tensors
