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

from linattn_jax._src.checks import check_positive_int, positive_sizes


def _positions(T: int, S: int, fn: str) -> tuple[jax.Array, jax.Array]:
  """Query positions ``[T, 1]`` and key positions ``[1, S]``, once T and S are checked."""
  T, S = positive_sizes(T=T, S=S, fn=fn)
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


def strided_predicate(q_pos: Any, k_pos: Any, T: int, S: int, stride: int,
                      window: tuple[int, int] | None) -> Any:
  """``k_pos % stride == 0`` (a summary column), or with ``window = (left, right)`` a key
  within the query's window (:func:`local_predicate`)."""
  hit = k_pos % stride == 0
  if window is not None:
    hit = hit | local_predicate(q_pos, k_pos, T, S, *window)
  return hit


def longformer_predicate(q_pos: Any, k_pos: Any, T: int, S: int, left: int, right: int,
                         global_positions: np.ndarray) -> Any:
  """A key in the query's window, a global key, or any key of a global query's row.

  ``global_positions`` are key positions (static, numpy); query i is the token
  at key position ``i + S - T``.
  """
  def is_global(pos):  # pos [...] -> [...]: one of the global positions.
    glob = np.asarray(global_positions).reshape((1,) * np.ndim(pos) + (-1,))
    return (pos[..., None] == glob).any(-1)

  return (local_predicate(q_pos, k_pos, T, S, left, right) | is_global(k_pos)
          | is_global(q_pos + (S - T)))


def length_predicate(pos: Any, lengths: jax.Array | None) -> jax.Array:
  """``pos < lengths`` per batch entry: ``[B, *pos.shape]`` (``[1, ...]`` all True if None)."""
  pos = jnp.asarray(pos)
  if lengths is None:
    return jnp.ones((1,) + pos.shape, bool)
  return pos[None] < jnp.reshape(lengths, (-1,) + (1,) * pos.ndim).astype(pos.dtype)


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

  Raises:
    ValueError: if T or S is not a positive int.

  Examples:
    >>> print(np.asarray(masks.causal(2, 4)).astype(int))
    [[1 1 1 0]
     [1 1 1 1]]
    >>> masks.causal(3).shape, masks.causal(3).dtype
    ((3, 3), dtype('bool'))
  """
  S = T if S is None else S
  q, k = _positions(T, S, "causal")
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
    ValueError: if T or S is not a positive int, both lengths are None, or
      a length is not rank 1.

  Examples:
    >>> m = masks.padding(3, 4, query_seq_lengths=jnp.array([2, 3]),
    ...                   key_value_seq_lengths=jnp.array([3, 1]))
    >>> m.shape
    (2, 3, 4)
    >>> print(np.asarray(m[0]).astype(int))
    [[1 1 1 0]
     [1 1 1 0]
     [0 0 0 0]]
  """
  if query_seq_lengths is None and key_value_seq_lengths is None:
    raise ValueError("padding: give query_seq_lengths or key_value_seq_lengths.")
  for name, x in (("query_seq_lengths", query_seq_lengths),
                  ("key_value_seq_lengths", key_value_seq_lengths)):
    if x is not None and jnp.ndim(x) != 1:
      raise ValueError(f"padding: {name} must have shape [B]; got {jnp.shape(x)}.")
  T, S = positive_sizes(T=T, S=S, fn="padding")
  q_ok = length_predicate(jnp.arange(T), query_seq_lengths)  # [B|1, T]
  k_ok = length_predicate(jnp.arange(S), key_value_seq_lengths)  # [B|1, S]
  return q_ok[:, :, None] & k_ok[:, None, :]


def normalize_window(window_size: Any, *, fn: str, name: str = "window_size") -> tuple[int, int]:
  """``int`` or ``(left, right)`` -> ``(left, right)`` of non-negative ints."""
  pair = (window_size, window_size) if np.ndim(window_size) == 0 else window_size
  try:
    left, right = (int(w) for w in pair)
    valid = all(int(w) == w for w in pair)
  except (TypeError, ValueError):
    valid = False
  if not valid or left < 0 or right < 0:
    raise ValueError(
        f"{fn}: {name} must be a non-negative int or a (left, right) "
        f"pair of them; got {window_size!r}."
    )
  return left, right


