"""PEFT LoRA adapters made in a test: on an HF model, with random non-zero B (PEFT starts B at zero), saved with
save_pretrained, and the HF model with the adapter as the reference."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def peft_adapter(model, path, seed: int, b_std: float = 0.05, **lora_config):
    """Yields `model` with a LoRA adapter (peft.LoraConfig(**lora_config)) whose B is random, saved to `path`;
    the model is itself again afterwards."""
    import peft
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **lora_config))
    try:
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, b_std)
        wrapped.save_pretrained(path)
        yield wrapped.eval()
    finally:
        wrapped.unload()


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, min_margin: float = 1e-3) -> list[list[int]]:
    """HF's greedy continuations of prompts of one length (one batch, no padding), checked to have no near-tie
    (where two correct implementations may differ)."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("prompts of one length: a batch without padding")
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(prompts), attention_mask=torch.ones(len(prompts), len(prompts[0]),
                                                                                           dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    top2 = torch.stack(out.logits).topk(2).values  # [new_tokens, B, 2]
    margin = (top2[..., 0] - top2[..., 1]).min().item()
    assert margin > min_margin, f"a near-tie in HF's greedy tokens (margin {margin:.2g}): pick another prompt or seed"
    return out.sequences[:, len(prompts[0]):].tolist()
