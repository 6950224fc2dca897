"""scripts/bench_decode.py's floor arithmetic: the KV-cache bytes a batch-1 decode step reads, against hand counts."""
import sys
from types import SimpleNamespace

import pytest

from locations import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import bench_decode  # noqa: E402

from jaxserve.cache import init_kv_cache  # noqa: E402
from jaxserve.config import FULL, SLIDING, ModelConfig  # noqa: E402


def config(**kw):
    return ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256, **kw)


@pytest.mark.parametrize("kv_cache_dtype, token_bytes", [("auto", 2 * 2 * 8 * 4),  # K and V, 2 heads of 8 floats
                                                         ("int8", 2 * 2 * (8 + 4))])  # int8 values, a float scale
def test_a_step_reads_each_layers_keys_and_values_of_its_context(kv_cache_dtype, token_bytes):
    c = config()
    runner = SimpleNamespace(config=c, page_size=4, kv_cache=init_kv_cache(c, 10, 4, "float32", kv_cache_dtype))
    assert bench_decode.kv_read_bytes(runner, 21) == 3 * 21 * token_bytes


def test_a_sliding_layer_reads_only_its_window():
    c = config(sliding_window=8, layer_types=(SLIDING, FULL, SLIDING))
    runner = SimpleNamespace(config=c, page_size=4, kv_cache=init_kv_cache(c, 10, 4, "float32"))
    token_bytes = 2 * 2 * 8 * 4
    assert bench_decode.kv_read_bytes(runner, 21) == (8 + 21 + 8) * token_bytes
    assert bench_decode.kv_read_bytes(runner, 5) == 3 * 5 * token_bytes  # a context shorter than the window
