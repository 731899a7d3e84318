"""Private implementation of linattn_jax; import from the public modules."""
