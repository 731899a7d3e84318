"""Gated DeltaProduct against its token recurrence: a decay, then n delta steps per token.

The oracle is the recurrence as the DeltaProduct paper writes it (and
flash-linear-attention's naive reference, which lays the n steps out along T),
one token at a time in float64 NumPy; a token past its sequence's length is no
step at all.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la

# Causal only.
delta_product_attention = functools.partial(la.delta_product_attention, is_causal=True)


def recurrence(q, k, v, beta, log_decay=None, *, initial=None, lengths=None):
  """``(out [B, T, N, D], S [B, K, H, D])`` in float64; bottom-right aligned (T ≤ S)."""
  q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
  B, T, N, H = q.shape
  S, n, K, D = k.shape[1], k.shape[2], k.shape[3], v.shape[-1]
  g = np.zeros((B, S, K)) if log_decay is None else np.asarray(log_decay, np.float64)
  state = np.zeros((B, K, H, D)) if initial is None else np.array(initial, np.float64)
  out = np.zeros((B, T, N, D))
  for i in range(B):
    for t in range(S):
      if lengths is None or t < lengths[i]:
        state[i] *= np.exp(g[i, t])[:, None, None]
        for j in range(n):
          kj = k[i, t, j]
          write = beta[i, t, j][:, None] * (v[i, t, j] - np.einsum("kh,khd->kd", kj, state[i]))
          state[i] += kj[:, :, None] * write[:, None, :]
      s = t + T - S
      if 0 <= s < T:
        out[i, s] = np.einsum("nh,nhd->nd", q[i, s] * H ** -0.5,
                              np.repeat(state[i], N // K, axis=0))
  return out, state


def inputs(*, T=11, S=11, n=2, seed=0):
  rng = np.random.default_rng(seed)
  B, N, K, H, D = 2, 4, 2, 8, 6
  q = rng.normal(size=(B, T, N, H))
  k = rng.normal(size=(B, S, n, K, H))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.normal(size=(B, S, n, K, D))
  beta = rng.uniform(0, 2, size=(B, S, n, K))  # β > 1: negative eigenvalues.
  g = np.log(rng.uniform(0.6, 1.0, size=(B, S, K)))
  initial = rng.normal(size=(B, K, H, D))
  return tuple(x.astype(np.float32) for x in (q, k, v, beta, g, initial))


# Chunks of a multiple of n read only each token's last step; chunks of 5 read every row.
@pytest.mark.parametrize("T, S, n, chunk_size", [(11, 11, 2, 4), (5, 11, 3, 6), (11, 11, 2, 5)],
                         ids=["n2", "prefix-n3", "n2-every-row"])
def test_every_implementation_equals_the_token_recurrence(T, S, n, chunk_size):
  q, k, v, beta, g, initial = inputs(T=T, S=S, n=n)
  g[:, S // 2] = -1e4  # A hard reset inside the chunks.
  lengths = np.array([S, S - 3])
  want, want_state = recurrence(q, k, v, beta, g, initial=initial, lengths=lengths)
  for implementation in ("reference", "scan", "chunked"):
    out, state = delta_product_attention(q, k, v, beta, log_decay=g, chunk_size=chunk_size,
                                            implementation=implementation,
                                            initial_state=la.GatedState(initial),
                                            key_value_seq_lengths=lengths, return_state=True)
    chex.assert_trees_all_close((out, state.kv), (want, want_state), atol=3e-5, rtol=3e-5,
                                custom_message=implementation)


def test_gradients_steps_and_packed_segments():
  q, k, v, beta, g, initial = inputs(seed=1)

  def loss(implementation, *x):
    out, final = delta_product_attention(*x[:4], log_decay=x[4], chunk_size=4,
                                            implementation=implementation, return_state=True,
                                            initial_state=la.GatedState(jnp.asarray(initial)))
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(final.kv))

  argnums = (1, 2, 3, 4, 5)
  chex.assert_trees_all_close(jax.grad(loss, argnums)("chunked", q, k, v, beta, g),
                              jax.grad(loss, argnums)("reference", q, k, v, beta, g),
                              atol=5e-5, rtol=5e-5)
  # One token at a time equals the pass.
  want, want_state = recurrence(q, k, v, beta, g, initial=initial)
  state, outs = la.GatedState(jnp.asarray(initial)), []
  for t in range(q.shape[1]):
    state, out = la.delta_product_attention_step(state, q[:, t], k[:, t], v[:, t], beta[:, t],
                                                 log_decay=g[:, t])
    outs.append(out)
  chex.assert_trees_all_close((jnp.stack(outs, 1), state.kv), (want, want_state), atol=3e-5,
                              rtol=3e-5)
  # Packed: each segment as if alone (its n steps per token stay together).
  ids = np.repeat(np.array([[0, 1], [3, 4]]), [4, 7], axis=1)
  out = delta_product_attention(q, k, v, beta, log_decay=g, segment_ids=ids, chunk_size=4)
  for lo, hi in ((0, 4), (4, 11)):
    alone = recurrence(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi], g[:, lo:hi])[0]
    chex.assert_trees_all_close(out[:, lo:hi], alone, atol=3e-5, rtol=3e-5)


def test_grouped_value_heads_and_jit():
  q, k, v, beta, g, _ = inputs(seed=2)
  q = q[:, :, :2]  # N = K = 2; V = 4 value heads.
  v, beta = np.concatenate([v, -v], axis=3), np.concatenate([beta, beta[..., ::-1]], axis=3)
  g = np.concatenate([g, g / 2], axis=2)
  want, _ = recurrence(np.repeat(q, 2, 2), np.repeat(k, 2, 3), v, beta, g)
  fn = jax.jit(lambda *x: delta_product_attention(*x[:4], log_decay=x[4], scale=8 ** -0.5))
  chex.assert_trees_all_close(fn(q, k, v, beta, g), want, atol=3e-5, rtol=3e-5)


def test_bad_inputs_raise_value_errors_naming_them():
  q, k, v, beta, g, _ = inputs()
  with pytest.raises(ValueError, match=r"key \[B, S, n, K, H\].*got \(2, 11, 4, 8\)"):
    delta_product_attention(q, k[:, :, 0], v, beta)
  with pytest.raises(ValueError, match=r"key and value lengths differ"):
    delta_product_attention(q, k, v[:, :5], beta)
  with pytest.raises(ValueError, match=r"beta must be a float array .*\(2, 11, 2, 2\)"):
    delta_product_attention(q, k, v, beta[..., 0])
  with pytest.raises(ValueError, match=r"log_decay must be a float array .*\(2, 11, 2\)"):
    delta_product_attention(q, k, v, beta, log_decay=g[:, :3])
  with pytest.raises(ValueError, match=r"beta \(write_strength\) must lie in \[0.0, 2.0\]"):
    delta_product_attention(q, k, v, beta + 2)
  with pytest.raises(ValueError, match="is_causal=False.*recurrence"):
    delta_product_attention(q, k, v, beta, is_causal=False)


def test_every_keyword_with_a_non_default_value_under_jit_and_eagerly():
  q, k, v, beta, g, initial = inputs(seed=6)
  ids = np.repeat(np.array([[0, 1], [0, 0]]), [5, 6], axis=1)
  lengths = np.array([11, 8])

  def call(q, k, v, beta, g, initial, ids, lengths):
    return la.delta_product_attention(
        q, k, v, beta, log_decay=g, scale=0.25, is_causal=True, key_value_seq_lengths=lengths,
        segment_ids=ids, initial_state=la.GatedState(initial), return_state=True,
        implementation="scan", chunk_size=3)

  args = (q, k, v, beta, g, initial, ids, lengths)
  eager, jitted = call(*args), jax.jit(call)(*args)
  chex.assert_trees_all_close(eager, jitted, atol=1e-5, rtol=1e-5)
  reference = la.delta_product_attention_reference(
      q, k, v, beta, log_decay=g, scale=0.25, is_causal=True, key_value_seq_lengths=lengths,
      segment_ids=ids, initial_state=la.GatedState(initial), return_state=True, chunk_size=3)
  chex.assert_trees_all_close(eager, reference, atol=3e-5, rtol=3e-5)
  first = recurrence(q[:1, :5] * 0.25 / 8 ** -0.5, k[:1, :5], v[:1, :5], beta[:1, :5],
                     g[:1, :5], initial=initial[:1])[0]  # Row 0's first segment.
  chex.assert_trees_all_close(eager[0][:1, :5], first, atol=3e-5, rtol=3e-5)
