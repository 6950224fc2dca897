"""The tiers conftest.py marks from what a test uses: each signal catches its use, and misses the look-alikes (the
shared tiny Llama is fast; a name that merely contains a signal's word is not it)."""
import sys

import pytest

TIER_SIGNALS = sys.modules["conftest"].TIER_SIGNALS


@pytest.mark.parametrize("source, tiers", [
    ("def test_x(default_llm):", {"real_model"}),
    ("llm = LLM('gemma3-270m', max_model_len=64)", {"real_model"}),
    ("loaded = load_model(None, jnp.float32)", {"real_model"}),
    ("hf = transformers.AutoModelForCausalLM.from_pretrained(path)", {"reference"}),
    ("rows = aot.compile_serving(config, chip)", {"aot"}),
    ("r = subprocess.run([sys.executable, '-m', 'jaxserve.cli'])", {"processes"}),
    ("cluster = ray.cluster_utils.Cluster(); ray.init(address=cluster.address)", {"processes"}),
    ("llm = make_llm(tiny_dir, tensor_parallel_size=2)", {"multi_device"}),
    ("save_tiny_model('qwen3', path)", {"model_zoo"}),
    ("llm = make_llm(tiny_dir, warmup=True)", {"warmup"}),
    ("prompt = ids[:LONG_CONTEXT]", {"long_context"}),
    # look-alikes: the shared tiny Llama, a local named like a signal, a warm-up that is switched off
    ("save_tiny_model('llama', path, seed=1)", set()),
    ("llm = LLM(tiny_dir, warmup=False)", set()),
    ("my_aot_rows = []; subprocesses = 0", set()),
])
def test_each_signal_catches_its_use_and_only_it(source, tiers):
    assert {tier for tier, signal in TIER_SIGNALS.items() if signal.search(source)} == tiers, source


def test_a_test_that_uses_nothing_heavy_is_fast(request):
    assert request.node.get_closest_marker("fast") is not None
    assert not any(request.node.get_closest_marker(tier) for tier in TIER_SIGNALS)


def test_a_fixture_of_a_fixture_counts(request, hf_default_model_lookalike):
    """The fixture closure is read: this test names no signal itself, its fixture's fixture does."""
    assert request.node.get_closest_marker("real_model") is not None


@pytest.fixture
def hf_default_model_lookalike(default_gguf_path_unused):
    return default_gguf_path_unused


@pytest.fixture
def default_gguf_path_unused():
    return "default_gguf_path"  # the source names the signal; nothing is loaded
