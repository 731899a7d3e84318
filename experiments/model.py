"""A small pre-norm Transformer built from `linattn_jax.nn` layers.

Decoder (causal; language modelling and recall) or encoder (bidirectional,
mean-pooled over the valid tokens; classification). Positions are learned
absolute embeddings added to the tokens: they work unchanged with every
variant (exact, kernel, Shen, Heinsen, sparse), in training and in decoding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import nn


class ShortConv(nnx.Module):
  """A causal depthwise convolution over the last ``width`` tokens (Based's short convolution).

  ``y_t = Σ_{i<width} w_i ∘ x_{t-i} + b``. In decoding, the last ``width - 1``
  inputs are its cache.

  Reference: Arora et al., "Simple linear attention language models balance
  the recall-throughput tradeoff" (Based), 2024.
  """

  def __init__(self, dim: int, width: int, *, dtype: Any, rngs: nnx.Rngs):
    self.width = width
    self.conv = nnx.Conv(dim, dim, (width,), padding="VALID", feature_group_count=dim,
                         dtype=dtype, rngs=rngs)
    self.cache = nnx.data(None)

  def init_cache(self, batch: int, dtype: Any) -> None:
    self.cache = nnx.Cache(jnp.zeros((batch, self.width - 1, self.conv.in_features), dtype))

  def __call__(self, x: jax.Array, *, decode: bool) -> jax.Array:
    if decode:
      past = self.cache.get_value()
    else:
      past = jnp.zeros((x.shape[0], self.width - 1, x.shape[2]), x.dtype)
    full = jnp.concatenate([past.astype(x.dtype), x], axis=1)
    if decode:
      self.cache.set_value(full[:, full.shape[1] - (self.width - 1):])
    return self.conv(full)


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

  def __call__(self, x, *, causal: bool, lengths, decode: bool):
    h = self.attn_norm(x)
    if self.short_conv is not None:
      h = self.short_conv(h, decode=decode)
    x = x + self.attn(h, is_causal=causal, decode=decode, key_value_seq_lengths=lengths)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class Transformer(nnx.Module):
  """Token and position embeddings, ``num_layers`` blocks, a final norm and a head.

  ``__call__(tokens [B, L], lengths=None, position=0, decode=False)`` returns
  logits ``[B, L, vocab]`` (decoder) or ``[B, num_classes]`` (encoder).
  ``position`` is the absolute position of ``tokens[:, 0]`` (decoding).
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
               position: Any = 0, decode: bool = False) -> jax.Array:
    L = tokens.shape[1]
    x = self.embed(tokens) + self.positions(position + jnp.arange(L))[None]
    for block in self.blocks:
      x = block(x, causal=self.causal, lengths=None if self.causal else lengths, decode=decode)
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
