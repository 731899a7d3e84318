"""Packed rows in the experiments: the short convolution, the model, the char_lm batches and
the training loop keep each document to itself."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linattn_jax as la
from experiments import data, train
from experiments.model import Transformer, positions
from linattn_jax import nn

# The training loop steps optax (see conftest: standard dtype promotion for it).
pytestmark = pytest.mark.standard_dtype_promotion

# Two rows of documents: 5, 7 and 4 tokens; 9 and 7 (one id per document).
LENGTHS = ((5, 7, 4), (9, 7))
L = 16


def _ids(lengths=LENGTHS) -> np.ndarray:
  return np.stack([np.repeat(np.arange(len(row)), row) for row in lengths]).astype(np.int32)


def _documents(lengths=LENGTHS) -> list[tuple[int, slice]]:
  """(row, slice) of every document."""
  out = []
  for b, row in enumerate(lengths):
    bounds = np.cumsum((0,) + row)
    out += [(b, slice(int(s), int(e))) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
  return out


def test_positions_count_from_each_documents_start():
  ids = jnp.asarray(_ids())
  np.testing.assert_array_equal(positions(L, 0, ids), np.concatenate(
      [np.concatenate([np.arange(n) for n in row])[None] for row in LENGTHS]))
  # A row continuing a document from position 3, then starting another at t = 2.
  np.testing.assert_array_equal(positions(4, jnp.array([3]), jnp.array([[7, 7, 8, 8]])),
                                [[3, 4, 0, 1]])
  np.testing.assert_array_equal(positions(3, 2), [[2, 3, 4]])


def test_short_convolution_does_not_mix_documents():
  """Training: each output equals its document convolved alone. Decoding, in a prompt, steps
  and a chunk across a boundary: the same outputs, and the next document equals a fresh
  decode of it."""
  conv = nn.ShortConvolution(4, 3, activation=None, use_bias=True, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, L, 4))
  ids = jnp.asarray(_ids())
  packed = conv(x, decode=False, segment_ids=ids)
  for b, doc in _documents():
    np.testing.assert_allclose(packed[b, doc], conv(x[b:b + 1, doc], decode=False)[0],
                               atol=1e-6, rtol=1e-6)
  conv.init_cache((2, L, 4))
  pieces = (3, 1, 3, 1, 8)  # The chunk at 4..6 crosses row 0's first boundary.
  bounds = np.cumsum((0,) + pieces)
  decoded = jnp.concatenate([conv(x[:, a:e], decode=True, segment_ids=ids[:, a:e])
                             for a, e in zip(bounds[:-1], bounds[1:], strict=True)], 1)
  np.testing.assert_allclose(decoded, packed, atol=1e-6, rtol=1e-6)
  conv.init_cache((1, L, 4))
  fresh = jnp.concatenate([conv(x[:1, t:t + 1], decode=True) for t in range(5, 12)], 1)
  np.testing.assert_allclose(decoded[:1, 5:12], fresh, atol=1e-6, rtol=1e-6)


def _model(attention: str, **kw) -> Transformer:
  return Transformer(vocab_size=11, num_classes=None, max_len=L, dim=16, num_layers=2,
                     num_heads=2, num_kv_heads=1, attention=attention, attention_options={},
                     dtype=None, short_conv=3, rngs=nnx.Rngs(0), **kw)


def test_decoding_packed_rows_equals_the_packed_pass():
  """A prompt, then steps with their ids and positions in their documents: the logits of
  one packed pass, through the attention caches and the convolutions' caches."""
  model = _model("softmax")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 11, (2, L)))
  ids = jnp.asarray(_ids())
  full = nnx.jit(lambda m, t, i: m(t, segment_ids=i))(model, tokens, ids)
  where = positions(L, 0, ids)  # [B, L]: each token's position in its document.
  model.init_cache(2, L)
  decode = nnx.jit(lambda m, t, i, p: m(t, segment_ids=i, position=p, decode=True))
  steps = [decode(model, tokens[:, :6], ids[:, :6], jnp.zeros((2,), jnp.int32))]
  steps += [decode(model, tokens[:, t:t + 1], ids[:, t:t + 1], where[:, t]) for t in range(6, L)]
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=2e-5, atol=2e-5)


def _padded(tokens: np.ndarray) -> dict[str, jnp.ndarray]:
  """Each document of the packed ``tokens [2, L + 1]`` alone in a row, right-padded."""
  docs = [tokens[b, doc] for b, doc in _documents()]
  rows = np.zeros((len(docs), L + 1), np.int32)
  weights = np.zeros((len(docs), L), np.float32)
  for i, doc in enumerate(docs):
    rows[i, :len(doc)] = doc
    weights[i, :len(doc) - 1] = 1.0  # Within the document; its last token predicts nothing.
  return {"inputs": jnp.asarray(rows[:, :-1]), "targets": jnp.asarray(rows[:, 1:]),
          "weights": jnp.asarray(weights)}


