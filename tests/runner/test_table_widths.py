"""Page-table widths: a step's table is the narrowest bucket that spans its rows, so its size follows the context the
rows hold, not max_model_len."""
from jaxserve.buckets import MIN_TABLE_TOKENS, Buckets
from jaxserve.cache import pages_needed
from jaxserve.runner.batch_builder import Row

from tiny import make_llm


def test_widths_grow_by_four_from_8k_and_one_width_up_to_8k():
    narrowest = pages_needed(MIN_TABLE_TOKENS, 16)
    assert Buckets.for_limits(8, 512, 8192, narrowest).widths() == (512, 2048, 8192)  # 128K tokens of 16-token pages
    assert Buckets.for_limits(8, 512, 512, narrowest).widths() == (512,)  # the default model's 8K: one width
    assert Buckets.for_limits(8, 512, 100, narrowest).widths() == (100,)
    assert Buckets.for_limits(8, 512, 8192).widths() == (8192,)  # no narrowest: every table full width
    b = Buckets.for_limits(8, 512, 8192, narrowest)
    assert [b.table_width(p) for p in (1, 512, 513, 2049, 8192)] == [512, 512, 2048, 8192, 8192]


def test_a_step_s_table_spans_its_rows_new_tokens_and_no_more(tiny_dir):
    """The width counts the step's own tokens too (the penalties write their past tokens at those positions)."""
    llm = make_llm(tiny_dir, max_model_len=96, block_size=4)
    r = llm.runner
    r.buckets = Buckets.for_limits(r.buckets.max_num_seqs, 16, r.buckets.pages_per_row, 8)  # widths 8 and 24 pages
    assert r.buckets.widths() == (8, 24)
    seen = []
    run = r.run
    r.run = lambda batch: seen.append(batch.rows.page_table.shape[1]) or run(batch)
    r.fetch(r.dispatch([Row([1] * 4, 28, list(range(1, 9)))]))  # 32 tokens: 8 pages, 7 of them cached
    r.fetch(r.dispatch([Row([1] * 4, 29, list(range(1, 10)))]))  # 33 tokens: a 9th page
    assert seen == [8, 24]