def local(T: int, S: int, window_size: Any) -> jax.Array:
  """Sliding-window mask ``[T, S]``: query i sees keys ``i-left`` to ``i+right``.

  ``window_size`` is an int (symmetric) or ``(left, right)``, as in
  ``jax.nn.dot_product_attention``'s ``local_window_size``. With T != S the
  window is centred on the bottom-right aligned position ``i + S - T``.
  T = S = 5, window (1, 1)::

      x x . . .
      x x x . .
      . x x x .
      . . x x x
      . . . x x

  Entry ``[i, j]`` is ``-left <= j - (i + S - T) <= right``.

  Args:
    T: query length.
    S: key length.
    window_size: int or ``(left, right)`` of non-negative ints.

  Returns:
    Boolean ``[T, S]``.

  Raises:
    ValueError: if T or S is not a positive int, for a negative window, or
      one that is not an int or a pair of ints.

  Examples:
    >>> print(np.asarray(masks.local(3, 5, (1, 0))).astype(int))
    [[0 1 1 0 0]
     [0 0 1 1 0]
     [0 0 0 1 1]]

  References:
    Beltagy et al., "Longformer: The Long-Document Transformer", 2020 (sliding window).
  """
  left, right = normalize_window(window_size, fn="local")
  q, k = _positions(T, S, "local")
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

  Entry ``[i, j]`` is ``j % stride == 0`` (or ``j`` in the window of i).

  Args:
    T: query length.
    S: key length.
    stride: distance between summary columns, a positive int.
    window_size: optional int or ``(left, right)`` local window.

  Returns:
    Boolean ``[T, S]``.

  Raises:
    ValueError: if T, S or ``stride`` is not a positive int, or for a
      negative or malformed window.

  Examples:
    >>> m = masks.strided(6, 6, 3, (1, 0)) & masks.causal(6)
    >>> print(np.asarray(m).astype(int))
    [[1 0 0 0 0 0]
     [1 1 0 0 0 0]
     [1 1 1 0 0 0]
     [1 0 1 1 0 0]
     [1 0 0 1 1 0]
     [1 0 0 1 1 1]]

  References:
    Child et al., "Generating Long Sequences with Sparse Transformers", 2019.
  """
  stride = check_positive_int(stride, name="stride", fn="strided")
  window = None if window_size is None else normalize_window(window_size, fn="strided")
  q, k = _positions(T, S, "strided")
  return jnp.broadcast_to(strided_predicate(q, k, T, S, stride, window), (T, S))


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

  Returns:
    Boolean ``[T, S]`` (or ``[N, T, S]`` for a per-head layout); entry
    ``[i, j]`` is ``layout[i // block_size, j // block_size]``.

  Raises:
    ValueError: if T, S or the block size is not a positive int, or on a
      layout of the wrong shape.

  Examples:
    >>> print(np.asarray(masks.block_sparse([[1, 0], [1, 1]], 2, 3, 4)).astype(int))
    [[1 1 0 0]
     [1 1 0 0]
     [1 1 1 1]]

  References:
    Child et al., "Generating Long Sequences with Sparse Transformers", 2019.
  """
  block_size = check_positive_int(block_size, name="block_size", fn="block_sparse")
  T, S = positive_sizes(T=T, S=S, fn="block_sparse")
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


def check_global_positions(positions: Any, S: int, fn: str) -> np.ndarray:
  """Sorted unique global key positions, each an int in ``[0, S)``; else ValueError."""
  pos = np.asarray(positions, dtype=np.int64).reshape(-1) if np.size(positions) else np.zeros(
      0, np.int64)
  if not np.all(np.equal(np.asarray(positions).reshape(-1), pos)) or np.any(pos < 0) or np.any(
      pos >= S):
    raise ValueError(f"{fn}: global_positions must be ints in [0, S={S}); got {positions!r}.")
  return np.unique(pos)


