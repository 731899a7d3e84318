"""Checks specific to efficient attention that the shared suite does not make.

The oracle here is numpy in float64: softmax(Q, axis=H) · softmax(K, axis=S)ᵀ V,
applied to the keys each query may see.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import Shape, assert_close, make_qkv

import linattn_jax as la
from linattn_jax._src.efficient import IMPLEMENTATIONS

CAUSAL_IMPLEMENTATIONS = ("reference", "scan", "chunked")
MODES = pytest.mark.parametrize("impl,is_causal", [
    *((impl, False) for impl in IMPLEMENTATIONS),
    *((impl, True) for impl in CAUSAL_IMPLEMENTATIONS)])
GQA = Shape(B=2, T=9, S=7, N=4, K=2, H=5, D=3)


def _attend(impl, q, k, v, **kw):
  """One jitted call (cheaper here than op-by-op dispatch); ``kw`` is closed over."""
  fn = functools.partial(la.efficient_attention, implementation=impl, chunk_size=3, **kw)
  return jax.jit(fn)(q, k, v)


def _softmax(x, axis):
  e = np.exp(x - x.max(axis=axis, keepdims=True))
  return e / e.sum(axis=axis, keepdims=True)


def numpy_efficient(q, k, v):
  """Non-causal ``softmax_H(Q) softmax_S(K)ᵀ V`` in float64; zeros when there is no key."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  K, D = v.shape[2:]
  if k.shape[1] == 0:
    return np.zeros((B, T, N, D))
  context = np.einsum("bskh,bskd->bkhd", _softmax(k, axis=1), v)
  q_soft = _softmax(q, axis=-1).reshape(B, T, K, N // K, H)
  return np.einsum("btkgh,bkhd->btkgd", q_soft, context).reshape(B, T, N, D)


def numpy_causal(q, k, v, lengths=None):
  """Row t is the non-causal formula over keys ``j < min(t + S - T + 1, length)``."""
  q, k, v = (np.asarray(x) for x in (q, k, v))  # Sliced in numpy, which compiles nothing.
  B, T = q.shape[:2]
  S = k.shape[1]
  out = np.zeros(q.shape[:3] + v.shape[-1:])
  for b in range(B):
    n = S if lengths is None else int(lengths[b])
    for t in range(T):
      L = max(0, min(t + S - T + 1, n))
      out[b, t] = numpy_efficient(q[b:b + 1, t:t + 1], k[b:b + 1, :L], v[b:b + 1, :L])[0, 0]
  return out


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_noncausal_equals_numpy_formula(impl):
  q, k, v = make_qkv(GQA, seed=3, amplitude=2.0)
  assert_close(_attend(impl, q, k, v), numpy_efficient(q, k, v), jnp.float32)


@pytest.mark.parametrize("impl", CAUSAL_IMPLEMENTATIONS)
@pytest.mark.parametrize("T,S", [(4, 11), (11, 4)])
def test_causal_row_equals_noncausal_formula_on_visible_prefix(impl, T, S):
  shape = Shape(B=2, T=T, S=S, N=4, K=2, H=5, D=3)
  q, k, v = make_qkv(shape, seed=4, amplitude=2.0)
  lengths = np.array([S, max(1, S - 3)])
  got = _attend(impl, q, k, v, is_causal=True, key_value_seq_lengths=jnp.asarray(lengths))
  assert_close(got, numpy_causal(q, k, v, lengths), jnp.float32)


@pytest.mark.parametrize("impl", CAUSAL_IMPLEMENTATIONS)
def test_huge_future_key_leaves_past_bitwise_identical(impl):
  shape = Shape(B=1, T=10, S=10, N=2, K=1, H=4, D=3)
  q, k, v = make_qkv(shape, seed=5)
  fn = jax.jit(lambda q, k, v: _attend(impl, q, k, v, is_causal=True))
  base = np.asarray(fn(q, k, v))
  for t in (0, 4, 7):  # 4 and 7 share a chunk of 3 with the perturbed key.
    out = np.asarray(fn(q, k.at[:, t + 1].set(1e4), v))
    np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])
    assert np.all(np.isfinite(out))
    assert not np.allclose(out[:, t + 1], base[:, t + 1]), "vacuous: the key had no effect"


