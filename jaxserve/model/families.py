"""The supported families: for each checkpoint architecture, how its checkpoint names the weights.

Every family runs `jaxserve.model.decoder.DecoderModel`, its differences carried by `ModelConfig`; what differs
here is the checkpoint: the names of its norms (Gemma's post_attention_layernorm is the attention's output norm,
where Llama's is the FFN's input norm) and their convention (Gemma's RMSNorm multiplies by 1 + w; the 1 is added
at load, so one RMSNorm serves all). Linear layers are named alike in every family.
"""
from __future__ import annotations

import dataclasses

# Our linear module -> its name under "model.layers.N." in a HF checkpoint.
LINEARS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
           "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
           "down_proj": "mlp.down_proj"}
_LLAMA_NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}
_QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


@dataclasses.dataclass(frozen=True)
class Family:
    norms: dict = dataclasses.field(default_factory=lambda: dict(_LLAMA_NORMS))  # ours -> the checkpoint's
    norm_offset: float = 0.0  # added to every norm weight at load


FAMILIES = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(),
    "Qwen3ForCausalLM": Family(norms={**_LLAMA_NORMS, **_QK_NORMS}),
    "Gemma3ForCausalLM": Family(norms={"input_layernorm": "input_layernorm",
                                       "attn_output_norm": "post_attention_layernorm",
                                       "post_attention_layernorm": "pre_feedforward_layernorm",
                                       "ffn_output_norm": "post_feedforward_layernorm", **_QK_NORMS},
                                norm_offset=1.0),
}


def family_of(config) -> Family:
    return FAMILIES[config.architecture]
