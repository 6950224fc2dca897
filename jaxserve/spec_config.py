"""SpeculativeConfig: what `speculative_config={...}` asks for (vLLM's keys), validated up front, and its flags."""
from __future__ import annotations

import argparse
import dataclasses

from jaxserve.cli_flags import json_object_flag

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
# Methods whose proposer is a head over the target's hidden states, not a model of its own.
HEAD_METHODS = ("eagle3", "mtp")
MAX_SPECULATIVE_TOKENS = 15  # a verification row scores k + 1 tokens; past this, acceptance never pays for it


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # The draft (draft_model): a .gguf file, a HF directory or a jaxserve checkpoint; the head (eagle3): a directory
    # in the EAGLE-3 reference layout or the speculators one (`jaxserve.weights.eagle3`); mtp: none (the MTP layer
    # is in the target's own checkpoint, as vLLM reads it), or that checkpoint's directory.
    model: str | None = None
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
        if self.method == "eagle3" and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs its head's checkpoint directory ('model')")
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


def check_speculation_with(c) -> None:
    """The engine options (an EngineConfig) a speculative head cannot serve with yet: each moves or splits K/V
    pages without the target's captured hidden states beside them, which the head would then read stale."""
    spec = c.speculative_config
    if spec is None or spec.method not in HEAD_METHODS:
        return
    if c.kv_offloading_size:
        raise ValueError(f"speculative method {spec.method!r} is not supported with kv_offloading_size yet")
    if c.decode_context_parallel_size > 1:
        raise ValueError(f"speculative method {spec.method!r} is not supported with decode_context_parallel_size > 1")


def add_speculative_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='speculative decoding as vLLM\'s flag: a JSON object of speculative_config, e.g. '
                        '\'{"method": "eagle3", "model": "HEAD_DIR", "num_speculative_tokens": 3}\' '
                        "(instead of the flags below)")
    p.add_argument("--speculative-method", default=None, choices=list(METHODS),
                   help="speculative decoding: ngram (prompt lookup, no model), draft_model (--draft-model), "
                        "eagle3 (--draft-model: an EAGLE-3 head's directory) or mtp (the target checkpoint's own "
                        "multi-token-prediction layer, no --draft-model)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="tokens proposed per verification (default 4 with a speculative method)")
    p.add_argument("--draft-model", default=None,
                   help="the draft for draft_model: a model sharing the target's tokenizer (.gguf, HF dir, checkpoint; "
                        "scripts/train_draft.py distills one for the default model); for eagle3 the head's directory "
                        "(scripts/train_eagle3.py trains one)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: the longest suffix looked up")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: the shortest suffix looked up")
    p.add_argument("--no-adaptive-speculation", dest="adaptive_speculation", action="store_false",
                   help="speculate for every sequence every step, not only where measured acceptance and step "
                        "costs say it pays")


def speculative_config_from_args(args: argparse.Namespace) -> dict | None:
    if getattr(args, "speculative_config", None) is not None:
        given = [f for f in ("speculative_method", "num_speculative_tokens", "draft_model") if getattr(args, f)]
        if given:
            raise ValueError(f"--speculative-config holds the whole speculative configuration: drop "
                             f"{', '.join('--' + g.replace('_', '-') for g in given)}")
        return json_object_flag("--speculative-config", args.speculative_config,
                                '{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}')
    method = args.speculative_method or ("draft_model" if args.draft_model else None)
    if method is None:
        if args.num_speculative_tokens is not None:
            raise ValueError("--num-speculative-tokens needs --speculative-method (or --draft-model)")
        return None
    config = dict(method=method, num_speculative_tokens=4 if args.num_speculative_tokens is None
                  else args.num_speculative_tokens, adaptive=args.adaptive_speculation)
    if method == "ngram":
        config.update(prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
    elif args.draft_model:
        config["model"] = args.draft_model
    return config