def longformer(T: int, S: int, window_size: Any, global_positions: Any) -> jax.Array:
  """Longformer mask ``[T, S]``: a local window plus global tokens.

  Global positions are key positions; the token at key p is query row
  ``p - (S - T)``. Its row sees every key and its column is seen by every
  query. T = S = 5, window (1, 0), global position 0::

      x x x x x
      x x . . .
      x x x . .
      x . x x .
      x . . x x

  Args:
    T: query length.
    S: key length.
    window_size: int or ``(left, right)``, as in :func:`local`.
    global_positions: key positions of the global tokens (ints).

  Returns:
    Boolean ``[T, S]``: ``local(T, S, window_size)``, or a global key
    column, or a global query row.

  Raises:
    ValueError: if T or S is not a positive int, for a negative or
      malformed window, or a global position that is not an int in ``[0, S)``.

  Examples:
    >>> print(np.asarray(masks.longformer(5, 5, (1, 0), [2])).astype(int))
    [[1 0 1 0 0]
     [1 1 1 0 0]
     [1 1 1 1 1]
     [0 0 1 1 0]
     [0 0 1 1 1]]

  References:
    Beltagy et al., "Longformer: The Long-Document Transformer", 2020.
  """
  left, right = normalize_window(window_size, fn="longformer")
  q, k = _positions(T, S, "longformer")
  glob = check_global_positions(global_positions, S, "longformer")
  return longformer_predicate(q, k, T, S, left, right, glob)


def _seed(rng: Any, fn: str) -> np.random.Generator:
  """A numpy Generator from an int seed or a concrete jax PRNG key."""
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
    return np.random.default_rng(int(rng))
  if isinstance(rng, jax.core.Tracer):
    raise ValueError(
        f"{fn}: rng must be static (an int seed or a concrete key): the pattern decides "
        "which blocks are gathered at trace time. Got a traced value.")
  try:
    data = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    return np.random.default_rng(np.asarray(data, np.uint32).reshape(-1).tolist())
  except (AttributeError, TypeError, ValueError) as e:
    raise ValueError(f"{fn}: rng must be an int seed or a jax PRNG key; got {rng!r}.") from e


def bigbird_layout(
    num_blocks: int,
    *,
    num_window_blocks: int = 3,
    num_global_blocks: int = 2,
    num_random_blocks: int = 3,
    rng: Any = 0,
    is_causal: bool = False,
) -> np.ndarray:
  """BigBird block layout ``[nb, nb]`` (numpy bool, static).

  Query block a attends to: the first ``num_global_blocks`` blocks (global
  columns); blocks ``a - w//2 .. a + (w-1)//2`` for a window of w blocks
  (``a - w + 1 .. a`` when causal); ``num_random_blocks`` other blocks drawn
  without replacement from ``rng`` (from the past only when causal). The
  global blocks' rows attend to everything (the past, when causal).
  nb = 6, w = 3, g = 1, r = 1 (random blocks marked r)::

      x x x x x x
      x x x . r .
      x x x x . r
      x r x x x .
      x . r x x x
      x . . r x x

  Args:
    num_blocks: nb, the number of blocks per axis (a positive int).
    num_window_blocks: w, blocks in the sliding window.
    num_global_blocks: g, leading global blocks.
    num_random_blocks: r, random blocks per non-global row.
    rng: an int seed or a concrete ``jax.random`` key (the same rng gives
      the same layout).
    is_causal: keep only blocks ``b <= a``.

  Returns:
    A numpy bool ``[nb, nb]`` layout: ``block_sparse(layout, bs, T, T)``
    expands it to the ``[T, T]`` mask of ``T = nb·bs`` tokens (see :func:`bigbird`).

  Raises:
    ValueError: for a ``num_blocks`` that is not a positive int, a block
      count that is not a non-negative int, or an ``rng`` that is traced or
      neither an int seed nor a PRNG key.

  Examples:
    >>> layout = masks.bigbird_layout(4, num_window_blocks=1, num_global_blocks=1,
    ...                               num_random_blocks=0)
    >>> print(layout.astype(int))
    [[1 1 1 1]
     [1 1 0 0]
     [1 0 1 0]
     [1 0 0 1]]

  References:
    Zaheer et al., "Big Bird: Transformers for Longer Sequences", 2020.
  """
  return bigbird_blocks(num_blocks, num_window_blocks=num_window_blocks,
                        num_global_blocks=num_global_blocks,
                        num_random_blocks=num_random_blocks, rng=rng, is_causal=is_causal,
                        fn="bigbird_layout")


