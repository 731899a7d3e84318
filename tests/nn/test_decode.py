"""Decoding from a KV cache: sparse patterns read only their rows' keys; the loop copies no cache.

A sparse pattern's decoded row i gathers the L keys its pattern names
(``sparse.decode_rows``) from the cache ``[B, K, C, H]``; these tests hold
it to the variant's full causal function on the same sequence, and to the
dense-row decode it replaces (a ``[C, C]`` pattern, capped at
``MAX_PATTERN_CAPACITY``), prompt, single steps and chunks alike.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import nn
from linattn_jax._src import gather, sparse
from linattn_jax._src.nn import cache as nn_cache
from linattn_jax._src.registry import get_spec

B, IN, N, K = 2, 16, 4, 2  # GQA: two query heads per key/value head; H = IN / N = 4.
L, C = 40, 48  # Decoded positions, cache capacity (longer: the rows must not depend on C).
# A prompt, steps, a chunk, steps, a longer chunk, steps: T > 1 and T = 1 at many positions,
# in three shapes (one compiled program each). Longformer's global positions 0, 7 and 20
# fall in the prompt, on a step and inside the longer chunk.
PIECES = (7, 1, 1, 1, 7, 1, 1, 12, 1, 1, 1, 1, 1, 1, 1, 1, 1)


def _shared_layout(nq: int, nk: int) -> np.ndarray:
  """Block diagonal, the first column and a block two back (any length)."""
  a, b = np.arange(nq)[:, None], np.arange(nk)[None, :]
  return (b == a) | (b == 0) | (b == a - 2)


def _per_head_layout(nq: int, nk: int) -> np.ndarray:
  """``[N, nq, nk]``: each query head its own blocks (head n: diagonal and n + 1 back)."""
  a, b = np.arange(nq)[:, None], np.arange(nk)[None, :]
  return np.stack([(b == a) | (b == a - n - 1) for n in range(N)])


PATTERNS = {
    "strided": ("strided", {"stride": 5, "window_size": (3, 0)}),
    "strided_no_window": ("strided", {"stride": 4}),
    "longformer": ("longformer", {"window_size": (4, 1), "global_positions": (0, 7, 20)}),
    "block_sparse": ("block_sparse", {"layout": _shared_layout, "block_size": 4}),
    "block_sparse_per_head": ("block_sparse", {"layout": _per_head_layout, "block_size": 4}),
    "bigbird": ("bigbird", {"block_size": 4, "num_window_blocks": 2, "num_global_blocks": 1,
                            "num_random_blocks": 2, "rng": 3}),
}


def _layer(name: str, options: dict, heads: int = N, kv_heads: int = K,
           features: int = IN) -> nn.MultiHeadAttention:
  return nn.MultiHeadAttention(heads, features, num_kv_heads=kv_heads, attention=name,
                               attention_options=options, rngs=nnx.Rngs(0))


def _decode_pieces(layer, x, pieces, mask=None) -> np.ndarray:
  """Decodes ``x [B, L, in]`` piece by piece from an empty cache of capacity C (sliced and
  joined in numpy, which compiles nothing)."""
  step = nnx.jit(lambda m, x, mask: m(x, decode=True, mask=mask))  # A new program each time.
  layer.init_cache((B, C, IN))
  bounds = np.cumsum((0,) + tuple(pieces))
  x, mask = np.asarray(x), None if mask is None else np.asarray(mask)
  outs = []
  for a, b in zip(bounds[:-1], bounds[1:], strict=True):
    rows = None if mask is None else mask[:, :, a:b]  # [B|1, N|1, T, C]
    outs.append(np.asarray(step(layer, x[:, a:b], rows)))
  return np.concatenate(outs, 1)


def _dense_row_decode(monkeypatch, layer, x, pieces, mask=None) -> jax.Array:
  """Decoding as before: the pattern's dense [C, C] rows."""
  with monkeypatch.context() as patch:
    patch.setattr(sparse, "decode_rows", lambda *args, **kwargs: None)
    return _decode_pieces(layer, x, pieces, mask)


@pytest.mark.parametrize("case", sorted(PATTERNS))
def test_sparse_decode_equals_the_full_function_and_the_dense_rows(case, monkeypatch):
  """Prefill, steps and chunks read gathered keys; together one causal call, as before."""
  name, options = PATTERNS[case]
  layer = _layer(name, options)
  x = jax.random.normal(jax.random.key(1), (B, L, IN))
  want = nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
  got = _decode_pieces(layer, x, PIECES)
  assert int(layer.cache.get_value().index) == L
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(got, _dense_row_decode(monkeypatch, layer, x, PIECES),
                              atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["longformer", "block_sparse_per_head"])
