"""Packed sequences through the layer: one call equals each document alone, decoding across a
boundary equals a fresh decode, and what cannot be honoured raises."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import TOLERANCE, layer_paths, suite_options
from flax import nnx

import linattn_jax as la
from linattn_jax import nn, parallel
from linattn_jax._src.nn import attention, packing
from linattn_jax._src.registry import CacheKind, get_spec

B, T, IN, N, K = 2, 11, 16, 4, 2  # GQA: two query heads per key/value head.
# Documents per row: a boundary inside the row, a one-token document, and one at the end.
IDS = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1],
                [4, 4, 5, 6, 6, 6, 6, 6, 6, 9, 9]], np.int32)
# Every variant whose function takes segment_ids joins by taking them: those without a
# pattern, and the sparse patterns (whose positions stay the row's).
PACKED = [name for name in la.available_attentions()
          if packing.takes_segment_ids(get_spec(name).function)]
PATTERNS = [name for name in PACKED if get_spec(name).dense_mask is not None]
# Those whose decode cache honours them: a KV cache or a recurrent state (not local's ring).
DECODED = [name for name in PACKED if get_spec(name).supports_causal
           and get_spec(name).cache_kind is not CacheKind.WINDOW]


def _layer(name: str, **kw) -> nn.MultiHeadAttention:
  spec = get_spec(name)
  owned = spec.params.names + ("rng",) if spec.params is not None else ()
  options = {k: v for k, v in suite_options(spec).items() if k not in owned}
  return nn.MultiHeadAttention(N, IN, num_kv_heads=K, attention=name,
                               attention_options=options, rngs=nnx.Rngs(0), **kw)


def _documents(ids: np.ndarray) -> list[slice]:
  """The slices of a row's documents."""
  starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
  return [slice(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _tolerance(name: str) -> dict:
  atol, rtol = TOLERANCE[jnp.dtype(jnp.float32)]
  scale = 10 if name == "random_fourier" else 1  # Signed features: a normaliser can cancel.
  return {"atol": scale * atol, "rtol": scale * rtol}


@jax.jit
def _same_segment(ids):  # [B, T] -> [B, 1, T, T]
  return (ids[:, :, None] == ids[:, None, :])[:, None]


# The layer's paths (a KV cache, a recurrent state, arrays it owns, gates it projects): the
# shared suite checks each variant's packed call, forward and gradient, in every form.
@pytest.mark.parametrize("name", layer_paths([name for name in PACKED if name not in PATTERNS]))
def test_a_packed_call_equals_each_document_alone(name):
  """Forward and gradient: a row of documents equals each document run by itself, causal
  (and bidirectional for exact softmax; the recurrences pack causal rows only).

  The documents run by themselves as the rows of one call: each padded at its end to the
  longest, its keys there hidden by its ``key_value_seq_lengths`` (one program for every
  document length)."""
  layer = _layer(name)
  x = jax.random.normal(jax.random.key(0), (B, T, IN))
  ids = jnp.asarray(IDS)
  docs = [(b, doc) for b in range(B) for doc in _documents(IDS[b])]
  longest = max(doc.stop - doc.start for _, doc in docs)
  rows = np.stack([np.pad(np.asarray(x)[b, doc], ((0, longest - (doc.stop - doc.start)), (0, 0)))
                   for b, doc in docs])
  lengths = np.asarray([doc.stop - doc.start for _, doc in docs], np.int32)
  modes = (True, False) if get_spec(name).full_softmax else (True,)
  doc = _documents(IDS[0])[1]

  @nnx.jit
  def run(m, x, ids, rows, lengths):
    """Per mode the packed call and the documents alone; the gradient of a loss on one
    document's outputs, packed and alone (one program)."""
    calls = [(m(x, is_causal=c, segment_ids=ids), m(rows, is_causal=c,
                                                    key_value_seq_lengths=lengths))
             for c in modes]
    grad = jax.grad(lambda x: jnp.sum(m(x, is_causal=True, segment_ids=ids)[0, doc] ** 2))(x)
    want = jax.grad(lambda y: jnp.sum(m(y, is_causal=True) ** 2))(x[:1, doc])
    return calls, grad, want

  calls, grad, want = run(layer, x, ids, rows, lengths)
  for causal, (packed, alone) in zip(modes, calls, strict=True):
    for i, (b, doc_i) in enumerate(docs):
      np.testing.assert_allclose(packed[b, doc_i], alone[i, :doc_i.stop - doc_i.start],
                                 err_msg=f"{name} causal={causal} row {b} {doc_i}",
                                 **_tolerance(name))
  # The gradient of a loss on one document's outputs reaches no input of the others.
  assert np.all(np.asarray(grad[0, :doc.start]) == 0) and np.all(np.asarray(grad[1]) == 0)
  np.testing.assert_allclose(grad[0, doc], want[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", PATTERNS)
def test_a_packed_pattern_is_its_pattern_cut_to_each_document(name):
  """A sparse pattern keeps the row's positions: the packed call equals the pattern with
  the documents' mask (the layer's dense path), causal and bidirectional."""
  layer = _layer(name)
  x = jax.random.normal(jax.random.key(4), (B, T, IN))
  ids = jnp.asarray(IDS)
  modes = (True, False) if get_spec(name).supports_noncausal else (True,)
  # Both calls in every mode, one compiled program (eagerly, each call is a program).
  calls = nnx.jit(lambda m, x, ids: [
      (m(x, is_causal=c, segment_ids=ids), m(x, is_causal=c, mask=_same_segment(ids)))
      for c in modes])(layer, x, ids)
  for causal, (packed, masked) in zip(modes, calls, strict=True):
    np.testing.assert_allclose(packed, masked, err_msg=f"{name} causal={causal}",
                               **_tolerance(name))


def test_segment_ids_with_a_mask_and_lengths_are_all_honoured():
  """softmax: ids, a general mask and key lengths at once equal the mask of all three;
  flash (no mask) takes ids with lengths; the pair of ids serves cross-attention."""
  layer = _layer("softmax")
  flash = _layer("flash")
  nnx.update(flash, nnx.state(layer, nnx.Param))
  x = jax.random.normal(jax.random.key(1), (B, T, IN))
  ids, lengths = jnp.asarray(IDS), jnp.array([T, 7])
  mask = jax.random.bernoulli(jax.random.key(2), 0.7, (B, 1, T, T))
  # Cross-attention: 5 queries against the 11 keys, ids on both sides.
  q_ids = jnp.array([[0, 0, 1, 1, 1], [5, 6, 6, 9, 9]])

  @nnx.jit
  def run(layer, flash, x, ids, lengths, mask, q_ids):
    """Each call below and the call it should equal (one compiled program)."""
    pair_mask = (q_ids[:, :, None] == ids[:, None, :])[:, None]
    return {
        "ids, mask and lengths": (
            layer(x, mask=mask, key_value_seq_lengths=lengths, segment_ids=ids, is_causal=True),
            layer(x, mask=mask & _same_segment(ids), key_value_seq_lengths=lengths,
                  is_causal=True)),
        "flash": (flash(x, key_value_seq_lengths=lengths, segment_ids=ids, is_causal=True),
                  layer(x, key_value_seq_lengths=lengths, segment_ids=ids, is_causal=True)),
        "cross": (layer(x[:, :5], x, segment_ids=(q_ids, ids)),
                  layer(x[:, :5], x, mask=pair_mask)),
        # Leading batch dims: [2, 1, T] ids for [2, 1, T, in] inputs.
        "batch dims": (layer(x[:, None], is_causal=True, segment_ids=ids[:, None])[:, 0],
                       layer(x, is_causal=True, segment_ids=ids)),
    }

  for what, (got, want) in run(layer, flash, x, ids, lengths, mask, q_ids).items():
    tolerance = 2e-5 if what == "flash" else 1e-6
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance, err_msg=what)


# A prompt, a step, a chunk (positions 4..6), steps, a chunk: every path.
PIECES = (3, 1, 3, 1, 1, 2)
# Row 0: documents of 4 and 7 positions, the second starting a chunk; row 1: of 7 and 4,
# the second starting at a single step (position 7).
DECODE_IDS = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1],
                       [2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3]], np.int32)


