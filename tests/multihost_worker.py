"""One process of a multi-process engine (tests/multihost/test_multihost.py starts several):

    python multihost_worker.py MODEL_DIR COORDINATOR NUM_PROCESSES PROCESS_ID TENSOR_PARALLEL OUT_JSON [OPTION...]

Every process runs this same script, as on a real multi-host slice; each writes the outputs it got. A COORDINATOR
of "lws:PORT" reads the processes from LeaderWorkerSet's variables (LWS_GROUP_SIZE, LWS_WORKER_INDEX) instead:
NUM_PROCESSES and PROCESS_ID then go unused. Options:
`forever`: write OUT_JSON.ready once the engine is up, then generate until killed; `keep=N`: keep N published
messages (multihost.channel.KEEP_MESSAGES), so followers must acknowledge often; `no-warmup`: compile on first use;
`fail-step`: process 0's fifth step after start-up raises once it is published, and the script carries on
generating, as a server would.
"""
import json
import sys
from pathlib import Path

from jaxserve import LLM, SamplingParams, multihost

ENGINE = dict(dtype="float32", max_model_len=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 320 for j in range(n)]} for i, n in enumerate([3, 9, 17, 30])]
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)]


def fail_fifth_run(runner):
    run, calls = runner.run, []

    def failing(batch):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected device failure")
        return run(batch)
    runner.run = failing


if __name__ == "__main__":
    model, coordinator, num_processes, process_id, tp, out = sys.argv[1:7]
    options = sys.argv[7:]
    for option in options:
        if option.startswith("keep="):
            multihost.channel.KEEP_MESSAGES = int(option[5:])
    processes = {} if coordinator.startswith("lws") else dict(num_processes=int(num_processes),
                                                               process_id=int(process_id))
    llm = LLM(model, coordinator_address=coordinator, **processes, tensor_parallel_size=int(tp),
              warmup="no-warmup" not in options, **ENGINE)
    if "forever" in options:
        Path(out + ".ready").touch()
        while True:
            llm.generate(PROMPTS, PARAMS[1], use_tqdm=False)
    if "fail-step" in options:
        if llm.is_leader:
            fail_fifth_run(llm.runner)
        for _ in range(3):
            try:
                llm.generate(PROMPTS, PARAMS[0], use_tqdm=False)
            except RuntimeError as e:
                print(f"generate failed: {e}", flush=True)
    results = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)] for p in PARAMS]
    Path(out).write_text(json.dumps(results))
