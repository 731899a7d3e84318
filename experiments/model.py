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


class Block(nnx.Module):
  """``x + mix(conv(norm(x)))``, then ``x + mlp(norm(x))`` (GELU, 4x width).

  ``layer`` is ``"attention"`` (an ``nn.MultiHeadAttention`` over ``attention``) or a
  token mixer's name (``nn.token_mixer_names()``, with ``mixer_options``; decoders only).
  The short convolution (``nn.ShortConvolution`` without activation, with a bias) is there
  when ``short_conv`` (its width) is > 0.
  """

  def __init__(self, dim: int, *, num_heads: int, num_kv_heads: int | None, attention: str,
               attention_options: dict[str, Any], dtype: Any, context_parallel: Any,
               short_conv: int, rngs: nnx.Rngs, layer: str = "attention",
               mixer_options: dict[str, Any] | None = None, rwkv_index: int = 0,
               rwkv_layers: int = 1):
    self.short_conv = (nn.ShortConvolution(dim, short_conv, activation=None, use_bias=True,
                                           dtype=dtype, rngs=rngs) if short_conv else None)
    self.attn_norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    if layer == "attention":
      self.attn = nn.MultiHeadAttention(num_heads, dim, num_kv_heads=num_kv_heads,
                                        attention=attention,
                                        attention_options=attention_options, dtype=dtype,
                                        context_parallel=context_parallel, rngs=rngs)
    else:
      self.attn = nn.token_mixer(layer, dim, num_heads, layer_index=rwkv_index,
                                 num_layers=rwkv_layers, dtype=dtype, rngs=rngs,
                                 **(mixer_options or {}))
    self.mlp_norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, dtype=dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

  def __call__(self, x, *, causal: bool, lengths, decode: bool, segment_ids=None,
               v_first=None):
    """``(x, v_first)``: RWKV-7 mixers pass the first one's values on."""
    h = self.attn_norm(x)
    if self.short_conv is not None:
      h = self.short_conv(h, decode=decode, segment_ids=segment_ids)
    if isinstance(self.attn, nn.RWKV7TimeMixer):
      h, v_first = self.attn(h, v_first, decode=decode, segment_ids=segment_ids)
    elif isinstance(self.attn, nn.RecurrentMixer | nn.MambaMixer | nn.Mamba2Mixer
                    | nn.ShortConvMixer):
      h = self.attn(h, decode=decode, segment_ids=segment_ids)
    else:  # An attention layer (or one standing in for it, as experiments.model_step's).
      h = self.attn(h, is_causal=causal, decode=decode, key_value_seq_lengths=lengths,
                    segment_ids=segment_ids)
    x = x + h
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x)))), v_first


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
  ``short_conv`` > 0 (decoders), an ``nn.ShortConvolution`` of that width precedes it.
  ``layer_pattern``: what each layer mixes tokens with, cycled over the layers:
  ``"attention"`` or a token mixer's name (decoders), e.g. three ``"gated_deltanet"``
  to one ``"attention"`` (Qwen3-Next's hybrid); ``mixer_options`` go to every mixer.
  """

  def __init__(self, *, vocab_size: int, num_classes: int | None, max_len: int, dim: int,
               num_layers: int, num_heads: int, num_kv_heads: int | None, attention: str,
               attention_options: dict[str, Any], dtype: Any, context_parallel: Any = None,
               short_conv: int = 0, layer_pattern: tuple[str, ...] = ("attention",),
               mixer_options: dict[str, Any] | None = None, rngs: nnx.Rngs):
    if short_conv and num_classes is not None:
      raise ValueError("short_conv is causal: it is for decoders, not the encoder.")
    layers = [layer_pattern[i % len(layer_pattern)] for i in range(num_layers)]
    mixers = [x for x in layers if x != "attention"]
    unknown = sorted(set(mixers) - set(nn.token_mixer_names()))
    if unknown:
      raise ValueError(f"layer_pattern: {unknown} are neither 'attention' nor a token mixer "
                       f"({', '.join(nn.token_mixer_names())}).")
    if mixers and num_classes is not None:
      raise ValueError("token mixers are causal: they are for decoders, not the encoder.")
    if mixers and context_parallel is not None:
      raise ValueError("context_parallel splits attention layers; the token mixers run "
                       "whole sequences.")
    rwkv = [i for i, x in enumerate(layers) if x == "rwkv7"]
    self.causal = num_classes is None
    self.embed = nnx.Embed(vocab_size, dim, dtype=dtype, rngs=rngs)
    self.positions = nnx.Embed(max_len, dim, dtype=dtype, rngs=rngs)  # Same scale as tokens.
    self.blocks = nnx.List([
        Block(dim, num_heads=num_heads, num_kv_heads=num_kv_heads, attention=attention,
              attention_options=attention_options, dtype=dtype,
              context_parallel=context_parallel, short_conv=short_conv, rngs=rngs,
              layer=layer, mixer_options=mixer_options,
              rwkv_index=rwkv.index(i) if i in rwkv else 0, rwkv_layers=max(len(rwkv), 1))
        for i, layer in enumerate(layers)])
    self.norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(dim, num_classes or vocab_size, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, lengths: jax.Array | None = None, *,
               segment_ids: jax.Array | None = None, position: Any = 0,
               decode: bool = False) -> jax.Array:
    L = tokens.shape[1]
    if segment_ids is not None and not self.causal:
      raise ValueError("segment_ids pack documents for the decoder; the encoder pools a row.")
    x = self.embed(tokens) + self.positions(positions(L, position, segment_ids))
    v_first = None
    for block in self.blocks:
      x, v_first = block(x, causal=self.causal, lengths=None if self.causal else lengths,
                         decode=decode, segment_ids=segment_ids, v_first=v_first)
    x = self.norm(x)
    if not self.causal:  # Mean over the valid tokens.
      valid = (jnp.arange(L)[None, :] < lengths[:, None])[..., None]
      x = jnp.sum(jnp.where(valid, x, 0), axis=1) / jnp.maximum(lengths[:, None], 1).astype(x.dtype)
    return self.head(x).astype(jnp.float32)

  def init_cache(self, batch: int, max_len: int) -> None:
    """Decode caches for ``max_len`` positions in every layer."""
    for block in self.blocks:
      shape, dtype = (batch, max_len, self.embed.features), self.embed.dtype or jnp.float32
      block.attn.init_cache(shape, dtype=dtype)
      if block.short_conv is not None:
        block.short_conv.init_cache(shape, dtype)


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
