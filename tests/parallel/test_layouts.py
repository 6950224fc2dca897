"""The embedding table's placement (jaxserve.parallel.layouts): row-major where the platform's default may not be (TPU,
taken here by the CPU for the test: its compiler honours a column-major argument too), nothing else touched, values
kept. What it does to TPU programs is tests/aot/test_aot.py's (the HBM audit of SmolLM2's steps)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout

from jaxserve.model.quant import Int8Rows, quantize_rows_int8
from jaxserve.parallel import layouts
from jaxserve.parallel.mesh import place

COLUMN_MAJOR = Layout(major_to_minor=(1, 0))


def tree(table):
    return {"params": {"embed_tokens": table, "lm_head": {"kernel": jnp.ones((4, 8))}, "norm": jnp.ones(4)}}


@pytest.fixture
def as_tpu(monkeypatch):
    monkeypatch.setattr(layouts, "TPU", jax.devices()[0].platform)


def test_only_the_tables_get_a_row_major_format_and_only_on_tpu(as_tpu):
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for table in (jnp.ones((8, 4)), quantize_rows_int8(jnp.ones((8, 4)))):
        params = tree(table)
        formats = layouts.param_formats(params, jax.tree.map(lambda _: one, params))
        placed = jax.tree.leaves(formats, is_leaf=lambda x: isinstance(x, Format))
        assert [type(f).__name__ for f in placed].count("Format") == 1  # the table (an int8 one's values)
        table_format = formats["params"]["embed_tokens"]
        table_format = table_format.values if isinstance(table_format, Int8Rows) else table_format
        assert table_format == Format(layouts.ROW_MAJOR, one)
    assert layouts.lookup_compiler_options(jax.devices()[0].platform) is not None


def test_off_tpu_nothing_changes():
    params = tree(jnp.ones((8, 4)))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, params)
    assert layouts.param_formats(params, shardings) == shardings
    assert layouts.with_row_major_tables(params) is not params  # a new tree of the same arrays
    assert all(a is b for a, b in zip(jax.tree.leaves(layouts.with_row_major_tables(params)),
                                      jax.tree.leaves(params)))
    assert layouts.lookup_compiler_options("cpu") is None and layouts.lookup_compiler_options("gpu") is None


def test_a_column_major_table_is_moved_row_major_and_looked_up_the_same(as_tpu):
    """The loader's table in a column-major layout (as TPU's default lays SmolLM2's out): moved once, same values;
    the lookup compiles for the layout the argument has."""
    values = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    table = jax.device_put(values, Format(COLUMN_MAJOR, one))
    moved = layouts.with_row_major_tables(tree(table))["params"]["embed_tokens"]
    assert table.format.layout.major_to_minor == (1, 0) and moved.format.layout.major_to_minor == (0, 1)
    ids = jnp.array([5, 0, 7])
    np.testing.assert_array_equal(jax.jit(lambda t, i: t[i])(moved, ids), values[[5, 0, 7]])
    again = tree(moved)
    assert layouts.with_row_major_tables(again)["params"]["embed_tokens"] is moved  # already row-major


def test_placed_over_a_mesh_in_the_format(as_tpu):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    params = tree(np.arange(8 * 4, dtype=np.float32).reshape(8, 4))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    placed = place(params, layouts.param_formats(params, jax.tree.map(lambda _: split, params)))
    assert placed["params"]["embed_tokens"].format == Format(
        placed["params"]["embed_tokens"].format.layout, split)
    assert placed["params"]["embed_tokens"].format.layout.major_to_minor == (0, 1)
    np.testing.assert_array_equal(placed["params"]["embed_tokens"], params["params"]["embed_tokens"])
