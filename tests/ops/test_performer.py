"""Performer attention beyond the shared suite: a log-space numpy oracle,
stabilised eps, causal stability against extreme future keys, features made one
chunk at a time, convergence to softmax attention as M grows, orthogonal vs
Gaussian features, streaming with an explicit projection, the registry entries
and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from _helpers import Shape, assert_close, largest_intermediate, make_qkv

import linattn_jax as la
from linattn_jax import feature_maps as fm

CAUSAL_IMPLS = ["scan", "associative_scan", "chunked"]
SHAPE = Shape(B=2, T=6, S=9, N=4, K=2, H=4, D=3)


def numpy_performer(q, k, v, w, *, kernel, causal, kv_len=None):
  """float64 oracle with eps = 0: the kernel in log space (log|κ|, sign(κ))."""
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
  B, T, N, H = q.shape
  _, S, K, _ = k.shape
  k, v = (np.repeat(x, N // K, axis=2) for x in (k, v))  # [B, S, N, ...]
  qh, kh = q / H ** 0.25, k / H ** 0.25
  half_q, half_k = 0.5 * np.sum(qh ** 2, -1), 0.5 * np.sum(kh ** 2, -1)  # [B, T|S, N]
  if kernel == "positive":  # κ = mean_m exp(w·q̂ - ‖q̂‖²/2 + w·k̂ - ‖k̂‖²/2).
    lq, lk = qh @ w.T - half_q[..., None], kh @ w.T - half_k[..., None]
    log_kappa = scipy.special.logsumexp(lq[:, :, None] + lk[:, None], axis=-1)
    sign = np.ones_like(log_kappa)
  else:  # κ = exp(‖q̂‖²/2 + ‖k̂‖²/2) mean_m cos(w·(q̂ - k̂)).
    c = np.cos((qh[:, :, None] - kh[:, None]) @ w.T).mean(-1)  # [B, T, S, N]
    log_kappa = half_q[:, :, None] + half_k[:, None] + np.log(np.abs(c))
    sign = np.sign(c)
  visible = np.ones((B, T, S), bool)
  if causal:
    visible &= np.arange(S)[None, None, :] <= np.arange(T)[None, :, None] + S - T
  if kv_len is not None:
    visible &= np.arange(S)[None, None, :] < np.asarray(kv_len)[:, None, None]
  log_kappa = np.where(visible[..., None], log_kappa, -np.inf)
  shift = np.max(log_kappa, axis=2, keepdims=True)
  weights = sign * np.exp(log_kappa - np.where(np.isfinite(shift), shift, 0))
  num = np.einsum("btsn,bsnd->btnd", weights, v)
  den = weights.sum(2)[..., None]
  return np.where(den == 0, 0, num / np.where(den == 0, 1, den))


def _projection(M=16, H=SHAPE.H, seed=0):
  return fm.orthogonal_random_projection(jax.random.key(seed), M, H)


@pytest.mark.parametrize("kernel, amplitude", [("positive", 1.0), ("positive", 4.0),
                                               ("trig", 0.5)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("implementation", ["reference", None])
def test_matches_log_space_numpy_oracle(kernel, amplitude, causal, implementation):
  q, k, v = make_qkv(SHAPE, amplitude=amplitude)
  w = _projection(M=64 if kernel == "trig" else 16)
  kv_len = np.array([9, 4])
  # At amplitude 4 the feature products are ~exp(-40): only the stabilised
  # computation stays finite and accurate.
  got = la.performer_attention(q, k, v, projection=w, kernel=kernel, is_causal=causal,
                               key_value_seq_lengths=jnp.asarray(kv_len), eps=0.0,
                               implementation=implementation, chunk_size=4)
  want = numpy_performer(q, k, v, w, kernel=kernel, causal=causal, kv_len=kv_len)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kernel", ["positive", "trig"])
@pytest.mark.parametrize("implementation, dtype", [
    ("scan", jnp.float32), ("associative_scan", jnp.float32), ("chunked", jnp.float32),
    ("chunked", jnp.bfloat16)])
def test_extreme_future_key_leaves_earlier_outputs_unchanged(kernel, implementation, dtype):
  shape = Shape(B=1, T=10, S=10, N=2, K=1, H=4, D=3)
  q, k, v = make_qkv(shape, dtype)
  fn = jax.jit(lambda q, k, v: la.performer_attention(
      q, k, v, projection=_projection(), kernel=kernel, is_causal=True,
      implementation=implementation, chunk_size=4))
  base = np.asarray(fn(q, k, v), np.float32)
  for j in (3, 6, 9):  # Inside a chunk, at a chunk start, the last key.
    out = np.asarray(fn(q, k.at[:, j].multiply(30), v.at[:, j].multiply(30)), np.float32)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[:, :j], base[:, :j])
    assert not np.allclose(out[:, j:], base[:, j:])  # The key does matter later.


@pytest.mark.parametrize("implementation, dtype", [("parallel", jnp.float16),
                                                   ("chunked", jnp.bfloat16)])
def test_low_precision_inputs_up_to_30_give_finite_outputs_and_gradients(dtype, implementation):
  q, k, v = make_qkv(SHAPE, dtype, amplitude=30.0)
  is_causal = implementation == "chunked"

  def f(q, k, v):
    return la.performer_attention(q, k, v, projection=_projection(), is_causal=is_causal,
                                  implementation=implementation)

  out = f(q, k, v)
  assert out.dtype == dtype and np.all(np.isfinite(np.asarray(out, np.float32)))
  assert np.any(np.asarray(out) != 0)  # eps in stabilised units: no collapse to zero.
  grads = jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g, np.float32)))


APPROX_SHAPE = Shape(B=1, T=32, S=32, N=2, K=2, H=8, D=4)


def _mean_squared_errors(draw, M, *, kernel, amplitude, draws):
  """MSE against exact softmax attention, one value per projection draw."""
  q, k, v = make_qkv(APPROX_SHAPE, amplitude=amplitude)
  want = la.softmax_attention_reference(q, k, v, is_causal=True)

  def one(rng):
    w = draw(rng, M, APPROX_SHAPE.H)
    out = la.performer_attention(q, k, v, projection=w, kernel=kernel, is_causal=True)
    return jnp.mean((out - want) ** 2)

  return np.asarray(jax.lax.map(one, jax.random.split(jax.random.key(1), draws)))


@pytest.mark.parametrize("kernel", ["positive", "trig"])
def test_the_chunked_form_featurises_one_chunk_at_a_time(kernel):
  """Forward + backward never hold the features of the whole sequence, ``[T, M]`` per
  head (4x the queries at M = 4H), nor their cotangents: the feature map runs inside
  each chunk's checkpointed body. The same measure sees them where they are made."""
  T, M, C = 1024, 64, 32
  q, k, v = make_qkv(Shape(B=1, T=T, S=T, N=1, K=1, H=16, D=8))
  w = fm.orthogonal_random_projection(jax.random.key(0), M, 16)
  loss = lambda q, k, v: jnp.sum(la.performer_attention(  # noqa: E731
      q, k, v, projection=w, kernel=kernel, is_causal=True, chunk_size=C) ** 2)
  whole = T * M * (2 if kernel == "trig" else 1)
  assert largest_intermediate(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v).jaxpr) < whole / 2
  featurize = getattr(fm, {"positive": "favor_plus", "trig": "random_fourier"}[kernel])(w)
  assert largest_intermediate(jax.make_jaxpr(featurize)(k).jaxpr) >= whole


