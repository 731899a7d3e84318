"""Linear attention beyond the shared suite: a numpy oracle, chunk sizes,
T != S alignment with states, padding and the state, the non-causal state,
the "parallel" form, backward memory, errors and the registry entries."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import Shape, assert_close, make_qkv

import linattn_jax as la
from linattn_jax import feature_maps as fm

CAUSAL_IMPLS = ["scan", "associative_scan", "chunked"]
NUMPY_MAPS = {
    fm.elu_plus_one: lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))),
    fm.relu: lambda x: np.maximum(x, 0),
}


def numpy_linear(q, k, v, phi, *, causal, kv_len=None, eps=1e-6, state=None):
  """Loop-per-row float64 oracle of the definition (state: (kv, k_sum) numpy)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, _ = q.shape
  _, S, K, D = v.shape
  out = np.zeros((B, T, N, D))
  for b in range(B):
    for n in range(N):
      h = n // (N // K)
      for t in range(T):
        fq = phi(q[b, t, n])
        num, den = np.zeros(D), 0.0
        if state is not None:
          num, den = fq @ state[0][b, h], fq @ state[1][b, h]
        for s in range(S):
          if (causal and s > t + S - T) or (kv_len is not None and s >= kv_len[b]):
            continue
          w = fq @ phi(k[b, s, h])
          num, den = num + w * v[b, s, h], den + w
        out[b, t, n] = num / (den + eps)
  return out


def _random_state(shape: Shape, M: int, seed: int = 4) -> la.LinearState:
  rng = np.random.default_rng(seed)
  return la.LinearState(
      jnp.asarray(rng.standard_normal((shape.B, shape.K, M, shape.D)), jnp.float32),
      jnp.asarray(rng.uniform(1, 2, (shape.B, shape.K, M)), jnp.float32))


SHAPES = [Shape(B=2, T=5, S=8, N=4, K=2, H=3, D=2), Shape(B=2, T=8, S=5, N=2, K=1, H=3, D=4)]


