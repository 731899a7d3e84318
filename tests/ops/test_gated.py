"""Gated linear attention and the delta rule against the papers' token recurrences.

The oracle below is the recurrence as the papers (and flash-linear-attention's
naive reference code) write it, one token at a time in float64 NumPy: decay
first, then write; a key past its sequence's length is no step at all.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax._src import delta as delta_rule
from linattn_jax._src import gated


def recurrence(q, k, v, *, log_decay=None, beta=None, initial=None, lengths=None):
  """``(out [B, T, N, D], S [B, K, H, D])`` in float64; bottom-right aligned."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K, D = k.shape[1], k.shape[2], v.shape[-1]
  q = q * H ** -0.5
  g = np.zeros((B, S, K)) if log_decay is None else np.asarray(log_decay, np.float64)
  g = g[..., None] if g.ndim == 3 else g  # [B, S, K, H|1]
  state = np.zeros((B, K, H, D)) if initial is None else np.array(initial, np.float64)
  out = np.zeros((B, T, N, D))
  for b in range(B):
    for j in range(S):
      if lengths is None or j < lengths[b]:
        state[b] *= np.exp(g[b, j])[..., None]
        write = v[b, j]
        if beta is not None:
          write = beta[b, j][:, None] * (v[b, j] - np.einsum("kh,khd->kd", k[b, j], state[b]))
        state[b] += k[b, j][:, :, None] * write[:, None, :]
      i = j + T - S
      if 0 <= i < T:
        out[b, i] = np.einsum("nh,nhd->nd", q[b, i], np.repeat(state[b], N // K, axis=0))
    if T > S:  # The first T - S queries see only the initial state.
      first = np.zeros((B, K, H, D)) if initial is None else np.asarray(initial, np.float64)
      out[b, :T - S] = np.einsum("tnh,nhd->tnd", q[b, :T - S],
                                 np.repeat(first[b], N // K, axis=0))
  return out, state


def inputs(*, T=13, S=13, per_feature=False, reset=False, seed=0):
  rng = np.random.default_rng(seed)
  B, N, K, H, D = 2, 4, 2, 8, 6
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k = rng.normal(size=(B, S, K, H)).astype(np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)  # The delta rule's layers normalise keys.
  v = rng.normal(size=(B, S, K, D)).astype(np.float32)
  g = np.log(rng.uniform(0.7, 1.0, size=(B, S, K) + ((H,) if per_feature else ())))
  if reset:
    g[:, S // 2] = -1e4  # A clean reset: everything before it is forgotten.
  # The whole range: β > 1 gives the transition a negative eigenvalue 1 - β along k.
  beta = rng.uniform(0, 2, size=(B, S, K)).astype(np.float32)
  initial = rng.normal(size=(B, K, H, D)).astype(np.float32)
  return q, k, v, g.astype(np.float32), beta, initial


# Every implementation on the first; the unaligned ones (the driver's alignment, shared by
# every form) through the default form only.
CASES = [
    dict(),
    dict(T=7, S=13),  # S > T: a prefix every query sees.
    dict(T=13, S=7),  # T > S: the first queries see only the initial state.
]


def call(delta, implementation, q, k, v, g, beta, **options):
  options = dict(options, implementation=implementation, chunk_size=4, return_state=True)
  if delta:
    return la.delta_rule_attention(q, k, v, beta, is_causal=True, log_decay=g, **options)
  return la.gated_linear_attention(q, k, v, g, is_causal=True, **options)


@pytest.mark.parametrize("delta, per_feature", [(False, False), (False, True), (True, False),
                                                (True, True)],
                         ids=["gla-per-head", "gla-per-feature", "delta", "kda"])
def test_every_implementation_equals_the_token_recurrence(delta, per_feature):
  implementations = delta_rule.DELTA_IMPLEMENTATIONS if delta else gated.GATED_IMPLEMENTATIONS
  for case in CASES:
    q, k, v, g, beta, initial = inputs(per_feature=per_feature, **case)
    lengths = np.array([k.shape[1], k.shape[1] - 3])
    want, want_state = recurrence(q, k, v, log_decay=g, beta=beta if delta else None,
                                  initial=initial, lengths=lengths)
    for implementation in implementations if case == CASES[0] else ("chunked",):
      out, state = call(delta, implementation, q, k, v, g, beta,
                        initial_state=la.GatedState(initial), key_value_seq_lengths=lengths)
      chex.assert_trees_all_close((out, state.kv), (want, want_state), atol=2e-5, rtol=2e-5,
                                  custom_message=f"{implementation} {case}")


@pytest.mark.parametrize("delta, per_feature", [(False, False), (False, True), (True, False),
                                                (True, True)],
                         ids=["gla-per-head", "gla-per-feature", "delta", "kda"])
def test_a_large_decay_is_a_clean_reset_in_the_chunked_forms(delta, per_feature):
  """Forward and gradients of a -1e4 decay: no overflow, no cancellation, no NaN."""
  q, k, v, g, beta, _ = inputs(per_feature=per_feature, reset=True)
  want, _ = recurrence(q, k, v, log_decay=g, beta=beta if delta else None)
  loss = lambda implementation, *x: jnp.sum(jnp.sin(call(delta, implementation, *x)[0]))  # noqa: E731
  grads = {}
  for implementation in ("scan", "chunked"):
    out, _ = call(delta, implementation, q, k, v, g, beta)
    chex.assert_trees_all_close(out, want, atol=2e-5, rtol=2e-5)
    grads[implementation] = jax.grad(loss, argnums=(1, 2, 3, 4, 5))(implementation, q, k, v, g,
                                                                       beta)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in grads[implementation])
  chex.assert_trees_all_close(grads["chunked"], grads["scan"], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "delta"])
def test_gradients_of_the_chunked_form_match_the_oracle(delta):
  q, k, v, g, beta, initial = inputs(seed=1)
  state = la.GatedState(jnp.asarray(initial))

  def loss(implementation, *x):
    out, final = call(delta, implementation, *x, initial_state=state)
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(final.kv))

  want = jax.grad(loss, argnums=(1, 2, 3, 4, 5))("reference", q, k, v, g, beta)
  got = jax.grad(loss, argnums=(1, 2, 3, 4, 5))("chunked", q, k, v, g, beta)
  chex.assert_trees_all_close(got, want, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "kda"])
@pytest.mark.parametrize("chunk_size", [64, 13], ids=["one-padded-chunk", "padded-to-16"])
def test_per_feature_chunks_split_at_every_level(chunk_size, delta):
  """The chunk forms with a decay per key feature (GLA's, and KDA's pair weights) weigh
  blocks of 4 positions directly and halve above them (64: four levels over one chunk
  padded from 37; 13: two levels in each of three chunks padded to 16): resets inside
  blocks and at a half's end, -inf, T and chunks not multiples of the blocks, padded keys."""
  q, k, v, g, beta, initial = inputs(T=37, S=37, per_feature=True, seed=2)
  g[:, [3, 10, 22]] = -1e4  # A block's and a half's last position (3), inside blocks.
  g[0, 29, 1, ::2] = -np.inf  # Some features of one head forget everything.
  lengths = np.array([37, 30])
  want, want_state = recurrence(q, k, v, log_decay=g, beta=beta if delta else None,
                                initial=initial, lengths=lengths)
  options = dict(chunk_size=chunk_size, initial_state=la.GatedState(initial),
                 key_value_seq_lengths=lengths, return_state=True)

  def run(implementation, q, k, v, g, beta):
    if delta:
      return la.delta_rule_attention(q, k, v, beta, log_decay=g, is_causal=True,
                                     implementation=implementation, **options)
    return la.gated_linear_attention(q, k, v, g, is_causal=True, implementation=implementation,
                                     **options)

  out, state = run("chunked", q, k, v, g, beta)
  chex.assert_trees_all_close((out, state.kv), (want, want_state), atol=2e-5, rtol=2e-5)

  def loss(implementation, *x):
    out, final = run(implementation, *x)
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(final.kv))

  grads = {i: jax.grad(loss, argnums=(1, 2, 3, 4, 5))(i, q, k, v, g, beta)
           for i in ("scan", "chunked")}
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in grads["chunked"])
  chex.assert_trees_all_close(grads["chunked"], grads["scan"], atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("chunk_size", [16, 13], ids=["power-of-two", "odd-halves"])
def test_delta_chunks_invert_their_system_by_halves(chunk_size):
  """The delta rule's chunk system is inverted by halves: sizes that halve evenly and sizes
  that do not (13, padded to 14 = 7 + 7, each padded to 8 = 4 + 4 ...), with a reset and
  padded keys."""
  q, k, v, g, beta, initial = inputs(T=37, S=37, reset=True, seed=3)
  lengths = np.array([37, 30])
  want, want_state = recurrence(q, k, v, log_decay=g, beta=beta, initial=initial, lengths=lengths)
  out, state = la.delta_rule_attention(q, k, v, beta, is_causal=True, log_decay=g,
                                       chunk_size=chunk_size, initial_state=la.GatedState(initial),
                                       key_value_seq_lengths=lengths, return_state=True)
  chex.assert_trees_all_close((out, state.kv), (want, want_state), atol=2e-5, rtol=2e-5)


def test_the_triangular_solve_differentiates_as_a_linear_solve_in_both_modes():
  """``solve_unit_lower`` (its derivative from the inverse it forms) against
  ``jnp.linalg.solve`` of the same unit lower system: value, forward mode (``jvp``) and
  reverse mode, eagerly and under jit, at a size the halves pad (6 = 4 + 2). Only the
  strictly lower part of M is read, so a tangent above it changes nothing."""
  rng = np.random.default_rng(0)
  C, D = 6, 3
  M = np.tril(rng.standard_normal((2, C, C)), -1) / 2 + np.eye(C)
  b, ct = rng.standard_normal((2, C, D)), rng.standard_normal((2, C, D))
  dM, db = rng.standard_normal((2, C, C)), rng.standard_normal((2, C, D))
  M, b, ct, dM, db = (jnp.asarray(x, jnp.float32) for x in (M, b, ct, dM, db))
  lower = lambda M: jnp.tril(M, -1) + jnp.eye(C)[None]  # noqa: E731
  plain = lambda M, b: jnp.linalg.solve(lower(M), b)  # noqa: E731
  for solve in (delta_rule.solve_unit_lower, jax.jit(delta_rule.solve_unit_lower)):
    got = jax.jvp(solve, (M, b), (dM, db))
    chex.assert_trees_all_close(got, jax.jvp(plain, (M, b), (dM, db)), atol=1e-5, rtol=1e-5)
    grads = jax.grad(lambda M, b, f=solve: jnp.sum(ct * f(M, b)), argnums=(0, 1))(M, b)
    want = jax.grad(lambda M, b: jnp.sum(ct * plain(M, b)), argnums=(0, 1))(M, b)
    chex.assert_trees_all_close(grads, want, atol=1e-5, rtol=1e-5)
    assert not np.any(np.triu(np.asarray(grads[0])))  # Nothing on or above the diagonal.


def test_pair_weights_per_feature_equal_the_sum_over_features():
  """The recursive halving of :func:`decays.pair_weights` against the ``[C, C, H]`` sum it
  avoids (float64; lengths that are no power of two; a reset; query heads broadcast)."""
  from linattn_jax._src import decays
  rng = np.random.default_rng(4)
  pair_weights = jax.jit(decays.pair_weights)  # One program per C (eagerly: one per op).
  for C in (1, 5, 16, 37):
    x, y = rng.normal(size=(2, 3, C, 5)), rng.normal(size=(2, 1, C, 5))
    g = -rng.uniform(size=(2, 1, C, 5))
    g[0, 0, C // 2] = -1e4
    later = np.arange(C)[None, :, None] > np.arange(C)[:, None, None]  # [j, l]: l > j
    upto = np.arange(C)[None, None, :] <= np.arange(C)[:, None, None]  # [i, ., l]: l <= i
    sums = np.einsum("jl,bklh,il->bkijh", later[..., 0], g, upto[:, 0].astype(float))
    want = np.einsum("bkih,bkjh,bkijh->bkij", x, y, np.exp(sums)) * np.tril(np.ones((C, C)))
    with jax.enable_x64(True):
      got = pair_weights(*(jnp.asarray(z) for z in (x, y, g)))
    np.testing.assert_allclose(got, want, atol=1e-12, err_msg=f"C={C}")


@pytest.mark.parametrize("name", ["gla", "gated_delta_net", "kda"])
def test_grouped_value_heads_read_their_query_and_key_head(name):
  """V = 3K value heads: value head j reads query and key head j // 3, with its own state,
  gates and beta (the recurrence per value head), through every entry point's arrays."""
  q, k, v, g, beta, initial = inputs(per_feature=name != "gated_delta_net")
  r = 3
  q = q[:, :, :2]  # N = K = 2 query and key heads.
  v, g, beta, initial = (np.concatenate([x * (i + 1) ** -0.5 for i in range(r)], axis=axis)
                         for x, axis in ((v, 2), (g, 2), (beta, 2), (initial, 1)))  # V = 6
  g, beta = g[:, :, [0, 2, 4, 1, 3, 5]], beta[:, :, [1, 0, 2, 5, 4, 3]]  # Distinct per head.
  inputs_ = dict(log_decay=g) if name == "gla" else dict(log_decay=g, beta=beta)
  want, want_state = recurrence(np.repeat(q, r, 2), np.repeat(k, r, 2), v, initial=initial,
                                log_decay=g, beta=None if name == "gla" else beta)
  fn = la.get_attention(name)
  out, state = fn(q, k, v, is_causal=True, return_state=True,
                  initial_state=la.GatedState(initial), **inputs_)
  chex.assert_trees_all_close((out, state.kv), (want, want_state), atol=2e-5, rtol=2e-5)
  assert out.shape == (2, 13, 6, 6)
  spec = la.get_spec(name).streaming
  step = {n: x[:, 0] for n, x in inputs_.items()}
  _, one = spec.step(spec.init(q[:, :1], k[:, :1], v[:, :1]), q[:, 0], k[:, 0], v[:, 0], **step)
  first, _ = recurrence(np.repeat(q[:, :1], r, 2), np.repeat(k[:, :1], r, 2), v[:, :1],
                        log_decay=g[:, :1], beta=None if name == "gla" else beta[:, :1])
  chex.assert_trees_all_close(one, first[:, 0], atol=2e-5, rtol=2e-5)
  summary = spec.summarize(k, v, **inputs_)
  assert summary.kv.shape == (2, 6, 8, 6)
  with pytest.raises(ValueError, match=r"head counts differ \(K=2 vs V=5\)"):
    fn(q, k, v[:, :, :5], is_causal=True, **{n: x[:, :, :2] for n, x in inputs_.items()})
  with pytest.raises(ValueError, match=r"the query has one head per key head, N = K = 2"):
    fn(np.repeat(q, 2, 2), k, v, is_causal=True, **inputs_)


def test_splitting_a_sequence_and_passing_the_state_equals_one_pass():
  q, k, v, g, beta, _ = inputs()
  for delta in (False, True):
    whole, whole_state = call(delta, "chunked", q, k, v, g, beta)
    first, state = call(delta, "chunked", *(x[:, :5] for x in (q, k, v, g, beta)))
    rest, final = call(delta, "chunked", *(x[:, 5:] for x in (q, k, v, g, beta)),
                       initial_state=state)
    chex.assert_trees_all_close((jnp.concatenate([first, rest], 1), final.kv),
                                (whole, whole_state.kv), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "delta"])
def test_scale_multiplies_the_queries(delta):
  """``scale`` judged apart from the oracle (which applies it the same way): the output is
  linear in the queries, so scale s gives s times the output at scale 1, and the default
  is 1 / sqrt(H). The state does not depend on it."""
  q, k, v, g, beta, _ = inputs()
  H = q.shape[-1]
  for implementation in ("reference", "chunked"):
    out, state = call(delta, implementation, q, k, v, g, beta, scale=0.5)
    one, one_state = call(delta, implementation, q, k, v, g, beta, scale=1.0)
    default, _ = call(delta, implementation, q, k, v, g, beta)
    np.testing.assert_allclose(out, 0.5 * one, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(default, one / np.sqrt(H), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state.kv, one_state.kv)


def test_bad_inputs_raise_value_errors_naming_them():
  q, k, v, g, beta, _ = inputs()
  with pytest.raises(ValueError, match="is_causal=False.*recurrence"):
    la.gated_linear_attention(q, k, v, g, is_causal=False)
  with pytest.raises(ValueError, match=r"log_decay must be .*\(2, 13, 2\) for key"):
    la.gated_linear_attention(q, k, v, g[:, :5], is_causal=True)
  with pytest.raises(ValueError, match=r"log_decay \(decay\) must lie in \[-inf, 0.0\]"):
    la.gated_linear_attention(q, k, v, -g, is_causal=True)  # Positive: a growing state.
  with pytest.raises(ValueError, match=r"beta \(write_strength\) must lie in \[0.0, 2.0\]"):
    la.delta_rule_attention(q, k, v, beta + 2.0, is_causal=True)
  with pytest.raises(ValueError, match="scale must be a static Python float"):
    jax.jit(lambda s: la.gated_linear_attention(q, k, v, g, is_causal=True, scale=s))(0.5)
  with pytest.raises(ValueError, match=r"beta must be .*\(2, 13, 2\)"):
    la.delta_rule_attention(q, k, v, beta[..., None], is_causal=True)
  with pytest.raises(ValueError, match=r"log_decay must be .*\[B, S, K, H\] = \(2, 13, 2, 8\)"):
    la.delta_rule_attention(q, k, v, beta, is_causal=True,  # Per feature (KDA): H = 8.
                            log_decay=np.zeros((2, 13, 2, 3), np.float32))
  with pytest.raises(ValueError, match="implementation"):
    la.delta_rule_attention(q, k, v, beta, is_causal=True, implementation="associative_scan")
  with pytest.raises(ValueError, match=r"GatedState.kv has shape"):
    la.gated_linear_attention(q, k, v, g, is_causal=True,
                              initial_state=la.GatedState(jnp.zeros((2, 2, 8, 5))))


def test_decoding_step_by_step_equals_one_causal_pass():
  q, k, v, g, beta, initial = inputs(T=6, S=6)
  for delta in (False, True):
    want, want_state = call(delta, "chunked", q, k, v, g, beta,
                            initial_state=la.GatedState(initial))
    state, outs = la.GatedState(jnp.asarray(initial)), []
    for t in range(6):
      if delta:
        state, out = la.delta_rule_attention_step(state, q[:, t], k[:, t], v[:, t], beta[:, t],
                                                  log_decay=g[:, t])
      else:
        state, out = la.gated_linear_attention_step(state, q[:, t], k[:, t], v[:, t], g[:, t])
      outs.append(out)
    chex.assert_trees_all_close((jnp.stack(outs, 1), state.kv), (want, want_state.kv),
                                atol=2e-5, rtol=2e-5)
  empty = la.init_gated_state(batch=2, num_kv_heads=2, head_dim=8, value_dim=6)
  chex.assert_trees_all_equal(empty.kv, jnp.zeros((2, 2, 8, 6)))


# Summaries and the registry entries --------------------------------------------------------


def span_map(k, *, log_decay=None, beta=None, lengths=None):
  """What the valid keys do to a state, float64: the summed log-decay ``[B, K(, H)]`` of gated
  attention, or ``Π_t exp(g_t) (I - β_t k_t k_tᵀ)`` ``[B, K, H, H]`` of the delta rule (a
  product of dense matrices, the latest on the left)."""
  k = np.asarray(k, np.float64)
  B, S, K, H = k.shape
  g = np.zeros((B, S, K)) if log_decay is None else np.asarray(log_decay, np.float64)
  valid = np.arange(S)[None, :] < (np.full(B, S) if lengths is None else lengths)[:, None]
  if beta is None:
    return np.einsum("bs...,bs->b...", g, valid.astype(np.float64))
  A = np.broadcast_to(np.eye(H), (B, K, H, H)).copy()
  for b in range(B):
    for j in range(S):
      if valid[b, j]:
        for h in range(K):
          kj = k[b, j, h]
          step = np.exp(g[b, j, h]) * (np.eye(H) - beta[b, j, h] * np.outer(kj, kj))
          A[b, h] = step @ A[b, h]
  return A


GATED_NAMES = ("retention", "simple_gla", "gla", "delta_net", "gated_delta_net")


def per_token_inputs(name, g, beta):
  """The registry entry's per-token inputs (retention has none)."""
  return {"retention": {}, "simple_gla": dict(log_decay=g), "gla": dict(log_decay=g),
          "delta_net": dict(beta=beta), "gated_delta_net": dict(beta=beta, log_decay=g)}[name]


def retention_log_decay(B, S, K):
  """RetNet's decays, written out: γ_i = 1 - 2^(-5-i) for head i."""
  return np.broadcast_to(np.log(1 - 2.0 ** (-5 - np.arange(K))), (B, S, K))


@pytest.mark.parametrize("name", GATED_NAMES)
def test_summaries_are_the_span_maps_and_combine_associatively(name):
  """Float64: per-span summaries combine (either way round) into the summary of all, which
  is the token recurrence's state from zero and the span's total decay or transition; a
  state followed by a summary is the recurrence from that state. One decay is a reset."""
  spec = la.get_spec(name)
  stream = spec.streaming
  with jax.enable_x64(True):
    q, k, v, g, beta, initial = (np.asarray(x, np.float64) for x in inputs(
        per_feature=name == "gla", reset=True, seed=2))
    if name == "retention":
      g = retention_log_decay(*k.shape[:3])
    lengths = np.array([13, 10])
    delta = name.endswith("delta_net")
    g_used = None if name == "delta_net" else g
    gates = per_token_inputs(name, g, beta)

    def summarize(a, b):
      return stream.summarize(k[:, a:b], v[:, a:b], chunk_size=3,
                              key_value_seq_lengths=np.clip(lengths - a, 0, b - a),
                              **{n: x[:, a:b] for n, x in gates.items()})

    parts = [summarize(a, b) for a, b in ((0, 4), (4, 9), (9, 13))]
    whole = summarize(0, 13)
    left = stream.combine(stream.combine(parts[0], parts[1]), parts[2])
    right = stream.combine(parts[0], stream.combine(parts[1], parts[2]))
    _, want_kv = recurrence(q, k, v, log_decay=g_used, beta=beta if delta else None,
                            lengths=lengths)
    want_map = span_map(k, log_decay=g_used, beta=beta if delta else None, lengths=lengths)
    assert type(whole) is (la.DeltaSummary if delta else la.GatedSummary)
    for got in (left, right, whole):
      chex.assert_trees_all_close(tuple(got), (want_kv, want_map), atol=1e-10, rtol=1e-10)
    _, from_initial = recurrence(q, k, v, log_decay=g_used, beta=beta if delta else None,
                                 initial=initial, lengths=lengths)
    continued = stream.combine(la.GatedState(jnp.asarray(initial)), whole)
    assert type(continued) is la.GatedState
    np.testing.assert_allclose(continued.kv, from_initial, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", ["gla", "gated_delta_net"])
def test_steps_from_the_empty_summary_leave_the_summary_of_their_tokens(name):
  """``identity`` is the identity map; each ``step`` composes one token into it. Decoding
  starts from ``init``, the bare ``[B, K, H, D]`` state, and steps to the same outputs."""
  spec = la.get_spec(name)
  stream = spec.streaming
  q, k, v, g, beta, _ = inputs(T=6, S=6, per_feature=name == "gla")
  gates = per_token_inputs(name, g, beta)
  decoded = stream.init(q, k, v)
  assert type(decoded) is la.GatedState and decoded.kv.shape == (2, 2, 8, 6)
  for t in range(6):
    decoded, out = stream.step(decoded, q[:, t], k[:, t], v[:, t],
                               **{n: x[:, t] for n, x in gates.items()})
    assert type(decoded) is la.GatedState
  state, outs = stream.identity(q, k, v), []
  for t in range(6):
    state, out = stream.step(state, q[:, t], k[:, t], v[:, t],
                             **{n: x[:, t] for n, x in gates.items()})
    outs.append(out)
  want_out, want_state = recurrence(q, k, v, log_decay=g,
                                   beta=beta if name == "gated_delta_net" else None)
  chex.assert_trees_all_close(jnp.stack(outs, 1), want_out, atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close((out, decoded.kv), (outs[-1], want_state), atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(tuple(state), tuple(stream.summarize(k, v, **gates)),
                              atol=2e-5, rtol=2e-5)


def test_retention_decays_each_head_by_its_fixed_gamma():
  q, k, v, *_ = inputs()
  want, _ = recurrence(q, k, v, log_decay=retention_log_decay(*k.shape[:3]))
  got = la.get_attention("retention", chunk_size=4)(q, k, v, is_causal=True)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)


def test_registry_entries_take_their_per_token_inputs_by_keyword_and_check_them():
  q, k, v, g, beta, _ = inputs()
  with pytest.raises(ValueError, match=r"simple_gla: each call needs .*log_decay \[B, S, K\]"):
    la.get_attention("simple_gla")(q, k, v, is_causal=True)
  with pytest.raises(ValueError, match=r"simple_gla: log_decay must be a float array \[B, S, K\] "
                                       r"= \(2, 13, 2\) for key \(2, 13, 2, 8\); got float32 "
                                       r"\(2, 13, 2, 8\)"):
    la.get_attention("simple_gla")(q, k, v, is_causal=True, log_decay=np.zeros(k.shape))
  with pytest.raises(ValueError, match=r"gla: log_decay must be a float array \[B, S, K, H\] .*"
                                       r"got float32 \(2, 13, 2\)"):
    la.get_attention("gla")(q, k, v, is_causal=True, log_decay=g)
  with pytest.raises(ValueError, match=r"delta_net: .*not taken \['log_decay'\]"):
    la.get_spec("delta_net").function(q, k, v, is_causal=True, beta=beta, log_decay=g)
  for name in GATED_NAMES:
    decay = np.broadcast_to(g[..., None], k.shape) if name == "gla" else g
    with pytest.raises(ValueError, match="is_causal=False is not supported"):
      la.get_attention(name)(q, k, v, is_causal=False, **per_token_inputs(name, decay, beta))


def test_combine_and_initial_state_name_the_summary_types_and_shapes():
  spec = la.get_spec("delta_net")
  q, k, v, _, beta, _ = inputs()
  summary = spec.streaming.summarize(k, v, beta=beta)
  gated = la.get_spec("simple_gla").streaming.summarize(k, v, log_decay=np.zeros(k.shape[:3]))
  with pytest.raises(ValueError, match="combine: .*got GatedSummary and DeltaSummary"):
    spec.streaming.combine(gated, summary)
  with pytest.raises(ValueError, match=r"combine: DeltaSummary.transition has shapes"):
    spec.streaming.combine(summary, summary._replace(transition=summary.transition[..., :3]))
  with pytest.raises(ValueError, match=r"initial_state must be a DeltaSummary .* or a GatedState"):
    la.delta_rule_attention(q, k, v, beta, is_causal=True, initial_state=gated)
  with pytest.raises(ValueError, match=r"DeltaSummary.transition has shape \(2, 2, 8, 3\); "
                                       r"expected \(2, 2, 8, 8\)"):
    la.delta_rule_attention(q, k, v, beta, is_causal=True, initial_state=summary._replace(
        transition=summary.transition[..., :3]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_a_long_sequence_stays_finite_and_its_state_bounded(dtype):
  """T = 65,536 in 16 bits with float32 states: outputs and gradients (q, k, v and the
  gates) are finite, and the state stays bounded where only the recurrence bounds it.

  - Gated, a decay per head and one per key feature, each about 0.99 (log-decay in
    [-0.015, -0.005]), positive unit keys and values in [0, 1]: every write is positive, so
    without its decays the state would grow with T (to about 14,000 here); with them each
    entry is at most Σ_j exp(-0.005 j) ≈ 200.5.
  - Delta rule, no decay (DeltaNet), β in [0, 1], random unit keys, values in [-1, 1]: a
    write replaces what its key stores, and with random keys the state's norm settles near
    √H times a value's (about 1.7 here; not a worst-case bound: keys chosen orthogonal to
    the state can grow it). Added instead of replaced, the writes grow it like √T (about
    180 here): the check is √H times the largest value's norm.
  """
  T, H = 65_536, 4
  rng = np.random.default_rng(0)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  q = jnp.asarray(rng.normal(size=(1, T, 1, H)), dtype)
  g = jnp.asarray(-rng.uniform(0.005, 0.015, size=(1, T, 1)), jnp.float32)
  beta = jnp.asarray(rng.uniform(0, 1, size=(1, T, 1)), jnp.float32)

  @functools.partial(jax.jit, static_argnames="delta")
  def run(q, k, v, gate, *, delta):
    def loss(q, k, v, gate):
      attention = la.delta_rule_attention if delta else la.gated_linear_attention
      out, state = attention(q, k, v, gate, is_causal=True, return_state=True)
      return jnp.sum(out.astype(jnp.float32)), (out, state)
    return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, gate)

  gated_k = jnp.asarray(unit(np.abs(rng.normal(size=(1, T, 1, H)))), dtype)
  gated_v = jnp.asarray(rng.uniform(0, 1, (1, T, 1, H)), dtype)
  per_feature = jnp.asarray(-rng.uniform(0.005, 0.015, size=(1, T, 1, H)), jnp.float32)
  for gate in (g, per_feature):
    grads, (out, state) = run(q, gated_k, gated_v, gate, delta=False)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in (out, *grads))
    assert out.dtype == dtype and state.kv.dtype == jnp.float32
    assert 1.0 < float(jnp.max(state.kv)) <= 200.5

  v = jnp.asarray(rng.uniform(-1, 1, (1, T, 1, H)), dtype)
  grads, (out, state) = run(q, jnp.asarray(unit(rng.normal(size=(1, T, 1, H))), dtype), v,
                            beta, delta=True)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in (out, *grads))
  largest_value = float(jnp.max(jnp.linalg.norm(v.astype(jnp.float32), axis=-1)))
  assert float(jnp.linalg.norm(state.kv)) <= H ** 0.5 * largest_value * (1 + 1e-2)
