"""Linformer beyond the shared suite: a numpy oracle, padded keys reach no projected row, the
registry's projections, the layer's parameters, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import Shape, make_qkv
from flax import nnx

import linattn_jax as la
from linattn_jax import nn

SHAPE = Shape(B=2, T=5, S=9, N=4, K=2, H=4, D=3)
P, L = 3, 12


def _projections(seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((P, L)) / np.sqrt(P), jnp.float32)
               for _ in range(2))


def numpy_linformer(q, k, v, e, f):
  q, k, v, e, f = (np.asarray(x, np.float64) for x in (q, k, v, e, f))
  S, G = k.shape[1], q.shape[2] // k.shape[2]
  kp = np.repeat(np.einsum("ps,bskh->bpkh", e[:, :S], k), G, axis=2)
  vp = np.repeat(np.einsum("ps,bskd->bpkd", f[:, :S], v), G, axis=2)
  logits = np.einsum("btnh,bpnh->bntp", q, kp) / np.sqrt(q.shape[-1])
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("bntp,bpnd->btnd", w, vp)


def test_both_implementations_are_softmax_over_the_projected_rows_and_padding_reaches_none():
  q, k, v = make_qkv(SHAPE)
  e, f = _projections()
  fn = jax.jit(lambda q, k, v, n, impl: la.linformer_attention(
      q, k, v, key_projection=e, value_projection=f, key_value_seq_lengths=n,
      implementation=impl), static_argnums=4)
  lengths = jnp.asarray([4, 9], jnp.int32)
  for impl in ("reference", "xla"):
    got = fn(q, k, v, lengths, impl)
    # A padded key is as if absent: row 0 equals a call on its first 4 keys.
    np.testing.assert_allclose(got[:1], numpy_linformer(q[:1], k[:1, :4], v[:1, :4], e, f),
                               rtol=2e-5, atol=2e-5, err_msg=impl)
    np.testing.assert_allclose(got[1:], numpy_linformer(q[1:], k[1:], v[1:], e, f),
                               rtol=2e-5, atol=2e-5, err_msg=impl)
  empty = fn(q, k, v, jnp.asarray([0, 9], jnp.int32), "xla")
  np.testing.assert_array_equal(empty[0], 0)


def test_the_registry_draws_the_projections_it_is_told_to():
  spec = la.get_spec("linformer")
  arrays = spec.params.init(jax.random.key(0), 8, projected_length=64, max_length=256)
  assert {n: x.shape for n, x in arrays.items()} == {"key_projection": (64, 256),
                                                     "value_projection": (64, 256)}
  assert abs(float(jnp.std(arrays["key_projection"])) - 1 / 8) < 0.01  # N(0, 1/P).
  q, k, v = make_qkv(SHAPE)
  fn = la.get_attention("linformer", projected_length=P, max_length=L, rng=3)
  drawn = spec.params.init(jax.random.key(3), SHAPE.H, projected_length=P, max_length=L)
  np.testing.assert_allclose(fn(q, k, v), numpy_linformer(q, k, v, *drawn.values()),
                             rtol=2e-5, atol=2e-5)


def test_the_layer_learns_its_projections_and_cannot_decode():
  layer = nn.MultiHeadAttention(4, 16, num_kv_heads=2, attention="linformer",
                                attention_options={"projected_length": P, "max_length": L},
                                rngs=nnx.Rngs(0))
  assert layer.key_projection.get_value().shape == (P, L)
  assert isinstance(layer.value_projection, nnx.Param)
  x = jax.random.normal(jax.random.key(1), (2, 9, 16))
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  assert float(jnp.abs(grads.key_projection.get_value()).sum()) > 0
  with pytest.raises(ValueError, match="linformer_attention: is_causal=True is not supported"):
    layer(x, is_causal=True)
  with pytest.raises(ValueError, match="init_cache: attention='linformer' is non-causal only"):
    layer.init_cache(x.shape)


def test_errors_name_the_option_and_the_shapes():
  q, k, v = make_qkv(SHAPE)
  e, f = _projections()

  def raises(match, **kw):
    with pytest.raises(ValueError, match=match):
      la.linformer_attention(q, k, v, **{"key_projection": e, "value_projection": f, **kw})

  raises(r"is_causal=True is not supported: each projected key", is_causal=True)
  raises(r"key_projection must be a float array \[P, L\]; got float32 \(12,\)",
         key_projection=e[0])
  raises(r"key_projection \(3, 12\) and value_projection \(2, 12\) must have one shape",
         value_projection=f[:2])
  raises(r"value_projection must be a float array.*int32", value_projection=f.astype(jnp.int32))
  raises(r"key length S=9 exceeds the projections' L=8", key_projection=e[:, :8],
         value_projection=f[:, :8])
  raises(r"unknown implementation='flash'", implementation="flash")
  with pytest.raises(ValueError, match=r"projected_length must be a positive int"):
    la.get_attention("linformer", projected_length=0)(q, k, v)
