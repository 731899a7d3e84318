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


# Calls as one compiled program each (eagerly, each call is a program): ``_both(f)``
# runs ``f`` on each layer given, ``_steps`` decodes one position at a time.
def _both(f):
  return nnx.jit(lambda *layers_and_x: tuple(f(layer, layers_and_x[-1])
                                             for layer in layers_and_x[:-1]))


@nnx.jit
def _step(layer, x, **kw):
  return layer(x, decode=True, **kw)


def _steps(layer, x, masks=None) -> np.ndarray:
  """``x [..., T, in]`` decoded one position at a time by one compiled step (sliced and
  joined in numpy, which compiles nothing)."""
  x = np.asarray(x)
  return np.concatenate([np.asarray(_step(layer, x[..., t:t + 1, :]) if masks is None else
                                    _step(layer, x[..., t:t + 1, :], mask=masks[..., t:t + 1, :]))
                         for t in range(x.shape[-2])], -2)


def test_positional_arguments_give_the_same_parameters_and_outputs():
  """(num_heads, in_features, qkv_features, out_features, num_kv_heads, in_kv_features)."""
  ours, theirs = _pair(N, IN, 24, 8, K, 12, decode=False)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(ours, nnx.Param),
               nnx.state(theirs, nnx.Param))
  x, y = _x(0), _x(1, (B, 5, 12))
  np.testing.assert_allclose(*nnx.jit(lambda a, b, x, y: (a(x, y), b(x, y)))(ours, theirs, x, y),
                             **ATOL)


def test_normalize_qk_checkpoint_loads_and_agrees():
  theirs = nnx.MultiHeadAttention(N, IN, normalize_qk=True, decode=False, rngs=nnx.Rngs(3))
  ours = nn.MultiHeadAttention(N, IN, normalize_qk=True, rngs=nnx.Rngs(4))
  nnx.update(ours, nnx.state(theirs, nnx.Param))  # A Flax checkpoint: query_ln, key_ln included.
  assert {"query_ln", "key_ln"} <= set(nnx.state(ours, nnx.Param))
  x = _x(2)
  np.testing.assert_allclose(*_both(lambda m, x: m(x, is_causal=True))(ours, theirs, x), **ATOL)


@pytest.mark.parametrize("broadcast_dropout", [True, False], ids=["broadcast", "per-head"])
def test_dropout_draws_flax_masks(broadcast_dropout):
  ours, theirs = _pair(N, IN, dropout_rate=0.3, broadcast_dropout=broadcast_dropout,
                       decode=False)
  x = _x(3)
  (a, kept_a), (b, kept_b) = _both(lambda m, x: (m(x, deterministic=False),
                                                 m(x, deterministic=True)))(ours, theirs, x)
  np.testing.assert_allclose(a, b, **ATOL)
  assert not np.allclose(a, kept_a)  # Dropout did something.
  np.testing.assert_allclose(kept_a, kept_b, **ATOL)
  # keep_rngs=False: the call's rngs.
  ours, theirs = _pair(N, IN, dropout_rate=0.3, keep_rngs=False, decode=False)
  np.testing.assert_allclose(
      *_both(lambda m, x: m(x, deterministic=False, rngs=nnx.Rngs(dropout=5)))(ours, theirs, x),
      **ATOL)
  with pytest.raises(ValueError, match="rngs"):
    ours(x, deterministic=False)


def test_dropout_on_a_sparse_pattern_and_refused_where_no_weights_exist():
  layer = nn.MultiHeadAttention(N, IN, attention="local", dropout_rate=0.5, deterministic=False,
                                attention_options={"window_size": (2, 0)}, rngs=nnx.Rngs(0))
  x = _x(4)
  fresh = nn.MultiHeadAttention(N, IN, attention="local", attention_options={"window_size": (2, 0)},
                                rngs=nnx.Rngs(0))
  dropped, kept, want = nnx.jit(lambda layer, fresh, x: (
      layer(x, is_causal=True), layer(x, is_causal=True, deterministic=True),
      fresh(x, is_causal=True)))(layer, fresh, x)
  assert np.isfinite(dropped).all()
  np.testing.assert_allclose(kept, want, **ATOL)
  assert not np.allclose(dropped, kept)
  for name in ("linear_elu", "flash", "heinsen"):
    with pytest.raises(ValueError, match=f"attention='{name}' never forms"):
      nn.MultiHeadAttention(N, IN, attention=name, dropout_rate=0.1, rngs=nnx.Rngs(0))


