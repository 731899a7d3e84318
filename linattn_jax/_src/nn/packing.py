"""Packed sequences in the layer: a call's ``segment_ids``, checked and flattened.

Several documents laid end to end in one row carry int ids, non-decreasing
along the row (``[0, 0, 0, 1, 1, 2]``); query t attends key j only where
their ids are equal, so one call equals each document run alone. The layer
hands the ids to the variant's function, which must take ``segment_ids``
(:func:`takes_segment_ids`); a variant that does not is refused by name.
Letters: B batch (the batch dims flattened), T query length, S key length.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from linattn_jax._src.registry import AttentionSpec

_FN = "MultiHeadAttention"


def takes_segment_ids(fn: Callable[..., Any] | None) -> bool:
  """Whether ``fn`` takes ``segment_ids`` (a variant's function, or its implied weights)."""
  return fn is not None and "segment_ids" in inspect.signature(fn).parameters


def require(spec: AttentionSpec, what: str = "") -> None:
  """Raises a ValueError naming the variant if its function does not take ``segment_ids``."""
  if not takes_segment_ids(spec.function):
    raise ValueError(f"{_FN}: attention={spec.name!r} does not take segment_ids{what}; its "
                     "function has no packed-sequence support, so the ids cannot be honoured.")


def flatten(segment_ids: Any, *, batch: tuple[int, ...], q_len: int, kv_len: int,
            decode: bool) -> jax.Array | tuple[jax.Array, jax.Array] | None:
  """The ids of a call on inputs with batch dims ``batch``, as ``[B, T]`` int32 (or the
  pair ``([B, T], [B, S])``), after checking them.

  One int array ``[*batch, T]`` serves queries and keys (T == S: self-attention, and
  every decode call); cross-attention with ids on both sides takes the pair
  ``(query_segment_ids [*batch, T], kv_segment_ids [*batch, S])``.

  Raises:
    ValueError: for ids that are not integers, of the wrong shape, one array where
      T != S, a pair while decoding, or a tuple that is not a pair.
  """
  if segment_ids is None:
    return None
  lead = "".join(f"{d}, " for d in batch)
  if isinstance(segment_ids, tuple | list):
    if decode or len(segment_ids) != 2:
      what = "decoding takes one array [..., T]" if decode else "a pair takes two arrays"
      raise ValueError(f"{_FN}: segment_ids: {what}; got a {type(segment_ids).__name__} of "
                       f"{len(segment_ids)} items.")
    return (_flat(segment_ids[0], batch, q_len, "query_segment_ids", lead),
            _flat(segment_ids[1], batch, kv_len, "kv_segment_ids", lead))
  if q_len != kv_len:
    raise ValueError(f"{_FN}: segment_ids: queries ({q_len}) and keys ({kv_len}) differ in "
                     "length; pass the pair (query_segment_ids [..., T], kv_segment_ids "
                     "[..., S]) as a tuple.")
  return _flat(segment_ids, batch, q_len, "segment_ids", lead)


def _flat(x: Any, batch: tuple[int, ...], length: int, name: str, lead: str) -> jax.Array:
  x = jnp.asarray(x)
  if x.shape != batch + (length,):
    raise ValueError(f"{_FN}: {name} must have shape [..., L] = ({lead}{length}) for these "
                     f"inputs; got {x.shape}.")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{_FN}: {name} must be integers; got {x.dtype}.")
  return x.reshape(math.prod(batch), length).astype(jnp.int32)
