"""Pallas kernels (flash attention for prefill, paged attention for decode/verify).

None yet: every backend currently runs the `jax.numpy` reference in `jaxserve.attention`, which is also the oracle
the kernels will be tested against (issue: Pallas kernels).
"""
