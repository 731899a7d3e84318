"""Feature maps: values, bf16 safety, unbiasedness of the random features,
orthogonal projections, shape errors, and parameters as pytree leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from _helpers import CompileCounter

import linattn_jax as la
from linattn_jax import feature_maps as fm

H = 4


def _qk(seed=0, amplitude=0.7):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(amplitude * rng.standard_normal(H), jnp.float32),
          jnp.asarray(amplitude * rng.standard_normal(H), jnp.float32))


def test_elu_plus_one_is_positive_and_finite_in_bfloat16():
  x = np.linspace(-30, 30, 601)
  got = np.asarray(fm.elu_plus_one(jnp.asarray(x, jnp.bfloat16)), np.float64)
  xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)  # The rounded inputs.
  want = np.where(xb > 0, xb + 1, np.exp(np.minimum(xb, 0)))
  assert np.all(np.isfinite(got)) and np.all(got > 0)
  np.testing.assert_allclose(got, want, rtol=1e-2)


def test_elu_plus_one_derivatives_match_elu():
  x = jnp.asarray([-80.0, -3.0, -1e-3, 0.0, 1e-3, 2.0, 50.0])
  for order in (jax.grad, lambda f: jax.grad(jax.grad(f))):
    got = jax.vmap(order(lambda x: fm.elu_plus_one(x)))(x)
    want = jax.vmap(order(lambda x: jax.nn.elu(x) + 1))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
  with jax.enable_x64(True):
    x64 = jnp.asarray([-1.3, -0.2, 0.4, 1.7], jnp.float64)
    jax.test_util.check_grads(fm.elu_plus_one, (x64,), order=2, modes=("fwd", "rev"))


def test_deterministic_maps_match_numpy():
  x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
  np.testing.assert_allclose(fm.relu(jnp.asarray(x)), np.maximum(x, 0))
  np.testing.assert_allclose(fm.exp(jnp.asarray(x), is_query=True), np.exp(x), rtol=1e-6)
  np.testing.assert_allclose(fm.elu_plus_one(jnp.asarray(x)),
                             np.where(x > 0, x + 1, np.exp(x)), rtol=1e-6)


def test_projected_map_and_its_gradient():
  rng = np.random.default_rng(1)
  w, b = rng.standard_normal((H, 6)), rng.standard_normal(6)
  x = rng.standard_normal((2, H))
  z = x @ w + b
  want = np.where(z > 0, z + 1, np.exp(z))
  phi = fm.projected(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32))
  np.testing.assert_allclose(phi(jnp.asarray(x, jnp.float32)), want, rtol=1e-5)
  grad = jax.grad(lambda w: fm.projected(w, b)(jnp.asarray(x, jnp.float32)).sum())(
      jnp.asarray(w, jnp.float32))
  assert grad.shape == (H, 6) and np.all(np.isfinite(grad)) and np.any(grad != 0)


def _estimates(make_map, draw, q, k, draws, num_features):
  """phi(q)·phi(k) for ``draws`` independent projections."""
  rngs = jax.random.split(jax.random.key(42), draws)

  def one(rng):
    phi = make_map(draw(rng, num_features, H))
    return phi(q) @ phi(k)

  return np.asarray(jax.vmap(one)(rngs), np.float64)


@pytest.mark.parametrize("make_map", [fm.favor_plus, fm.random_fourier],
                         ids=["favor_plus", "random_fourier"])
@pytest.mark.parametrize("draw", [fm.gaussian_random_projection,
                                  fm.orthogonal_random_projection], ids=["gaussian", "orthogonal"])
def test_random_features_are_unbiased_for_the_softmax_kernel(make_map, draw):
  q, k = _qk()
  want = float(np.exp(np.dot(q, k) / np.sqrt(H)))
  est = _estimates(make_map, draw, q, k, draws=4000, num_features=8)
  stderr = est.std(ddof=1) / np.sqrt(est.size)
  assert abs(est.mean() - want) < 4 * stderr, (est.mean(), want, stderr)
  assert stderr < 0.05 * want  # The check above is not vacuous.


def test_trig_features_sin_and_cos_match_float64_at_every_magnitude():
  """``random_fourier``'s float32 sin and cos (one range reduction, two polynomials):
  within 2e-7 of float64's for |x| <= 1e6; for any finite x no further off than the
  values at a point within one ulp of x, and within [-1, 1]; NaN at ±inf and NaN, as
  ``jnp.sin``; derivatives cos and -sin; float64 inputs take ``jnp``'s."""
  from linattn_jax._src.feature_maps import sin_cos
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.standard_normal(20_000) * scale for scale in (1, 30, 1e3, 1e5, 1e6)]
                     + [[0.0, np.pi / 2, -np.pi, 2.5e7, 1e20, -3e38]]).astype(np.float32)
  got = [np.asarray(y, np.float64) for y in jax.jit(sin_cos)(jnp.asarray(x))]
  x64 = x.astype(np.float64)
  for value, exact in zip(got, (np.sin(x64), np.cos(x64)), strict=True):
    err = np.abs(value - exact)
    assert err[np.abs(x) <= 1e6].max() <= 2e-7
    assert np.all(err <= np.spacing(np.abs(x)) + 2e-7)  # |sin'|, |cos'| <= 1.
    assert np.all(np.abs(value) <= 1 + 2**-23)
  assert np.isnan(np.asarray(sin_cos(jnp.asarray([np.inf, -np.inf, np.nan])))).all()
  grad = jax.grad(lambda x: jnp.sum(sin_cos(x)[0] * 2 + sin_cos(x)[1]))(jnp.asarray(x[:1000]))
  np.testing.assert_allclose(grad, 2 * np.cos(x64[:1000]) - np.sin(x64[:1000]), atol=5e-7)
  with jax.enable_x64(True):
    x64_sin, x64_cos = sin_cos(jnp.asarray(x64[:1000]))
    np.testing.assert_array_equal(x64_sin, jnp.sin(x64[:1000]))
    np.testing.assert_array_equal(x64_cos, jnp.cos(x64[:1000]))


