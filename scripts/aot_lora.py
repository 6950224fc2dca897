"""The multi-LoRA term compiled deviceless for TPU and GPU (the real compilers, no chip): the Pallas kernels
(`jaxserve.pallas_kernels.lora`) beside three XLA formulations, with what each moves through HBM.

    .aot-venv/bin/python scripts/aot_lora.py [--target v5e:2x2 --target h100] [--tokens 64 --tokens 512]

For one projection (default Llama 3 8B's up, 4096 -> 14336; 8 slots of rank 16; bf16) and each step size it prints
per implementation the compiler's temporaries, its HBM audit (weight-sized copies of A or B), on TPU the XLA cost
model's bytes accessed (it counts a Pallas call as nothing), and against them the ideal: x + every slot's A and B
(the step's tokens using all of them) + the output. For the kernels it adds their own bytes, modelled from their
grid (x and the output once, each block's used slots' A and B once, the [T, R] float32 intermediate written and
read): the compilers do not see inside a kernel. The XLA formulations:
  one-hot  every slot's product for every token, masked: compute and A/B reads grow with the slots;
  gather   each token's A and B gathered ([T, in, R] and [T, R, out] in HBM), then batched per-token products;
  ragged   tokens sorted by slot, `jax.lax.ragged_dot` on each half, unsorted (x and the output move again).
These are compiler figures, not measurements.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.aot import deviceless as aot  # noqa: E402
from jaxserve.pallas_kernels.lora import GPU_BLOCK_T, TPU_BLOCK_T, slot_plan  # noqa: E402


def one_hot(x, a, b, slot):
    mask = (slot[:, None] == jnp.arange(a.shape[0])).astype(jnp.float32)  # [T, N]
    h = jnp.einsum("ti,nir->tnr", x, a, preferred_element_type=jnp.float32) * mask[:, :, None]
    return jnp.einsum("tnr,nro->to", h.astype(x.dtype), b, preferred_element_type=jnp.float32).astype(x.dtype)


def gather(x, a, b, slot):
    index = jnp.maximum(slot, 0)
    h = jnp.einsum("ti,tir->tr", x, a[index], preferred_element_type=jnp.float32)
    out = jnp.einsum("tr,tro->to", h.astype(x.dtype), b[index], preferred_element_type=jnp.float32)
    return jnp.where((slot >= 0)[:, None], out, 0).astype(x.dtype)


def ragged(x, a, b, slot):
    N = a.shape[0]
    key = jnp.where(slot >= 0, slot, N)  # no adapter: after every group, in none
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=N + 1)[:N].astype(jnp.int32)
    h = jax.lax.ragged_dot(x[order], a, sizes, preferred_element_type=jnp.float32)  # [T, R], sorted
    out = jax.lax.ragged_dot(h.astype(x.dtype), b, sizes, preferred_element_type=jnp.float32)
    return jnp.zeros_like(out).at[order].set(out).astype(x.dtype)


def kernel_bytes(slot, num_slots, d_in, d_out, rank, itemsize, block_t) -> int:
    """The kernels' HBM bytes for these slots (module docstring)."""
    T, reads = len(slot), int(slot_plan(jnp.asarray(slot), block_t, num_slots)[1].sum())
    return T * (d_in + d_out) * itemsize + reads * rank * (d_in + d_out) * itemsize + 2 * T * rank * 4


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append")
    p.add_argument("--tokens", action="append", type=int)
    p.add_argument("--d-in", type=int, default=4096)
    p.add_argument("--d-out", type=int, default=14336)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    N, R, d_in, d_out, bf16 = args.slots, args.rank, args.d_in, args.d_out, jnp.bfloat16
    print(f"{d_in} -> {d_out}, {N} slots of rank {R}, bf16; every slot used (tokens' slots cycle through them)")
    print(f"{'target':8} {'T':>4} {'impl':8} {'temp MB':>8} {'copies MB':>9} {'XLA bytes MB':>12} "
          f"{'kernel MB':>9} {'ideal MB':>8}")
    for target in args.target or ["v5e:2x2", "h100"]:
        device = aot.target_devices(target)[0]
        block_t = TPU_BLOCK_T if device.platform == "tpu" else GPU_BLOCK_T
        for T in args.tokens or [64, 512]:
            slot = np.arange(T, dtype=np.int32) % N  # every block uses every slot: the kernels' worst case
            ideal = (T * (d_in + d_out) + N * R * (d_in + d_out)) * 2
            sds = jax.ShapeDtypeStruct
            shapes = (sds((T, d_in), bf16), sds((N, d_in, R), bf16), sds((N, R, d_out), bf16), sds((T,), jnp.int32))
            for name, fn in (("pallas", None), ("one-hot", one_hot), ("gather", gather), ("ragged", ragged)):
                if fn is None:
                    c = aot.compile_lora_kernel(device, T, d_in, d_out, N, R)
                    mine = f"{kernel_bytes(slot, N, d_in, d_out, R, 2, block_t) / 1e6:9.1f}"
                else:
                    c = aot.compile_program("lora " + name, "", fn, shapes, device,
                                            roles=(None, "weights", "weights", None))
                    mine = f"{'':9}"
                if c.error:
                    print(f"{target:8} {T:4} {name:8} {c.error}")
                    continue
                xla = f"{c.bytes_accessed / 1e6:12.1f}" if c.bytes_accessed else f"{'-':>12}"
                print(f"{target:8} {T:4} {name:8} {c.temp_bytes / 1e6:8.2f} {c.traffic_bytes / 1e6:9.1f} {xla} "
                      f"{mine} {ideal / 1e6:8.1f}")


if __name__ == "__main__":
    main()
