"""The GPU ragged kernel's block sizes, derived from the step's shape, the heads and the chip's shared memory.

A program of the kernel (query block, KV head) holds block_q tokens x G = heads / KV heads query heads as the rows of
its dots (R rows, a power of two >= 16: Triton's smallest dot) and walks its row's keys `keys` at a time (cached
pages, `block_pages` per step; the step's new keys, `block_k` per step).

Shared memory, per program (Triton stages a dot's operands there; H100 / H200 give a block 227 KB, 232448 bytes
opt-in), bounded by

    num_stages x 2 x keys x D x q_bytes     K and V key blocks, one pair per pipeline stage (int8 pages dequantized
                                            to the queries' dtype first: their blocks take no more)
  + R x D x q_bytes                         the queries
  + R x keys x q_bytes                      the probabilities, the second dot's operand

The compiler's own requests (read from its RESOURCE_EXHAUSTED message with the opt-in limit set to 1 KB, for
head_dim 64 / 128 / 256, bf16 and int8 pages, 16 and 64 dot rows) never exceed this: with 64 rows (prefill) the
first two terms are its request to within 1 KB; with 16 rows (decode) it asks about half (it does not pipeline
those dots). E.g. Gemma 3 1B's heads (G 4, D 256) at 16 tokens per program: R 64, and 128-key bf16 blocks with 2
stages asked 2 x 2 x 128 x 256 x 2 + 64 x 256 x 2 = 294912 bytes, over the 232448 there are (the old fixed
sizes); 64-key blocks ask 163840 (bound 172032).

Registers: the float32 accumulator [R, D] and scores [R, keys] live through the walk, spread over num_warps x 32
threads; past ~128 four-byte registers a thread they spill (a slow kernel, not an error), so more warps share them.
"""
from __future__ import annotations

from typing import NamedTuple

from jaxserve.pallas_kernels.softmax import pow2, pow2_floor

HOPPER_SHARED_MEMORY = 232448  # bytes per block, opt-in (H100, H200); the compile targets in
#                                jaxserve.aot.deviceless say so
HOPPER_CORES = 132  # SMs (H100 SXM, H200): programs that run at once, one block each at the least
MIN_SPLIT_BLOCKS = 4  # key blocks a split walks at the least: its partial result (R x D float32) stays ~3% of its reads
MAX_KEYS = 128  # keys per step of the walk: past this a wider block buys little and costs registers
MAX_ROWS = 128  # dot rows per program in prefill: block_q x G
NUM_STAGES = 2  # double buffering: the next key block loads while this one's dots run
_REGS_PER_THREAD = 128


class GpuBlocks(NamedTuple):
    block_q: int  # tokens of one row per program
    block_k: int  # new keys per step of the walk over the row's new tokens
    block_pages: int  # cached pages per step of the walk over the row's pages
    num_warps: int
    num_stages: int


def dot_rows(block_q: int, group: int) -> int:
    """A program's dot rows: its tokens' query heads, padded to a power of two >= 16."""
    return pow2(block_q * group, 16)


def step_block_q(num_tokens: int, num_rows: int, group: int, block_q: int = 16) -> int:
    """Tokens per program for a step of num_tokens over num_rows. A step with no more tokens than rows (the bucket
    every decode-only step uses) takes the most tokens whose G query heads fit in 16 dot rows: a decode row's
    program then is its G heads padded to 16, exactly what one token would cost, and a prompt chunk that lands in
    such a bucket still shares the walk over its cached keys 16 / G tokens at a time. Other steps take `block_q`
    (prompt chunks: fewer programs re-reading the row's pages), capped at MAX_ROWS dot rows."""
    if num_tokens <= num_rows:
        return pow2_floor(16 // group) if group <= 16 else 1
    return max(1, min(block_q, pow2_floor(MAX_ROWS // group)))


def shared_memory_bytes(keys: int, rows: int, head_dim: int, q_bytes: int, num_stages: int) -> int:
    """A bound on what the compiler asks for one program (the module docstring's sum)."""
    return (num_stages * 2 * keys + rows) * head_dim * q_bytes + rows * keys * q_bytes


def gpu_blocks(num_tokens: int, num_rows: int, group: int, head_dim: int, page_size: int, q_bytes: int,
               shared_memory: int = HOPPER_SHARED_MEMORY, block_q: int = 16) -> GpuBlocks:
    """Block sizes for one step shape: the widest key blocks (a power of two, 16..MAX_KEYS, whole pages when pages
    are that small) whose shared memory fits, then enough warps for the float32 tiles."""
    block_q = step_block_q(num_tokens, num_rows, group, block_q)
    rows = dot_rows(block_q, group)
    keys = MAX_KEYS
    while keys > 16 and shared_memory_bytes(keys, rows, head_dim, q_bytes, NUM_STAGES) > shared_memory:
        keys //= 2
    # A page is the smallest cached block: pages wider than `keys` go one at a time (and ask for more).
    block_pages = max(1, keys // page_size)
    block_k = min(keys, 32)  # new keys: mostly the causal diagonal of a prompt chunk, half of a block masked
    fp32_tiles = rows * (head_dim + keys)
    num_warps = 4 if fp32_tiles <= 4 * 32 * _REGS_PER_THREAD else 8
    return GpuBlocks(block_q, block_k, block_pages, num_warps, NUM_STAGES)


def key_splits(num_programs: int, pages_per_row: int, block_pages: int, cores: int) -> int:
    """How many programs share one row's cached keys (flash-decoding): enough that num_programs x splits fills
    `cores` (a decode-only step of 1-4 rows on 8 KV heads is 8-32 programs on a 132-SM chip), but each split at
    least MIN_SPLIT_BLOCKS key blocks of the longest row the page table holds; 1 when programs are already
    plentiful. Static: the grid's third axis (a row's splits divide its own cached blocks at run time)."""
    wanted = -(-cores // max(num_programs, 1))
    most = pages_per_row // (block_pages * MIN_SPLIT_BLOCKS)
    return max(1, min(wanted, most))