def test_general_mask_softmax_sparse_and_recurrent():
  ours, theirs = _pair(N, IN, decode=False)
  x = _x(5)
  mask = jax.random.bernoulli(jax.random.key(6), 0.6, (B, 1, T, T))
  # A sparse pattern combines its own pattern with the mask: softmax over both.
  local = nn.MultiHeadAttention(N, IN, attention="local", rngs=nnx.Rngs(0),
                                attention_options={"window_size": (2, 1)})
  pattern = np.abs(np.subtract.outer(np.arange(T), np.arange(T))) <= 2
  pattern &= np.subtract.outer(np.arange(T), np.arange(T)) >= -1

  @nnx.jit  # Each call and the call it should equal (one compiled program).
  def run(ours, theirs, local, x, mask):
    as_float = mask.astype(jnp.float32)  # Flax's mask helpers return floats.
    return [(ours(x, mask=mask), theirs(x, mask=mask)),
            (ours(x, mask=as_float), theirs(x, mask=mask)),
            (local(x, mask=mask), ours(x, mask=mask & pattern[None, None]))]

  for what, (got, want) in zip(("bool", "float", "local"), run(ours, theirs, local, x, mask),
                               strict=True):
    np.testing.assert_allclose(got, want, err_msg=what, **ATOL)
  with pytest.raises(ValueError, match="attention='linear_elu' cannot honour a general `mask`"):
    nn.MultiHeadAttention(N, IN, attention="linear_elu", rngs=nnx.Rngs(0))(x, mask=mask)


def test_sow_weights():
  ours, theirs = _pair(N, IN, decode=False)
  x = _x(7)
  layer = nn.MultiHeadAttention(N, IN, attention="linear_elu", rngs=nnx.Rngs(0))

  @nnx.jit  # One compiled program.
  def run(ours, theirs, layer, x):
    sown = [nnx.capture(lambda m: m(x, sow_weights=True, is_causal=True), nnx.Intermediate)(m)
            for m in (ours, theirs, layer)]
    # A kernel variant sows the weights it implies: they give its output.
    w = sown[2][1]["attention_weights"][0]  # [B, N, T, S]
    return sown, layer.out(jnp.einsum("bnts,bsnh->btnh", w, layer.value(x)))  # v [B, S, N, H]

  ((_, mine), (_, flax), (out, sown)), implied = run(ours, theirs, layer, x)
  np.testing.assert_allclose(mine["attention_weights"][0], flax["attention_weights"][0], **ATOL)
  # Rows sum to one, and they give its output.
  w = sown["attention_weights"][0]  # [B, N, T, S]
  assert w.shape == (B, N, T, T)
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(out, implied, atol=1e-5)
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
  full = nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
  decoding = nnx.view(layer, decode=True, batch_size=B, max_length=T)
  step = nnx.jit(lambda m, x: m(x))  # The view decodes: one compiled step for the T steps.
  steps = np.concatenate([np.asarray(step(decoding, np.asarray(x)[:, t:t + 1]))
                          for t in range(T)], axis=1)
  np.testing.assert_allclose(steps, full, atol=1e-5, rtol=1e-5)
  with pytest.raises(AttributeError, match="keeps a StateCache"):
    _ = decoding.cached_key


