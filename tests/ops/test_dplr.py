"""The diagonal-plus-low-rank recurrence (DPLR, RWKV-7) against its token recurrence.

The oracle below is the recurrence as RWKV-7's paper and flash-linear-attention's
``dplr_recurrence`` write it, one token at a time in float64 NumPy: the state's
read ``aᵀ S_{t-1}`` is written back along ``b``, the old state decays, the key
writes ``k vᵀ``; a key past its sequence's length is no step at all.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax._src import dplr

dplr_attention = functools.partial(la.dplr_attention, is_causal=True)  # Causal only.


def recurrence(q, k, v, a, b, log_decay, *, initial=None, lengths=None):
  """``(out [B, T, N, D], S [B, K, H, D])`` in float64; bottom-right aligned (T ≤ S here)."""
  q, k, v, a, b, g = (np.asarray(x, np.float64) for x in (q, k, v, a, b, log_decay))
  B, T, N, H = q.shape
  S, K, D = k.shape[1], k.shape[2], v.shape[-1]
  q = q * H ** -0.5
  state = np.zeros((B, K, H, D)) if initial is None else np.array(initial, np.float64)
  out = np.zeros((B, T, N, D))
  for i in range(B):
    for j in range(S):
      if lengths is None or j < lengths[i]:
        read = np.einsum("kh,khd->kd", a[i, j], state[i])
        state[i] = (np.exp(g[i, j])[..., None] * state[i] + b[i, j][..., None] * read[:, None]
                    + k[i, j][..., None] * v[i, j][:, None])
      t = j + T - S
      if 0 <= t < T:
        out[i, t] = np.einsum("nh,nhd->nd", q[i, t], np.repeat(state[i], N // K, axis=0))
  return out, state


def inputs(*, T=13, S=13, seed=0):
  rng = np.random.default_rng(seed)
  B, N, K, H, D = 2, 4, 2, 8, 6
  q = rng.normal(size=(B, T, N, H))
  k = rng.normal(size=(B, S, K, H)) / 2
  v = rng.normal(size=(B, S, K, D))
  kappa = rng.normal(size=(B, S, K, H))
  kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)  # RWKV-7's removal key.
  a, b = -kappa, kappa * rng.uniform(0, 1, size=(B, S, K, H))  # b = κ̂ ⊙ iclr.
  g = np.log(rng.uniform(0.6, 1.0, size=(B, S, K, H)))
  initial = rng.normal(size=(B, K, H, D))
  return tuple(x.astype(np.float32) for x in (q, k, v, a, b, g, initial))


@pytest.mark.parametrize("T, S, chunk_size", [(13, 13, 4), (7, 13, 4), (37, 37, 13)],
                         ids=["aligned", "prefix", "odd-chunks"])
def test_every_implementation_equals_the_token_recurrence(T, S, chunk_size):
  """Every form, with an initial state, padded keys, a hard decay (-1e4: the diagonal part
  forgets, the low-rank part still reads) and T < S (a prefix every query sees)."""
  q, k, v, a, b, g, initial = inputs(T=T, S=S)
  g[:, S // 2] = -1e4
  lengths = np.array([S, S - 3])
  want, want_state = recurrence(q, k, v, a, b, g, initial=initial, lengths=lengths)
  for implementation in dplr.DPLR_IMPLEMENTATIONS:
    out, state = dplr_attention(q, k, v, a, b, log_decay=g, implementation=implementation,
                                   chunk_size=chunk_size, initial_state=la.GatedState(initial),
                                   key_value_seq_lengths=lengths, return_state=True)
    chex.assert_trees_all_close((out, state.kv), (want, want_state), atol=3e-5, rtol=3e-5,
                                custom_message=implementation)


def test_without_a_decay_and_with_one_per_head():
  q, k, v, a, b, g, _ = inputs(seed=1)
  for log_decay, want_g in ((None, np.zeros_like(g)), (g[..., 0], np.repeat(g[..., :1], 8, -1))):
    want, _ = recurrence(q, k, v, a, b, want_g)
    out = dplr_attention(q, k, v, a, b, log_decay=log_decay, chunk_size=4)
    chex.assert_trees_all_close(out, want, atol=3e-5, rtol=3e-5)


def test_gradients_of_the_chunked_form_match_the_oracle():
  q, k, v, a, b, g, initial = inputs(seed=2)
  g[:, 5] = -1e4
  state = la.GatedState(jnp.asarray(initial))

  def loss(implementation, *x):
    out, final = dplr_attention(*x[:5], log_decay=x[5], implementation=implementation,
                                   chunk_size=4, initial_state=state, return_state=True)
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(final.kv))

  argnums = tuple(range(1, 7))
  want = jax.grad(loss, argnums=argnums)("reference", q, k, v, a, b, g)
  got = jax.grad(loss, argnums=argnums)("chunked", q, k, v, a, b, g)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in got)
  chex.assert_trees_all_close(got, want, atol=5e-5, rtol=5e-5)


def test_decay_gradient_of_a_batch_of_chunks_of_16():
  """The shape at which XLA:CPU once crashed on this gradient (B = 16, two chunks of the
  default 16, one decay per key feature): it runs, and equals the scan form's."""
  keys = jax.random.split(jax.random.key(7), 6)
  B, T, K, H = 16, 32, 2, 16
  q, k, v = (jax.random.normal(x, (B, T, K, H)) for x in keys[:3])
  kappa = jax.random.normal(keys[3], (B, T, K, H))
  kappa = kappa / jnp.linalg.norm(kappa, axis=-1, keepdims=True)
  g = -0.5 * jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, K, H)))

  def loss(g, implementation):
    return jnp.sum(jnp.sin(dplr_attention(q, k, v, -kappa, 0.5 * kappa, log_decay=g,
                                          implementation=implementation)))

  got = jax.jit(jax.grad(loss), static_argnums=1)(g, "chunked")
  want = jax.jit(jax.grad(loss), static_argnums=1)(g, "scan")
  chex.assert_trees_all_close(got, want, atol=5e-5, rtol=5e-5)


