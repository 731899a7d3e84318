"""Attention that forms its weights: a variant's pattern and a general mask, dropout, sowing.

The layer takes this path for a variant that forms softmax weights (softmax
and the sparse patterns) when a call asks for what only explicit weights can
honour: a general ``mask``, attention dropout or ``sow_weights``. A kernel
variant's weights, for sowing only, come from its spec (:func:`implied`).
Letters: B batch, T query length, S key length, N query heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from linattn_jax._src import dense
from linattn_jax._src.registry import AttentionSpec, accepted


class Dropout(NamedTuple):
  """Attention dropout for one call: a key, the rate, and one pattern per ``[T, S]``."""

  rng: jax.Array
  rate: float
  broadcast: bool  # One pattern for every batch entry and head.


def softmax(spec: AttentionSpec, q: jax.Array, k: jax.Array, v: jax.Array, *,
            options: Mapping[str, Any], mask: jax.Array | None, is_causal: bool,
            lengths: jax.Array | None, dropout: Dropout | None = None,
            sow: Callable[[jax.Array], None] | None = None, segment_ids: Any = None) -> jax.Array:
  """Softmax attention over ``spec``'s pattern and ``mask`` on ``[B, T, N, H]`` arrays.

  ``sow`` receives the weights ``[B, N, T, S]`` (float32) before dropout.
  Without a pattern, dropout or sowing this is the variant's own function
  with the mask. ``segment_ids`` (``[B, T]`` or the pair ``([B, T], [B, S])``)
  restrict each query to its own segment's keys, as in ``softmax_attention``.
  """
  if spec.dense_mask is None and dropout is None and sow is None:
    packed = {} if segment_ids is None else {"segment_ids": segment_ids}
    return spec.function(q, k, v, mask=mask, is_causal=is_causal,
                         key_value_seq_lengths=lengths, **packed, **options)
  if spec.dense_mask is not None:
    T, S = q.shape[1], k.shape[1]
    what = accepted(spec.dense_mask, spec.what_options(options))
    pattern = jnp.asarray(spec.dense_mask(T, S, is_causal=is_causal, **what))
    pattern = pattern.reshape((1,) * (4 - pattern.ndim) + pattern.shape)  # [1, N|1, T, S]
    mask = pattern if mask is None else mask & pattern
  a = dense.prepare(q, k, v, bias=None, mask=mask, is_causal=is_causal,
                    scale=options.get("scale"), query_seq_lengths=None,
                    key_value_seq_lengths=lengths, segment_ids=segment_ids,
                    fn="MultiHeadAttention")
  w = dense.weights(a)  # [B, N, T, S] float32
  if sow is not None:
    sow(w)
  if dropout is not None:
    keep_prob = 1.0 - dropout.rate
    shape = (1, 1) + w.shape[2:] if dropout.broadcast else w.shape
    keep = jax.random.bernoulli(dropout.rng, keep_prob, shape)
    w = w * (keep.astype(w.dtype) / keep_prob)
  return dense.apply_weights(a, w)


def implied(spec: AttentionSpec, q: jax.Array, k: jax.Array, *, options: Mapping[str, Any],
            is_causal: bool, lengths: jax.Array | None, **packed: Any) -> jax.Array:
  """The normalised weights ``[B, N, T, S]`` a kernel variant implies (``spec.weights``);
  ``packed``: its ``segment_ids``, where it takes them."""
  implied_ = spec.weights(q, k, is_causal=is_causal, key_value_seq_lengths=lengths,
                          **packed, **spec.what_options(options))
  return implied_.weights / implied_.normalizer[..., None]
