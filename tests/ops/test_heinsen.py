"""Heinsen log-space attention: checks beyond the shared suite.

Oracles: a float64 numpy linear attention with φ = exp written out directly, and
``heinsen_attention_reference``. Covers signed and zero values, logits far beyond the
float32 exp range, the log-value form, padding vs truncation, state passing and the
chunked backward pass's memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import Shape, assert_close, cotangent, make_qkv, output_and_gradients_program

import linattn_jax as la

FAST = ("parallel", "chunked")
IMPLS = ("reference",) + FAST
# T == S, T < S, T > S; GQA and MQA; D != H.
SHAPES = (
    Shape(B=2, T=9, S=9, N=4, K=2, H=3, D=5),
    Shape(B=2, T=5, S=11, N=3, K=1, H=4, D=2),
    Shape(B=2, T=11, S=6, N=2, K=2, H=3, D=4),
)


def _exp_linear_attention(q, k, v, *, is_causal, lengths):
  """φ(q)ᵀ Σ φ(k) vᵀ / φ(q)ᵀ Σ φ(k) with φ = exp, float64 numpy, one head at a time."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, _ = q.shape
  _, S, K, D = v.shape
  out = np.zeros((B, T, N, D))
  t, j = np.arange(T)[:, None], np.arange(S)[None, :]
  for b in range(B):
    visible = (j < lengths[b]) & ((j <= t + S - T) if is_causal else True)
    for n in range(N):
      kv = n // (N // K)
      a = (np.exp(q[b, :, n]) @ np.exp(k[b, :, kv]).T) * visible  # [T, S]
      den = a.sum(axis=1, keepdims=True)
      out[b, :, n] = np.where(den > 0, a @ v[b, :, kv] / np.where(den > 0, den, 1.0), 0.0)
  return out


def _call(impl, q, k, v, **kw):
  return la.heinsen_attention(q, k, v, implementation=impl, chunk_size=4, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equals_exp_feature_linear_attention_in_float64(impl, is_causal, shape):
  with jax.enable_x64(True):
    q, k, v = make_qkv(shape, jnp.float64, seed=3)
    lengths = np.array([shape.S, shape.S // 2])
    got = _call(impl, q, k, v, is_causal=is_causal, key_value_seq_lengths=jnp.asarray(lengths))
    want = _exp_linear_attention(q, k, v, is_causal=is_causal, lengths=lengths)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def _signed_values_with_zeros(shape: Shape) -> jax.Array:
  """Values of both signs and exact zeros: column 0 all zero, column 1 all positive."""
  rng = np.random.default_rng(7)
  v = rng.standard_normal((shape.B, shape.S, shape.K, shape.D))
  v[rng.random(v.shape) < 0.3] = 0.0
  v[..., 0] = 0.0
  v[..., 1] = np.abs(v[..., 1]) + 0.5
  return jnp.asarray(v, jnp.float32)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)  # T < S and T > S alignments.
def test_signed_and_zero_values_forward_and_gradient(impl, is_causal, shape):
  q, k, _ = make_qkv(shape, seed=2)
  v = _signed_values_with_zeros(shape)
  lengths = jnp.asarray([shape.S, 3])
  fast = functools.partial(_call, impl, is_causal=is_causal, key_value_seq_lengths=lengths)
  ref = functools.partial(la.heinsen_attention_reference, is_causal=is_causal,
                          key_value_seq_lengths=lengths)
  ct = cotangent(np.zeros(q.shape[:3] + v.shape[3:], np.float32))

  def output_and_grads(f):  # One compiled program each.
    return output_and_gradients_program(f)(ct, q, k, v)

  out, got_grads = output_and_grads(fast)
  ref_out, want = output_and_grads(ref)
  assert_close(out, ref_out, jnp.float32)
  np.testing.assert_array_equal(out[..., 0], 0.0)
  # The output is linear in v: exact zeros get the true gradient Σ_t w_tj ct_t, not 0.
  assert np.all(np.asarray(want[2])[:, :3, :, 0] != 0)  # the zeros' gradients matter.
  for got, w in zip(got_grads, want, strict=True):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)


def _exp_form_after_state(q, k, v, state):
  """Causal T == S attention after an initial state, in plain exponentials (no log space)."""
  G = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, G, axis=2) for x in (k, v))  # [B, S, N, ·]
  # [B, N, H, ·]
  kv, k_sum, running_max = (jnp.repeat(x, G, axis=1) for x in jax.tree.leaves(state))
  a = jnp.einsum("btnh,bsnh->btsn", jnp.exp(q), jnp.exp(k)) * jnp.tril(
      jnp.ones((q.shape[1], k.shape[1])))[None, ..., None]
  num = jnp.einsum("btsn,bsnd->btnd", a, v) + jnp.einsum(
      "btnh,bnhd->btnd", jnp.exp(q), jnp.exp(running_max)[..., None] * kv)
  den = a.sum(axis=2) + jnp.einsum("btnh,bnh->btn", jnp.exp(q), jnp.exp(running_max) * k_sum)
  return num / den[..., None]


