"""Experiments run on linattn_jax (benchmarks); not part of the installed package."""
