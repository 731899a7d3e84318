"""Mamba's selective scan: each form equals the oracle (``selective_scan_reference``, itself
checked against the recurrence stepped by hand in float64 numpy), forward and gradient;
packed documents, state passing and the streaming step equal the one-pass results;
bfloat16 inputs keep a float32 state; the chunked forms never hold a ``[T, E, N]`` array;
bad inputs raise naming them."""

from __future__ import annotations

import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import TOLERANCE

import linattn_jax as la

Bsz, T, E, G, N = 2, 13, 6, 2, 4
IDS = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2], [4] * T], np.int32)


def _inputs(dtype=jnp.float32, T=T):
  k = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(k[0], (Bsz, T, E))
  dt = jax.nn.softplus(jax.random.normal(k[1], (Bsz, T, E)))
  A = -jnp.exp(0.5 * jax.random.normal(k[2], (E, N)))
  b, c = (jax.random.normal(key, (Bsz, T, G, N)) for key in k[3:5])
  h0 = la.SelectiveState(jax.random.normal(k[5], (Bsz, E, N)))
  cast = lambda a: np.asarray(a, np.float64).astype(dtype)  # noqa: E731
  return (*(cast(a) for a in (x, dt, A, b, c)), cast(jnp.arange(E) / E),
          la.SelectiveState(cast(h0.h)))


def _stepped_by_hand(x, dt, A, b, c, D, h0, ids):
  """The recurrence one channel and token at a time, float64 numpy."""
  x, dt, A, b, c, D, h = (np.asarray(a, np.float64) for a in (x, dt, A, b, c, D, h0.h))
  h = h.copy()
  y = np.zeros(x.shape)
  for t in range(x.shape[1]):
    for row in range(x.shape[0]):
      if t and ids[row, t] != ids[row, t - 1]:
        h[row] = 0.0
      for e in range(E):
        g = e // (E // G)
        h[row, e] = np.exp(dt[row, t, e] * A[e]) * h[row, e] + dt[row, t, e] * x[row, t, e] * b[
            row, t, g]
        y[row, t, e] = c[row, t, g] @ h[row, e] + D[e] * x[row, t, e]
  return y, h


def test_the_oracle_is_the_recurrence_stepped_by_hand():
  x, dt, A, b, c, D, h0 = _inputs(np.float64)
  with jax.enable_x64(True):
    y, state = jax.jit(functools.partial(la.selective_scan_reference, return_state=True))(
        x, dt, A, b, c, D, segment_ids=IDS, initial_state=h0)
  want, h = _stepped_by_hand(x, dt, A, b, c, D, h0, IDS)
  np.testing.assert_allclose(y, want, atol=1e-12, rtol=1e-12)
  np.testing.assert_allclose(state.h, h, atol=1e-12, rtol=1e-12)


@functools.cache
def _program(implementation, chunk_size):
  """Output, final state and the gradients of ``Σ ct·y + Σ h`` w.r.t. every input."""
  def loss(x, dt, A, b, c, D, h0, ct):
    y, state = la.selective_scan(x, dt, A, b, c, D, segment_ids=IDS, initial_state=h0,
                                 return_state=True, chunk_size=chunk_size,
                                 implementation=implementation)
    return jnp.sum(y * ct) + jnp.sum(state.h), (y, state.h)
  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))


@pytest.mark.parametrize("implementation, chunk_size", [
    ("scan", 4), ("associative_scan", 5), (None, None)])
def test_each_form_equals_the_oracle_forward_and_gradient(implementation, chunk_size):
  """Chunks of 4 and 5 over 13 tokens: boundaries inside and at documents, a padded
  last chunk; the default chunk is one chunk here."""
  inputs = _inputs()
  ct = jax.random.normal(jax.random.key(9), (Bsz, T, E))
  (_, (y, h)), grads = _program(implementation, chunk_size)(*inputs, ct)
  (_, (y_ref, h_ref)), grads_ref = _program("reference", None)(*inputs, ct)
  atol, rtol = TOLERANCE[jnp.dtype(jnp.float32)]
  np.testing.assert_allclose(y, y_ref, atol=atol, rtol=rtol)
  np.testing.assert_allclose(h, h_ref, atol=atol, rtol=rtol)
  for g, g_ref, name in zip(grads, grads_ref, ("x", "dt", "A", "b", "c", "D", "h0"),
                            strict=True):
    g, g_ref = jax.tree.leaves(g)[0], jax.tree.leaves(g_ref)[0]
    np.testing.assert_allclose(g, g_ref, atol=10 * atol, rtol=10 * rtol, err_msg=f"d{name}")


