"""Deviceless analysis: the real TPU and GPU compilers run without a chip, and what their programs move (HBM traffic,
collectives)."""