@MODES
def test_huge_visible_keys_are_stable(impl, is_causal):
  shape = Shape(B=1, T=8, S=8, N=2, K=1, H=4, D=3)
  q, k, v = make_qkv(shape, seed=6)
  k = k * 3e3  # exp(k) overflows float32 and float64 without the running maxima.
  out = _attend(impl, q, k, v, is_causal=is_causal)
  want = numpy_causal(q, k, v) if is_causal else numpy_efficient(q, k, v)
  assert_close(out, want, jnp.float32)
  grads = jax.grad(lambda k: jnp.sum(_attend(impl, q, k, v, is_causal=is_causal)))(k)
  assert np.all(np.isfinite(np.asarray(grads)))


@pytest.mark.parametrize("name", ["efficient", "heinsen"])
def test_rows_past_the_rise_limit_take_the_exact_form_and_its_gradient(name):
  """A key far above the ones before it in its chunk: the rows from it to the chunk's end
  are recomputed exactly in the all-chunks form, forward and in its custom gradient."""
  from linattn_jax._src.kernel import MAX_RISE
  q, k, v = make_qkv(Shape(B=1, T=13, S=13, N=2, K=1, H=4, D=3), seed=13)
  big = 3 * MAX_RISE
  assert big - float(jnp.max(k)) > MAX_RISE  # Rows 6 and 7 (chunk 4..7) climb past it.
  k = k.at[:, 6].set(big)
  fn = la.get_attention(name)
  ct = jax.random.normal(jax.random.key(1), q.shape[:-1] + v.shape[-1:])

  def out_and_grads(**how):
    out, vjp = jax.vjp(lambda *x: fn(*x, is_causal=True, **how), q, k, v)
    return out, vjp(ct)

  chex.assert_trees_all_close(jax.jit(functools.partial(out_and_grads, chunk_size=4))(),
                              out_and_grads(implementation="reference"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_noncausal_padding_equals_truncation(impl):
  shape = Shape(B=1, T=6, S=9, N=2, K=1, H=4, D=3)
  q, k, v = make_qkv(shape, seed=7)
  padded = _attend(impl, q, k.at[:, 5:].set(50.0), v, key_value_seq_lengths=jnp.array([5]))
  assert_close(padded, _attend(impl, q, k[:, :5], v[:, :5]), jnp.float32)


@pytest.mark.parametrize("impl", ("scan", "chunked"))
def test_causal_padded_keys_do_not_advance_the_state(impl):
  shape = Shape(B=1, T=9, S=9, N=2, K=1, H=4, D=3)
  q, k, v = make_qkv(shape, seed=8)
  n = 5
  padded, state = _attend(impl, q, k.at[:, n:].set(50.0), v, is_causal=True,
                          key_value_seq_lengths=jnp.array([n]), return_state=True)
  cut, cut_state = _attend(impl, q[:, :n], k[:, :n], v[:, :n], is_causal=True,
                           return_state=True)
  assert_close(padded[:, :n], cut, jnp.float32)
  # Rows past the length see exactly the n valid keys.
  assert_close(padded[:, n:], numpy_efficient(q[:, n:], k[:, :n], v[:, :n]), jnp.float32)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(cut_state), strict=True):
    assert_close(got, want, jnp.float32)


@MODES
def test_rows_without_keys_are_zero_with_finite_gradients(impl, is_causal):
  q, k, v = make_qkv(Shape(B=2, T=5, S=4, N=2, K=1, H=3, D=2), seed=9)
  lengths = jnp.array([0, 4])

  def f(q, k, v):
    return _attend(impl, q, k, v, is_causal=is_causal, key_value_seq_lengths=lengths)

  out = np.asarray(f(q, k, v))
  assert np.all(out[0] == 0)
  if is_causal:  # T > S: the first T - S queries see no key.
    assert np.all(out[1, 0] == 0) and np.all(out[1, 1] != 0)
  grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(g)[0] == 0)


def test_state_carries_across_implementations_and_into_decoding():
  shape = Shape(B=2, T=12, S=12, N=4, K=2, H=5, D=3)
  q, k, v = make_qkv(shape, seed=10)
  whole = numpy_causal(q, k, v)
  piece = lambda x, a, b: x[:, a:b]  # noqa: E731
  outs = []
  state = None
  for impl, (a, b) in (("scan", (0, 3)), ("chunked", (3, 8))):
    out, state = _attend(impl, *(piece(x, a, b) for x in (q, k, v)), is_causal=True,
                         initial_state=state, return_state=True)
    outs.append(out)
  step = jax.jit(la.efficient_attention_step)
  for t in range(8, 12):
    state, out = step(state, q[:, t], k[:, t], v[:, t])
    outs.append(out[:, None])
  assert_close(jnp.concatenate(outs, axis=1), whole, jnp.float32)


