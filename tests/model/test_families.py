"""Every engine feature on the newer families (tiny random Qwen3 and Gemma 3 checkpoints; their HF parity is in
test_hf_parity): the Pallas kernels, tensor parallelism, quantized weights and KV pages, prefix caching under
continuous batching."""
import numpy as np
import pytest

from jaxserve import SamplingParams

from hf_models import save_tiny_model
from tiny import make_llm, prompts, step_logits

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, path)
    return str(path)


def tokens(llm, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def case(family_dir):
    """Prompts longer than Gemma's 12-token window, with a shared prefix, and the reference engine's tokens."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 320, 20).tolist()
    ps = prompts(rng, [5, 30]) + [{"prompt_token_ids": shared + [7, 8]}, {"prompt_token_ids": shared + [9]}]
    return ps, tokens(make_llm(family_dir, enable_prefix_caching=False, max_num_seqs=1), ps)


def test_batched_with_prefix_hits_as_one_at_a_time(family_dir, case):
    ps, want = case
    llm = make_llm(family_dir)
    assert tokens(llm, ps[:3]) + tokens(llm, ps[3:]) == want  # the last prompt finds the third's prefix cached
    assert llm.stats().prefix_cache_hits > 0
    llm.core.assert_idle_and_clean()


def test_pallas_kernels_give_the_reference_tokens(family_dir, case):
    ps, want = case
    assert tokens(make_llm(family_dir, attention_backend="pallas"), ps) == want


def test_tensor_parallel(family_dir, case):
    ps, want = case
    assert tokens(make_llm(family_dir, tensor_parallel_size=2), ps) == want


# Random tiny weights are harder on int4 groups than trained ones; measured here 0.13 (Gemma 3) and 0.34 (Qwen3).
@pytest.mark.parametrize("options, tolerance", [(dict(quantization="int8"), 0.1), (dict(quantization="int4"), 0.5),
                                                (dict(kv_cache_dtype="int8"), 0.05)])
def test_quantized_weights_and_pages_stay_close(family_dir, case, options, tolerance):
    """A prompt's logits under quantized weights or KV pages stay near float32's, relative to their range (the
    quality figures on real models are in BENCHMARKS.md); the last 10 tokens attend to the first 20 in the cache."""
    ids = case[0][1]["prompt_token_ids"][:30]

    def logits(llm):
        step_logits(llm, ids[:20])
        return step_logits(llm, ids, cached=20)
    want, got = logits(make_llm(family_dir)), logits(make_llm(family_dir, **options))
    assert np.abs(got - want).max() / np.abs(want).max() < tolerance


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])  # plain, biases, QK norms, sandwich norms
def test_every_parameter_declares_its_logical_axes(kind, tmp_path):
    """Every parameter the model makes names the logical axes of each of its dimensions (declared_params refuses
    one that does not), with rules for each (jaxserve.parallel.mesh.RULES), and a loaded checkpoint's params are
    exactly the declared tree: no leaf is left to a default split."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxserve.model.decoder import declared_params
    from jaxserve.parallel.mesh import RULES
    from jaxserve.weights import load_model
    save_tiny_model(kind, tmp_path)
    loaded = load_model(str(tmp_path), jnp.float32)
    shapes, axes = declared_params(loaded.config)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_spec) == jax.tree.structure(loaded.params)
    for spec, leaf, shape in zip(jax.tree.leaves(axes, is_leaf=is_spec), jax.tree.leaves(loaded.params),
                                 jax.tree.leaves(shapes)):
        assert leaf.shape == shape.shape and len(spec) == leaf.ndim and all(name in RULES for name in spec)
