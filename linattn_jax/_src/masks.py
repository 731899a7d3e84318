"""Dense boolean attention patterns (True = attend) and their index predicates.

The predicates work on broadcastable integer position arrays, so the dense
builders here and the blockwise kernels (which evaluate them one block at a
time) share one definition of every pattern.

Alignment when T != S: query i sits at key position ``i + (S - T)``
("bottom-right" alignment), so the last query lines up with the last key. This
is what a decode step against a cache needs: with T new queries and S cached
keys, query i may see keys ``0 .. i + S - T``. The alignment uses the static
lengths T and S.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax._src.checks import check_positive_int


def _positions(T: int, S: int) -> tuple[jax.Array, jax.Array]:
  return jnp.arange(T)[:, None], jnp.arange(S)[None, :]


def causal_predicate(q_pos: Any, k_pos: Any, T: int, S: int) -> jax.Array:
  """``k_pos <= q_pos + (S - T)``: the key is not in the query's future."""
  return k_pos <= q_pos + (S - T)


def local_predicate(
    q_pos: Any, k_pos: Any, T: int, S: int, left: int, right: int
) -> jax.Array:
  """Key within ``[i - left, i + right]`` of query i's aligned position."""
  rel = k_pos - (q_pos + (S - T))
  return (rel >= -left) & (rel <= right)


def length_predicate(pos: Any, lengths: jax.Array | None) -> jax.Array:
  """``pos < lengths`` per batch entry: ``[B, *pos.shape]`` (``[1, ...]`` all True if None)."""
  pos = jnp.asarray(pos)
  if lengths is None:
    return jnp.ones((1,) + pos.shape, bool)
  return pos < jnp.reshape(lengths, (-1,) + (1,) * pos.ndim)


def causal(T: int, S: int | None = None) -> jax.Array:
  """Causal mask ``[T, S]``, bottom-right aligned.

  T = S = 4::

      x . . .
      x x . .
      x x x .
      x x x x

  T = 2, S = 4 (two new queries after two cached keys)::

      x x x .
      x x x x

  Args:
    T: query length.
    S: key length; defaults to T.

  Returns:
    Boolean ``[T, S]``; entry ``[i, j]`` is ``j <= i + S - T``.
  """
  S = T if S is None else S
  q, k = _positions(T, S)
  return causal_predicate(q, k, T, S)


def padding(
    T: int,
    S: int,
    *,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
) -> jax.Array:
  """Padding mask ``[B, T, S]`` from per-example valid lengths.

  Query lengths ``[2]``, key lengths ``[3]``, T = 3, S = 4::

      x x x .
      x x x .
      . . . .

  Args:
    T: padded query length.
    S: padded key length.
    query_seq_lengths: ``[B]`` ints; query rows at or past the length see
      nothing. None means all T rows are valid.
    key_value_seq_lengths: ``[B]`` ints; keys at or past the length are
      masked. None means all S keys are valid.

  Returns:
    Boolean ``[B, T, S]``.

  Raises:
    ValueError: if both lengths are None, or they are not rank 1.
  """
  if query_seq_lengths is None and key_value_seq_lengths is None:
    raise ValueError("padding: give query_seq_lengths or key_value_seq_lengths.")
  for name, x in (("query_seq_lengths", query_seq_lengths),
                  ("key_value_seq_lengths", key_value_seq_lengths)):
    if x is not None and jnp.ndim(x) != 1:
      raise ValueError(f"padding: {name} must have shape [B]; got {jnp.shape(x)}.")
  q_ok = length_predicate(jnp.arange(T), query_seq_lengths)  # [B|1, T]
  k_ok = length_predicate(jnp.arange(S), key_value_seq_lengths)  # [B|1, S]
  return q_ok[:, :, None] & k_ok[:, None, :]


def normalize_window(window_size: Any, *, fn: str) -> tuple[int, int]:
  """``int`` or ``(left, right)`` -> ``(left, right)`` of non-negative ints."""
  pair = (window_size, window_size) if np.ndim(window_size) == 0 else window_size
  try:
    left, right = (int(w) for w in pair)
    valid = all(int(w) == w for w in pair)
  except (TypeError, ValueError):
    valid = False
  if not valid or left < 0 or right < 0:
    raise ValueError(
        f"{fn}: window_size must be a non-negative int or a (left, right) "
        f"pair of them; got {window_size!r}."
    )
  return left, right


def local(T: int, S: int, window_size: Any) -> jax.Array:
  """Sliding-window mask ``[T, S]``: query i sees keys ``i-left .. i+right``.

  ``window_size`` is an int (symmetric) or ``(left, right)``, as in
  ``jax.nn.dot_product_attention``'s ``local_window_size``. With T != S the
  window is centred on the bottom-right aligned position ``i + S - T``.
  T = S = 5, window (1, 1)::

      x x . . .
      x x x . .
      . x x x .
      . . x x x
      . . . x x
  """
  left, right = normalize_window(window_size, fn="local")
  q, k = _positions(T, S)
  return local_predicate(q, k, T, S, left, right)


def strided(T: int, S: int, stride: int, window_size: Any = None) -> jax.Array:
  """Strided ("summary column") mask ``[T, S]``: keys j with ``j % stride == 0``.

  With ``window_size`` the local window is added (logical or), the Sparse
  Transformer combination that reaches any key in two hops. T = S = 6,
  stride 3, window (1, 0)::

      x . . x . .
      x x . x . .
      x x x x . .
      x . x x . .
      x . . x x .
      x . . x x x

  Combine with :func:`causal` for the causal pattern.
  """
  stride = check_positive_int(stride, name="stride", fn="strided")
  q, k = _positions(T, S)
  out = jnp.broadcast_to(k % stride == 0, (T, S))
  if window_size is not None:
    out = out | local(T, S, window_size)
  return out


def block_sparse(layout: Any, block_size: int, T: int, S: int) -> jax.Array:
  """Expands a block layout to a dense mask ``[..., T, S]``.

  ``layout[..., a, b]`` says whether query block a attends to key block b;
  blocks are ``block_size`` long, the last one may be partial. Layout
  ``[[1, 0], [1, 1]]`` with block_size 2, T = S = 4::

      x x . .
      x x . .
      x x x x
      x x x x

  Args:
    layout: static boolean ``[ceil(T/bs), ceil(S/bs)]`` or
      ``[N, ceil(T/bs), ceil(S/bs)]`` (one per head).
    block_size: block length along both axes.
    T: query length.
    S: key length.

  Raises:
    ValueError: on a non-positive block size or a layout of the wrong shape.
  """
  block_size = check_positive_int(block_size, name="block_size", fn="block_sparse")
  layout = np.asarray(layout)
  want = (-(-T // block_size), -(-S // block_size))
  if layout.ndim not in (2, 3) or layout.shape[-2:] != want:
    raise ValueError(
        f"block_sparse: layout must have shape [{want[0]}, {want[1]}] or "
        f"[N, {want[0]}, {want[1]}] for T={T}, S={S}, block_size={block_size}; "
        f"got {layout.shape}."
    )
  dense = np.repeat(np.repeat(layout.astype(bool), block_size, -2), block_size, -1)
  return jnp.asarray(dense[..., :T, :S])