@pytest.mark.parametrize("impl", FAST)
def test_gradients_with_an_initial_state(impl):
  shape = Shape(B=2, T=11, S=11, N=4, K=2, H=3, D=5)
  q, k, v = make_qkv(shape, seed=10)
  cut = 3  # zeros in the tail only; a value of each sign in the prefix: a finite state.
  v = v.at[:, 0].set(jnp.abs(v[:, 0]) + 0.5).at[:, 1].set(-jnp.abs(v[:, 1]) - 0.5)
  v = v.at[:, cut:].set(_signed_values_with_zeros(shape)[:, cut:])
  _, state = _call(impl, q[:, :cut], k[:, :cut], v[:, :cut], is_causal=True, return_state=True)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
  tail = (q[:, cut:], k[:, cut:], v[:, cut:])
  fast = lambda q, k, v, state: _call(impl, q, k, v, is_causal=True,  # noqa: E731
                                      initial_state=state)
  ct = cotangent(fast(*tail, state))

  def grads(f):
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3)))(*tail, state)

  # q, k, v (zeros included) and the state, against the direct exponential form.
  for got, want in zip(jax.tree.leaves(grads(fast)), jax.tree.leaves(grads(_exp_form_after_state)),
                       strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_huge_logits_stay_finite_and_match_float64(impl, is_causal):
  shape = SHAPES[0]
  rng = np.random.default_rng(11)
  q = jnp.asarray(rng.uniform(-80, 80, (shape.B, shape.T, shape.N, shape.H)), jnp.float32)
  k = jnp.asarray(rng.uniform(-80, 80, (shape.B, shape.S, shape.K, shape.H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((shape.B, shape.S, shape.K, shape.D)), jnp.float32)
  with np.errstate(over="ignore", invalid="ignore"):  # the direct form in float32 overflows:
    direct = np.exp(np.asarray(q[0, :, 0])) @ np.exp(np.asarray(k[0, :, 0])).T
  assert not np.all(np.isfinite(direct))
  fn = functools.partial(_call, impl, is_causal=is_causal)
  out = fn(q, k, v)
  want = _exp_linear_attention(q, k, v, is_causal=is_causal, lengths=[shape.S] * shape.B)
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
  grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent(out)), argnums=(0, 1, 2))
  for g in grads(q, k, v):
    assert np.all(np.isfinite(g))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_log_heinsen_is_log_of_heinsen(impl, is_causal):
  shape = SHAPES[2]  # T > S: causal rows without keys.
  q, k, log_v = make_qkv(shape, seed=4)
  log_v = log_v.at[:, 1, :, 0].set(-jnp.inf)  # a zero value.
  lengths = jnp.asarray([shape.S, 2])
  kw = dict(is_causal=is_causal, key_value_seq_lengths=lengths, implementation=impl,
            chunk_size=4)
  got = la.log_heinsen_attention(q, k, log_v, **kw)
  want = jnp.log(la.heinsen_attention(q, k, jnp.exp(log_v), **kw))  # -inf for empty rows.
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite],
                             rtol=1e-5, atol=1e-5)
  # Far below the float32 range exp(log_v) underflows to 0; the log form shifts exactly.
  shifted = la.log_heinsen_attention(q, k, log_v - 300.0, **kw)
  np.testing.assert_allclose(np.asarray(shifted)[finite], np.asarray(got)[finite] - 300.0,
                             rtol=1e-6, atol=1e-4)
  g = jax.grad(lambda lv: jnp.sum(jnp.where(finite, la.log_heinsen_attention(q, k, lv, **kw), 0)))
  assert np.all(np.isfinite(g(log_v)))


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_equals_truncation(impl):
  shape = Shape(B=2, T=10, S=10, N=2, K=1, H=3, D=4)
  q, k, v = make_qkv(shape, seed=5)
  lengths = [10, 6]
  for is_causal in (False, True):
    out = _call(impl, q, k, v, is_causal=is_causal, key_value_seq_lengths=jnp.asarray(lengths))
    for b, n in enumerate(lengths):
      kt, vt = k[b:b + 1, :n], v[b:b + 1, :n]
      if is_causal:  # queries before the cut see a causal prefix, later ones every kept key.
        parts = [_call(impl, q[b:b + 1, :n], kt, vt, is_causal=True)]
        if n < shape.T:
          parts.append(_call(impl, q[b:b + 1, n:], kt, vt, is_causal=False))
        want = jnp.concatenate(parts, axis=1)
      else:
        want = _call(impl, q[b:b + 1], kt, vt, is_causal=False)
      assert_close(out[b:b + 1], want, jnp.float32, err_msg=f"b={b} causal={is_causal}")