@pytest.mark.parametrize("name", ["softmax", "linear_elu"])
def test_any_number_of_batch_dims(name):
  layer = nn.MultiHeadAttention(N, IN, attention=name, rngs=nnx.Rngs(0))
  x = _x(10, (2, 3, T, IN))
  lengths = jnp.array([[3, 7, 5], [1, 2, 7]], jnp.int32)
  theirs = nnx.MultiHeadAttention(N, IN, decode=False, rngs=nnx.Rngs(0))
  mask = jax.random.bernoulli(jax.random.key(11), 0.7, (2, 3, 1, T, T))

  @nnx.jit  # Each call and the call it should equal (one compiled program).
  def run(layer, theirs, x, lengths, mask):
    flat = x.reshape(6, T, IN)
    pairs = {"causal": (layer(x, is_causal=True),
                        layer(flat, is_causal=True).reshape(x.shape)),
             "lengths": (layer(x, key_value_seq_lengths=lengths),
                         layer(flat, key_value_seq_lengths=lengths.reshape(6)).reshape(x.shape))}
    if name == "softmax":
      pairs["mask"] = (layer(x, mask=mask), theirs(x, mask=mask))
    return pairs

  pairs = run(layer, theirs, x, lengths, mask)
  for what, (got, want) in pairs.items():
    np.testing.assert_allclose(got, want, err_msg=what, **ATOL)
  layer.init_cache((2, 3, T, IN))
  steps = _steps(layer, x)  # One program for the T steps.
  np.testing.assert_allclose(steps, pairs["causal"][0], atol=1e-5, rtol=1e-5)
  if name == "softmax":
    assert layer.cached_key.shape == (2, 3, T, N, IN // N)


def test_attention_fn_is_honoured_like_flax():
  ours, theirs = _pair(N, IN, attention_fn=nnx.dot_product_attention, decode=False)
  x = _x(12)
  np.testing.assert_allclose(*_both(lambda m, x: m(x, is_causal=True))(ours, theirs, x), **ATOL)
  for layer in (ours, theirs):
    layer.init_cache(x.shape)
  np.testing.assert_allclose(_steps(ours, x[:, :3]), _steps(theirs, x[:, :3]), **ATOL)
  with pytest.raises(ValueError, match="attention_fn replaces the registered attention"):
    nn.MultiHeadAttention(N, IN, attention="linear_elu", attention_fn=nnx.dot_product_attention,
                          rngs=nnx.Rngs(0))


def test_mask_while_decoding_a_kv_cache():
  """A mask over the cache's positions narrows what each decoded token reads."""
  layer = nn.MultiHeadAttention(N, IN, rngs=nnx.Rngs(0))
  x = _x(13)
  mask = jax.random.bernoulli(jax.random.key(14), 0.7, (B, 1, T, T))
  mask = np.asarray(mask) | np.eye(T, dtype=bool)[None, None]  # Each token sees itself.
  full = nnx.jit(lambda m, x, mask: m(x, mask=mask))(
      layer, x, mask & np.tril(np.ones((T, T), bool))[None, None])
  layer.init_cache(x.shape)
  steps = _steps(layer, x, masks=mask)  # One program for the T steps.
  np.testing.assert_allclose(steps, full, atol=1e-5, rtol=1e-5)


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
  variables = jax.jit(lambda key, x: stack.init(key, x, None))(jax.random.key(0), x)

  @jax.jit  # One compiled program: the stack, its gradient, and the layers one by one.
  def run(variables, x):
    out, _ = stack.apply(variables, x, None)
    grads = jax.grad(lambda v: stack.apply(v, x, None)[0].sum())(variables)
    params = variables["params"]["ToLinen_0"]
    h = x
    for i in range(depth):
      layer = nn.MultiHeadAttention(N, IN, attention="linear_elu", rngs=nnx.Rngs(0))
      nnx.update(layer, nnx.State({name: {leaf: nnx.Param(value[i]) for leaf, value in p.items()}
                                   for name, p in params.items()}))
      h = h + layer(h, is_causal=True)
    return out, h, grads

  out, h, grads = run(variables, x)
  np.testing.assert_allclose(out, h, atol=1e-5, rtol=1e-5)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
