"""jaxserve: an LLM inference engine in JAX."""
from jaxserve.async_engine import AsyncEngine
from jaxserve.engine import LLM
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
