"""The layer against flax.nnx.MultiHeadAttention, argument by argument, on the same parameters.

Each test builds both layers from the same seed (Flax's draws come first in
ours, so the parameter trees are identical) and compares outputs, sown
weights, dropout and decode caches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from linattn_jax import nn

B, T, IN, N, K = 2, 7, 16, 4, 2
ATOL = dict(atol=2e-6, rtol=2e-6)


def _pair(*args, **kw):
  ours = nn.MultiHeadAttention(*args, rngs=nnx.Rngs(0), **kw)
  theirs = nnx.MultiHeadAttention(*args, rngs=nnx.Rngs(0), **kw)
  return ours, theirs


def _x(seed, shape=(B, T, IN)):
  return jax.random.normal(jax.random.key(seed), shape)


def test_positional_arguments_give_the_same_parameters_and_outputs():
  """(num_heads, in_features, qkv_features, out_features, num_kv_heads, in_kv_features)."""
  ours, theirs = _pair(N, IN, 24, 8, K, 12, decode=False)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(ours, nnx.Param),
               nnx.state(theirs, nnx.Param))
  x, y = _x(0), _x(1, (B, 5, 12))
  np.testing.assert_allclose(ours(x, y), theirs(x, y), **ATOL)


def test_normalize_qk_checkpoint_loads_and_agrees():
  theirs = nnx.MultiHeadAttention(N, IN, normalize_qk=True, decode=False, rngs=nnx.Rngs(3))
  ours = nn.MultiHeadAttention(N, IN, normalize_qk=True, rngs=nnx.Rngs(4))
  nnx.update(ours, nnx.state(theirs, nnx.Param))  # A Flax checkpoint: query_ln, key_ln included.
  assert {"query_ln", "key_ln"} <= set(nnx.state(ours, nnx.Param))
  x = _x(2)
  np.testing.assert_allclose(ours(x, is_causal=True), theirs(x, is_causal=True), **ATOL)


@pytest.mark.parametrize("broadcast_dropout", [True, False], ids=["broadcast", "per-head"])
def test_dropout_draws_flax_masks(broadcast_dropout):
  ours, theirs = _pair(N, IN, dropout_rate=0.3, broadcast_dropout=broadcast_dropout,
                       decode=False)
  x = _x(3)
  a, b = ours(x, deterministic=False), theirs(x, deterministic=False)
  np.testing.assert_allclose(a, b, **ATOL)
  assert not np.allclose(a, ours(x, deterministic=True))  # Dropout did something.
  np.testing.assert_allclose(ours(x, deterministic=True), theirs(x, deterministic=True), **ATOL)
  # keep_rngs=False: the call's rngs.
  ours, theirs = _pair(N, IN, dropout_rate=0.3, keep_rngs=False, decode=False)
  np.testing.assert_allclose(ours(x, deterministic=False, rngs=nnx.Rngs(dropout=5)),
                             theirs(x, deterministic=False, rngs=nnx.Rngs(dropout=5)), **ATOL)
  with pytest.raises(ValueError, match="rngs"):
    ours(x, deterministic=False)


def test_dropout_on_a_sparse_pattern_and_refused_where_no_weights_exist():
  layer = nn.MultiHeadAttention(N, IN, attention="local", dropout_rate=0.5, deterministic=False,
                                attention_options={"window_size": (2, 0)}, rngs=nnx.Rngs(0))
  x = _x(4)
  dropped = layer(x, is_causal=True)
  assert np.isfinite(dropped).all()
  kept = layer(x, is_causal=True, deterministic=True)
  np.testing.assert_allclose(kept, nn.MultiHeadAttention(
      N, IN, attention="local", attention_options={"window_size": (2, 0)},
      rngs=nnx.Rngs(0))(x, is_causal=True), **ATOL)
  assert not np.allclose(dropped, kept)
  for name in ("linear_elu", "flash", "heinsen"):
    with pytest.raises(ValueError, match=f"attention='{name}' never forms"):
      nn.MultiHeadAttention(N, IN, attention=name, dropout_rate=0.1, rngs=nnx.Rngs(0))


def test_general_mask_softmax_sparse_and_recurrent():
  ours, theirs = _pair(N, IN, decode=False)
  x = _x(5)
  mask = jax.random.bernoulli(jax.random.key(6), 0.6, (B, 1, T, T))
  np.testing.assert_allclose(ours(x, mask=mask), theirs(x, mask=mask), **ATOL)
  as_float = mask.astype(jnp.float32)  # Flax's mask helpers return floats.
  np.testing.assert_allclose(ours(x, mask=as_float), theirs(x, mask=mask), **ATOL)
  # A sparse pattern combines its own pattern with the mask: softmax over both.
  local = nn.MultiHeadAttention(N, IN, attention="local", rngs=nnx.Rngs(0),
                                attention_options={"window_size": (2, 1)})
  pattern = jnp.asarray(np.abs(np.subtract.outer(np.arange(T), np.arange(T))) <= 2)[None, None]
  pattern &= jnp.asarray(np.subtract.outer(np.arange(T), np.arange(T)) >= -1)[None, None]
  np.testing.assert_allclose(local(x, mask=mask), ours(x, mask=mask & pattern), **ATOL)
  with pytest.raises(ValueError, match="attention='linear_elu' cannot honour a general `mask`"):
    nn.MultiHeadAttention(N, IN, attention="linear_elu", rngs=nnx.Rngs(0))(x, mask=mask)


def test_sow_weights():
  ours, theirs = _pair(N, IN, decode=False)
  x = _x(7)
  _, mine = nnx.capture(lambda m: m(x, sow_weights=True, is_causal=True), nnx.Intermediate)(ours)
  _, flax = nnx.capture(lambda m: m(x, sow_weights=True, is_causal=True),
                        nnx.Intermediate)(theirs)
  np.testing.assert_allclose(mine["attention_weights"][0], flax["attention_weights"][0], **ATOL)
  # A kernel variant sows the weights it implies: rows sum to one, and they give its output.
  layer = nn.MultiHeadAttention(N, IN, attention="linear_elu", rngs=nnx.Rngs(0))
  out, sown = nnx.capture(lambda m: m(x, sow_weights=True, is_causal=True),
                          nnx.Intermediate)(layer)
  w = sown["attention_weights"][0]  # [B, N, T, S]
  assert w.shape == (B, N, T, T)
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
  v = layer.value(x)  # [B, S, N, H]
  np.testing.assert_allclose(out, layer.out(jnp.einsum("bnts,bsnh->btnh", w, v)), atol=1e-5)
  with pytest.raises(ValueError, match="attention='efficient' forms no attention weights"):
    nn.MultiHeadAttention(N, IN, attention="efficient", rngs=nnx.Rngs(0))(x, sow_weights=True)


def test_decode_in_flax_form_with_flax_cache_names():
  """decode= in the constructor, an unbatched cache shape, one token at a time."""
  ours, theirs = _pair(N, IN, num_kv_heads=K, decode=True)
  x = _x(8, (T, IN))  # No batch dims.
  for layer in (ours, theirs):
    layer.init_cache(x.shape)
  assert ours.cached_key.shape == theirs.cached_key.shape == (T, K, IN // N)
  assert ours.cached_key.dtype == theirs.cached_key.dtype == jnp.float32
  step = nnx.jit(lambda layer, x: layer(x))  # One program per layer for the steps.
  for t in range(4):
    np.testing.assert_allclose(step(ours, x[t:t + 1]), step(theirs, x[t:t + 1]), **ATOL)
  np.testing.assert_allclose(ours.cached_key, theirs.cached_key[...], **ATOL)
  np.testing.assert_allclose(ours.cached_value, theirs.cached_value[...], **ATOL)
  assert int(ours.cache_index) == int(theirs.cache_index[...]) == 4


def test_nnx_view_sets_decode_and_allocates_the_cache():
  layer = nn.MultiHeadAttention(N, IN, attention="linear_elu", rngs=nnx.Rngs(0))
  x = _x(9)
  full = layer(x, is_causal=True)
  decoding = nnx.view(layer, decode=True, batch_size=B, max_length=T)
  steps = jnp.concatenate([decoding(x[:, t:t + 1]) for t in range(T)], axis=1)
  np.testing.assert_allclose(steps, full, atol=1e-5, rtol=1e-5)
  with pytest.raises(AttributeError, match="keeps a StateCache"):
    _ = decoding.cached_key


@pytest.mark.parametrize("name", ["softmax", "linear_elu"])
def test_any_number_of_batch_dims(name):
  layer = nn.MultiHeadAttention(N, IN, attention=name, rngs=nnx.Rngs(0))
  x = _x(10, (2, 3, T, IN))
  np.testing.assert_allclose(layer(x, is_causal=True),
                             layer(x.reshape(6, T, IN), is_causal=True).reshape(2, 3, T, IN),
                             **ATOL)
  lengths = jnp.array([[3, 7, 5], [1, 2, 7]], jnp.int32)
  np.testing.assert_allclose(
      layer(x, key_value_seq_lengths=lengths),
      layer(x.reshape(6, T, IN), key_value_seq_lengths=lengths.reshape(6)).reshape(x.shape),
      **ATOL)
  layer.init_cache((2, 3, T, IN))
  step = nnx.jit(lambda layer, x: layer(x, decode=True))  # One program for the T steps.
  steps = jnp.concatenate([step(layer, x[..., t:t + 1, :]) for t in range(T)], axis=-2)
  np.testing.assert_allclose(steps, layer(x, is_causal=True), atol=1e-5, rtol=1e-5)
  if name == "softmax":
    assert layer.cached_key.shape == (2, 3, T, N, IN // N)
    theirs = nnx.MultiHeadAttention(N, IN, decode=False, rngs=nnx.Rngs(0))
    mask = jax.random.bernoulli(jax.random.key(11), 0.7, (2, 3, 1, T, T))
    np.testing.assert_allclose(layer(x, mask=mask), theirs(x, mask=mask), **ATOL)


def test_attention_fn_is_honoured_like_flax():
  ours, theirs = _pair(N, IN, attention_fn=nnx.dot_product_attention, decode=False)
  x = _x(12)
  np.testing.assert_allclose(ours(x, is_causal=True), theirs(x, is_causal=True), **ATOL)
  for layer in (ours, theirs):
    layer.init_cache(x.shape)
  for t in range(3):
    np.testing.assert_allclose(ours(x[:, t:t + 1], decode=True),
                               theirs(x[:, t:t + 1], decode=True), **ATOL)
  with pytest.raises(ValueError, match="attention_fn replaces the registered attention"):
    nn.MultiHeadAttention(N, IN, attention="linear_elu", attention_fn=nnx.dot_product_attention,
                          rngs=nnx.Rngs(0))


def test_mask_while_decoding_a_kv_cache():
  """A mask over the cache's positions narrows what each decoded token reads."""
  layer = nn.MultiHeadAttention(N, IN, rngs=nnx.Rngs(0))
  x = _x(13)
  mask = jax.random.bernoulli(jax.random.key(14), 0.7, (B, 1, T, T))
  mask = mask | jnp.eye(T, dtype=bool)[None, None]  # Each token sees itself.
  full = layer(x, mask=mask & jnp.tril(jnp.ones((T, T), bool))[None, None])
  layer.init_cache(x.shape)
  step = nnx.jit(lambda layer, x, mask: layer(x, decode=True, mask=mask))  # One program.
  steps = [step(layer, x[:, t:t + 1], mask[:, :, t:t + 1]) for t in range(T)]
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_linen_bridge_inside_nn_scan_over_layers():
  """The layer as a flax.linen module, stacked by linen.scan: each layer is ours."""
  depth = 3

  class Block(linen.Module):
    @linen.compact
    def __call__(self, x, _):
      attend = nnx.bridge.to_linen(nn.MultiHeadAttention, N, IN, attention="linear_elu")
      return x + attend(x, is_causal=True), None

  stack = linen.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=depth)()
  x = _x(15)
  variables = stack.init(jax.random.key(0), x, None)
  out, _ = stack.apply(variables, x, None)
  params = variables["params"]["ToLinen_0"]
  h = x
  for i in range(depth):
    layer = nn.MultiHeadAttention(N, IN, attention="linear_elu", rngs=nnx.Rngs(0))
    nnx.update(layer, nnx.State({name: {leaf: nnx.Param(value[i]) for leaf, value in p.items()}
                                 for name, p in params.items()}))
    h = h + layer(h, is_causal=True)
  np.testing.assert_allclose(out, h, atol=1e-5, rtol=1e-5)
  grads = jax.grad(lambda v: stack.apply(v, x, None)[0].sum())(variables)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
