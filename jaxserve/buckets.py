"""Shape buckets: every step input is padded up to one of a few sizes, so serving compiles a bounded, known set."""
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
    num_seqs: tuple[int, ...]  # decode batch sizes
    prefill_tokens: tuple[int, ...]  # tokens of one prefill chunk
    num_pages: tuple[int, ...]  # page-table width (pages of tokens cached before the step)

    @classmethod
    def for_limits(cls, max_num_seqs: int, max_chunk_tokens: int, max_pages_per_seq: int) -> "Buckets":
        # Batch sizes double (decode cost grows with every padded row); chunk sizes grow 4x, which keeps the
        # program count small. The page table is always full width: attention visits only the blocks of pages
        # that hold cached tokens (a dynamic trip count), so a wider table costs nothing but its transfer.
        return cls(num_seqs=geometric(1, max_num_seqs),
                   prefill_tokens=geometric(min(16, max_chunk_tokens), max_chunk_tokens, 4),
                   num_pages=(max_pages_per_seq,))

    def shapes(self):
        """Every (kind, rows, tokens per row, page-table width) a step can take."""
        for p in self.num_pages:
            for t in self.prefill_tokens:
                yield ("prefill", 1, t, p)
            for s in self.num_seqs:
                yield ("decode", s, 1, p)
