"""Log-linear attention against the paper's definition, written out pair by pair.

The oracle builds each query's Fenwick blocks as the paper states them (for each
set bit ℓ - 1 of position i, the 2^(ℓ-1) keys just before i with its bits below
ℓ - 1 cleared; the query's own key at level 0), in float64 NumPy, with no bit
tricks; the implementations use ``bit_length(i XOR j)`` and a binary-counter merge
of level states.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la


def level(i, j):
  """The level of key j ≤ i for query i, from the blocks' definition."""
  if i == j:
    return 0
  for ell in range(1, 64):
    width = 1 << (ell - 1)
    end = i - i % width  # i with its bits below ℓ - 1 cleared.
    if i & width and end - width <= j < end:
      return ell
  raise AssertionError((i, j))


def definition(q, k, v, lam, g, *, scale=None):
  """``out [B, T, N, D]`` in float64, one pair at a time."""
  q, k, v, lam, g = (np.asarray(x, np.float64) for x in (q, k, v, lam, g))
  B, T, N, H = q.shape
  K = k.shape[2]
  scale = H ** -0.5 if scale is None else scale
  out = np.zeros((B, T, N, v.shape[-1]))
  for b in range(B):
    for n in range(N):
      h = n // (N // K)
      for i in range(T):
        for j in range(i + 1):
          weight = lam[b, i, n, level(i, j)] * np.exp(g[b, j + 1:i + 1, h].sum())
          out[b, i, n] += scale * weight * (q[b, i, n] @ k[b, j, h]) * v[b, j, h]
  return out


def inputs(*, T=13, L=5, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  B, N, K, H, D = 2, 4, 2, 4, 3
  q, k, v = (rng.normal(size=s) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, D)))
  lam = rng.uniform(0.2, 1.5, size=(B, T, N, L))
  g = np.log(rng.uniform(0.5, 1.0, size=(B, T, K)))
  return tuple(x.astype(dtype) for x in (q, k, v, lam, g))


