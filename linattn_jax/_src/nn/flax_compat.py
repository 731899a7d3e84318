"""Flax's calling conventions: batch dims, masks, an injected ``attention_fn`` and its decode.

``flax.nnx.MultiHeadAttention`` takes inputs with any number of leading batch
dims and masks broadcastable to ``[..., N, T, S]`` (bool or float), and calls
an ``attention_fn(query, key, value, mask=..., ...)`` on ``[..., T, N, H]``
arrays. Here are both directions: :func:`as_flax_attention_fn` makes any
linattn_jax function such an ``attention_fn``, and :func:`call_attention_fn` is
the layer calling an injected one as Flax does, decoding through the layer's
KV cache one position at a time. Letters: B batch (the batch dims flattened),
T query length, S key length, N query heads, K key/value heads, H head dim,
C a KV cache's capacity.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from linattn_jax._src.nn import cache as cache_lib


def as_flax_attention_fn(fn: Callable[..., Any]) -> Callable[..., jax.Array]:
  """Adapts a linattn_jax function to ``flax.nnx.MultiHeadAttention(attention_fn=...)``.

  Flax calls ``attention_fn(query, key, value, mask=..., dropout_rng=...,
  dropout_rate=..., broadcast_dropout=..., deterministic=..., dtype=...,
  precision=..., module=..., is_causal=...)``. ``mask`` (and ``bias``) reach
  ``fn`` if it takes them; ``dtype`` casts the inputs. What ``fn`` cannot
  honour raises: a mask or bias for a function without one, dropout on
  weights it never forms, a ``precision``, or ``sow_weights`` (``module``).

  Flax passes query ``[B, T, N, H]``, key ``[B, S, N, H]`` and value
  ``[B, S, N, H]`` and expects ``[B, T, N, H]`` back, the layout of every
  linattn_jax function.

  Args:
    fn: e.g. ``linear_attention``, or ``get_attention("local", window_size=64)``.

  Returns:
    A function with Flax's ``attention_fn`` signature.

  Raises:
    ValueError: when the returned function is called with what ``fn`` cannot
      honour (listed above), naming each.

  Examples:
    >>> attention_fn = nn.as_flax_attention_fn(la.linear_attention)
    >>> flax_layer = nnx.MultiHeadAttention(2, 16, attention_fn=attention_fn, decode=False,
    ...                                     rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 16))
    >>> flax_layer(x).shape
    (1, 8, 16)

    Same parameter names and shapes as this package's layer, so with the same
    seed the two agree:

    >>> ours = nn.MultiHeadAttention(2, 16, attention="linear_elu", rngs=nnx.Rngs(0))
    >>> bool(jnp.allclose(ours(x), flax_layer(x), atol=1e-5))
    True
  """
  takes = inspect.signature(fn).parameters

  def attention_fn(query, key, value, bias=None, mask=None, *, dropout_rng=None,
                   dropout_rate=0.0, broadcast_dropout=True, deterministic=True, dtype=None,
                   precision=None, module=None, is_causal=False, **others):
    del dropout_rng, broadcast_dropout  # Only meaningful with dropout, refused below.
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "fn")
    problems = [f"`{k}`" for k in others]
    if dropout_rate and not deterministic:
      problems.append("dropout on attention weights (they are never formed)")
    if precision is not None:
      problems.append("`precision`")
    if module is not None:
      problems.append("sow_weights (attention weights are never formed)")
    for option, value_ in (("mask", mask), ("bias", bias)):
      if value_ is not None and option not in takes:
        problems.append(f"`{option}`")
    if problems:
      raise ValueError(f"as_flax_attention_fn({name}): cannot honour {', '.join(problems)}.")
    if dtype is not None:
      query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    extra = {k: x for k, x in (("mask", mask), ("bias", bias)) if x is not None}
    return fn(query, key, value, is_causal=is_causal, **extra)

  return attention_fn


def call_attention_fn(layer: Any, q: jax.Array, k: jax.Array, v: jax.Array, *,
                      mask: Any, is_causal: bool | None, decode: bool,
                      dropout_rng: jax.Array | None, sow_weights: bool,
                      lengths: jax.Array | None, batch: tuple[int, ...]) -> jax.Array:
  """``layer.attention_fn`` on ``[*batch, T, N|K, H]`` arrays, called as Flax calls it.

  With ``decode``, the one position's key and value go into the layer's
  :class:`KVCache` (the same write as a registered variant's decode), and the
  function reads the whole cache in Flax's layout ``[*batch, C, K, H]`` with the
  positions not yet written masked.
  """
  fn = "MultiHeadAttention"
  if lengths is not None:
    raise ValueError(f"{fn}: key_value_seq_lengths reaches registered attentions only; with "
                     "attention_fn pass a mask.")
  if decode:
    cache = cache_lib.current(layer.cache)
    C = cache.key.shape[2]
    if q.shape[-3] != 1:
      raise ValueError(f"{fn}: with attention_fn, decode takes one position at a time; got "
                       f"{q.shape[-3]}.")
    k, v = flat(k, batch), flat(v, batch)
    cache_lib.check_fits(cache, k, layer.cache_batch_shape)
    cache = cache_lib.write(cache, k, v)
    layer.cache.set_value(cache)
    k, v = (cache_lib.flax_layout(x, batch).astype(q.dtype) for x in (cache.key, cache.value))
    seen = jnp.broadcast_to(jnp.arange(C) < cache.index, batch + (1, 1, C))
    mask = seen if mask is None else jnp.logical_and(mask, seen)
  return layer.attention_fn(
      q, k, v, mask=mask, dropout_rng=dropout_rng, dropout_rate=layer.dropout_rate,
      broadcast_dropout=layer.broadcast_dropout, deterministic=dropout_rng is None,
      dtype=layer.dtype, precision=layer.precision, module=layer if sow_weights else None,
      is_causal=bool(is_causal))


def flat(x: jax.Array, batch: tuple[int, ...]) -> jax.Array:
  """``[*batch, L, heads, dim]`` -> ``[B, L, heads, dim]`` (B = 1 for no batch dims)."""
  return x.reshape((math.prod(batch),) + x.shape[len(batch):])


def flat_mask(mask: Any, batch: tuple[int, ...]) -> jax.Array | None:
  """A mask broadcastable to ``[*batch, N, T, S]`` as ``[B|1, N|1, T|1, S|1]`` bool."""
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  mask = mask if mask.dtype == jnp.bool_ else mask != 0  # Flax's masks may be float.
  rank = len(batch) + 3
  if mask.ndim > rank:
    raise ValueError(f"MultiHeadAttention: mask of shape {mask.shape} has more dims than "
                     f"[..., N, T, S] for batch dims {batch}.")
  mask = mask.reshape((1,) * (rank - mask.ndim) + mask.shape)
  lead = mask.shape[:len(batch)]
  if all(d == 1 for d in lead):
    return mask.reshape((1,) + mask.shape[len(batch):])
  try:
    mask = jnp.broadcast_to(mask, batch + mask.shape[len(batch):])
  except ValueError:
    raise ValueError(f"MultiHeadAttention: mask of shape {mask.shape} does not broadcast to "
                     f"the batch dims {batch}.") from None
  return mask.reshape((math.prod(batch),) + mask.shape[len(batch):])


def flax_cache_view(field: str, doc: str) -> property:
  """A read-only property showing the layer's :class:`KVCache` ``field`` as Flax's attribute:
  ``key``/``value`` in Flax's layout ``[*batch, C, K, H]``, ``index`` as it is."""

  def view(layer: Any) -> jax.Array:
    cache = cache_lib.current(layer.cache)
    if not isinstance(cache, cache_lib.KVCache):
      raise AttributeError(f"MultiHeadAttention: attention={layer.attention!r} keeps a "
                           f"{type(cache).__name__}, not keys and values; read layer.cache.")
    x = getattr(cache, field)
    return x if field == "index" else cache_lib.flax_layout(x, layer.cache_batch_shape)

  return property(view, doc=doc)