def test_packed_split_and_stepped_calls_equal_the_one_pass():
  x, dt, A, b, c, D, h0 = _inputs()
  run = jax.jit(functools.partial(la.selective_scan, return_state=True, chunk_size=4))
  full, h_full = run(x, dt, A, b, c, D, initial_state=h0)
  # Two calls, the state passed on (the split inside a chunk).
  first, h_mid = run(*(a[:, :6] for a in (x, dt)), A, *(a[:, :6] for a in (b, c)), D,
                     initial_state=h0)
  second, h_end = run(*(a[:, 6:] for a in (x, dt)), A, *(a[:, 6:] for a in (b, c)), D,
                      initial_state=h_mid)
  atol, rtol = TOLERANCE[jnp.dtype(jnp.float32)]
  np.testing.assert_allclose(jnp.concatenate([first, second], 1), full, atol=atol, rtol=rtol)
  np.testing.assert_allclose(h_end.h, h_full.h, atol=atol, rtol=rtol)
  # One token at a time.
  step = jax.jit(la.selective_scan_step)
  state, ys = h0, []
  for t in range(T):
    state, y = step(state, x[:, t], dt[:, t], A, b[:, t], c[:, t], D)
    ys.append(y)
  np.testing.assert_allclose(jnp.stack(ys, 1), full, atol=atol, rtol=rtol)
  # Row 0's third document (from position 5) alone, from a zero state.
  packed = run(x, dt, A, b, c, D, segment_ids=IDS, initial_state=h0)[0]
  # Every keyword eagerly too (the jitted calls above and in the parity test take them all).
  eager, eager_state = la.selective_scan(x, dt, A, b, c, D, segment_ids=IDS, initial_state=h0,
                                         return_state=True, chunk_size=4,
                                         implementation="associative_scan")
  np.testing.assert_allclose(eager, packed, atol=atol, rtol=rtol)
  assert eager_state.h.shape == h0.h.shape
  alone = run(*(a[:1, 5:] for a in (x, dt)), A, *(a[:1, 5:] for a in (b, c)), D)[0]
  np.testing.assert_allclose(packed[:1, 5:], alone, atol=atol, rtol=rtol)


def test_bfloat16_inputs_keep_a_float32_state():
  x, dt, A, b, c, D, h0 = _inputs(jnp.bfloat16)
  y, state = jax.jit(functools.partial(la.selective_scan, return_state=True))(
      x, dt, A, b, c, D, initial_state=h0)
  assert y.dtype == jnp.bfloat16 and state.h.dtype == jnp.float32
  f32 = [np.asarray(a, np.float32) for a in (x, dt, A, b, c, D)]
  want = la.selective_scan_reference(*f32, initial_state=la.SelectiveState(
      np.asarray(h0.h, np.float32)))
  atol, rtol = TOLERANCE[jnp.dtype(jnp.bfloat16)]
  np.testing.assert_allclose(np.asarray(y, np.float32), want, atol=atol * 4, rtol=rtol)


@pytest.mark.parametrize("implementation", ["scan", "associative_scan"])
def test_no_array_of_the_whole_sequence_times_the_state_is_formed(implementation):
  """Forward and backward of 64 tokens in chunks of 8: no intermediate has both the 64
  positions and the E·N state entries (the oracle, for contrast, does)."""
  x, dt, A, b, c, D, h0 = _inputs(T=64)

  def shapes(implementation):
    grad = jax.grad(lambda x: jnp.sum(la.selective_scan(
        x, dt, A, b, c, D, chunk_size=8, implementation=implementation) ** 2))
    jaxpr = jax.make_jaxpr(grad)(x)
    found = set()

    def walk(jp):
      for eqn in jp.eqns:
        found.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          walk(sub)
    walk(jaxpr.jaxpr)
    return found

  whole = lambda shape: 64 in shape and math.prod(shape) >= Bsz * 64 * E * N  # noqa: E731
  assert not [s for s in shapes(implementation) if whole(s)]
  assert [s for s in shapes("reference") if whole(s)]


def test_bad_inputs_raise_value_errors_naming_them():
  x, dt, A, b, c, D, h0 = _inputs()
  scan = la.selective_scan
  with pytest.raises(ValueError, match=r"x and dt must be \[B, T, E\] of one shape"):
    scan(x, dt[:, :5], A, b, c)
  with pytest.raises(ValueError, match=r"A must be \[E, N\] = \(6, N\).*got \(5, 4\)"):
    scan(x, dt, A[:5], b, c)
  with pytest.raises(ValueError, match=r"b and c must be one shape \(2, 13, 'G', 4\)"):
    scan(x, dt, A, b, c[..., :2])
  with pytest.raises(ValueError, match=r"the 4 groups of b and c must divide E=6"):
    scan(x, dt, A, jnp.zeros((Bsz, T, 4, N)), jnp.zeros((Bsz, T, 4, N)))
  with pytest.raises(ValueError, match=r"D must be \[E\] = \(6,\); got \(3,\)"):
    scan(x, dt, A, b, c, D[:3])
  with pytest.raises(ValueError, match=r"initial_state must be a SelectiveState.*\(2, 6, 4\)"):
    scan(x, dt, A, b, c, initial_state=la.SelectiveState(h0.h[:1]))
  with pytest.raises(ValueError, match=r"segment_ids must be integers \[B, T\]"):
    scan(x, dt, A, b, c, segment_ids=IDS.astype(np.float32))
  with pytest.raises(ValueError, match=r"segment_ids must not decrease"):
    scan(x, dt, A, b, c, segment_ids=IDS[:, ::-1])
  with pytest.raises(ValueError, match=r"implementation must be one of"):
    scan(x, dt, A, b, c, implementation="chunked")
  with pytest.raises(ValueError, match=r"chunk_size must be a positive int; got 0"):
    scan(x, dt, A, b, c, chunk_size=0)
  with pytest.raises(ValueError, match=r"x must be a float array; got int32"):
    scan(jnp.zeros((Bsz, T, E), jnp.int32), dt, A, b, c)
  with pytest.raises(ValueError, match=r"^selective_scan_reference: A must be \[E, N\]"):
    la.selective_scan_reference(x, dt, A[:5], b, c)
  with pytest.raises(ValueError, match=r"selective_scan_step: x and dt must be \[B, E\]"):
    la.selective_scan_step(h0, x, dt, A, b, c)
