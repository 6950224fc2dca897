"""Records lm-evaluation-harness's own `hf` backend on the default model (HF transformers, float32, from the same
GGUF jaxserve loads) over tests/server/test_lm_eval.py's two tiny tasks into tests/data/lm_eval_hf.json: the reference
that test compares `jaxserve serve` against, per document. (HF's reading of the GGUF, its tokenizer and its evaluation
take minutes on two cores: recorded, not recomputed. Re-record after an lm-eval, transformers or task change.)

    python scripts/record_lm_eval_references.py [--out tests/data/lm_eval_hf.json]
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import transformers

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
from test_lm_eval import MC, TASKS, evaluate, per_document  # noqa: E402 - the test's own tasks and settings

from jaxserve.weights.default_model import default_model_path  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(TESTS / "data" / "lm_eval_hf.json"))
    args = p.parse_args()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    out = Path(args.out).resolve()
    os.chdir(TASKS)  # the task files name their data files relative to it
    hf = evaluate(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu"))
    source = (f"lm-eval {lm_eval.__version__} hf backend, HF transformers {transformers.__version__}, torch "
              f"{torch.__version__}, float32, from {path.name}")
    out.write_text(json.dumps(dict(source=source, acc=hf["results"][MC]["acc,none"], documents=per_document(hf)),
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