def test_the_delta_rule_is_the_case_a_minus_beta_k_b_k():
  """``a = -β k``, ``b = k`` with the decay applied first (``a = -β k ⊙ exp(g)``) and the
  write ``(β k) vᵀ`` is Gated DeltaNet's (and, with a decay per feature, KDA's) recurrence."""
  q, k, v, _, _, g, _ = inputs(seed=3)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  beta = np.random.default_rng(3).uniform(0, 1, size=k.shape[:-1]).astype(np.float32)
  want = la.delta_rule_attention(q, k, v, beta, log_decay=g, is_causal=True)
  out = dplr_attention(q, beta[..., None] * k, v,
                          -beta[..., None] * k * np.exp(g), k, log_decay=g)
  chex.assert_trees_all_close(out, want, atol=3e-5, rtol=3e-5)


def test_packed_segments_drop_the_state_and_the_low_rank_read():
  """A segment start drops the state: its own ``a`` reads nothing of the earlier segment
  (unlike a -1e4 decay, which leaves the low-rank read)."""
  q, k, v, a, b, g, _ = inputs(seed=4)
  ids = np.repeat(np.array([[0, 1], [0, 2]]), [6, 7], axis=1)
  out = dplr_attention(q, k, v, a, b, log_decay=g, segment_ids=ids, chunk_size=4)
  for lo, hi in ((0, 6), (6, 13)):
    alone = dplr_attention(*(x[:, lo:hi] for x in (q, k, v, a, b)), log_decay=g[:, lo:hi],
                              chunk_size=4)
    chex.assert_trees_all_close(out[:, lo:hi], alone, atol=3e-5, rtol=3e-5)


def test_decoding_steps_and_the_registry_entries():
  q, k, v, a, b, g, initial = inputs(T=6, S=6, seed=5)
  want, want_state = recurrence(q, k, v, a, b, g, initial=initial)
  state, outs = la.GatedState(jnp.asarray(initial)), []
  for t in range(6):
    state, out = la.dplr_attention_step(state, q[:, t], k[:, t], v[:, t], a[:, t], b[:, t],
                                        log_decay=g[:, t])
    outs.append(out)
  chex.assert_trees_all_close((jnp.stack(outs, 1), state.kv), (want, want_state), atol=3e-5,
                              rtol=3e-5)
  for name in ("dplr", "rwkv7"):
    out = la.get_attention(name)(q, k, v, is_causal=True, a=a, b=b, log_decay=g)
    chex.assert_trees_all_close(out, recurrence(q, k, v, a, b, g)[0], atol=3e-5, rtol=3e-5)
    with pytest.raises(ValueError, match=r"needs the per-token input\(s\) log_decay"):
      la.get_attention(name)(q, k, v, is_causal=True, a=a, b=b)


def test_bad_inputs_raise_value_errors_naming_them():
  q, k, v, a, b, g, _ = inputs()
  with pytest.raises(ValueError, match="is_causal=False.*recurrence"):
    dplr_attention(q, k, v, a, b, is_causal=False)
  with pytest.raises(ValueError, match=r"a must be a float array \[B, S, K, H\] = \(2, 13, 2, 8\)"):
    dplr_attention(q, k, v, a[..., 0], b)
  with pytest.raises(ValueError, match=r"b must be a float array"):
    dplr_attention(q, k, v, a, b[:, :5])
  with pytest.raises(ValueError, match=r"log_decay \(decay\) must lie in \[-inf, 0.0\]"):
    dplr_attention(q, k, v, a, b, log_decay=-g)
  with pytest.raises(ValueError, match="implementation"):
    dplr_attention(q, k, v, a, b, implementation="associative_scan")