@pytest.mark.parametrize("T, chunk_size", [(13, 4), (16, 8), (9, 1)])
def test_every_implementation_equals_the_definition(T, chunk_size):
  q, k, v, lam, g = inputs(T=T)
  g[:, T // 2] = -1e4  # A hard reset inside a chunk.
  want = definition(q, k, v, lam, g)
  for implementation in ("reference", "scan", "chunked"):
    out = la.log_linear_attention(q, k, v, lam, log_decay=g, is_causal=True,
                                  implementation=implementation, chunk_size=chunk_size)
    chex.assert_trees_all_close(out, want, atol=2e-5, rtol=2e-5, custom_message=implementation)


def test_unit_level_scales_are_gated_linear_attention():
  q, k, v, lam, g = inputs(T=16, seed=1)
  out = la.log_linear_attention(q, k, v, np.ones_like(lam), log_decay=g, is_causal=True)
  gla = la.gated_linear_attention(q, k, v, g, is_causal=True)
  chex.assert_trees_all_close(out, gla, atol=2e-5, rtol=2e-5)


def test_gradients_of_the_chunked_form_equal_the_reference():
  q, k, v, lam, g = inputs(seed=2)

  def loss(implementation, *x):
    out = la.log_linear_attention(*x[:4], log_decay=x[4], is_causal=True, chunk_size=4,
                                  implementation=implementation)
    return jnp.sum(jnp.sin(out))

  argnums = (1, 2, 3, 4, 5)
  chex.assert_trees_all_close(jax.grad(loss, argnums)("chunked", q, k, v, lam, g),
                              jax.grad(loss, argnums)("reference", q, k, v, lam, g),
                              atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_prefill_then_steps_equal_the_full_pass(dtype):
  q, k, v, lam, g = inputs(T=16, L=6, seed=3)  # The state after 16 tokens needs 6 levels.
  q, k, v, lam, g = (jnp.asarray(x, dtype) for x in (q, k, v, lam, g))
  want = la.log_linear_attention(q, k, v, lam, log_decay=g, is_causal=True)
  out, state = la.log_linear_attention(q[:, :11], k[:, :11], v[:, :11], lam[:, :11],
                                       log_decay=g[:, :11], is_causal=True, chunk_size=4,
                                       return_state=True)
  assert state.levels.dtype == jnp.float32
  step = jax.jit(la.log_linear_attention_step)
  outs = [out]
  for t in range(11, 16):
    state, o = step(state, q[:, t], k[:, t], v[:, t], lam[:, t], log_decay=g[:, t])
    outs.append(o[:, None])
  tol = 1e-5 if dtype == np.float32 else 3e-2
  chex.assert_trees_all_close(jnp.concatenate(outs, 1).astype(jnp.float32),
                              want.astype(jnp.float32), atol=tol, rtol=tol)
  np.testing.assert_array_equal(state.position, [16, 16])
  # From the empty state, one token at a time, the scan's state.
  _, scanned = la.log_linear_attention(q, k, v, lam, log_decay=g, is_causal=True,
                                       implementation="scan", return_state=True)
  state = la.init_log_linear_state(2, 2, 4, 3, num_levels=6)
  for t in range(16):
    state, _ = step(state, q[:, t], k[:, t], v[:, t], lam[:, t], log_decay=g[:, t])
  chex.assert_trees_all_close(state, scanned, atol=tol, rtol=tol)


def test_a_state_past_its_levels_raises_or_turns_nan():
  q, k, v, lam, g = inputs(T=4, L=3)
  state = la.init_log_linear_state(2, 2, 4, 3, num_levels=3)  # Positions 0..3.
  step = jax.jit(la.log_linear_attention_step)
  for t in range(4):
    state, out = step(state, q[:, t], k[:, t], v[:, t], lam[:, t])
    assert np.isfinite(out).all()
  assert np.isnan(state.levels).all()  # The merge after position 3 needs a third level.
  with pytest.raises(ValueError, match="serves positions below 4; got position 4"):
    la.log_linear_attention_step(state, q[:, 0], k[:, 0], v[:, 0], lam[:, 0])
  with pytest.raises(ValueError, match="serves position 4, which needs L ≥ 4"):
    la.log_linear_attention(q, k, v, lam, is_causal=True, return_state=True)


def test_bad_inputs_raise_value_errors_naming_them():
  q, k, v, lam, g = inputs()
  call = lambda *x, **kw: la.log_linear_attention(*x, **{"is_causal": True, **kw})  # noqa: E731
  with pytest.raises(ValueError, match="causal only"):
    la.log_linear_attention(q, k, v, lam)
  with pytest.raises(ValueError, match=r"L ≥ 5 levels for T = 13; got float32 \(2, 13, 4, 4\)"):
    call(q, k, v, lam[..., :4])
  with pytest.raises(ValueError, match=r"lengths must be equal .*T=12, S=13"):
    call(q[:, 1:], k, v, lam[:, 1:])
  with pytest.raises(ValueError, match=r"log_decay must be a float array \[B, S, K\]"):
    call(q, k, v, lam, log_decay=g[..., :1])
  with pytest.raises(ValueError, match=r"log_decay \(decay\) must lie in"):
    call(q, k, v, lam, log_decay=-g)
  with pytest.raises(ValueError, match=r"chunk_size must be a power of two \(.*\); got 6"):
    call(q, k, v, lam, chunk_size=6)
  with pytest.raises(ValueError, match="unknown implementation='flash'"):
    call(q, k, v, lam, implementation="flash")
  with pytest.raises(ValueError, match="'reference' returns no state"):
    call(q, k, v, lam, implementation="reference", return_state=True)
  state = la.init_log_linear_state(2, 2, 4, 3, num_levels=5)
  with pytest.raises(ValueError, match=r"level_scales must be \[B, N, L\] with L = 5"):
    la.log_linear_attention_step(state, q[:, 0], k[:, 0], v[:, 0], lam[:, 0, :, :3])
  with pytest.raises(ValueError, match="does not match key"):
    la.log_linear_attention_step(state, q[:, 0], k[:, 0, :1], v[:, 0, :1], lam[:, 0])
  with pytest.raises(ValueError, match="state must be a LogLinearState"):
    la.log_linear_attention_step(la.GatedState(state.levels), q[:, 0], k[:, 0], v[:, 0],
                                 lam[:, 0])


def test_every_keyword_with_a_non_default_value_under_jit_and_eagerly():
  q, k, v, lam, g = inputs(T=8, seed=4)  # L = 5: the state after 8 tokens needs the fifth.

  def call(q, k, v, lam, g):
    return la.log_linear_attention(q, k, v, lam, log_decay=g, scale=0.3, is_causal=True,
                                   return_state=True, implementation="scan", chunk_size=2)

  eager, jitted = call(q, k, v, lam, g), jax.jit(call)(q, k, v, lam, g)
  chex.assert_trees_all_close(eager, jitted, atol=1e-6, rtol=1e-6)
  want = definition(q, k, v, lam, g, scale=0.3)
  chex.assert_trees_all_close(eager[0], want, atol=2e-5, rtol=2e-5)
  reference = lambda *x: la.log_linear_attention_reference(  # noqa: E731
      *x[:4], log_decay=x[4], scale=0.3, is_causal=True)
  chex.assert_trees_all_close(reference(q, k, v, lam, g), want, atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(jax.jit(reference)(q, k, v, lam, g), want, atol=2e-5, rtol=2e-5)
  # Unbatched, and the step's keywords: the state continues the pass.
  out, state = la.log_linear_attention(q[0, :7], k[0, :7], v[0, :7], lam[0, :7],
                                       log_decay=g[0, :7], scale=0.3, is_causal=True,
                                       return_state=True)
  chex.assert_trees_all_close(out, want[0, :7], atol=2e-5, rtol=2e-5)
  state = la.LogLinearState(state.levels[None], state.position[None])
  step = lambda s, *x: la.log_linear_attention_step(s, *x[:4], log_decay=x[4], scale=0.3)  # noqa: E731
  last = (q[:1, 7], k[:1, 7], v[:1, 7], lam[:1, 7], g[:1, 7])
  for fn in (step, jax.jit(step)):
    _, o = fn(state, *last)
    chex.assert_trees_all_close(o, want[:1, 7], atol=2e-5, rtol=2e-5)