@nnx.jit
def _full_and_pieces(layer, x, ids):
  """The packed causal call over ``x`` (it reads no cache), and ``x`` decoded in ``PIECES``
  from a fresh cache, each piece with its ids (one program)."""
  bounds = np.cumsum((0,) + PIECES)
  return layer(x, is_causal=True, segment_ids=ids), jnp.concatenate(
      [layer(x[:, a:b], decode=True, segment_ids=ids[:, a:b])
       for a, b in zip(bounds[:-1], bounds[1:], strict=True)], 1)


@nnx.jit
def _step(layer, x):
  return layer(x, decode=True)


def _decode_steps(layer, x) -> np.ndarray:
  """``x`` decoded one position at a time, without ids (one compiled step, called per
  position; sliced and joined in numpy, which compiles nothing)."""
  x = np.asarray(x)
  return np.concatenate([np.asarray(_step(layer, x[:, t:t + 1])) for t in range(x.shape[1])], 1)


@nnx.jit
def _decode_with_ids(layer, x, ids):
  return layer(x, decode=True, segment_ids=ids)


@pytest.mark.parametrize("name", DECODED)
def test_decoding_across_a_boundary_equals_a_fresh_decode_of_the_next_document(name):
  """Decoding a packed row equals the packed call. Through each of the layer's paths: the
  document after the boundary equals it decoded from a fresh cache (but for a pattern,
  whose positions are the row's), and positions without ids continue the last document.
  (For the other variants the first follows from the packed call's test and the prefill
  test; the second is the cache's bookkeeping, the same on each path.)"""
  layer = _layer(name)
  x = jax.random.normal(jax.random.key(3), (B, T, IN))
  layer.init_cache((B, T + 1, IN))
  full, got = _full_and_pieces(layer, x, jnp.asarray(DECODE_IDS))
  got = np.asarray(got)
  tolerance = _tolerance(name)
  np.testing.assert_allclose(got, full, err_msg=name, **tolerance)
  assert np.array_equal(_last_ids(layer.cache.get_value()), DECODE_IDS[:, -1])
  if name not in layer_paths(DECODED):
    return
  if name not in PATTERNS:
    for row, start in ((0, 4), (1, 7)):
      layer.init_cache((1, T + 1, IN))
      fresh = _decode_steps(layer, np.asarray(x)[row:row + 1, start:])
      np.testing.assert_allclose(got[row:row + 1, start:], fresh, err_msg=f"{name} row {row}",
                                 **tolerance)
  # Positions without ids continue the last decoded one's document.
  layer.init_cache((B, T + 1, IN))
  first = _decode_with_ids(layer, np.asarray(x)[:, :8], jnp.asarray(DECODE_IDS[:, :8]))
  rest = _decode_steps(layer, np.asarray(x)[:, 8:])
  np.testing.assert_allclose(np.concatenate([first, rest], 1), got, err_msg=name, **tolerance)
  assert np.array_equal(_last_ids(layer.cache.get_value()), DECODE_IDS[:, -1])


