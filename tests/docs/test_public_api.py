"""The public functions as a user calls them: compiled, also when called eagerly."""

from __future__ import annotations

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import CompileCounter

import linattn_jax as la

PROJECTION = la.feature_maps.orthogonal_random_projection(jax.random.key(0), 8, 4)
COMPILED = {
    "softmax_attention": dict(),
    "softmax_attention_reference": dict(),  # The oracles too: a test calls them eagerly.
    "efficient_attention_reference": dict(),
    "flash_attention": dict(),
    "linear_attention": dict(),
    "performer_attention": dict(projection=PROJECTION),
    "cosformer_attention": dict(max_length=8),
    "cosformer_attention_reference": dict(max_length=8),
    "linformer_attention": dict(key_projection=jnp.ones((3, 8)), value_projection=jnp.ones((3, 8))),
    "efficient_attention": dict(),
    "heinsen_attention": dict(),
    "log_heinsen_attention": dict(),
    "local_attention": dict(window_size=[2, 0]),  # A list: made a hashable static option.
    "strided_attention": dict(stride=2),
    "longformer_attention": dict(window_size=1, global_positions=[0]),
    # A numpy layout and a PRNG key: hashed by value as static options.
    "block_sparse_attention": dict(layout=np.tril(np.ones((4, 4), bool)), block_size=2),
    "bigbird_attention": dict(block_size=2, num_window_blocks=1, num_global_blocks=1,
                              num_random_blocks=1, rng=jax.random.key(3)),
}


@pytest.mark.parametrize("name", COMPILED)
def test_public_functions_run_one_compiled_program_when_called_eagerly(name):
  """Eager calls run compiled code, not op by op."""
  causal = name != "linformer_attention"  # Non-causal only.
  fn = functools.partial(getattr(la, name), is_causal=causal, **COMPILED[name])
  q1 = jnp.ones((1, 8, 2, 4))
  q2 = 2 * q1  # Same shape and dtype (not weakly typed), other values.
  jaxpr = jax.make_jaxpr(lambda q: fn(q, q, q))(q1).jaxpr
  assert [eqn.primitive.name for eqn in jaxpr.eqns] == ["jit"]
  with CompileCounter() as compiles:  # Once for the shapes (unless cached), not per call.
    fn(q1, q1, q1).block_until_ready()
    fn(q2, q1, q1).block_until_ready()
  assert compiles.count <= 1


@pytest.mark.parametrize("name", ["selective_scan", "selective_scan_reference"])
def test_the_selective_scan_runs_one_compiled_program_when_called_eagerly(name):
  x1, bc = jnp.ones((1, 8, 4)), jnp.ones((1, 8, 1, 2))
  x2 = 2 * x1  # Same shape and dtype (not weakly typed), other values.
  fn = functools.partial(getattr(la, name), dt=x1, A=-jnp.ones((4, 2)), b=bc, c=bc)  # G = 1
  assert [eqn.primitive.name for eqn in jax.make_jaxpr(fn)(x1).jaxpr.eqns] == ["jit"]
  with CompileCounter() as compiles:  # Once for the shapes, not per call.
    fn(x1).block_until_ready()
    fn(x2).block_until_ready()
  assert compiles.count <= 1


def test_array_options_are_static_by_value():
  """Equal layouts and keys share a program; a different one is a different pattern."""
  q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 4)), jnp.float32)
  layout = np.tril(np.ones((4, 4), bool))
  run = lambda layout: la.block_sparse_attention(q, q, q, layout=layout, block_size=2)  # noqa: E731
  first = run(layout)
  with CompileCounter() as compiles:
    again = run(layout.copy())
  assert compiles.count == 0
  np.testing.assert_array_equal(again, first)
  other = run(np.eye(4, dtype=bool))
  np.testing.assert_allclose(other, la.block_sparse_attention(
      q, q, q, layout=np.eye(4, dtype=bool), block_size=2, implementation="reference"),
      rtol=1e-5, atol=1e-6)
  assert not np.allclose(other, first)
  options = dict(block_size=2, num_window_blocks=1, num_global_blocks=1, num_random_blocks=1)
  by_key = la.bigbird_attention(q, q, q, rng=jax.random.key(5), **options)
  by_ref = la.bigbird_attention(q, q, q, rng=jax.random.key(5), implementation="reference",
                                **options)
  np.testing.assert_allclose(by_key, by_ref, rtol=1e-5, atol=1e-6)


# The attention oracles (the selective scan's, whose inputs are not q, k, v, is checked in
# test_selective_scan.py).
REFERENCES = [name for name in la.__all__
              if name.endswith("_reference") and name != "selective_scan_reference"]


@pytest.mark.parametrize("name", REFERENCES)
def test_the_oracles_reject_bad_input_under_their_own_name(name):
  """A user calling an oracle directly gets its name in the error, not the fast function's."""
  options = {"performer": dict(projection=PROJECTION), "cosformer": dict(max_length=8),
             "linformer": dict(key_projection=jnp.ones((3, 8)),
                               value_projection=jnp.ones((3, 8)))}.get(name.split("_")[0], {})
  q, kv = jnp.ones((1, 4, 2, 4)), jnp.ones((1, 4, 3, 4))  # H = 4: the projection's.
  gates = jnp.zeros((1, 4, 2))  # log_decay or beta: an extra per-key input.
  extra = (gates,) if name.startswith(("gated", "delta")) else ()
  extra = (kv, kv) if name.startswith("dplr") else extra  # a and b [B, S, K, H].
  steps = name.startswith("delta_product")  # Keys and values [B, S, n, K, H]; beta [B, S, n, K].
  extra = (jnp.zeros((1, 4, 1, 3)),) if steps else extra
  extra = (jnp.ones((1, 4, 2, 3)),) if name.startswith("log_linear") else extra  # λ [B, T, N, L]
  fn = lambda q, k, v, **kw: getattr(la, name)(  # noqa: E731
      q, *((k[:, :, None], v[:, :, None]) if steps else (k, v)), *extra, **options, **kw)
  with pytest.raises(ValueError, match=rf"^{name}: .*multiple of.*K=3"):
    fn(q, kv, kv, is_causal=True)
  with pytest.raises(ValueError, match=rf"^{name}: is_causal must be a static Python bool"):
    jax.jit(lambda causal: fn(q, q, q, is_causal=causal))(True)


def test_submodules_are_attributes_of_the_package():
  """``import linattn_jax as la`` alone gives ``la.nn``, ``la.parallel``, ``la.masks`` and
  ``la.feature_maps`` (checked in a fresh interpreter: here they are imported already)."""
  code = ("import linattn_jax as la; print(la.nn.MultiHeadAttention.__name__, "
          "la.parallel.ring_attention.__name__, la.masks.causal.__name__, "
          "la.feature_maps.relu.__name__)")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        check=True, timeout=120)
  assert done.stdout.split() == ["MultiHeadAttention", "ring_attention", "causal", "relu"]