@pytest.mark.parametrize("impl", FAST)
def test_padded_keys_do_not_advance_the_state(impl):
  q, k, v = make_qkv(SHAPES[0], seed=6)
  _, padded = _call(impl, q, k, v, is_causal=True, return_state=True,
                    key_value_seq_lengths=jnp.asarray([9, 4]))
  _, truncated = _call(impl, q[1:, :4], k[1:, :4], v[1:, :4], is_causal=True, return_state=True)
  for got, want in zip(jax.tree.leaves(padded), jax.tree.leaves(truncated), strict=True):
    np.testing.assert_allclose(got[1:], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("cuts", [(1, 5), (3, 4, 8)])
def test_state_passing_in_pieces_equals_one_pass(impl, cuts):
  shape = Shape(B=2, T=13, S=13, N=4, K=2, H=3, D=5)
  q, k, v = make_qkv(shape, seed=8)
  whole, final = _call(impl, q, k, v, is_causal=True, return_state=True)
  state, outs = None, []
  for lo, hi in zip((0,) + cuts, cuts + (shape.T,), strict=True):
    out, state = _call(impl, q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], is_causal=True,
                       initial_state=state, return_state=True)
    outs.append(out)
  assert_close(jnp.concatenate(outs, axis=1), whole, jnp.float32)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(final), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # The non-causal pass ends in the same state; a fresh state is empty.
  _, full_state = _call(impl, q, k, v, is_causal=False, return_state=True)
  for got, want in zip(jax.tree.leaves(full_state), jax.tree.leaves(final), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  empty = la.init_heinsen_state(shape.B, shape.K, shape.H, shape.D)
  assert np.all(empty.kv == 0) and np.all(empty.k_sum == 0)
  assert np.all(np.isneginf(empty.running_max))
  assert jax.tree.map(jnp.shape, empty) == jax.tree.map(jnp.shape, final)


def test_step_decodes_after_a_prefill_and_unbatched():
  shape = Shape(B=1, T=8, S=8, N=2, K=1, H=3, D=2)
  q, k, v = make_qkv(shape, seed=9)
  whole = la.heinsen_attention(q, k, v, is_causal=True)
  out, state = la.heinsen_attention(q[:, :5], k[:, :5], v[:, :5], is_causal=True,
                                    return_state=True)
  state = jax.tree.map(lambda x: x[0], state)  # unbatched decode from here on.
  for t in range(5, 8):
    state, out_t = la.heinsen_attention_step(state, q[0, t], k[0, t], v[0, t])
    assert out_t.shape == (shape.N, shape.D)
    assert_close(out_t, whole[0, t], jnp.float32)


def _largest_array(jaxpr) -> int:
  """Elements of the largest value any equation (nested ones included) produces."""
  largest = 0
  for eqn in jaxpr.eqns:
    largest = max([largest] + [int(np.prod(v.aval.shape)) for v in eqn.outvars])
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr.
        if hasattr(sub, "eqns"):
          largest = max(largest, _largest_array(sub))
  return largest


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_chunked_forward_and_backward_never_hold_per_position_states(is_causal):
  shape = Shape(B=1, T=256, S=256, N=1, K=1, H=8, D=8)
  q, k, v = make_qkv(shape)

  def largest(impl):
    loss = lambda q, k, v: jnp.sum(la.heinsen_attention(  # noqa: E731
        q, k, v, is_causal=is_causal, implementation=impl, chunk_size=8))
    return _largest_array(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)

  # [T, H, D]: one state per position. "chunked" keeps one per chunk (T / C of them) and
  # [C, C, H] blocks; causal "parallel" forms them all (the measure can see them).
  per_position = shape.T * shape.H * shape.D
  assert largest("chunked") <= per_position // 4
  if is_causal:
    assert largest("parallel") >= per_position


def test_bad_options_raise():
  q, k, v = make_qkv(SHAPES[0])
  with pytest.raises(ValueError, match="chunk_size"):
    la.heinsen_attention(q, k, v, chunk_size=0)
  with pytest.raises(ValueError, match=r"initial_state HeinsenState.kv has shape \(2, 2, 3, 4\); "
                     r"expected \(2, 2, 3, 5\)"):
    la.heinsen_attention(q, k, v, initial_state=la.init_heinsen_state(2, 2, 3, 4))
  with pytest.raises(ValueError, match="HeinsenState"):
    la.heinsen_attention(q, k, v, initial_state=jnp.zeros(3))
  with pytest.raises(ValueError, match="rank"):
    la.heinsen_attention_step(la.init_heinsen_state(2, 2, 3, 5), q[:, 0], k[:, 0], v[0, 0, 0])
  with pytest.raises(ValueError, match="head_dim"):
    la.init_heinsen_state(1, 1, 0, 1)
  with pytest.raises(ValueError, match="unknown implementation"):
    la.log_heinsen_attention(q, k, v, implementation="scan")
