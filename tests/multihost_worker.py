"""One process of a multi-process engine (tests/test_multihost.py starts several):

    python multihost_worker.py MODEL_DIR COORDINATOR NUM_PROCESSES PROCESS_ID TENSOR_PARALLEL OUT_JSON [forever]

Every process runs this same script, as on a real multi-host slice; each writes the outputs it got. With
`forever` it writes OUT_JSON.ready once the engine is up, then generates until it is killed.
"""
import json
import sys
from pathlib import Path

from jaxserve import LLM, SamplingParams

ENGINE = dict(max_model_len=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 320 for j in range(n)]} for i, n in enumerate([3, 9, 17, 30])]
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)]

if __name__ == "__main__":
    model, coordinator, num_processes, process_id, tp, out = sys.argv[1:7]
    llm = LLM(model, coordinator_address=coordinator, num_processes=int(num_processes), process_id=int(process_id),
              tensor_parallel_size=int(tp), **ENGINE)
    if sys.argv[7:] == ["forever"]:
        Path(out + ".ready").touch()
        while True:
            llm.generate(PROMPTS, PARAMS[1], use_tqdm=False)
    results = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)] for p in PARAMS]
    Path(out).write_text(json.dumps(results))
