"""A HF model directory's tokenizer files: tokenizer.json, tokenizer_config.json, generation_config.json and
chat_template.jinja, read into `Tokenizer`'s arguments (`Tokenizer.save` writes the first three back)."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def hf_tokenizer_args(path) -> dict:
    """`Tokenizer`'s arguments from a HF model directory: tokenizer.json, tokenizer_config.json,
    generation_config.json."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path} has no tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg = _read_json(path / "tokenizer_config.json")
    gen = _read_json(path / "generation_config.json")

    def token_id(token):  # tokenizer_config writes special tokens as strings or as AddedToken dicts
        token = token.get("content") if isinstance(token, dict) else token
        return tok.token_to_id(token) if token else None

    bos = token_id(cfg.get("bos_token"))
    if bos is None:
        bos = gen.get("bos_token_id")
    gen_eos = gen.get("eos_token_id")
    eos = [token_id(cfg.get("eos_token"))] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])
    add_bos = cfg.get("add_bos_token")
    if add_bos is None:  # no flag: BOS is added iff tokenizer.json's post-processor adds it
        add_bos = bos is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos]
    template = cfg.get("chat_template")
    if (path / "chat_template.jinja").is_file():  # newer transformers save the template beside the config
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return dict(tok=tok, bos_token_id=bos, eos_token_ids=[i for i in eos if i is not None], add_bos=bool(add_bos),
                chat_template=template)