@pytest.mark.parametrize("kernel, amplitude", [("positive", 1.0), ("trig", 0.5)])
def test_error_against_softmax_falls_as_features_grow(kernel, amplitude):
  errors = [_mean_squared_errors(fm.orthogonal_random_projection, M, kernel=kernel,
                                 amplitude=amplitude, draws=32).mean()
            for M in (4, 16, 64, 256)]
  assert all(b < 0.8 * a for a, b in zip(errors, errors[1:], strict=False)), errors


def test_orthogonal_features_do_at_least_as_well_as_gaussian_on_average():
  options = dict(kernel="positive", amplitude=1.0, draws=200)
  for M in (8, 16):
    orth = _mean_squared_errors(fm.orthogonal_random_projection, M, **options)
    gauss = _mean_squared_errors(fm.gaussian_random_projection, M, **options)
    assert orth.mean() <= gauss.mean(), (M, orth.mean(), gauss.mean())


@pytest.mark.parametrize("kernel", ["positive", "trig"])
def test_step_with_explicit_projection_matches_causal_pass(kernel):
  shape = Shape(B=2, T=7, S=7, N=4, K=2, H=4, D=3)
  q, k, v = make_qkv(shape, amplitude=2.0)
  w = _projection()
  M = 16 if kernel == "positive" else 32
  state = la.init_performer_state(shape.B, shape.K, shape.H, shape.D, projection=w, kernel=kernel)
  assert state.kv.shape == (shape.B, shape.K, M, shape.D)
  assert np.all(state.running_max == -np.inf)

  def step(state, qkv):
    return la.performer_attention_step(state, *qkv, projection=w, kernel=kernel)

  state, outs = jax.lax.scan(step, state, tuple(x.swapaxes(0, 1) for x in (q, k, v)))
  want, want_state = la.performer_attention(q, k, v, projection=w, kernel=kernel,
                                            is_causal=True, return_state=True)
  assert_close(outs.swapaxes(0, 1), want, jnp.float32)
  for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
    assert_close(got, ref, jnp.float32)


