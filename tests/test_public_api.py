"""The public functions as a user calls them: compiled, also when called eagerly."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from _helpers import CompileCounter

import linattn_jax as la

PROJECTION = la.feature_maps.orthogonal_random_projection(jax.random.key(0), 8, 4)
COMPILED = {
    "softmax_attention": dict(),
    "flash_attention": dict(),
    "linear_attention": dict(),
    "performer_attention": dict(projection=PROJECTION),
    "efficient_attention": dict(),
    "heinsen_attention": dict(),
    "log_heinsen_attention": dict(),
    "local_attention": dict(window_size=[2, 0]),  # A list: made a hashable static option.
    "strided_attention": dict(stride=2),
    "longformer_attention": dict(window_size=1, global_positions=[0]),
}


@pytest.mark.parametrize("name", COMPILED)
def test_public_functions_run_one_compiled_program_when_called_eagerly(name):
  """Eager calls run compiled code, not op by op (block_sparse's numpy layouts
  and bigbird's PRNG keys are not yet hashable options, so those two still do)."""
  fn = functools.partial(getattr(la, name), is_causal=True, **COMPILED[name])
  q1 = jnp.ones((1, 8, 2, 4))
  q2 = 2 * q1  # Same shape and dtype (not weakly typed), other values.
  jaxpr = jax.make_jaxpr(lambda q: fn(q, q, q))(q1).jaxpr
  assert [eqn.primitive.name for eqn in jaxpr.eqns] == ["jit"]
  with CompileCounter() as compiles:  # Once for the shapes (unless cached), not per call.
    fn(q1, q1, q1).block_until_ready()
    fn(q2, q1, q1).block_until_ready()
  assert compiles.count <= 1
