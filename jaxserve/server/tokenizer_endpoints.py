"""vLLM's tokenizer endpoints, so that a client needs no local tokenizer (lm-evaluation-harness's remote tokenizer
reads exactly these): `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`. Bodies checked and answered
here, pure functions of the served model's tokenizer; `jaxserve.server.tokenizer_routes` routes them."""
from __future__ import annotations

from jaxserve.openai.errors import ApiError
from jaxserve.openai.requests import check_body_fields, parse_chat

_TOKENIZE = {"model": (str,), "prompt": (str,), "add_special_tokens": (bool,), "messages": (list,),
             "add_generation_prompt": (bool,), "return_token_strs": (bool,)}
_DETOKENIZE = {"model": (str,), "tokens": (list,)}


def tokenize(body: dict, tokenizer, max_model_len: int) -> dict:
    """{prompt, add_special_tokens (true)} or {messages, add_generation_prompt (true)} -> {tokens, count,
    max_model_len} (and token_strs with return_token_strs). Messages go through the chat template, which writes
    any BOS itself."""
    check_body_fields(body, _TOKENIZE)
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "send exactly one of prompt or messages", "prompt")
    if "messages" in body:
        messages, _, _ = parse_chat({"messages": body["messages"]})  # checked as a chat request's
        try:
            text = tokenizer.apply_chat_template(messages, body.get("add_generation_prompt", True) is not False)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        special = False
    else:
        text, special = body["prompt"], body.get("add_special_tokens", True) is not False
    try:
        ids = tokenizer.encode(text, add_special_tokens=special)
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e), "prompt") from None
    answer = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if body.get("return_token_strs"):
        answer["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
    return answer


def detokenize(body: dict, tokenizer, vocab_size: int) -> dict:
    """{tokens: [ids]} -> {prompt: their text} (special tokens kept, as vLLM)."""
    check_body_fields(body, _DETOKENIZE)
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(400, "tokens must be an array of token ids", "tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"token ids must be in [0, {vocab_size}), got {bad[0]}", "tokens")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """What vLLM's /tokenizer_info returns of an HF tokenizer: its class, special tokens (as text), chat template
    and length."""
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")

    def text(token_id):
        return tokenizer.id_to_token(token_id) if token_id is not None else None
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(tokenizer.bos_token_id),
            "eos_token": text(eos), "pad_token": None, "unk_token": None, "add_bos_token": tokenizer.add_bos,
            "add_eos_token": False, "chat_template": tokenizer.chat_template, "model_max_length": max_model_len,
            "vocab_size": tokenizer.vocab_size}
