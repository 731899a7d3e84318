"""A small pre-norm Transformer built from `linattn_jax.nn` layers.

Decoder (causal; language modelling and recall) or encoder (bidirectional,
mean-pooled over the valid tokens; classification). Positions are learned
absolute embeddings added to the tokens: they work unchanged with every
variant (exact, kernel, Shen, Heinsen, sparse), in training and in decoding.

A decoder takes packed rows: with ``segment_ids`` (int ``[B, L]``, non-decreasing,
one id per document laid end to end in the row) every attention layer and short
convolution sees only its own document, and positions count from each
document's start, so a row of documents gives each document's logits alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import nn


class ShortConv(nnx.Module):
  """A causal depthwise convolution over the last ``width`` tokens (Based's short convolution).

  ``y_t = Σ_{i<width} w_i ∘ x_{t-i} + b``. With ``segment_ids`` ``[B, T]`` (packed
  rows), a tap that reaches into an earlier document is zero: ``x_{t-i}`` counts
  only where its id equals ``x_t``'s. In decoding, the last ``width - 1`` inputs
  and their ids are its cache; a step's ids (left out: the last input's) decide
  which of them it reads, so a new document starts as from an empty cache.

  Reference: Arora et al., "Simple linear attention language models balance
  the recall-throughput tradeoff" (Based), 2024.
  """

  def __init__(self, dim: int, width: int, *, dtype: Any, rngs: nnx.Rngs):
    self.width = width
    self.conv = nnx.Conv(dim, dim, (width,), padding="VALID", feature_group_count=dim,
                         dtype=dtype, rngs=rngs)
    self.cache = nnx.data(None)
    self.cache_ids = nnx.data(None)

  def init_cache(self, batch: int, dtype: Any) -> None:
    self.cache = nnx.Cache(jnp.zeros((batch, self.width - 1, self.conv.in_features), dtype))
    self.cache_ids = nnx.Cache(jnp.zeros((batch, self.width - 1), jnp.int32))

  def __call__(self, x: jax.Array, *, decode: bool,
               segment_ids: jax.Array | None = None) -> jax.Array:
    B, T, dim = x.shape
    past_len = self.width - 1
    if past_len == 0:  # Each output reads its own input only.
      return self.conv(x)
    if decode:
      past, past_ids = self.cache.get_value(), self.cache_ids.get_value()
      if segment_ids is None:  # The inputs continue the last one's document.
        segment_ids = jnp.broadcast_to(past_ids[:, -1:], (B, T))
    else:
      past = jnp.zeros((B, past_len, dim), x.dtype)
      # Zeros before the row: any id reads them as nothing.
      past_ids = None if segment_ids is None else jnp.broadcast_to(
          segment_ids[:, :1], (B, past_len))
    full = jnp.concatenate([past.astype(x.dtype), x], axis=1)  # [B, width - 1 + T, dim]
    if segment_ids is None:
      return self.conv(full)
    full_ids = jnp.concatenate([past_ids, segment_ids.astype(jnp.int32)], axis=1)
    if decode:
      self.cache.set_value(full[:, T:])
      self.cache_ids.set_value(full_ids[:, T:])
    return self._masked(full, full_ids, segment_ids)

  def _masked(self, full: jax.Array, full_ids: jax.Array, ids: jax.Array) -> jax.Array:
    """The convolution of ``full [B, width - 1 + T, dim]`` with the taps whose input
    lies in another document than the output's (``full_ids`` against ``ids [B, T]``) zeroed."""
    T = ids.shape[1]
    kernel, bias = self.conv.kernel[...], self.conv.bias[...]  # [width, 1, dim], [dim]
    full, kernel, bias = self.conv.promote_dtype((full, kernel, bias), dtype=self.conv.dtype)
    y = jnp.broadcast_to(bias[None, None], (full.shape[0], T, full.shape[2]))
    for k in range(self.width):  # Tap k reads x_{t - (width - 1 - k)}.
      same = (full_ids[:, k:k + T] == ids)[..., None]
      y = y + jnp.where(same, full[:, k:k + T] * kernel[k][None], 0)
    return y


