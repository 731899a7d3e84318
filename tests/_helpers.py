"""Inputs, tolerances and spec helpers shared by the tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import linattn_jax as la

# (atol, rtol) of a fast implementation against its oracle, per input dtype.
# The oracle runs on the same (already rounded) inputs, so the budget covers
# only the fast path's own rounding: float32 blockwise sums, and for 16-bit
# inputs the final cast of the output (bf16 keeps 8 bits, f16 11).
TOLERANCE = {
    jnp.dtype(jnp.float64): (1e-10, 1e-10),
    jnp.dtype(jnp.float32): (2e-5, 2e-5),
    jnp.dtype(jnp.float16): (4e-3, 4e-3),
    jnp.dtype(jnp.bfloat16): (3e-2, 3e-2),
}
# Gradients add a few more roundings than outputs.
GRAD_TOLERANCE = {
    jnp.dtype(jnp.float64): (1e-9, 1e-9),
    jnp.dtype(jnp.float32): (1e-4, 1e-4),
    jnp.dtype(jnp.float16): (2e-2, 2e-2),
    jnp.dtype(jnp.bfloat16): (1e-1, 1e-1),
}


@dataclasses.dataclass(frozen=True)
class Shape:
  """Sizes of one test case, in the toolkit's letters."""

  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  D: int

  def __str__(self) -> str:
    return f"B{self.B}T{self.T}S{self.S}N{self.N}K{self.K}H{self.H}D{self.D}"


# Odd lengths, T < S, T > S, GQA (K < N), MQA (K = 1), D != H.
SHAPES = (
    Shape(B=2, T=13, S=13, N=4, K=2, H=8, D=8),
    Shape(B=1, T=7, S=19, N=3, K=1, H=8, D=5),
    Shape(B=2, T=19, S=11, N=2, K=2, H=4, D=6),
)
TINY = Shape(B=1, T=5, S=5, N=2, K=1, H=3, D=2)


def make_qkv(shape: Shape, dtype: Any = jnp.float32, seed: int = 0, amplitude: float = 1.0):
  """Random normal query, key and value of ``shape`` (cast to ``dtype``)."""
  rng = np.random.default_rng(seed)
  dims = ((shape.B, shape.T, shape.N, shape.H), (shape.B, shape.S, shape.K, shape.H),
          (shape.B, shape.S, shape.K, shape.D))
  return tuple(jnp.asarray(amplitude * rng.standard_normal(d), dtype) for d in dims)


def kv_lengths(shape: Shape) -> jax.Array:
  """Per-example key lengths: a short one, (B > 1) an empty one, (B > 2) a full one.

  Full rows without padding are what ``lengths=None`` runs; an empty row
  must give zeros (and zero, finite gradients), not NaN.
  """
  choices = [max(1, shape.S // 3), 0, shape.S]
  return jnp.asarray([choices[b % 3] for b in range(shape.B)], jnp.int32)


def cotangent(out: jax.Array, seed: int = 1) -> jax.Array:
  """A fixed random output cotangent, so that gradients see every entry."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(out.shape), out.dtype)


def assert_close(actual, expected, dtype, table=None, err_msg: str = "") -> None:
  atol, rtol = (table or TOLERANCE)[jnp.dtype(dtype)]
  np.testing.assert_allclose(
      np.asarray(actual, np.float64), np.asarray(expected, np.float64),
      atol=atol, rtol=rtol, err_msg=err_msg,
  )


def spec_cases():
  """``(spec, implementation)`` for every registered implementation."""
  return [(spec, impl)
          for spec in map(la.get_spec, la.available_attentions())
          for impl in (spec.suite_implementations or spec.implementations)]


def case_id(case) -> str:
  spec, impl = case
  return spec.name if impl is None else f"{spec.name}-{impl}"


def build(spec, impl, **options):
  """(fast, oracle) for one spec/implementation with the suite's options."""
  options = {**spec.test_options, **options}
  if impl is not None:
    options["implementation"] = impl
  return spec.build(**options), spec.build_reference(**options)


def largest_intermediate(jaxpr) -> int:
  """Element count of the largest value a jaxpr (and its sub-jaxprs) produces."""
  size = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      size = max(size, int(np.prod(var.aval.shape)) if var.aval.shape else 1)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      size = max(size, largest_intermediate(sub))
  return size
