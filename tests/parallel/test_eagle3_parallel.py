"""EAGLE-3 over a mesh: at tensor_parallel_size 2 the head's weights, cache and draft vocabulary are split as the
target's are, and the text and every proposal are one device's."""
import jax
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.model.eagle3 import to_target_vocab
from jaxserve.parallel.mesh import MODEL, make_mesh
from jaxserve.runner.head_steps import target_logits
from jaxserve.weights import load_model

from eagle3_heads import write_tiny_head
from tiny import make_llm, prompts

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2,
                                reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=2")


def served(llm, ps, sp):
    """The text of ps and the proposals made for it, in order, per sequence."""
    seen: dict = {}
    propose = llm.core.proposer.propose

    def recording(batch):
        got = propose(batch)
        for s, p in got.tokens.items():
            if p:
                seen.setdefault(s.request_id, []).append((len(s.token_ids), list(p)))
        return got
    llm.core.proposer.propose = recording  # type: ignore[method-assign]
    out = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    return out, seen


def test_tensor_parallel_head_gives_one_devices_text_and_proposals(tiny_dir, tmp_path):
    head_dir = write_tiny_head(tmp_path / "head", load_model(tiny_dir, "float32").config, "eagle3", seed=7)
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 320, 10).tolist()
    ps = prompts(rng, [2, 9, 21, 33]) + [{"prompt_token_ids": shared + rng.integers(0, 320, 4).tolist()}] * 2
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = dict(method="eagle3", model=head_dir, num_speculative_tokens=3, adaptive=False)
    want, want_proposals = served(make_llm(tiny_dir, speculative_config=spec), ps, sp)
    llm = make_llm(tiny_dir, speculative_config=spec, tensor_parallel_size=2)
    got, proposals = served(llm, ps, sp)
    assert got == want, f"seed {seed}"
    assert sum(map(len, proposals.values())) > 10
    assert proposals == want_proposals, f"seed {seed}"
    head = llm.core.proposer.runner
    layer = head.params["params"]["layers_0"]
    assert layer["q_proj"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, MODEL)
    assert head.params["params"]["lm_head"]["kernel"].sharding.spec[-1] == MODEL  # the draft vocabulary split
    for shard in head.kv_cache[0][0].addressable_shards:  # [num_pages, kv_heads, page_size, head_dim]: 1 head each
        assert shard.data.shape[1] == 1
    # The target's captured features [slots, F] split by column, and fc's rows with them: no device holds them all.
    assert llm.runner.features.sharding.spec == jax.sharding.PartitionSpec(None, MODEL)
    assert head.params["params"]["fc"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(MODEL, None)
    llm.core.assert_idle_and_clean()


@pytest.mark.parametrize("draft_vocab_size", [24, 22])  # split over 4 devices, and whole on each
def test_draft_logits_land_in_each_devices_vocabulary_slice(draft_vocab_size):
    """Each device builds only its slice of the [S, V] target logits from the gathered draft logits: the values
    to_target_vocab gives, split as sampling reads them."""
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    V, mesh = 64, make_mesh(4, 1, jax.devices()[:4])
    ids = np.sort(rng.choice(V, draft_vocab_size, replace=False))
    d2t = jax.numpy.asarray(ids - np.arange(draft_vocab_size), jax.numpy.int32)
    logits = jax.numpy.asarray(rng.standard_normal((5, draft_vocab_size)), jax.numpy.float32)
    spec = jax.sharding.PartitionSpec(None, MODEL if draft_vocab_size % 4 == 0 else None)
    got = jax.jit(lambda x, d: target_logits(mesh, x, d, V))(
        jax.device_put(logits, jax.sharding.NamedSharding(mesh, spec)), d2t)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(to_target_vocab(logits, d2t, V)), f"seed {seed}")
    assert got.sharding.spec == jax.sharding.PartitionSpec(None, MODEL)
