"""SpeculativeConfig: what `speculative_config={...}` asks for (vLLM's keys), validated up front."""
from __future__ import annotations

import dataclasses

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 15  # a verification row scores k + 1 tokens; past this, acceptance never pays for it


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft (draft_model): a .gguf file, a HF directory or a jaxserve checkpoint
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 2  # ngram: the shortest
    # Speculate only where measured acceptance and step costs say it pays (jaxserve.batching.speculation.controller);
    # False: every decoding sequence proposes every step, as in vLLM.
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs a draft model ('model' / --draft-model)")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative method 'ngram' uses no model; drop 'model' or use method 'draft_model'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
            raise ValueError(f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or a dict of its fields (unknown keys are an error, not ignored)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(fields)}")
        missing = [f for f in ("method", "num_speculative_tokens") if f not in value]
        if missing:
            raise ValueError(f"speculative_config needs {missing}")
        return cls(**value)


def check_draft(draft_config, target_config, max_model_len: int) -> None:
    """A draft must speak the target's vocabulary and reach as far as the target's sequences."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_config.vocab_size} tokens) is not the target's "
                         f"({target_config.vocab_size}): a draft must share the target's tokenizer")
    if draft_config.derived_max_model_len < max_model_len:  # (stretched by its RoPE scaling, as the target's)
        raise ValueError(f"the draft model's context ({draft_config.derived_max_model_len} tokens) is shorter than "
                         f"max_model_len ({max_model_len}); lower max_model_len or use another draft")