def test_sparse_decode_with_a_mask_equals_the_dense_rows(case, monkeypatch):
  """A general mask over the cache's positions narrows the gathered keys as it did the rows."""
  name, options = PATTERNS[case]
  layer = _layer(name, options)
  x = jax.random.normal(jax.random.key(2), (B, L, IN))
  mask = jax.random.bernoulli(jax.random.key(3), 0.8, (B, 1, L, C))  # [B, N|1, T, C]
  pieces = (9, 1, 7, 1)
  x = np.asarray(x)[:, :18]
  got = _decode_pieces(layer, x, pieces, mask)
  chex.assert_trees_all_close(got, _dense_row_decode(monkeypatch, layer, x, pieces, mask),
                              atol=2e-5, rtol=2e-5)


def test_sparse_decode_rows_follow_the_pattern_not_the_capacity():
  """A row gathers its window and the summary columns (strided), not the cache's C keys."""
  for capacity in (1024, 65536):
    rows = sparse.decode_rows(get_spec("strided"), capacity, N,
                              {"stride": 128, "window_size": (256, 0)})
    at, ok = jax.eval_shape(lambda i, rows=rows: gather.row_keys(rows, i),
                            jax.ShapeDtypeStruct((1,), jnp.int32))
    assert at.shape == ok.shape == (1, 1, 257 + capacity // 128)


def test_sparse_decode_past_the_dense_pattern_cap():
  """A cache beyond MAX_PATTERN_CAPACITY decodes (strided and longformer), exactly."""
  steps, capacity = (1, 3, 1), nn_cache.MAX_PATTERN_CAPACITY + 64
  P = capacity - sum(steps) - 3  # Decode the last positions but three.
  head_major = lambda y: jnp.pad(y.swapaxes(1, 2), ((0, 0), (0, 0), (0, capacity - P), (0, 0)))  # noqa: E731
  for name, options in (("strided", {"stride": 64, "window_size": (32, 0)}),
                        ("longformer", {"window_size": (32, 0), "global_positions": (0, 5000)})):
    layer = _layer(name, options, heads=2, kv_heads=1, features=4)  # H = 2.
    x = jax.random.normal(jax.random.key(4), (1, P + sum(steps), 4))
    # The full call, and the cache after decoding x[:, :P]: its keys and values, head-major
    # [B, K, C, H] (one compiled program).
    want, key, value = nnx.jit(lambda m, x: (
        m(x, is_causal=True)[:, P:], head_major(m.key(x[:, :P])), head_major(m.value(x[:, :P]))))(
            layer, x)
    layer.init_cache((1, capacity, 4))
    layer.cache.set_value(layer.cache.get_value()._replace(
        key=key, value=value, index=jnp.asarray(P, jnp.int32)))
    step = nnx.jit(lambda m, x: m(x, decode=True))
    bounds = P + np.cumsum((0,) + steps)
    pieces = zip(bounds[:-1], bounds[1:], strict=True)
    x = np.asarray(x)
    got = np.concatenate([np.asarray(step(layer, x[:, a:b])) for a, b in pieces], 1)
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["softmax", "longformer"])
def test_decode_loop_updates_the_cache_in_place(name):
  """Inside a scanned decode loop no [B, K, C, H] buffer (nor the [B, C] segment ids) is
  copied: the write waits for the read, so XLA updates the carried cache in place (before:
  two copies per step)."""
  options = {"window_size": (4, 0), "global_positions": (0,)} if name == "longformer" else {}
  layer = _layer(name, options)
  layer.init_cache((B, C, IN))
  graphdef, cache, rest = nnx.split(layer, nnx.Cache, ...)

  def run(cache, rest, tokens):
    def body(cache, token):
      model = nnx.merge(graphdef, cache, rest)
      return nnx.state(model, nnx.Cache), model(token, decode=True)

    return jax.lax.scan(body, cache, tokens)

  tokens = jnp.ones((3, B, 1, IN))
  hlo = jax.jit(run, donate_argnums=0).lower(cache, rest, tokens).compile().as_text()
  copies = re.findall(rf"= f32\[{B},{K},{C},{IN // N}\]\{{[0-9,]*\}} copy\(", hlo)
  copies += re.findall(rf"= s32\[{B},{C}\]\{{[0-9,]*\}} copy\(", hlo)  # The segment ids.
  assert not copies, f"{len(copies)} copies of the cache: {copies}"