def test_favor_plus_estimates_are_positive_and_trig_ones_are_signed():
  q, k = _qk(seed=3, amplitude=1.5)
  draw = fm.gaussian_random_projection
  assert np.all(_estimates(fm.favor_plus, draw, q, k, draws=500, num_features=2) > 0)
  assert np.any(_estimates(fm.random_fourier, draw, q, k, draws=500, num_features=2) < 0)


@pytest.mark.parametrize("make_map", [fm.favor_plus, fm.random_fourier])
def test_log_scaled_features_reassemble_phi(make_map):
  x = jnp.asarray(np.random.default_rng(2).standard_normal((5, H)), jnp.float32)
  phi = make_map(fm.gaussian_random_projection(jax.random.key(0), 7, H))
  features, log_scale = phi.log_scaled(x)
  np.testing.assert_allclose(jnp.exp(log_scale)[:, None] * features, phi(x), rtol=1e-5)
  assert np.all(np.abs(features) <= 1.0 + 1e-6)
  if make_map is fm.favor_plus:
    np.testing.assert_allclose(features.max(axis=-1), 1.0)  # Stabilised per row.


def test_orthogonal_projection_rows_are_orthogonal_within_blocks():
  M, Hd = 20, 8  # Blocks of 8, 8 and a truncated block of 4 rows.
  w = np.asarray(fm.orthogonal_random_projection(jax.random.key(0), M, Hd), np.float64)
  assert w.shape == (M, Hd)
  unit = w / np.linalg.norm(w, axis=1, keepdims=True)
  for start in range(0, M, Hd):
    block = unit[start:start + Hd]
    np.testing.assert_allclose(block @ block.T, np.eye(len(block)), atol=1e-5)
  # Different blocks are independent draws, not orthogonal to each other.
  assert np.abs(unit[:Hd] @ unit[Hd:2 * Hd].T).max() > 0.1


@pytest.mark.parametrize("draw", [fm.gaussian_random_projection,
                                  fm.orthogonal_random_projection])
def test_projection_row_norms_are_chi_distributed(draw):
  import scipy.stats  # Here, not at the top: it takes a second to import, in every worker.

  M, Hd = 4096, 8
  w = np.asarray(draw(jax.random.key(7), M, Hd), np.float64)
  sq_norms = np.sum(w * w, axis=1)
  assert scipy.stats.kstest(sq_norms, scipy.stats.chi2(df=Hd).cdf).pvalue > 1e-3
  # Rows are marginally N(0, I): every coordinate has unit variance.
  np.testing.assert_allclose(w.var(axis=0), 1.0, atol=0.1)


def test_projections_are_pure_functions_of_the_rng():
  a = fm.orthogonal_random_projection(jax.random.key(3), 10, 4)
  b = fm.orthogonal_random_projection(jax.random.key(3), 10, 4)
  c = fm.orthogonal_random_projection(jax.random.key(4), 10, 4)
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


def test_shape_errors_name_the_shapes():
  w = jnp.ones((6, H))
  with pytest.raises(ValueError, match=r"projection must be \[M, H\].*\(6,\)"):
    fm.favor_plus(jnp.ones(6))
  with pytest.raises(ValueError, match=r"\(6, 4\).*\(2, 5\).*H=5"):
    fm.favor_plus(w)(jnp.ones((2, 5)))
  with pytest.raises(ValueError, match=r"random_fourier.*\(6, 4\).*\(3\,\)"):
    fm.random_fourier(w)(jnp.ones(3))
  with pytest.raises(ValueError, match=r"weight \(4, 6\), bias \(5,\)"):
    fm.projected(jnp.ones((4, 6)), jnp.ones(5))
  with pytest.raises(ValueError, match="num_features"):
    fm.orthogonal_random_projection(jax.random.key(0), 0, 4)


def test_parameters_are_pytree_leaves_and_new_values_compile_nothing():
  """Maps carry their arrays as data: new values of the same shapes reuse programs."""
  x = 0.3 * jax.random.normal(jax.random.key(9), (2, 5, 2, H))
  w, b = jnp.full((H, 6), 0.1), jnp.zeros(6)
  assert len(jax.tree.leaves(fm.projected(w, b))) == 2
  p1, p2 = (fm.orthogonal_random_projection(jax.random.key(i), 8, H) for i in (0, 1))
  assert jax.tree.leaves(fm.favor_plus(p1))[0] is p1

  def loss(w, b, x):  # Eager jax.grad, as a training loop would call it.
    return la.linear_attention(x, x, x, feature_map=fm.projected(w, b), is_causal=True).sum()

  grad = jax.grad(loss, argnums=(0, 1))
  calls = [
      (grad, (w, b, x), (w + 0.5, b - 0.1, x)),
      (lambda p: la.performer_attention(x, x, x, projection=p, is_causal=True), (p1,), (p2,)),
      (lambda p: la.linear_attention(x, x, x, feature_map=fm.favor_plus(p)), (p1,), (p2,)),
      (jax.jit(lambda phi, x: la.linear_attention(x, x, x, feature_map=phi)),
       (fm.random_fourier(p1), x), (fm.random_fourier(p2), x)),
  ]
  for i, (fn, first, second) in enumerate(calls):
    a = fn(*first)
    with CompileCounter() as compiles:
      b_ = fn(*second)
    assert compiles.count == 0, f"call {i}: new parameter values compiled {compiles.count}x"
    assert not all(np.allclose(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b_),
                                                     strict=True)), f"call {i}: vacuous"