def _last_ids(cache) -> np.ndarray:
  if isinstance(cache, nn.KVCache):
    return np.asarray(cache.segment_ids)[:, int(cache.index) - 1]
  return np.asarray(cache.segment_id)


def _mesh():
  return jax.make_mesh((2,), ("seq",), devices=jax.devices()[:2])


@pytest.mark.skipif(not packing.takes_segment_ids(parallel.ContextParallel.attend),
                    reason="ContextParallel.attend takes no segment_ids yet")
@pytest.mark.parametrize("name", [name for name in ("softmax", "linear_elu") if name in PACKED])
def test_context_parallel_packs_as_one_device(name):
  """Rows split along T over 2 devices: the packed output of one device."""
  layer = _layer(name)
  split = _layer(name, context_parallel=parallel.ContextParallel(_mesh(), "seq"))
  nnx.update(split, nnx.state(layer, nnx.Param))
  x = jax.random.normal(jax.random.key(5), (B, 12, IN))
  ids = jnp.asarray(np.array([[0] * 5 + [1] * 7, [3] * 6 + [4] * 6], np.int32))
  np.testing.assert_allclose(split(x, is_causal=True, segment_ids=ids),
                             layer(x, is_causal=True, segment_ids=ids), atol=2e-5, rtol=2e-5)


def _without_segment_ids(name: str, monkeypatch) -> None:
  """Makes ``name``'s layer see a function without ``segment_ids``."""
  spec = get_spec(name)

  def no_packing(query, key, value, *, is_causal=False, key_value_seq_lengths=None):
    return spec.function(query, key, value, is_causal=is_causal,
                         key_value_seq_lengths=key_value_seq_lengths)

  monkeypatch.setattr(attention, "get_spec",
                      lambda _: dataclasses.replace(spec, name="unpacked", function=no_packing))