def test_noncausal_state_with_different_scales_is_a_prefix():
  q, k, v = make_qkv(SHAPE, amplitude=2.0)
  k = k.at[:, 5:].multiply(2.0)  # The second part raises the running maximum.
  w = _projection()
  _, state = la.performer_attention(q, k[:, :5], v[:, :5], projection=w, return_state=True)
  got = la.performer_attention(q, k[:, 5:], v[:, 5:], projection=w, initial_state=state)
  assert_close(got, la.performer_attention(q, k, v, projection=w), jnp.float32)


def test_registry_redraw_is_a_pure_function_of_rng():
  q, k, v = make_qkv(SHAPE)
  run = lambda **o: la.get_attention("performer", num_features=8, **o)(  # noqa: E731
      q, k, v, is_causal=True)
  np.testing.assert_array_equal(run(rng=1), run(rng=1))
  np.testing.assert_array_equal(run(rng=1), run(rng=jax.random.key(1)))
  assert not np.allclose(run(rng=1), run(rng=2))
  for name, M in (("performer", 8), ("random_fourier", 16)):
    spec = la.get_spec(name)
    assert spec.streaming.init(q, k, v, num_features=8).kv.shape == (2, 2, M, 3)
    assert spec.noncausal_only == {"parallel"}


def _has_qr(jaxpr) -> bool:
  return any(eqn.primitive.name in ("householder_product", "geqrf", "qr")
             or any(_has_qr(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
             for eqn in jaxpr.eqns)


def test_a_seed_draws_outside_the_callers_program_and_a_traced_key_inside():
  """A seed (or a concrete key) draws the projection once, at trace time: the caller's
  program holds it as a constant and computes no QR factorisation; a key that is an
  argument of the caller's program draws inside it. Both give the same values, also
  under ``shard_map`` (where the drawn arrays are typed by its manual mesh), to float32's
  rounding (one draw is compiled on its own, the other inside a larger program)."""
  q, k, v = make_qkv(SHAPE)
  fn = la.get_attention("performer", num_features=8)
  seeded = jax.make_jaxpr(lambda q: fn(q, k, v, is_causal=True, rng=3))(q)
  traced = jax.make_jaxpr(lambda q, key: fn(q, k, v, is_causal=True, rng=key))(
      q, jax.random.key(3))
  assert not _has_qr(seeded.jaxpr) and _has_qr(traced.jaxpr)
  want = jax.jit(lambda q, key: fn(q, k, v, is_causal=True, rng=key))(q, jax.random.key(3))
  close = lambda got: np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)  # noqa: E731
  close(jax.jit(lambda q: fn(q, k, v, is_causal=True, rng=3))(q))
  mesh = jax.make_mesh((2,), ("b",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices("cpu")[:2])
  spec = jax.sharding.PartitionSpec("b")
  split = jax.jit(jax.shard_map(lambda q, k, v: fn(q, k, v, is_causal=True, rng=3), mesh=mesh,
                                in_specs=spec, out_specs=spec))
  close(split(q, k, v))
  close(fn(q, k, v, is_causal=True, rng=3))


def test_errors_name_shapes_and_options():
  q, k, v = make_qkv(SHAPE)
  with pytest.raises(ValueError, match=r"performer_attention: projection must be \[M, H\] with "
                     r"H=4 \(the last axis of query \(2, 6, 4, 4\)\); got \(16, 5\)"):
    la.performer_attention(q, k, v, projection=jnp.ones((16, 5)))
  with pytest.raises(ValueError, match=r"projection must be \[M, H\].*got \(16,\)"):
    la.performer_attention(q, k, v, projection=jnp.ones(16))
  with pytest.raises(ValueError, match=r"performer_attention: projection must be \[M, H\]"):
    la.performer_attention_step(
        la.init_performer_state(SHAPE.B, SHAPE.K, SHAPE.H, SHAPE.D, projection=_projection()),
        q[:, 0], k[:, 0], v[:, 0], projection=jnp.ones((16, 5)))
  with pytest.raises(ValueError, match="init_performer_state: head_dim must be a positive"):
    la.init_performer_state(SHAPE.B, SHAPE.K, -1, SHAPE.D, projection=_projection())
  with pytest.raises(ValueError, match=r"init_performer_state: projection must be \[M, H\] "
                     r"with H=4"):
    la.init_performer_state(SHAPE.B, SHAPE.K, SHAPE.H, SHAPE.D, projection=jnp.ones((16, 5)))
  with pytest.raises(ValueError, match="unknown kernel"):
    la.performer_attention(q, k, v, projection=_projection(), kernel="cosine")
  with pytest.raises(ValueError, match="is_causal"):
    la.performer_attention(q, k, v, projection=_projection(), is_causal=True,
                           implementation="parallel")
  bad = la.init_performer_state(SHAPE.B, SHAPE.K, SHAPE.H, SHAPE.D,
                                projection=_projection()[:8])
  with pytest.raises(ValueError, match=r"initial_state.*\(2, 2, 8, 3\).*\(2, 2, 16, 3\)"):
    la.performer_attention(q, k, v, projection=_projection(), initial_state=bad)