@pytest.mark.parametrize("feature_map", list(NUMPY_MAPS), ids=["elu", "relu"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_state", [False, True], ids=["", "state"])
def test_reference_matches_numpy_loops(feature_map, causal, shape, with_state):
  q, k, v = make_qkv(shape)
  kv_len = np.array([shape.S, 2])
  state = _random_state(shape, shape.H) if with_state else None
  got = la.linear_attention_reference(
      q, k, v, feature_map=feature_map, is_causal=causal,
      key_value_seq_lengths=jnp.asarray(kv_len), initial_state=state)
  want = numpy_linear(q, k, v, NUMPY_MAPS[feature_map], causal=causal, kv_len=kv_len,
                      state=None if state is None else tuple(map(np.asarray, state)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", CAUSAL_IMPLS)
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_causal_forms_match_reference_with_state_and_padding(implementation, chunk_size, shape):
  q, k, v = make_qkv(shape)
  options = dict(is_causal=True, key_value_seq_lengths=jnp.array([shape.S - 1, 2]),
                 initial_state=_random_state(shape, shape.H), return_state=True)
  out, state = la.linear_attention(q, k, v, implementation=implementation,
                                   chunk_size=chunk_size, **options)
  want, want_state = la.linear_attention_reference(q, k, v, **options)
  assert_close(out, want, jnp.float32)
  for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
    assert_close(got, ref, jnp.float32)


def test_parallel_is_noncausal_only_and_matches_reference():
  shape = SHAPES[0]
  q, k, v = make_qkv(shape)
  options = dict(key_value_seq_lengths=jnp.array([3, 0]), return_state=True,
                 initial_state=_random_state(shape, shape.H))
  out, state = la.linear_attention(q, k, v, implementation="parallel", **options)
  want, want_state = la.linear_attention_reference(q, k, v, **options)
  assert_close(out, want, jnp.float32)
  assert_close(state.kv, want_state.kv, jnp.float32)
  with pytest.raises(ValueError, match="parallel.*is_causal"):
    la.linear_attention(q, k, v, implementation="parallel", is_causal=True)
  assert la.get_spec("linear_elu").noncausal_only == {"parallel"}


@pytest.mark.parametrize("implementation", [None, "reference"])
def test_noncausal_initial_state_is_a_prefix_every_query_sees(implementation):
  shape = Shape(B=1, T=4, S=9, N=2, K=1, H=3, D=2)
  q, k, v = make_qkv(shape)
  _, state = la.linear_attention(q, k[:, :5], v[:, :5], return_state=True,
                                 implementation=implementation)
  got = la.linear_attention(q, k[:, 5:], v[:, 5:], initial_state=state,
                            implementation=implementation)
  assert_close(got, la.linear_attention(q, k, v), jnp.float32)


@pytest.mark.parametrize("implementation", ["reference", "parallel", *CAUSAL_IMPLS])
def test_padded_keys_do_not_advance_the_state(implementation):
  q, k, v = make_qkv(Shape(B=1, T=7, S=7, N=2, K=2, H=3, D=2))
  is_causal = implementation != "parallel"
  options = dict(is_causal=is_causal, implementation=implementation, chunk_size=3,
                 return_state=True)
  _, padded = la.linear_attention(q, k, v, key_value_seq_lengths=jnp.array([4]), **options)
  _, short = la.linear_attention(q[:, :4], k[:, :4], v[:, :4], **options)
  for got, want in zip(jax.tree.leaves(padded), jax.tree.leaves(short), strict=True):
    assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("implementation", CAUSAL_IMPLS)
def test_split_anywhere_with_gqa_and_unbatched_state(implementation):
  q, k, v = make_qkv(Shape(B=1, T=10, S=10, N=4, K=2, H=3, D=2))
  q, k, v = q[0], k[0], v[0]  # Unbatched: the state has no batch axis either.
  call = lambda *a, **kw: la.linear_attention(  # noqa: E731
      *a, is_causal=True, implementation=implementation, chunk_size=3, **kw)
  whole = call(q, k, v)
  for split in (2, 7):
    out1, state = call(q[:split], k[:split], v[:split], return_state=True)
    assert state.kv.shape == (2, 3, 2) and state.k_sum.shape == (2, 3)
    out2 = call(q[split:], k[split:], v[split:], initial_state=state)
    assert_close(jnp.concatenate([out1, out2]), whole, jnp.float32)


def test_step_matches_causal_pass_and_keeps_a_float32_state():
  shape = Shape(B=2, T=6, S=6, N=4, K=2, H=3, D=2)
  q, k, v = make_qkv(shape, jnp.bfloat16)
  state = la.init_linear_state(shape.B, shape.K, shape.H, shape.D)
  outs = []
  for t in range(shape.T):
    state, out = la.linear_attention_step(state, q[:, t], k[:, t], v[:, t])
    outs.append(out)
  assert state.kv.dtype == jnp.float32 and outs[0].dtype == jnp.bfloat16
  want = la.linear_attention(q, k, v, is_causal=True)
  assert_close(jnp.stack(outs, axis=1), want, jnp.bfloat16)


@pytest.mark.parametrize("implementation", ["reference", "parallel", "chunked"])
def test_relu_rows_without_positive_features_return_zeros(implementation):
  q, k, v = make_qkv(Shape(B=1, T=4, S=4, N=1, K=1, H=3, D=2))
  q = -jnp.abs(q)  # relu(q) = 0: a zero kernel row.

  def f(q):
    return la.linear_attention(q, k, v, feature_map=fm.relu, implementation=implementation,
                               is_causal=implementation == "chunked")

  np.testing.assert_array_equal(f(q), 0.0)
  assert np.all(np.isfinite(jax.grad(lambda q: f(q).sum())(q)))


@pytest.mark.parametrize("implementation", CAUSAL_IMPLS)
def test_backward_keeps_one_state_per_chunk_not_per_token(implementation):
  T, M, C = 128, 64, 16  # M = D = H.
  q, k, v = make_qkv(Shape(B=1, T=T, S=T, N=1, K=1, H=M, D=M))
  f = lambda q, k, v: la.linear_attention(  # noqa: E731
      q, k, v, is_causal=True, implementation=implementation, chunk_size=C)
  _, vjp = jax.vjp(f, q, k, v)
  saved = sum(x.size for x in jax.tree.leaves(vjp))  # The residuals.
  # A few copies of inputs and features, O(T·(M + D)), and one state per chunk.
  budget = 20 * T * M + (T // C) * (M * M + M + 1)
  assert 0 < saved <= budget < T * M * M, (saved, budget)


def test_errors_name_options_and_shapes():
  shape = SHAPES[0]
  q, k, v = make_qkv(shape)
  for chunk_size in (0, -3, 2.5):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
      la.linear_attention(q, k, v, is_causal=True, chunk_size=chunk_size)
  with pytest.raises(ValueError, match="init_linear_state: batch must be a positive int"):
    la.init_linear_state(0, 1, 4, 3)
  with pytest.raises(ValueError, match="init_local_state: value_dim must be a positive int"):
    la.init_local_state(1, num_kv_heads=1, head_dim=4, value_dim=-2, window_size=(2, 0))
  with pytest.raises(ValueError, match="eps"):
    la.linear_attention(q, k, v, eps=-1.0)
  bad = la.init_linear_state(shape.B, shape.K, shape.H + 1, shape.D)
  with pytest.raises(ValueError, match=r"initial_state.*\(2, 2, 4, 2\).*\(2, 2, 3, 2\)"):
    la.linear_attention(q, k, v, is_causal=True, initial_state=bad)

  def query_only_doubled(x, *, is_query):
    return jnp.concatenate([x, x], -1) if is_query else x

  with pytest.raises(ValueError, match=r"feature map.*\(2, 2, 2, 5, 6\) and .* -> \(2, 2, 8, 3\)"):
    la.linear_attention(q, k, v, feature_map=query_only_doubled)
  with pytest.raises(ValueError, match="unknown implementation"):
    la.linear_attention(q, k, v, implementation="fast")


@pytest.mark.parametrize("name, feature_map", [("linear_elu", fm.elu_plus_one),
                                               ("linear_relu", fm.relu)])
def test_registry_entries_fix_the_feature_map(name, feature_map):
  q, k, v = make_qkv(SHAPES[1])
  got = la.get_attention(name, chunk_size=2)(q, k, v, is_causal=True)
  want = numpy_linear(q, k, v, NUMPY_MAPS[feature_map], causal=True)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  spec = la.get_spec(name)
  options = inspect.signature(spec.function).parameters
  assert {"chunk_size", "implementation", "eps"} <= set(options)
  state = spec.streaming.init(q, k, v)
  assert state.kv.shape == (2, 1, 3, 4)


@pytest.mark.parametrize("fn, extra, form", [
    (la.linear_attention, {}, "kernel"),
    (la.performer_attention, {"projection": jnp.ones((4, 8))}, "random_features"),
    (la.gated_linear_attention, {"log_decay": -jnp.ones((1, 80, 2))}, "kernel"),
    (la.gated_linear_attention, {"log_decay": -jnp.ones((1, 80, 2, 8))}, "gla"),
    (la.delta_rule_attention, {"beta": jnp.ones((1, 80, 2)) / 2}, "delta"),
], ids=["linear", "performer", "gated-per-head", "gla-per-feature", "delta"])
def test_chunk_size_none_is_the_backends_measured_default(fn, extra, form):
  """``chunk_size=None`` traces the program of the backend's C for the chunked form; T = 80
  is one chunk at C >= 80 and several at 32 or 64."""
  from linattn_jax._src import recurrence
  # The values docs/benchmarks.md#chunk-size documents, stated here on their own.
  backend = jax.default_backend()
  assert recurrence.default_chunk_size() == {"gpu": 256}.get(backend, 64)
  assert recurrence.default_chunk_size("random_features") == {"gpu": 512}.get(backend, 128)
  assert recurrence.default_chunk_size("gla") == {"gpu": 256}.get(backend, 128)
  assert recurrence.default_chunk_size("delta") == {"gpu": 256}.get(backend, 32)
  assert recurrence.default_chunk_size("per_feature") == 64
  q, k, v = make_qkv(Shape(B=1, T=80, S=80, N=2, K=2, H=8, D=4))

  def program(chunk_size):
    return str(jax.make_jaxpr(lambda q, k, v: fn(q, k, v, is_causal=True, chunk_size=chunk_size,
                                                 **extra))(q, k, v))
  default = recurrence.default_chunk_size(form)
  assert program(None) == program(default)
  for other in {32, 64} - {default}:  # One chunk of 80 (C >= 80) or several.
    assert program(None) != program(other)
  with pytest.raises(ValueError, match="chunk_size"):
    fn(q, k, v, is_causal=True, chunk_size=0, **extra)
