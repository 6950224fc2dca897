"""Shape buckets: every step is padded up to one of a few sizes, so serving compiles a bounded, known set."""
from __future__ import annotations

import dataclasses


def geometric(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    """lo, lo*factor, ... and finally hi itself (hi need not be a power)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    return tuple(out) + (hi,)


def round_up(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


# The narrowest page table, in tokens. A table's width is a step's cost that grows with it (its copy to the device,
# and the penalties' past tokens, [rows, width x page_size]), but each width is a whole set of programs to compile:
# up to 8K-token contexts (the default model's own) a table of all a sequence can need is one width; longer ones add
# a width per factor 4 (128K: tables of 8K, 32K and 128K tokens' pages, three times the programs of one).
MIN_TABLE_TOKENS = 8192
TABLE_WIDTH_FACTOR = 4


@dataclasses.dataclass(frozen=True)
class Buckets:
    num_tokens: tuple[int, ...]  # tokens of a step, ascending
    max_num_seqs: int
    pages_per_row: int  # the widest page table: the most a sequence can need
    table_widths: tuple[int, ...] = ()  # page-table widths, ascending, the last pages_per_row (empty: that alone)

    @classmethod
    def for_limits(cls, max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int,
                   min_table_pages: int | None = None) -> "Buckets":
        """min_table_pages: the narrowest page table (pages of MIN_TABLE_TOKENS, say); None: every table is full
        width."""
        # Token counts double: a padded token costs a whole token of every matmul, and the scheduler cuts prompt
        # chunks to the bucket below when rounding up would pad more than a quarter (Scheduler._fit_to_bucket).
        # Attention visits only the blocks of pages that hold cached tokens (a dynamic trip count), so a table wider
        # than the rows need costs no attention work, only its own size (see MIN_TABLE_TOKENS).
        # No 2-token bucket: below ~8 tokens a step reads weights far more than it computes, so padding 2 to 4
        # costs nothing, and each bucket is a program to compile.
        tokens = tuple(t for t in geometric(1, max_num_batched_tokens) if t != 2)
        narrowest = min(min_table_pages or max_pages_per_seq, max_pages_per_seq)
        widths = geometric(narrowest, max_pages_per_seq, TABLE_WIDTH_FACTOR)
        return cls(num_tokens=tokens, max_num_seqs=max_num_seqs, pages_per_row=max_pages_per_seq,
                   table_widths=widths)

    def num_rows(self, num_tokens: int) -> int:
        """Rows of the step of `num_tokens` tokens (a bucket): a row has a token at least, and a sequence one row."""
        return min(num_tokens, self.max_num_seqs)

    def widths(self) -> tuple[int, ...]:
        return self.table_widths or (self.pages_per_row,)

    def table_width(self, pages: int) -> int:
        """The page-table width of a step whose widest row spans `pages` pages."""
        return round_up(pages, self.widths())

    def shapes(self):
        """Every (tokens, rows) a step can take (each at every table width)."""
        for t in self.num_tokens:
            yield t, self.num_rows(t)