def bigbird_blocks(num_blocks: int, *, num_window_blocks: int, num_global_blocks: int,
                   num_random_blocks: int, rng: Any, is_causal: bool, fn: str) -> np.ndarray:
  """:func:`bigbird_layout`, its errors naming ``fn`` (the public function called)."""
  for name, n in (("num_window_blocks", num_window_blocks),
                  ("num_global_blocks", num_global_blocks),
                  ("num_random_blocks", num_random_blocks)):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
      raise ValueError(f"{fn}: {name} must be a non-negative int; got {n!r}.")
  gen = _seed(rng, fn)
  nb = check_positive_int(num_blocks, name="num_blocks", fn=fn)
  g = min(num_global_blocks, nb)
  a = np.arange(nb)[:, None]
  b = np.arange(nb)[None, :]
  w = num_window_blocks
  window = (b > a - w) & (b <= a) if is_causal else (b >= a - w // 2) & (b <= a + (w - 1) // 2)
  layout = window & (w > 0) | (b < g) | (a < g)
  for row in range(g, nb):
    free = np.flatnonzero(~layout[row] & ((np.arange(nb) < row) if is_causal else True))
    picks = gen.choice(free, size=min(num_random_blocks, free.size), replace=False)
    layout[row, picks] = True
  if is_causal:
    layout &= b <= a
  return layout


def bigbird(
    T: int,
    S: int,
    block_size: int,
    *,
    num_window_blocks: int = 3,
    num_global_blocks: int = 2,
    num_random_blocks: int = 3,
    rng: Any = 0,
    is_causal: bool = False,
) -> jax.Array:
  """BigBird mask ``[T, S]``: :func:`bigbird_layout` expanded to tokens.

  Blocks live on one grid of ``U = max(T, S)`` positions, bottom-right
  aligned: query i sits at ``U - T + i``, key j at ``U - S + j``. The same
  ``rng`` gives the same pattern as ``bigbird_attention``. Combine with
  :func:`causal` (or ``is_causal=True`` in the attention call) for the
  element-level causal rule inside diagonal blocks.

  Args:
    T: query length.
    S: key length.
    block_size: block length on both axes (a positive int).
    num_window_blocks, num_global_blocks, num_random_blocks, rng, is_causal:
      as in :func:`bigbird_layout`.

  Returns:
    Boolean ``[T, S]``.

  Raises:
    ValueError: if T, S or ``block_size`` is not a positive int, and as
      :func:`bigbird_layout`.

  Examples:
    >>> m = masks.bigbird(6, 6, 2, num_window_blocks=1, num_global_blocks=1,
    ...                   num_random_blocks=0)
    >>> print(np.asarray(m).astype(int))
    [[1 1 1 1 1 1]
     [1 1 1 1 1 1]
     [1 1 1 1 0 0]
     [1 1 1 1 0 0]
     [1 1 0 0 1 1]
     [1 1 0 0 1 1]]

  References:
    Zaheer et al., "Big Bird: Transformers for Longer Sequences", 2020.
  """
  bs = check_positive_int(block_size, name="block_size", fn="bigbird")
  U = max(positive_sizes(T=T, S=S, fn="bigbird"))
  layout = bigbird_blocks(-(-U // bs), num_window_blocks=num_window_blocks,
                          num_global_blocks=num_global_blocks,
                          num_random_blocks=num_random_blocks, rng=rng, is_causal=is_causal,
                          fn="bigbird")
  return block_sparse(layout, bs, U, U)[U - T:, U - S:]
