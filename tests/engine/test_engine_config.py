"""EngineConfig: one frozen, validated set of engine arguments, and the CLI flags that build it. No model loads."""
import dataclasses

import pytest

from jaxserve import LLM, AsyncEngine, EngineConfig, SpeculativeConfig
from jaxserve.cli import build_parser


def test_defaults_and_frozen():
    c = EngineConfig()
    # max_num_batched_tokens None: 512 a step, growing by queue depth (jaxserve.batching.token_budget)
    assert (c.model, c.max_num_seqs, c.max_num_batched_tokens, c.block_size, c.warmup) == (None, 64, None, 16, True)
    assert (c.tensor_parallel_size, c.data_parallel_size, c.coordinator_address) == (1, 1, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_num_seqs = 8


def test_speculative_config_is_parsed():
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert c.speculative_config == SpeculativeConfig("ngram", 3)
    assert EngineConfig(speculative_config=c.speculative_config) == c


@pytest.mark.parametrize("bad, error, message", [
    (dict(model=3), TypeError, "model"),
    (dict(max_model_len=1), ValueError, "max_model_len"),
    (dict(max_model_len="long"), TypeError, "max_model_len"),
    (dict(dtype="int8"), ValueError, "dtype"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_num_seqs=2.0), TypeError, "max_num_seqs"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), ValueError, "at least max_num_seqs"),
    (dict(block_size=True), TypeError, "block_size"),
    (dict(kv_cache_memory_bytes=0), ValueError, "kv_cache_memory_bytes"),
    (dict(gpu_memory_utilization=0), ValueError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(seed="x"), TypeError, "seed"),
    (dict(enable_prefix_caching="no"), TypeError, "enable_prefix_caching"),
    (dict(scheduling_policy="lifo"), ValueError, "scheduling_policy"),
    (dict(ttft_slo=0), ValueError, "ttft_slo"),
    (dict(tpot_slo=-1.0), ValueError, "tpot_slo"),
    (dict(attention_backend="flash"), ValueError, "attention_backend"),
    (dict(quantization="fp4"), ValueError, "quantization"),
    (dict(quantization="int4", quantization_group_size=0), ValueError, "quantization_group_size"),
    (dict(quantization="int8", quantization_group_size=64), ValueError, "group size"),
    (dict(quantize_embeddings=True), ValueError, "quantize_embeddings"),
    (dict(quantization="int4", calibration_text="text"), ValueError, "awq"),
    (dict(kv_cache_dtype="fp8"), ValueError, "kv_cache_dtype"),
    (dict(kv_offloading_size=-1), ValueError, "kv_offloading_size"),
    (dict(kv_offloading_size="4"), ValueError, "kv_offloading_size"),
    (dict(kv_offloading_size=float("nan")), ValueError, "kv_offloading_size"),
    (dict(kv_offloading_size=4, enable_prefix_caching=False), ValueError, "enable_prefix_caching"),
    (dict(kv_offloading_size=4, speculative_config={"method": "draft_model", "model": "d.gguf",
                                                    "num_speculative_tokens": 2}), ValueError, "draft model"),
    (dict(kv_offloading_size=4, role="decode"), ValueError, "disaggregated"),
    (dict(speculative_config={"method": "medusa", "num_speculative_tokens": 2}), ValueError, "method"),
    (dict(speculative_config="ngram"), TypeError, "speculative_config"),
    (dict(warmup=None), TypeError, "warmup"),
    (dict(async_scheduling="on"), TypeError, "async_scheduling"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size"),
    (dict(data_parallel_size=-2), ValueError, "data_parallel_size"),
    (dict(coordinator_address="host:1234"), ValueError, "all three"),
    (dict(coordinator_address="host:1234", num_processes=2), ValueError, "all three"),
    (dict(num_processes=2, process_id=0), ValueError, "all three"),
    (dict(coordinator_address="host:1234", num_processes=0, process_id=0), ValueError, "num_processes"),
    (dict(coordinator_address="host:1234", num_processes=2, process_id=2), ValueError, "process_id"),
    (dict(coordinator_address="host:1234", num_processes=2, process_id=-1), ValueError, "process_id"),
    (dict(coordinator_address=1234, num_processes=2, process_id=0), TypeError, "coordinator_address"),
])
def test_bad_values_are_refused(bad, error, message):
    with pytest.raises(error, match=message):
        EngineConfig(**bad)


