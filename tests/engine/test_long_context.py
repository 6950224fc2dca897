"""One 128K-token request through the whole engine: a tiny YaRN x4 Llama's chunked prefill and decode against a
streaming numpy reference at positions near 32K, 64K and 128K, served after warm-up without compiling."""
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

from long_context import LONG_CONTEXT, StreamingReference, save_long_model

DECODE = 4


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("long-llama")
    return str(path), save_long_model(path, seed=0)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_a_128k_request_equals_a_streaming_reference_and_compiles_nothing_after_warmup(long_model):
    path, weights = long_model
    seed = 49
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 320, LONG_CONTEXT - DECODE).tolist()
    llm = LLM(path, dtype="float32", max_model_len=LONG_CONTEXT, block_size=16, max_num_seqs=2,
              max_num_batched_tokens=2048, kv_cache_memory_bytes=64 << 20, warmup=True)
    buckets = llm.runner.buckets
    assert buckets.widths() == (512, 2048, 8192)  # the tables of 8K, 32K and 128K tokens' pages
    compiled = llm.runner.steps.num_compiled()
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=DECODE, temperature=0, prompt_logprobs=0, logprobs=0))[0]
    assert llm.runner.steps.num_compiled() == compiled, "serving a 128K request after warm-up compiled"

    generated = out.outputs[0].token_ids
    assert len(generated) == DECODE
    tokens = prompt + generated
    # Probes on both sides of the 32K and 64K boundaries (the page-table widths' and YaRN's original context's),
    # and the last positions: the prompt's end and each decode step's.
    probes = np.array([8191, 8192, 32767, 32768, 65535, 65536, 98304] + list(range(len(prompt) - 2, len(tokens) - 1)))
    ref = log_softmax(StreamingReference(weights).logits(tokens, probes))  # [n, V]
    for i, p in enumerate(probes):
        target = tokens[p + 1]
        if p + 1 < len(prompt):
            got = out.prompt_logprobs[p + 1][target].logprob
        else:
            got = out.outputs[0].logprobs[p + 1 - len(prompt)][target].logprob
            # greedy: the reference's argmax, unless its top two are closer than float32 reaches
            top2 = np.sort(ref[i])[-2:]
            assert target == ref[i].argmax() or top2[1] - top2[0] < 1e-3, (seed, p, target, ref[i].argmax())
        assert abs(got - ref[i, target]) < 2e-3, (f"seed {seed}: position {p}: logprob of token {target} "
                                                 f"{got} != reference {ref[i, target]}")