class Block(nnx.Module):
  """``x + attn(conv(norm(x)))``, then ``x + mlp(norm(x))`` (GELU, 4x width).

  The short convolution is there when ``short_conv`` (its width) is > 0.
  """

  def __init__(self, dim: int, *, num_heads: int, num_kv_heads: int | None, attention: str,
               attention_options: dict[str, Any], dtype: Any, context_parallel: Any,
               short_conv: int, rngs: nnx.Rngs):
    self.short_conv = (ShortConv(dim, short_conv, dtype=dtype, rngs=rngs) if short_conv
                       else None)
    self.attn_norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.attn = nn.MultiHeadAttention(num_heads, dim, num_kv_heads=num_kv_heads,
                                      attention=attention, attention_options=attention_options,
                                      dtype=dtype, context_parallel=context_parallel,
                                      rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, dtype=dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

  def __call__(self, x, *, causal: bool, lengths, decode: bool, segment_ids=None):
    h = self.attn_norm(x)
    if self.short_conv is not None:
      h = self.short_conv(h, decode=decode, segment_ids=segment_ids)
    x = x + self.attn(h, is_causal=causal, decode=decode, key_value_seq_lengths=lengths,
                      segment_ids=segment_ids)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class Transformer(nnx.Module):
  """Token and position embeddings, ``num_layers`` blocks, a final norm and a head.

  ``__call__(tokens [B, L], lengths=None, segment_ids=None, position=0,
  decode=False)`` returns logits ``[B, L, vocab]`` (decoder) or ``[B, num_classes]``
  (encoder). ``position`` (an int, or ``[B]`` ints) is the position of
  ``tokens[:, 0]`` in its document (decoding). ``segment_ids`` ``[B, L]`` (decoders):
  packed rows, see the module docstring; a document that starts inside ``tokens``
  counts its positions from 0 there.
  With ``context_parallel`` (a ``linattn_jax.parallel.ContextParallel``)
  every layer's attention splits the sequence over that mesh axis; with
  ``short_conv`` > 0 (decoders), a :class:`ShortConv` of that width precedes it.
  """

  def __init__(self, *, vocab_size: int, num_classes: int | None, max_len: int, dim: int,
               num_layers: int, num_heads: int, num_kv_heads: int | None, attention: str,
               attention_options: dict[str, Any], dtype: Any, context_parallel: Any = None,
               short_conv: int = 0, rngs: nnx.Rngs):
    if short_conv and num_classes is not None:
      raise ValueError("short_conv is causal: it is for decoders, not the encoder.")
    self.causal = num_classes is None
    self.embed = nnx.Embed(vocab_size, dim, dtype=dtype, rngs=rngs)
    self.positions = nnx.Embed(max_len, dim, dtype=dtype, rngs=rngs)  # Same scale as tokens.
    self.blocks = nnx.List([
        Block(dim, num_heads=num_heads, num_kv_heads=num_kv_heads, attention=attention,
              attention_options=attention_options, dtype=dtype,
              context_parallel=context_parallel, short_conv=short_conv, rngs=rngs)
        for _ in range(num_layers)])
    self.norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(dim, num_classes or vocab_size, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, lengths: jax.Array | None = None, *,
               segment_ids: jax.Array | None = None, position: Any = 0,
               decode: bool = False) -> jax.Array:
    L = tokens.shape[1]
    if segment_ids is not None and not self.causal:
      raise ValueError("segment_ids pack documents for the decoder; the encoder pools a row.")
    x = self.embed(tokens) + self.positions(positions(L, position, segment_ids))
    for block in self.blocks:
      x = block(x, causal=self.causal, lengths=None if self.causal else lengths, decode=decode,
                segment_ids=segment_ids)
    x = self.norm(x)
    if not self.causal:  # Mean over the valid tokens.
      valid = (jnp.arange(L)[None, :] < lengths[:, None])[..., None]
      x = jnp.sum(jnp.where(valid, x, 0), axis=1) / jnp.maximum(lengths[:, None], 1).astype(x.dtype)
    return self.head(x).astype(jnp.float32)

  def init_cache(self, batch: int, max_len: int) -> None:
    """Decode caches for ``max_len`` positions in every layer."""
    for block in self.blocks:
      block.attn.init_cache((batch, max_len, self.embed.features), dtype=self.embed.dtype)
      if block.short_conv is not None:
        block.short_conv.init_cache(batch, self.embed.dtype or jnp.float32)


def positions(L: int, position: Any = 0, segment_ids: jax.Array | None = None) -> jax.Array:
  """The position of each of L tokens in its document: ``[1, L]``, or ``[B, L]`` with
  ``segment_ids [B, L]`` or a ``position`` per row ``[B]``.

  ``position``: the first token's. Without ids the tokens are one document; with them, a
  document that starts at t > 0 (its id differs from the token before) counts from 0 at t.
  """
  t = jnp.arange(L)[None]  # [1, L]
  first = jnp.reshape(jnp.asarray(position), (-1, 1))  # [1 | B, 1]
  if segment_ids is None:
    return first + t
  starts = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)  # [B, L]
  start = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)  # The latest start at or before t.
  return jnp.where(start > 0, t - start, first + t)