def test_what_cannot_be_honoured_raises(monkeypatch):
  x = jnp.ones((B, T, IN))
  ids = jnp.asarray(IDS)
  layer = _layer("softmax")
  for bad, match in [
      (ids.astype(jnp.float32), r"segment_ids must be integers; got float32"),
      (ids[:, :5], r"segment_ids must have shape \[..., L\] = \(2, 11\) for these inputs; "
                   r"got \(2, 5\)"),
      ((ids,), r"a pair takes two arrays; got a tuple of 1 items"),
  ]:
    with pytest.raises(ValueError, match=match):
      layer(x, is_causal=True, segment_ids=bad)
  with pytest.raises(ValueError, match=r"queries \(5\) and keys \(11\) differ in length; pass "
                     r"the pair"):
    layer(x[:, :5], x, segment_ids=ids)
  layer.init_cache((B, T, IN))
  with pytest.raises(ValueError, match="decoding takes one array"):
    layer(x, decode=True, segment_ids=(ids, ids))
  flax_like = nn.MultiHeadAttention(N, IN, attention_fn=nn.as_flax_attention_fn(
      la.softmax_attention), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="segment_ids reach registered attentions only"):
    flax_like(x, segment_ids=ids)
  split = nn.MultiHeadAttention(N, IN, rngs=nnx.Rngs(0),
                                context_parallel=parallel.ContextParallel(_mesh(), "seq"))
  attend = parallel.ContextParallel.attend

  def without_ids(self, attention, q, k, v, *, is_causal, key_value_seq_lengths=None, **options):
    return attend(self, attention, q, k, v, is_causal=is_causal,
                  key_value_seq_lengths=key_value_seq_lengths, **options)

  monkeypatch.setattr(parallel.ContextParallel, "attend", without_ids)
  with pytest.raises(ValueError, match="context_parallel takes no segment_ids here"):
    split(jnp.ones((B, 8, IN)), is_causal=True, segment_ids=jnp.zeros((B, 8), jnp.int32))
  local = _layer("local")
  local.init_cache((B, T, IN))
  with pytest.raises(ValueError, match="attention='local'.* segment_ids"):
    local(x[:, :1], decode=True, segment_ids=ids[:, :1])
  # A variant whose function does not take them is refused by name, never ignored.
  _without_segment_ids("linear_elu", monkeypatch)
  unpacked = nn.MultiHeadAttention(N, IN, attention="linear_elu", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="attention='unpacked' does not take segment_ids; its "
                     "function has no packed-sequence support"):
    unpacked(x, is_causal=True, segment_ids=ids)
  unpacked.init_cache((B, T, IN))
  with pytest.raises(ValueError, match="attention='unpacked' does not take segment_ids while "
                     "decoding"):
    unpacked(x[:, :1], decode=True, segment_ids=ids[:, :1])
  assert unpacked(x[:, :1], decode=True).shape == (B, 1, IN)  # Without ids it decodes.


def _with_segment_ids(name: str, monkeypatch) -> None:
  """Makes ``name``'s layer see a function that takes ``segment_ids`` but must never be
  called with them (for what the layer checks before a call), and implied weights (where
  it has them) that take none."""
  spec = get_spec(name)

  def packing_declared(*args, segment_ids=None, **kwargs):
    assert segment_ids is None, "the function was called with segment_ids"
    return spec.function(*args, **kwargs)

  def unpacked_weights(query, key, *, is_causal=False, key_value_seq_lengths=None, **options):
    return spec.weights(query, key, is_causal=is_causal,
                        key_value_seq_lengths=key_value_seq_lengths, **options)

  signature = inspect.signature(spec.function)
  parameters = [p for p in signature.parameters.values() if p.name != "segment_ids"]
  packing_declared.__signature__ = signature.replace(parameters=[
      *parameters, inspect.Parameter("segment_ids", inspect.Parameter.KEYWORD_ONLY, default=None)])
  monkeypatch.setattr(attention, "get_spec", lambda _: dataclasses.replace(
      spec, function=packing_declared,
      weights=None if spec.weights is None else unpacked_weights))


def test_sowing_a_kernel_variants_weights_needs_ids_in_its_implied_weights(monkeypatch):
  _with_segment_ids("linear_elu", monkeypatch)
  layer = _layer("linear_elu")
  with pytest.raises(ValueError, match="sow_weights: the weights attention='linear_elu' "
                     "implies take no segment_ids"):
    layer(jnp.ones((B, T, IN)), is_causal=True, sow_weights=True, segment_ids=jnp.asarray(IDS))
