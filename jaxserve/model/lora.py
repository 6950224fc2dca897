"""The LoRA term of a linear layer over a ragged batch whose tokens each name an adapter slot (or none).

lora_delta(x [T, in], a [N, in, R], b [N, R, out], slot [T]) = x[t] @ a[slot[t]] @ b[slot[t]] per token, exactly 0
where slot[t] is -1 (a base-model token): one program for any mix of adapters, whatever slots hold.

Ways to compute it, all in jnp (scripts/bench_lora.py measures them):
- "gather" (BGMV): each token gathers its slot's A and B and multiplies them. Work grows with T, not with N;
  the gathered copies are T x R x (in + out) values per layer.
- "sorted" (SGMV): tokens sorted by slot into blocks of one slot each (each slot's run padded to a whole block),
  each block gathers its slot's A and B once. Gathers (T / block + N) copies instead of T.
- "segmented": "sorted", except for a step whose adapter tokens all name one slot (a prefill chunk of one sequence,
  every row on one adapter: the common case), which indexes that slot's A and B once and multiplies x by them as
  they are: no sort, no scatter into blocks, no gathers back (a `lax.cond`: both compiled in the one program).
- "ragged": tokens sorted by slot, then `jax.lax.ragged_dot`. XLA:CPU expands it to a dense product per group
  with masks, so its work grows with N (as would a one-hot einsum over slots).
On TPU and GPU the term is the Pallas kernels' (`jaxserve.pallas_kernels.lora`: each token block reads each adapter it
uses once, with no sort), where the layer's A and B are whole on the device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels import lora_delta_gpu, lora_delta_tpu

F32 = jnp.float32


# The method the model uses (read when a step is traced; scripts/bench_lora.py sets it to compare them). Segmented,
# by bench_lora's figures on XLA:CPU (BENCHMARKS.md): a 64-row decode step with 8 adapters at ~1.0x the base step
# (gather 1.2x, ragged 1.0x), a 512-token prefill at 1.4-1.7x (gather 5x, ragged 2x) when sorted, and one sorted
# 512-token term costs ~0.35x its base product where one slot's, indexed once, costs ~0.06x (a micro-benchmark
# measured once: [512, 576] x [576, 1536], rank 16, 8 slots, 2026-12-07).
METHOD = "segmented"


def lora_delta(x, a, b, slot, method: str | None = None, kernels: bool = True):
    """[T, out] in x's dtype; rows whose slot is -1 are exactly 0. method: the jnp method (None: METHOD on CPU, the
    Pallas kernels on TPU and GPU). kernels=False: a and b are split over a tensor-parallel mesh, which a Pallas call
    cannot take (the partitioner would gather them whole onto every device), so every platform runs the jnp method."""
    xla = METHODS[method or METHOD]
    if method is not None or not kernels:
        return xla(x, a, b, slot)
    return jax.lax.platform_dependent(x, a, b, slot, tpu=lora_delta_tpu, cuda=lora_delta_gpu, default=xla)


def _gather(x, a, b, slot):
    s = jnp.maximum(slot, 0)  # [T]
    h = jnp.einsum("ti,tir->tr", x, a[s], preferred_element_type=F32)  # [T, R]
    h = jnp.where(slot[:, None] >= 0, h, 0).astype(b.dtype)
    return jnp.einsum("tr,tro->to", h, b[s], preferred_element_type=F32).astype(x.dtype)


def _sorted(slot, num_slots: int):
    """Tokens in slot order (base tokens last): (order [T], key [T] in that order, counts [N])."""
    key = jnp.where(slot >= 0, slot, num_slots)  # [T]
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=num_slots + 1)[:num_slots]  # [N]
    return order, key[order], counts


def _ragged(x, a, b, slot):
    order, key, counts = _sorted(slot, a.shape[0])
    h = jax.lax.ragged_dot(x[order], a, counts, preferred_element_type=F32).astype(b.dtype)  # [T, R]
    y = jax.lax.ragged_dot(h, b, counts, preferred_element_type=F32)  # [T, out]
    y = jnp.where((key < a.shape[0])[:, None], y, 0)
    return jnp.zeros_like(y).at[order].set(y).astype(x.dtype)


def segment_block(num_tokens: int) -> int:
    """Tokens per block of the segmented method: about 8 blocks' worth of tokens, at least 8."""
    return max(8, num_tokens // 8)


def one_slot(slot):
    """Whether every token on an adapter names the same slot (true too where none does)."""
    return jnp.all((slot < 0) | (slot == jnp.max(slot)))


def _one_slot(x, a, b, slot):
    """The term where every adapter token names slot max(slot): that slot's A and B indexed once ([in, R], [R, out]),
    every token multiplied by them, base tokens' rows then zeroed."""
    s = jnp.maximum(jnp.max(slot), 0)
    h = jnp.dot(x, a[s], preferred_element_type=F32)  # [T, R]
    h = jnp.where(slot[:, None] >= 0, h, 0).astype(b.dtype)
    return jnp.dot(h, b[s], preferred_element_type=F32).astype(x.dtype)


def _segmented(x, a, b, slot):
    return jax.lax.cond(one_slot(slot), _one_slot, _sorted_blocks, x, a, b, slot)


def _sorted_blocks(x, a, b, slot):
    (T, n_in), N = x.shape, a.shape[0]
    block = segment_block(T)
    K = -(-T // block) + N  # blocks: each slot's run adds at most one partial block
    order, key, counts = _sorted(slot, N)
    padded = -(-counts // block) * block  # [N]
    ends = jnp.cumsum(padded)  # [N]: the padded runs end to end
    starts = ends - padded
    first = jnp.cumsum(counts) - counts  # [N]: where each slot's tokens start in sorted order
    keyc = jnp.minimum(key, N - 1)
    dest_sorted = jnp.where(key < N, starts[keyc] + jnp.arange(T) - first[keyc], K * block)  # base tokens: nowhere
    dest = jnp.zeros(T, jnp.int32).at[order].set(dest_sorted)  # [T]: each token's row in the blocks
    # The blocks' rows gathered from x (XLA:CPU copies a gathered row as one block but scatters element by element):
    # src [K * block] is each row's token, T (a zero row) for padding.
    src = jnp.full(K * block, T, jnp.int32).at[dest].set(jnp.arange(T, dtype=jnp.int32), mode="drop")
    xs = jnp.take(x, src, axis=0, mode="fill", fill_value=0).reshape(K, block, n_in)
    block_slot = jnp.minimum(jnp.searchsorted(ends, jnp.arange(K) * block, side="right"), N - 1)  # [K]
    h = jnp.einsum("kti,kir->ktr", xs, a[block_slot], preferred_element_type=F32).astype(b.dtype)
    y = jnp.einsum("ktr,kro->kto", h, b[block_slot], preferred_element_type=F32).reshape(K * block, -1)
    return jnp.take(y, dest, axis=0, mode="fill", fill_value=0).astype(x.dtype)


METHODS = {"gather": _gather, "sorted": _sorted_blocks, "segmented": _segmented, "ragged": _ragged}