def _packed(tokens: np.ndarray) -> dict[str, jnp.ndarray]:
  """``tokens [2, L + 1]`` as packed rows: no target across a boundary (the last token
  begins a document that is cut off, as the padded rows' documents end before it)."""
  ids = np.concatenate([_ids(), _ids()[:, -1:] + 1], axis=1)  # The ids of the L + 1 tokens.
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
          "weights": jnp.asarray((ids[:, 1:] == ids[:, :-1]).astype(np.float32)),
          "segment_ids": jnp.asarray(ids[:, :-1])}


def _takes_ids(attention: str) -> bool:
  return "segment_ids" in inspect.signature(la.get_spec(attention).function).parameters


@pytest.mark.parametrize("attention", [
    pytest.param(name, marks=pytest.mark.skipif(not _takes_ids(name), reason=(
        f"{name}'s function takes no segment_ids yet")))
    for name in ("softmax", "linear_elu", "gla")])
def test_a_packed_batch_gives_the_loss_and_gradients_of_separate_padded_rows(attention):
  """The same documents, packed two rows or padded one per row: the same loss, accuracy and
  gradient, through the whole model (positions, short convolutions, attention)."""
  model = _model(attention)
  tokens = np.random.default_rng(1).integers(1, 11, (2, L + 1)).astype(np.int32)

  @nnx.jit
  def loss_and_grad(model, batch):
    (_, metrics), grads = nnx.value_and_grad(train.loss_and_metrics, has_aux=True)(model, batch)
    return metrics, grads

  packed, padded = (loss_and_grad(model, make(tokens)) for make in (_packed, _padded))
  np.testing.assert_allclose(packed[0]["loss"], padded[0]["loss"], rtol=1e-5)
  np.testing.assert_allclose(packed[0]["accuracy"], padded[0]["accuracy"], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               packed[1], padded[1])


def test_packed_char_lm_rows_are_the_same_bytes_with_files_told_apart():
  B, length = 64, 128
  for split in (data.TRAIN, data.VALID):
    plain = data.char_lm_batch(0, 3, split, B, length)
    packed = data.char_lm_packed_batch(0, 3, split, B, length)
    assert all(np.array_equal(plain[k], packed[k]) for k in ("inputs", "targets"))
    ids = packed["segment_ids"]
    assert ids.dtype == np.int32 and np.all(ids[:, 0] == 0) and np.all(np.diff(ids, axis=1) >= 0)
    # A target is dropped exactly where its byte starts another file.
    text, starts = data.stdlib_corpus()[split], data.stdlib_document_starts()[split]
    assert starts[0] == 0 and len(text) > starts[-1]
    first = data.char_lm_window_starts(0, 3, split, B, length)
    for row in range(B):
      np.testing.assert_array_equal(text[first[row]:first[row] + length], plain["inputs"][row])
      crossing = np.isin(first[row] + 1 + np.arange(length), starts)
      np.testing.assert_array_equal(packed["weights"][row] == 0, crossing)
      np.testing.assert_array_equal(np.diff(ids[row]) > 0, crossing[:-1])
  # Rows that hold two files exist at this size (a file is about 12 kB).
  ids = np.concatenate([data.char_lm_packed_batch(0, s, data.TRAIN, B, length)["segment_ids"]
                        for s in range(8)])
  assert np.any(ids[:, -1] > 0)


def test_the_training_loop_packs(tmp_path, monkeypatch):
  """A few packed steps with a short convolution; evaluation scores in-file targets only."""
  config = train.Config(
      attention="softmax", attention_options={}, task="char_lm", seq_len=16, batch_size=8,
      num_steps=2, learning_rate=1e-2, warmup_steps=1, weight_decay=0.0, clip_norm=1.0,
      num_layers=1, model_dim=16, num_heads=2, num_kv_heads=None, dtype="float32", seed=0,
      workdir=str(tmp_path), eval_every=2, eval_batches=1, checkpoint_every=2, log_every=1,
      redraw_every=0, sample_length=4, short_conv=2, pack=True)
  read, batches = train.Trainer.batch, {}

  def batch(self, step, split):  # The batches the loop trains and evaluates on.
    batches[step, split] = read(self, step, split)
    return batches[step, split]

  monkeypatch.setattr(train.Trainer, "batch", batch)
  summary = train.train(config)
  assert np.isfinite(summary["final"]["eval_bits_per_char"])
  assert batches[0, data.TRAIN]["segment_ids"].shape == (8, 16)
