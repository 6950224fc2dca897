"""HeadConfig: a speculative head's architecture, read from its checkpoint (EAGLE-3 or MTP), never hard-coded.

A head proposes the target's next tokens from the target's own hidden states: the target's step captures the inputs
of `feature_layers` (the residual stream entering those layers; num_layers: the final hidden state, before the final
norm) and keeps them by cache slot, as it keeps K/V (`jaxserve.runner.steps`). The head has one decoder layer with
its own K/V pages, indexed by the target's page ids.
"""
from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig

KINDS = ("eagle3", "mtp")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    kind: str  # "eagle3": EAGLE-3 (fc over the features, a layer over [embedding, hidden]); "mtp": see jaxserve.model
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's: proposals are target token ids
    draft_vocab_size: int  # the head's LM head's rows; d2t maps them to target ids (= vocab_size: the identity)
    target_hidden_size: int
    feature_layers: tuple[int, ...]  # target layers whose inputs it reads, ascending (num_layers: the final state)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | tuple | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    # EAGLE-3 (speculators' `norm_before_residual`): the layer's residual is the normed hidden input, not the input.
    norm_before_residual: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown speculative head kind {self.kind!r}; known: {KINDS}")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size {self.vocab_size}]")
        if not self.feature_layers or list(self.feature_layers) != sorted(set(self.feature_layers)):
            raise ValueError(f"feature_layers must be ascending and distinct, got {self.feature_layers}")

    @property
    def feature_size(self) -> int:
        """Floats the target keeps per token for the head: its captured layers' hidden states side by side."""
        return len(self.feature_layers) * self.target_hidden_size

    def layer_config(self) -> ModelConfig:
        """The head's decoder layer as a one-layer Llama config: its K/V cache, RoPE and budget are that model's.
        Its vocabulary is the target's: the head's steps sample target token ids."""
        return ModelConfig(architecture="LlamaForCausalLM", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                           max_position_embeddings=self.max_position_embeddings,
                           attention_bias=self.attention_bias)

    def check_target(self, target: ModelConfig) -> None:
        """A head fits only the target it was trained on: its hidden size, vocabulary and layers."""
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"the head reads hidden states of size {self.target_hidden_size} (target_hidden_size); "
                             f"the target's hidden_size is {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"the head's vocab_size {self.vocab_size} is not the target's {target.vocab_size}")
        if self.feature_layers[0] < 0 or self.feature_layers[-1] > target.num_layers:
            raise ValueError(f"the head reads layers {self.feature_layers} (eagle_aux_hidden_state_layer_ids); the "
                             f"target has {target.num_layers}")


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's layers when a checkpoint names none: a low, a middle and a high one, as vLLM takes them."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))
