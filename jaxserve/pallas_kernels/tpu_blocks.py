"""The TPU ragged kernel's block sizes and VMEM limit, derived from the step's shape, the heads, the pages and the
chip's VMEM (`pltpu.get_tpu_info().vmem_capacity_bytes`: 128 MiB a core on v5e and v6e, 64 MiB on v5p and v7x).

A program (one query block of block_q tokens) holds in VMEM, Mosaic padding each array's two minor dimensions to
its tiles (8 sublanes x 128 lanes of 32 bits; 16 sublanes for 16-bit dtypes, 32 for int8):

    2 x 2 x pages_per_block x KVH x [page_size, D]    K and V page blocks, double-buffered (DMA'd while the
                                                     previous block is computed); int8 pages add their scales
                                                     [KVH, page_size] float32 per page
  + 2 x 2 x KVH x [block_q, D]                       the step's own K, V blocks, double-buffered
  + 2 x 2 x KVH x [rows, D]                          queries and outputs (rows = block_q x G), Pallas' pipeline
  + KVH x ([rows, D] + 2 [rows, 1]) float32          the running softmax (max and sum take a tile's lanes)
  + 3 [rows, keys] float32 + 2 [keys, D]             one head's scores, probabilities, and dequantized K, V

The compiler does not raise its scoped limit by itself (16 MiB on v5e, 32 MiB on v6e, from its
CompileTimeScopedVmemOom errors, 2026-12-02): the kernel asks for this sum times VMEM_HEADROOM as
`vmem_limit_bytes`. The sum is an estimate, not a bound: the compiler's own figure (its scoped allocation, read
from the error with the limit set to 64 KiB; deviceless v5e and v6e, the five families of the compile test, 512-
and 64-token steps of 64 rows and a 4-row one) was 0.3x to 3.8x it (3.8x: v5e, Gemma 3 1B's heads, 512 tokens,
no bf16 VPU on v5e; 2.2x: v5e, int8 pages). VMEM does not bind at these sizes (at most 6.1 MiB asked, of 128 MiB:
v5e, Llama 3 8B's heads, int8 pages); what bounds a key block is the DMA: each page is
one async copy per K and V issued from scalar code, and jax's own tuned ragged-attention table never goes past
16 pages a block at page size 16 (its MAX_PAGES_PER_SEQ: 32 scalar registers). A block fetches the fewest pages
that move BLOCK_BYTES of K and V (each block's fixed cost, ~0.35 us a loop step, is then < 1/3 of its transfer on
v5e), capped there and at the row's pages.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from jaxserve.pallas_kernels.softmax import pow2, pow2_floor

TPU_VMEM = 128 << 20  # v5e and v6e, per core: what serving derives from when no chip says otherwise
BLOCK_BYTES = 1 << 20  # K and V bytes a key block moves at the least when it can
MAX_PAGES_PER_BLOCK = 16
VMEM_HEADROOM = 4  # the limit asked for: the modelled sum times this (the compiler's figure was up to 3.8x it)
TABLE_CHUNK = 128  # page-table entries per DMA into SMEM (512 bytes, 2048 tokens of 16-token pages)
DEFAULT_SCOPED_VMEM = 32 << 20  # never ask for less than the largest chip's default (v6e's; v5e's is 16 MiB)


class TpuBlocks(NamedTuple):
    block_q: int  # tokens of one row per program
    pages_per_block: int  # pages per DMA'd block of cached keys
    vmem_limit_bytes: int


def _tile(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a [rows, cols] array in VMEM tiles: (8 x 4 / itemsize) sublanes x 128 lanes."""
    sublanes = 8 * 4 // itemsize
    return -(-rows // sublanes) * sublanes * -(-cols // 128) * 128 * itemsize


def vmem_bytes(block_q: int, pages_per_block: int, group: int, kv_heads: int, head_dim: int, page_size: int,
               q_bytes: int, kv_bytes: int, quantized: bool) -> int:
    """The module docstring's sum for one program."""
    rows, keys = block_q * group, pages_per_block * page_size
    pages = 2 * 2 * pages_per_block * kv_heads * _tile(page_size, head_dim, kv_bytes)
    if quantized:
        pages += 2 * 2 * pages_per_block * _tile(kv_heads, page_size, 4)
    own = 2 * 2 * kv_heads * _tile(block_q, head_dim, q_bytes)
    io = 2 * 2 * kv_heads * _tile(rows, head_dim, q_bytes)
    softmax = kv_heads * (_tile(rows, head_dim, 4) + 2 * _tile(rows, 1, 4))
    work = 3 * _tile(rows, keys, 4) + 2 * _tile(keys, head_dim, q_bytes)
    return pages + own + io + softmax + work


def decode_block_q(group: int) -> int:
    """Tokens per program of a step with no more tokens than rows (every decode-only one): the fewest whose G query
    heads fill whole 8-row sublane tiles (8 / gcd(G, 8): G 8 -> 1, G 4 -> 2, G 3 -> 8), so a decode row's program
    is about its G heads, not 16 x G rows with 15 / 16 of them empty. (Mosaic refused int8 pages with 5 query rows,
    G 5 at 1 token: a broadcast it could not verify, deviceless v5e.)"""
    return 8 // math.gcd(group, 8)


def tpu_blocks(num_tokens: int, num_rows: int, pages_per_row: int, group: int, kv_heads: int, head_dim: int,
               page_size: int, q_bytes: int, kv_bytes: int, quantized: bool, vmem: int = TPU_VMEM,
               block_q: int = 16, pages_per_block: int | None = None) -> TpuBlocks:
    """Block sizes for one step shape: block_q (`decode_block_q` in decode-only steps), then (unless given) the
    fewest pages a block that move BLOCK_BYTES of K and V, at most MAX_PAGES_PER_BLOCK and the row's pages; halved
    (pages first, then block_q while its query rows stay whole sublane tiles) until the limit asked fits in half
    the chip's VMEM; the limit is for the blocks returned."""
    if num_tokens <= num_rows:
        block_q = decode_block_q(group)
    page_bytes = 2 * kv_heads * page_size * head_dim * kv_bytes  # K and V of one page
    pages = pages_per_block or min(pow2(-(-BLOCK_BYTES // page_bytes)), MAX_PAGES_PER_BLOCK,
                                   pow2_floor(pages_per_row))

    def need(block_q, pages):
        return vmem_bytes(block_q, pages, group, kv_heads, head_dim, page_size, q_bytes, kv_bytes, quantized)
    while need(block_q, pages) * VMEM_HEADROOM > vmem // 2:
        if pages > 1 and pages_per_block is None:
            pages //= 2
        elif block_q % 2 == 0 and (block_q // 2 * group) % 8 == 0:
            block_q //= 2
        else:
            break
    limit = min(vmem, max(need(block_q, pages) * VMEM_HEADROOM, DEFAULT_SCOPED_VMEM))
    return TpuBlocks(block_q, pages, limit)