def test_distributed_settings_all_together():
    c = EngineConfig(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3)
    assert (c.coordinator_address, c.num_processes, c.process_id) == ("10.0.0.1:1234", 4, 3)


def test_unknown_engine_argument_is_a_type_error():
    # Raised by the config, before any model loads.
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)
    with pytest.raises(TypeError, match="gpu_utilization"):
        AsyncEngine.from_args(gpu_utilization=0.5)


def parse(*argv):
    return EngineConfig.from_cli_args(build_parser().parse_args(argv))


def test_cli_generate_flags():
    c = parse("generate", "--prompt", "hi", "--model", "m.gguf", "--dtype", "bfloat16", "--max-model-len", "256",
              "--block-size", "8", "--kv-cache-dtype", "int8", "--warmup", "--seed", "7",
              "--speculative-method", "ngram", "--prompt-lookup-min", "1", "--no-adaptive-speculation",
              "--tensor-parallel-size", "2", "--data-parallel-size", "3", "--coordinator-address", "h:1",
              "--num-processes", "2", "--process-id", "1")
    assert c == EngineConfig(model="m.gguf", dtype="bfloat16", max_model_len=256, block_size=8, kv_cache_dtype="int8",
                             max_num_seqs=1, warmup=True, tensor_parallel_size=2, data_parallel_size=3,
                             coordinator_address="h:1", num_processes=2, process_id=1,
                             speculative_config=SpeculativeConfig("ngram", 4, prompt_lookup_min=1, adaptive=False))
    assert c.seed == 0  # generate's --seed seeds sampling, not the engine
    # One prompt at a time, no warm-up unless asked.
    assert parse("chat") == EngineConfig(max_num_seqs=1, warmup=False)


def test_kv_offloading_size_as_vllm_names_it():
    assert parse("serve", "--kv-offloading-size", "2.5").kv_offloading_size == 2.5
    assert EngineConfig().kv_offloading_size is None and EngineConfig(kv_offloading_size=0).kv_offloading_size == 0


def test_cli_serve_flags(tmp_path):
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("some text to calibrate on")
    c = parse("serve", "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--no-enable-prefix-caching",
              "--scheduling-policy", "priority", "--ttft-slo", "0.5", "--tpot-slo", "0.05",
              "--attention-backend", "reference", "--no-warmup", "--quantization", "awq",
              "--quantization-group-size", "64", "--quantize-embeddings", "--calibration-file", str(calibration),
              "--draft-model", "draft.gguf", "--num-speculative-tokens", "3", "--data-parallel-size", "2")
    assert c == EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, enable_prefix_caching=False,
                             scheduling_policy="priority", ttft_slo=0.5, tpot_slo=0.05, attention_backend="reference",
                             warmup=False, quantization="awq", quantization_group_size=64, quantize_embeddings=True,
                             calibration_text="some text to calibrate on", data_parallel_size=2,
                             speculative_config=SpeculativeConfig("draft_model", 3, model="draft.gguf"))
    assert parse("serve") == EngineConfig()  # serve's defaults are the engine's
    # Decided by the backend unless given, either way.
    assert parse("serve").async_scheduling is None
    assert parse("serve", "--async-scheduling").async_scheduling is True
    assert parse("serve", "--no-async-scheduling").async_scheduling is False


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--num-speculative-tokens", "2"], "--speculative-method"),
    (["serve", "--max-num-seqs", "0"], "max_num_seqs"),
    (["serve", "--process-id", "0"], "all three"),
])
def test_cli_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_every_flag_is_declared_on_its_field():
    """The flags are made from the fields' metadata: each field but seed (generate's --seed seeds sampling) is set
    by a flag of serve, and each of those flags sets a field back."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    flagged = {f.name for f in dataclasses.fields(EngineConfig) if "cli" in f.metadata}
    assert fields - flagged == {"seed"}
    serve = build_parser().parse_args(["serve"])
    assert EngineConfig.from_cli_args(serve) == EngineConfig()
    assert flagged - {"calibration_text", "speculative_config"} <= set(vars(serve))


def test_the_option_values_are_those_their_code_implements():
    """jaxserve.options holds what the config checks; the code that implements each option agrees."""
    from jaxserve import options
    from jaxserve.weights import resolve_dtype
    for dtype in options.DTYPES[1:]:
        resolve_dtype(dtype)  # each one the config accepts loads
    assert EngineConfig(attention_backend="dense").attention_backend == "dense"
