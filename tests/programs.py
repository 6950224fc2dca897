"""A step's compiled program as text, for tests that read what it runs."""
from jaxserve.buckets import round_up
from jaxserve.runner.batch_builder import Row, build_batch


def step_program(llm, rows: list[Row]) -> str:
    """The compiled text of the plain step's forward program over rows, as the runner would dispatch them."""
    r = llm.runner
    tokens = round_up(sum(len(row.token_ids) for row in rows), r.buckets.num_tokens)
    batch = r.steps.put_batch(build_batch(rows, r.page_size, r.config.vocab_size, tokens, r.buckets.num_rows(tokens),
                                          r.buckets.pages_per_row))
    return r.steps._forward.lower(r.params, r.kv_cache, r.last_tokens, batch, None).compile().as_text()


def entry(hlo: str) -> str:
    top = hlo[hlo.index("\nENTRY"):]
    return top[:top.index("\n}")]