def test_prefill_with_longer_keys_then_continue():
  """S > T: keys 0..S-T-1 are a prefix of the query block; the state then continues."""
  shape = Shape(B=1, T=10, S=10, N=2, K=1, H=4, D=3)
  q, k, v = make_qkv(shape, seed=11)
  out1, state = _attend(None, q[:, 4:6], k[:, :6], v[:, :6], is_causal=True,
                        return_state=True)
  out2 = _attend(None, q[:, 6:], k[:, 6:], v[:, 6:], is_causal=True, initial_state=state)
  assert_close(jnp.concatenate([out1, out2], axis=1), numpy_causal(q, k, v)[:, 4:],
               jnp.float32)


def test_unbatched_state_round_trip():
  q, k, v = make_qkv(Shape(B=1, T=6, S=6, N=2, K=1, H=4, D=3), seed=12)
  out1, state = _attend(None, q[0, :2], k[0, :2], v[0, :2], is_causal=True, return_state=True)
  assert state.kv.shape == (1, 4, 3)
  out2 = _attend(None, q[0, 2:], k[0, 2:], v[0, 2:], is_causal=True, initial_state=state)
  assert_close(jnp.concatenate([out1, out2]), numpy_causal(q, k, v)[0], jnp.float32)


def test_chunked_gradient_keeps_no_state_per_token():
  """Backward temporaries stay far below one [H, D] state per token (scan's cost).

  H = D = 128 so that a state per token (H·D floats) is far more than what the
  chunked forms keep per position: features, weights and values, a few tens of
  floats per H + D + C.
  """
  T, H, D = 256, 128, 128
  q, k, v = make_qkv(Shape(B=1, T=T, S=T, N=1, K=1, H=H, D=D))
  per_token_states = T * H * D * 4

  def temp_bytes(impl, chunk_size=32):
    loss = lambda *a: jnp.sum(  # noqa: E731
        la.efficient_attention(*a, is_causal=True, implementation=impl, chunk_size=chunk_size))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
      pytest.skip("this backend reports no memory analysis")
    return analysis.temp_size_in_bytes

  # One chunk of T tokens is not checkpointed: the measure can see per-token states.
  assert temp_bytes("scan", chunk_size=T) > per_token_states
  assert temp_bytes("scan") < per_token_states / 2
  assert temp_bytes("chunked") < per_token_states / 2


def test_invalid_options_raise():
  q, k, v = make_qkv(Shape(B=2, T=4, S=4, N=2, K=1, H=3, D=2))
  with pytest.raises(ValueError, match="parallel.*is_causal"):
    la.efficient_attention(q, k, v, is_causal=True, implementation="parallel")
  _, state = la.efficient_attention(q, k, v, is_causal=True, return_state=True)
  with pytest.raises(ValueError, match=r"EfficientState.kv has shape \(2, 1, 3, 1\); "
                     r"expected \(2, 1, 3, 2\)"):
    la.efficient_attention(q, k, v, is_causal=True, initial_state=state._replace(
        kv=state.kv[..., :1]))
  with pytest.raises(ValueError, match="chunk_size"):
    la.efficient_attention(q, k, v, chunk_size=0)
  with pytest.raises(ValueError, match="same rank"):
    la.efficient_attention_step(state, q, k[:, 0], v[:, 0])
  with pytest.raises(ValueError, match="state"):
    la.efficient_attention_step(la.init_efficient_state(2, 1, 3, 5), q[:, 0], k[:, 0], v[:, 0])


@pytest.mark.parametrize("implementation", ["reference", None])
@pytest.mark.parametrize("name", ["linear_elu", "performer", "efficient", "heinsen"])
def test_every_recurrent_variant_reads_an_initial_state_causal_or_not(name, implementation):
  """One rule for the recurrent variants: a state holds earlier keys that every query sees."""
  spec = la.get_spec(name)
  q, k, v = make_qkv(Shape(B=2, T=4, S=4, N=2, K=1, H=3, D=2))
  earlier_k, earlier_v = 0.5 * k[:, :3] + 1, v[:, :3] - 1
  state = spec.streaming.summarize(earlier_k, earlier_v)
  how = {} if implementation is None else {"implementation": implementation}
  got, after = spec.function(q, k, v, initial_state=state, return_state=True, **how)
  both_k, both_v = (jnp.concatenate(x, axis=1) for x in ((earlier_k, k), (earlier_v, v)))
  want, want_state = spec.function(q, both_k, both_v, return_state=True)
  chex.assert_trees_all_close(got, want, atol=1e-5)
  chex.assert_trees_all_close(after, want_state, atol=1e-5)
