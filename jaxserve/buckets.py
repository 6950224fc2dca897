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


@dataclasses.dataclass(frozen=True)
class Buckets:
    num_tokens: tuple[int, ...]  # tokens of a step, ascending
    max_num_seqs: int
    pages_per_row: int  # page-table width: always the most a sequence can need

    @classmethod
    def for_limits(cls, max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int) -> "Buckets":
        # Token counts double: a padded token costs a whole token of every matmul, and the scheduler cuts prompt
        # chunks to the bucket below when rounding up would pad more than a quarter (Scheduler._fit_to_bucket).
        # The page table is always full width: attention visits only the blocks of pages that hold cached tokens
        # (a dynamic trip count), so a wider table costs nothing but its transfer.
        # No 2-token bucket: below ~8 tokens a step reads weights far more than it computes, so padding 2 to 4
        # costs nothing, and each bucket is a program to compile.
        tokens = tuple(t for t in geometric(1, max_num_batched_tokens) if t != 2)
        return cls(num_tokens=tokens, max_num_seqs=max_num_seqs, pages_per_row=max_pages_per_seq)

    def num_rows(self, num_tokens: int) -> int:
        """Rows of the step of `num_tokens` tokens (a bucket): a row has a token at least, and a sequence one row."""
        return min(num_tokens, self.max_num_seqs)

    def shapes(self):
        """Every (tokens, rows) a step can take."""
        for t in self.num_tokens:
            yield t, self.num_rows(t)
