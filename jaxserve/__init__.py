"""jaxserve: an LLM inference engine in JAX."""
from jaxserve.async_engine import AsyncEngine
from jaxserve.engine import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_config import SpeculativeConfig

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "SpeculativeConfig", "RequestOutput",
           "CompletionOutput", "Logprob", "LoRARequest"]
