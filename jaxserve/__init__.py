"""jaxserve: an LLM inference engine in JAX.

The public API is imported on first use (PEP 562), so what needs no engine (the router over servers,
jaxserve.router) imports no jax."""
import importlib

_PUBLIC = {"LLM": "jaxserve.engine.llm", "AsyncEngine": "jaxserve.engine.async_engine",
           "EngineConfig": "jaxserve.engine_config", "SamplingParams": "jaxserve.sampling_params",
           "SpeculativeConfig": "jaxserve.spec_config",
           "RequestOutput": "jaxserve.outputs", "CompletionOutput": "jaxserve.outputs", "Logprob": "jaxserve.outputs",
           "LoRARequest": "jaxserve.lora.request"}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # once
    return value


def __dir__():
    return sorted([*globals(), *_PUBLIC])
