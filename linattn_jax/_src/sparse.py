"""Sparse and structured softmax attention whose cost follows the pattern.

Each function is exact softmax attention restricted to a pattern (True =
attend), with two implementations:

- ``"reference"``: ``softmax_attention_reference`` with the dense mask from
  ``linattn_jax.masks`` (the oracle; O(T·S));
- ``"blocked"`` (the default): query rows are taken a block at a time and
  each block gathers only the keys its pattern can reach (see ``gather``),
  so cost and memory are O(T·L) for L gathered keys per block.

Rows that reach global tokens (Longformer, BigBird) are computed in a second
pass over all keys and written over the tiled result. Causal alignment for
T != S is bottom-right (query i sits at key position ``i + S - T``).

Packed sequences (``segment_ids``, as in ``softmax_attention``): query t sees key
j only if the pattern allows (t, j) and both lie in one segment (and the causal
rule and key lengths allow it). Patterns stay tied to the absolute positions of
the packed call: a window is cut at a segment boundary, strided's summary
columns, the block grids and the global and random positions stay where they
are, and each is seen only from its own segment. Both implementations apply the
rule: the oracle as one more dense mask, ``blocked`` on its gathered keys (the
ids are read at the same positions), so packing adds a comparison per score.

Letters: B batch, T query length, S key length, N query heads, K key/value
heads, H query/key head dim, D value head dim.

References:
  Child et al., "Generating Long Sequences with Sparse Transformers", 2019.
  Beltagy et al., "Longformer: The Long-Document Transformer", 2020.
  Zaheer et al., "Big Bird: Transformers for Longer Sequences", 2020.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from linattn_jax._src import checks, dense
from linattn_jax._src import masks as masks_lib
from linattn_jax._src.dense import softmax_attention_reference
from linattn_jax._src.gather import Plan, RowKeys, attend, block_table, dedupe, tile_rows
from linattn_jax._src.registry import AttentionSpec, StreamingSpec, accepted, register_attention

SparseImplementation = Literal["reference", "blocked"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(SparseImplementation)
DEFAULT_BLOCK_SIZE = 64

PatternRule = Callable[[np.ndarray, np.ndarray], np.ndarray]
# Decreasing ids are caught while they are concrete (an eager call), before tracing.
_SEGMENT_ORDER = {"segment_ids": checks.check_segment_order}


class _Pass(NamedTuple):
  """One gathered pass: its plan and the element rule inside gathered keys."""

  plan: Plan
  rule: PatternRule | None = None


class _Pattern(NamedTuple):
  """A sparse pattern for one (T, S): its dense twin and its gathered passes.

  Each pass computes the rows its plan lists; a later pass replaces rows an
  earlier one computed (e.g. global tokens over the windowed rows).
  """

  dense: Callable[[], jax.Array]  # The dense twin [T, S] or [N, T, S] (reference only).
  passes: tuple[_Pass, ...]


def _run(fn: str, query, key, value, *, implementation, is_causal, scale,
         key_value_seq_lengths, segment_ids,
         pattern: Callable[[int, int], _Pattern]) -> jax.Array:
  """Validates, builds the pattern for the static (T, S) and dispatches."""
  checks.check_choice(implementation, name="implementation",
                      choices=(None,) + IMPLEMENTATIONS, fn=fn)
  p = checks.prepare_qkv(query, key, value, fn=fn)
  kv_len = checks.check_lengths(
      p, fn=fn, key_value_seq_lengths=key_value_seq_lengths)["key_value_seq_lengths"]
  segments = checks.check_segment_ids(segment_ids, p, fn=fn)
  B, T, S, N, H, D = p.dims.B, p.dims.T, p.dims.S, p.dims.N, p.dims.H, p.dims.D
  pat = pattern(T, S)
  if implementation == "reference":
    dense = jnp.asarray(pat.dense())
    out = softmax_attention_reference(
        p.query, p.key, p.value, mask=dense if dense.ndim == 2 else dense[None],
        is_causal=is_causal, scale=scale, key_value_seq_lengths=kv_len, segment_ids=segments)
    return p.restore(out)
  scale = checks.resolve_scale(scale, H)
  out = jnp.zeros((B, T, N, D), checks.accumulation_dtype(p.query.dtype))
  for ps in pat.passes:
    rows = ps.plan.rows.reshape(-1)
    keep = rows < T
    new = attend(p.query, p.key, p.value, ps.plan, dims=p.dims, scale=scale,
                 is_causal=is_causal, key_value_seq_lengths=kv_len, pattern=ps.rule,
                 segment_ids=segments)
    if np.array_equal(rows[:T], np.arange(T)) and not keep[T:].any():  # Rows in order.
      out = new.reshape(B, -1, N, D)[:, :T]
    else:
      out = out.at[:, rows[keep]].set(new.reshape(B, -1, N, D)[:, keep])
  return p.restore(out.astype(p.query.dtype))


def _all_keys(rows: np.ndarray, S: int) -> Plan:
  """A plan in which the given rows ``[1, Q]`` see every key."""
  keys = np.arange(S)[None, None]
  return Plan(rows, keys, np.ones(keys.shape, bool))


# The query block of the windowed patterns (local, longformer) when none is given: the
# window's width left + right, within these bounds. Each block reads Q + left + right keys,
# so a larger block wastes more of its scores but makes fewer, larger products, which run
# faster on CPU (docs/benchmarks.md#block-size-of-local-and-longformer); GPU and TPU take
# the same rule.
_WINDOW_BLOCK_BOUNDS = (64, 256)


def _block(block_size: Any, T: int, fn: str) -> int:
  """The query block Q: ``block_size`` (checked), at most T."""
  return min(checks.check_positive_int(block_size, name="block_size", fn=fn), T)


def _window_block(block_size: Any, T: int, left: int, right: int, fn: str) -> int:
  """A windowed pattern's query block: ``block_size``, or for None the window's width
  ``left + right`` within ``_WINDOW_BLOCK_BOUNDS``."""
  if block_size is None:
    low, high = _WINDOW_BLOCK_BOUNDS
    block_size = min(max(left + right, low), high)
  return _block(block_size, T, fn)


def _window_pass(T: int, S: int, Q: int, left: int, right: int) -> tuple[np.ndarray, np.ndarray]:
  """Rows ``[R, Q]`` and the key range ``[R, Q + left + right]`` each block's window spans."""
  rows = tile_rows(T, Q)
  start = rows[:, :1] + (S - T) - left
  return rows, start + np.arange(Q + left + right)[None, :]


# --------------------------------------------------------------- local ---


@checks.compiled("window_size", "is_causal", "scale", "implementation", "block_size",
                 "return_state", concrete_checks=_SEGMENT_ORDER)
def local_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    window_size: Any,
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    return_state: bool = False,
    implementation: SparseImplementation | None = None,
    block_size: int | None = None,
) -> jax.Array | tuple[jax.Array, LocalState]:
  """Sliding-window softmax attention in O(T·w).

  ``out_i = Σ_j softmax_j(q_i·k_j·scale) v_j`` over the keys
  ``j = i' - left .. i' + right`` with ``i' = i + S - T`` (positions aligned
  bottom-right when T != S), as ``jax.nn.dot_product_attention``'s
  ``local_window_size``; with ``is_causal`` the right side is 0. Equals
  ``softmax_attention(..., mask=masks.local(T, S, window_size))``.

  Args:
    query: ``[B, T, N, H]``; key ``[B, S, K, H]``; value ``[B, S, K, D]``;
      K must divide N (GQA / MQA). Unbatched rank-3 inputs are accepted.
    window_size: int (symmetric) or ``(left, right)``, non-negative.
    scale: logit scale, default ``1 / sqrt(H)``.
    is_causal: drop keys after the query (right side 0).
    key_value_seq_lengths: optional ``[B]`` ints; later keys are masked.
    segment_ids: packed sequences, as in :func:`softmax_attention`: int ids that do not
      decrease along the sequence, one array ``[B, T]`` (``[T]`` unbatched) when T == S,
      else the pair ``(query_segment_ids [B, T], kv_segment_ids [B, S])``. Query i sees
      key j only if j is in its window and ``q_ids[b, i] == kv_ids[b, j]``: a window
      near a boundary is cut there and sees fewer keys (a query whose window holds no
      key of its segment, possible with T != S, returns zeros). The window is relative
      to the query, so with T == S one packed call equals each segment run alone.
      Shapes and dtype are checked when traced, non-decreasing ids only eagerly.
    return_state: also return the :class:`LocalState` after the S keys (the
      last ``left + 1`` keys and values), from which
      :func:`local_attention_step` decodes on (causal only; every key counts,
      so not with ``key_value_seq_lengths`` or ``segment_ids``).
    implementation: ``"blocked"`` (default) or ``"reference"``.
    block_size: query rows per gathered block; each block gathers
      ``block_size + left + right`` keys. Default: the window's width
      ``left + right`` within [64, 256] (fewer, larger products; measured on CPU).

  Returns:
    ``[B, T, N, D]`` in the input dtype; rows with no visible key are zero.
    With ``return_state``, ``(out, state)``.

  Raises:
    ValueError: negative or malformed windows, bad block sizes, bad shapes,
      dtypes or lengths, malformed (or, eagerly, decreasing) ``segment_ids``, an
      unknown implementation, ``return_state`` without ``is_causal`` or with
      ``key_value_seq_lengths`` or ``segment_ids``.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N, H]
    >>> out = la.local_attention(x, x, x, window_size=(2, 1), block_size=4)
    >>> out.shape
    (1, 8, 2, 4)
    >>> dense = la.softmax_attention(x, x, x, mask=masks.local(8, 8, (2, 1)))
    >>> bool(jnp.allclose(out, dense, atol=1e-5))
    True

    Two packed sequences of 3 and 5 tokens: the second one's windows stop at its start.

    >>> ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    >>> packed = la.local_attention(x, x, x, window_size=(2, 1), segment_ids=ids)
    >>> alone = la.local_attention(x[:, 3:], x[:, 3:], x[:, 3:], window_size=(2, 1))
    >>> bool(jnp.allclose(packed[:, 3:], alone, atol=1e-5))
    True

  References:
    Beltagy et al., "Longformer: The Long-Document Transformer", 2020 (sliding window).
  """
  fn = "local_attention"
  left, right = masks_lib.normalize_window(window_size, fn=fn)
  right = 0 if is_causal else right
  if return_state and (not is_causal or key_value_seq_lengths is not None):
    raise ValueError(
        f"{fn}: return_state needs is_causal=True and no key_value_seq_lengths (the state is "
        "the decoding window after all S keys).")
  if return_state and segment_ids is not None:
    raise ValueError(
        f"{fn}: return_state does not support segment_ids: the decoding window holds no "
        "segment ids, so a step after a packed prefill would see the earlier segments' keys; "
        "prefill the sequence to decode on alone.")

  def pattern(T: int, S: int) -> _Pattern:
    rows, keys = _window_pass(T, S, _window_block(block_size, T, left, right, fn), left, right)
    plan = Plan(rows, keys[None], dedupe(keys[None], np.ones(keys[None].shape, bool), S))
    rule = lambda q, k: masks_lib.local_predicate(q, k, T, S, left, right)  # noqa: E731
    return _Pattern(lambda: masks_lib.local(T, S, (left, right)), (_Pass(plan, rule),))

  out = _run(fn, query, key, value, implementation=implementation, is_causal=is_causal,
             scale=scale, key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
             pattern=pattern)
  return (out, _window_state(key, value, left)) if return_state else out


def _window_state(key: Any, value: Any, left: int) -> LocalState:
  """The ring buffer after keys 0..S-1: slot s holds the last position p < S with p % W = s."""
  key, value = jnp.asarray(key), jnp.asarray(value)
  batched = key.ndim == 4
  key, value = (x if batched else x[None] for x in (key, value))
  S, W = key.shape[1], left + 1
  positions = S - 1 - (S - 1 - np.arange(W)) % W
  filled = (positions >= 0)[None, :, None, None]
  keys, values = (jnp.where(filled, x[:, np.maximum(positions, 0)], 0) for x in (key, value))
  if not batched:
    keys, values = keys[0], values[0]
  return LocalState(keys, values, jnp.asarray(S, jnp.int32))


class LocalState(NamedTuple):
  """Decoding state of causal :func:`local_attention`: the last W = left + 1 keys and values.

  A ring buffer: position p is kept in slot ``p % W``, so the memory is
  ``W·K·(H + D)`` per example whatever the position. Unbatched states drop B.

  Attributes:
    keys: ``[B, W, K, H]`` in the input dtype; slot ``p % W`` holds position p.
    values: ``[B, W, K, D]`` in the input dtype.
    position: ``[]`` int32: the tokens seen so far.

  Examples:
    >>> x = jnp.ones((1, 7, 2, 4))  # [B, S, K, H]
    >>> _, state = la.local_attention(x, x, x, window_size=(3, 0), is_causal=True,
    ...                               return_state=True)
    >>> state.keys.shape, state.values.shape, int(state.position)
    ((1, 4, 2, 4), (1, 4, 2, 4), 7)
  """

  keys: jax.Array  # [B, W, K, H] input dtype; slot p % W holds position p.
  values: jax.Array  # [B, W, K, D] input dtype.
  position: jax.Array  # [] int32: tokens seen so far.


def init_local_state(batch: int, num_kv_heads: int, head_dim: int, value_dim: int,
                     dtype: Any = jnp.float32, *, window_size: Any) -> LocalState:
  """Empty :class:`LocalState` for causal :func:`local_attention_step`.

  Zeros ``keys [B, W, K, H]`` and ``values [B, W, K, D]`` with W = left + 1,
  and ``position = 0``. Only the left window matters for causal decoding:
  memory is ``(left + 1)·K·(H + D)`` per example, whatever the position.

  Args:
    batch: B.
    num_kv_heads: K.
    head_dim: H.
    value_dim: D.
    dtype: the dtype of the cached keys and values (that of the inputs).
    window_size: int or ``(left, right)``, as in :func:`local_attention`
      (``right`` is ignored: decoding is causal).

  Returns:
    A :class:`LocalState`.

  Raises:
    ValueError: for a negative or malformed ``window_size``, or a size that
      is not a positive int.

  Examples:
    >>> state = la.init_local_state(1, num_kv_heads=2, head_dim=4, value_dim=5, window_size=(3, 0))
    >>> state.keys.shape, state.values.shape, int(state.position)
    ((1, 4, 2, 4), (1, 4, 2, 5), 0)
  """
  left, _ = masks_lib.normalize_window(window_size, fn="init_local_state")
  B, K, H, D = checks.positive_sizes(
      batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, value_dim=value_dim,
      fn="init_local_state")
  W = left + 1
  return LocalState(jnp.zeros((B, W, K, H), dtype), jnp.zeros((B, W, K, D), dtype),
                    jnp.zeros((), jnp.int32))


def local_attention_step(state: LocalState, query: jax.Array, key: jax.Array, value: jax.Array,
                         *, scale: float | None = None) -> tuple[LocalState, jax.Array]:
  """One causal decoding step of :func:`local_attention`.

  Writes the new key/value into slot ``position % W`` and attends over the
  filled slots, i.e. positions ``position - left .. position``.

  ``out = Σ_j softmax_j(q·k_j·scale) v_j`` over the (at most ``left + 1``)
  keys in the buffer, this one included. Scanned over T tokens from
  :func:`init_local_state` it equals ``local_attention(..., is_causal=True)``.

  Args:
    state: a :class:`LocalState` ``[B, W, K, H]`` / ``[B, W, K, D]``, from
      :func:`init_local_state`, a previous step, or ``local_attention(...,
      return_state=True)``.
    query: ``[B, N, H]``; key ``[B, K, H]``; value ``[B, K, D]`` (or
      unbatched ``[N, H]``, ``[K, H]``, ``[K, D]`` with an unbatched state,
      as ``local_attention`` returns for unbatched inputs).
    scale: logit scale, default ``1 / sqrt(H)``.

  Returns:
    ``(state, out)`` with ``out`` ``[B, N, D]`` (``[N, D]`` unbatched) in the
    query dtype.

  Raises:
    ValueError: if query, key and value do not all have the state's rank
      minus one, or the shapes do not match the state's B, K, H and D (or
      K does not divide N).

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> def step(state, x_t):
    ...   return la.local_attention_step(state, x_t, x_t, x_t)
    >>> empty = la.init_local_state(1, 2, 4, 4, window_size=(2, 0))
    >>> state, outs = jax.lax.scan(step, empty, x.swapaxes(0, 1))
    >>> full = la.local_attention(x, x, x, window_size=(2, 0), is_causal=True)
    >>> bool(jnp.allclose(outs.swapaxes(0, 1), full, atol=1e-5))
    True

  References:
    Beltagy et al., "Longformer: The Long-Document Transformer", 2020 (sliding window).
  """
  fn = "local_attention_step"
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  batched = state.keys.ndim == 4
  if not batched and state.keys.ndim == 3 and query.ndim == key.ndim == value.ndim == 2:
    state = LocalState(state.keys[None], state.values[None], state.position)  # Add B = 1.
    query, key, value = query[None], key[None], value[None]
  B, W, K, H = state.keys.shape if state.keys.ndim == 4 else (None,) * 4
  D = state.values.shape[-1]
  if B is None or key.shape != (B, K, H) or value.shape != (B, K, D) or query.ndim != 3 or (
      query.shape[0] != B or query.shape[2] != H or query.shape[1] % K):
    raise ValueError(
        f"{fn}: expected query [B, N, H], key [B, K, H] and value [B, K, D] matching the "
        f"state's keys [B, W, K, H] {state.keys.shape} and values {state.values.shape}, with K "
        f"dividing N (no B when the state has none); got query {query.shape}, key {key.shape}, "
        f"value {value.shape}.")
  slot = state.position % W
  keys = jax.lax.dynamic_update_index_in_dim(state.keys, key.astype(state.keys.dtype), slot, 1)
  values = jax.lax.dynamic_update_index_in_dim(state.values, value.astype(state.values.dtype),
                                               slot, 1)
  filled = jnp.arange(W) <= state.position  # Slots written so far.
  # The production dense path (jax.nn's XLA attention); oracles are for tests only.
  a = dense.prepare(query[:, None], keys, values, bias=None, mask=filled[None, None, None, :],
                    is_causal=False, scale=scale, query_seq_lengths=None,
                    key_value_seq_lengths=None, fn=fn)
  out = dense.xla(a)  # [B, 1, N, D]
  if not batched:
    return LocalState(keys[0], values[0], state.position + 1), out[0, 0]
  return LocalState(keys, values, state.position + 1), out[:, 0]


# ------------------------------------------------------------- strided ---


@checks.compiled("stride", "window_size", "is_causal", "scale", "implementation", "block_size",
                 concrete_checks=_SEGMENT_ORDER)
def strided_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    stride: int,
    window_size: Any = None,
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    implementation: SparseImplementation | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> jax.Array:
  """Strided ("summary column") attention plus an optional local window.

  ``out_i = Σ_j softmax_j(q_i·k_j·scale) v_j`` over the keys j with
  ``j % stride == 0``, plus keys in query i's window when ``window_size`` is
  given: the Sparse Transformer combination in which any key is two hops
  away. Cost O(T·(S / stride + w)). Equals
  ``softmax_attention(..., mask=masks.strided(T, S, stride, window_size))``.

  Args:
    query: ``[B, T, N, H]``; key ``[B, S, K, H]``; value ``[B, S, K, D]``.
    stride: distance between summary columns, >= 1.
    window_size: optional int or ``(left, right)`` local window.
    segment_ids: packed sequences (forms as in :func:`local_attention`): query i sees
      key j only if the pattern above allows it and both lie in one segment. The
      summary columns stay at the positions ``j % stride == 0`` of the packed call, so
      a segment sees the columns that fall inside it, counted from the call's start,
      not from its own (it equals the segment run alone only when it starts at a
      multiple of ``stride``); a window is cut at the segment's boundary.
    (Others as :func:`local_attention`.)

  Returns:
    ``[B, T, N, D]`` in the input dtype; rows with no visible key are zero.

  Raises:
    ValueError: for a ``stride`` or ``block_size`` that is not a positive
      int, a negative or malformed window, bad shapes, dtypes or lengths,
      malformed (or, eagerly, decreasing) ``segment_ids``, or an unknown
      implementation.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> out = la.strided_attention(x, x, x, stride=3, window_size=(1, 0), is_causal=True)
    >>> mask = masks.strided(8, 8, 3, (1, 0))
    >>> dense = la.softmax_attention(x, x, x, mask=mask, is_causal=True)
    >>> out.shape, bool(jnp.allclose(out, dense, atol=1e-5))
    ((1, 8, 2, 4), True)

  References:
    Child et al., "Generating Long Sequences with Sparse Transformers", 2019.
  """
  fn = "strided_attention"
  stride = checks.check_positive_int(stride, name="stride", fn=fn)
  window = None if window_size is None else masks_lib.normalize_window(window_size, fn=fn)
  left, right = window or (0, 0)

  def pattern(T: int, S: int) -> _Pattern:
    Q = _block(block_size, T, fn)
    summary = np.arange(0, S, stride)
    if window_size is None:
      rows = tile_rows(T, Q)
      keys = np.broadcast_to(summary, (rows.shape[0], summary.size))
    else:
      rows, spans = _window_pass(T, S, Q, left, right)
      keys = np.concatenate([spans, np.broadcast_to(summary, (rows.shape[0], summary.size))], 1)
    keys = keys[None]
    plan = Plan(rows, keys, dedupe(keys, np.ones(keys.shape, bool), S))
    rule = lambda q, k: masks_lib.strided_predicate(q, k, T, S, stride, window)  # noqa: E731
    return _Pattern(lambda: masks_lib.strided(T, S, stride, window_size), (_Pass(plan, rule),))

  return _run(fn, query, key, value, implementation=implementation, is_causal=is_causal,
              scale=scale, key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
              pattern=pattern)


def _strided_rows(S: int, *, stride: int, window_size: Any) -> RowKeys:
  """Decoding :func:`strided_attention`: row i gathers its window and the summary columns
  ``0, stride, ..`` (``S / stride + left + 1`` keys)."""
  fn = "strided_attention"
  stride = checks.check_positive_int(stride, name="stride", fn=fn)
  window = None if window_size is None else masks_lib.normalize_window(window_size, fn=fn)
  rule = lambda q, k: masks_lib.strided_predicate(q, k, S, S, stride, window)  # noqa: E731
  return RowKeys(window=None if window is None else window[0],
                 columns=np.arange(0, S, stride), rule=rule)


# -------------------------------------------------------- block sparse ---


def _layout_plan(layout: np.ndarray, row_blocks: np.ndarray, bs: int, S: int,
                 key_offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """``(keys, valid)``: for each listed query block, the key slots its layout row selects.

  ``layout`` is ``[P, nqb, nkb]``; ``row_blocks`` the query blocks to plan,
  with their query positions in ``rows`` computed by the caller. Key block b
  covers key positions ``b·bs - key_offset .. (b + 1)·bs - key_offset - 1``.
  """
  table = block_table(layout[:, row_blocks])  # [P, R, M]
  keys = (table[..., None] * bs + np.arange(bs) - key_offset).reshape(table.shape[:2] + (-1,))
  valid = np.repeat(table >= 0, bs, axis=-1)
  return keys, dedupe(keys, valid, S)


def _check_layout(layout: Any, T: int, S: int, bs: int, fn: str) -> np.ndarray:
  """A static boolean layout as ``[P, ceil(T/bs), ceil(S/bs)]``."""
  if callable(layout):
    layout = layout(-(-T // bs), -(-S // bs))
  if isinstance(layout, jax.core.Tracer):
    raise ValueError(f"{fn}: layout must be static (numpy or a concrete array), not traced.")
  layout = np.asarray(layout)
  want = (-(-T // bs), -(-S // bs))
  if layout.ndim not in (2, 3) or layout.shape[-2:] != want:
    raise ValueError(
        f"{fn}: layout must have shape [{want[0]}, {want[1]}] or [N, {want[0]}, {want[1]}] "
        f"for T={T}, S={S}, block_size={bs}; got {layout.shape}.")
  return layout.astype(bool).reshape((-1,) + want)


@checks.compiled("layout", "block_size", "is_causal", "scale", "implementation",
                 concrete_checks=_SEGMENT_ORDER)
def block_sparse_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    layout: Any,
    block_size: int,
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    implementation: SparseImplementation | None = None,
) -> jax.Array:
  """Softmax attention over the key blocks a static block layout selects.

  ``out_i = Σ_j softmax_j(q_i·k_j·scale) v_j`` over the keys j whose block
  ``j // bs`` has ``layout[i // bs, j // bs]`` set: ``layout[a, b]`` (or
  ``layout[n, a, b]`` per query head) says whether query block a (rows
  ``a·bs .. a·bs + bs - 1``) attends to key block b. Each query block
  gathers only its selected key blocks: cost O(T · bs · max row count).
  Equals ``softmax_attention(..., mask=masks.block_sparse(layout, bs, T, S))``.

  Args:
    query: ``[B, T, N, H]``; key ``[B, S, K, H]``; value ``[B, S, K, D]``.
    layout: static bool ``[ceil(T/bs), ceil(S/bs)]`` or
      ``[N, ceil(T/bs), ceil(S/bs)]``, or a callable
      ``(num_q_blocks, num_k_blocks) -> layout`` for length-generic patterns.
    block_size: block length ``bs`` on both axes; the last block may be
      partial (inputs are padded internally).
    segment_ids: packed sequences (forms as in :func:`local_attention`): query i sees
      key j only if ``layout`` selects their blocks and both lie in one segment. The
      blocks stay on the grid of the packed call (block a is rows ``a·bs ..``
      whatever the segments), so a block that a boundary crosses is split between its
      segments, and a selected key block of another segment adds nothing.
    (Others as :func:`local_attention`.)

  Returns:
    ``[B, T, N, D]`` in the input dtype; rows with no visible key are zero.

  Raises:
    ValueError: for a ``block_size`` that is not a positive int, a traced
      layout, a layout of the wrong shape, a per-head layout whose first axis
      is not N, bad shapes, dtypes or lengths, malformed (or, eagerly,
      decreasing) ``segment_ids``, or an unknown implementation.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> layout = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1]], bool)
    >>> out = la.block_sparse_attention(x, x, x, layout=layout, block_size=2)
    >>> dense = la.softmax_attention(x, x, x, mask=masks.block_sparse(layout, 2, 8, 8))
    >>> out.shape, bool(jnp.allclose(out, dense, atol=1e-5))
    ((1, 8, 2, 4), True)

  References:
    Child et al., "Generating Long Sequences with Sparse Transformers", 2019.
  """
  fn = "block_sparse_attention"
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  bs = checks.check_positive_int(block_size, name="block_size", fn=fn)

  def pattern(T: int, S: int) -> _Pattern:
    grid = _head_layout(layout, T, S, bs, query_heads, fn)
    rows = tile_rows(T, bs)
    keys, valid = _layout_plan(grid, np.arange(rows.shape[0]), bs, S)
    dense = lambda: masks_lib.block_sparse(_squeeze_heads(grid), bs, T, S)  # noqa: E731
    return _Pattern(dense, (_Pass(Plan(rows, keys, valid)),))

  query_heads = np.shape(query)[-2]
  return _run(fn, query, key, value, implementation=implementation, is_causal=is_causal,
              scale=scale, key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
              pattern=pattern)


def _head_layout(layout: Any, T: int, S: int, bs: int, N: int, fn: str) -> np.ndarray:
  """:func:`_check_layout`, whose first axis must be 1 (shared) or N (one per query head)."""
  grid = _check_layout(layout, T, S, bs, fn)
  if grid.shape[0] not in (1, N):
    raise ValueError(f"{fn}: a per-head layout needs N={N} heads; got {grid.shape}.")
  return grid


def _causal_table(grid: np.ndarray) -> np.ndarray:
  """The key blocks ``[P, nb, M]`` (see :func:`block_table`) each block row of a square
  layout ``[P, nb, nb]`` lists up to its own: what a decoded row gathers."""
  nb = grid.shape[-1]
  return block_table(grid & (np.arange(nb)[None, :] <= np.arange(nb)[:, None]))


def _block_sparse_rows(S: int, *, layout: Any, block_size: int, num_heads: int) -> RowKeys:
  """Decoding :func:`block_sparse_attention` on a sequence of S keys: the blocks listed for
  row i's block row (``block_size`` times the longest causal row's count of keys)."""
  fn = "block_sparse_attention"
  bs = checks.check_positive_int(block_size, name="block_size", fn=fn)
  return RowKeys(blocks=_causal_table(_head_layout(layout, S, S, bs, num_heads, fn)),
                 block_size=bs)


# ---------------------------------------------------------- longformer ---


@checks.compiled("window_size", "global_positions", "is_causal", "scale", "implementation",
                 "block_size", concrete_checks=_SEGMENT_ORDER)
def longformer_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    window_size: Any,
    global_positions: Sequence[int] = (),
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    implementation: SparseImplementation | None = None,
    block_size: int | None = None,
) -> jax.Array:
  """Longformer attention: a local window plus global tokens. Cost O(T·(w + g)).

  ``out_i = Σ_j softmax_j(q_i·k_j·scale) v_j`` over the keys j in query i's
  window and the global keys: every query sees its window and the global
  tokens; a global token's query sees every key. Global positions are key
  positions (the token at key p is query ``p - (S - T)`` when T != S). Equals
  ``softmax_attention(..., mask=masks.longformer(T, S, window_size, global_positions))``.

  Args:
    query: ``[B, T, N, H]``; key ``[B, S, K, H]``; value ``[B, S, K, D]``.
    window_size: int or ``(left, right)``.
    global_positions: static key positions of the global tokens.
    segment_ids: packed sequences (forms as in :func:`local_attention`): query i sees
      key j only if the pattern above allows it and both lie in one segment. Global
      positions are positions of the packed call: a global token's query sees every
      key of its own segment (not the whole call), a global key is seen by the
      queries of its segment only, and a segment holding no global position has
      only its windows (cut at its boundaries).
    (Others as :func:`local_attention`.)

  Returns:
    ``[B, T, N, D]`` in the input dtype; rows with no visible key are zero.

  Raises:
    ValueError: for a negative or malformed window, global positions that are
      not ints in ``[0, S)``, a ``block_size`` that is not a positive int, bad
      shapes, dtypes or lengths, malformed (or, eagerly, decreasing)
      ``segment_ids``, or an unknown implementation.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> out = la.longformer_attention(x, x, x, window_size=1, global_positions=(0, 5))
    >>> mask = masks.longformer(8, 8, 1, (0, 5))
    >>> out.shape, bool(jnp.allclose(out, la.softmax_attention(x, x, x, mask=mask), atol=1e-5))
    ((1, 8, 2, 4), True)

  References:
    Beltagy et al., "Longformer: The Long-Document Transformer", 2020.
  """
  fn = "longformer_attention"
  left, right = masks_lib.normalize_window(window_size, fn=fn)

  def pattern(T: int, S: int) -> _Pattern:
    glob = masks_lib.check_global_positions(global_positions, S, fn)
    Q = _window_block(block_size, T, left, right, fn)
    rows, window = _window_pass(T, S, Q, left, right)
    keys = np.concatenate([window, np.broadcast_to(glob, (rows.shape[0], glob.size))], 1)[None]
    tiled = Plan(rows, keys, dedupe(keys, np.ones(keys.shape, bool), S))
    rule = lambda q, k: masks_lib.longformer_predicate(q, k, T, S, left, right, glob)  # noqa: E731
    dense = lambda: masks_lib.longformer(T, S, (left, right), glob)  # noqa: E731
    global_rows = glob - (S - T)
    global_rows = global_rows[(global_rows >= 0) & (global_rows < T)]
    passes = (_Pass(tiled, rule),)
    if global_rows.size:
      passes += (_Pass(_all_keys(global_rows[None], S)),)
    return _Pattern(dense, passes)

  return _run(fn, query, key, value, implementation=implementation, is_causal=is_causal,
              scale=scale, key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
              pattern=pattern)


def _longformer_rows(S: int, *, window_size: Any, global_positions: Sequence[int]) -> RowKeys:
  """Decoding :func:`longformer_attention` on a sequence of S keys: row i gathers its window
  and the keys ``0 .. g`` up to the last global position g: the global keys, and
  every key a global row (at most g) sees; ``left + g + 2`` keys."""
  fn = "longformer_attention"
  left, right = masks_lib.normalize_window(window_size, fn=fn)
  glob = masks_lib.check_global_positions(global_positions, S, fn)
  rule = lambda q, k: masks_lib.longformer_predicate(q, k, S, S, left, right, glob)  # noqa: E731
  return RowKeys(window=left, columns=np.arange(glob.max(initial=-1) + 1), rule=rule)


# -------------------------------------------------------------- bigbird ---


@checks.compiled("block_size", "num_window_blocks", "num_global_blocks", "num_random_blocks",
                 "rng", "is_causal", "scale", "implementation", concrete_checks=_SEGMENT_ORDER)
def bigbird_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    block_size: int,
    num_window_blocks: int = 3,
    num_global_blocks: int = 2,
    num_random_blocks: int = 3,
    rng: Any = 0,
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    implementation: SparseImplementation | None = None,
) -> jax.Array:
  """BigBird attention: global, sliding-window and random key blocks.

  On a grid of ``block_size`` blocks (see :func:`masks.bigbird_layout`),
  each query block attends to the first ``num_global_blocks`` key blocks, a
  window of ``num_window_blocks`` blocks around itself and
  ``num_random_blocks`` random other blocks drawn from ``rng``; the global
  query blocks attend to everything. With ``is_causal`` window and random
  blocks come only from the past, and the causal mask applies inside blocks:
  truly causal, never full attention. Equals
  ``softmax_attention(..., mask=masks.bigbird(T, S, block_size, ..., rng=rng,
  is_causal=is_causal))``.

  ``out_i = Σ_j softmax_j(q_i·k_j·scale) v_j`` over the keys of the blocks
  query i's block selects.

  Args:
    query: ``[B, T, N, H]``; key ``[B, S, K, H]``; value ``[B, S, K, D]``.
    block_size: block length on both axes.
    num_window_blocks: blocks in the sliding window (odd numbers centre it).
    num_global_blocks: leading blocks that are global.
    num_random_blocks: random key blocks per non-global query block.
    rng: an int seed or a concrete ``jax.random`` key; the pattern is built
      at trace time (it decides which blocks are gathered), so it must be
      static: the same rng gives the same pattern.
    segment_ids: packed sequences (forms as in :func:`local_attention`): query i sees
      key j only if the block pattern above allows it and both lie in one segment.
      The grid, the global blocks (the first ``num_global_blocks`` of the packed
      call) and the random draws are those of the packed call: a global block is
      global within the segments it holds (its queries see their own segment's keys;
      other segments do not see it), a window or random block counts only where it
      overlaps the query's segment, and a segment then sees fewer keys than it would
      alone.
    (Others as :func:`local_attention`.)

  Returns:
    ``[B, T, N, D]`` in the input dtype; rows with no visible key are zero.

  Raises:
    ValueError: for a ``block_size`` that is not a positive int, a block
      count that is not a non-negative int, an ``rng`` that is traced or not
      a seed or key, bad shapes, dtypes or lengths, malformed (or, eagerly,
      decreasing) ``segment_ids``, or an unknown implementation.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> options = dict(num_window_blocks=1, num_global_blocks=1, num_random_blocks=1, rng=0)
    >>> out = la.bigbird_attention(x, x, x, block_size=2, **options)
    >>> mask = masks.bigbird(8, 8, 2, **options)
    >>> out.shape, bool(jnp.allclose(out, la.softmax_attention(x, x, x, mask=mask), atol=1e-5))
    ((1, 8, 2, 4), True)

  References:
    Zaheer et al., "Big Bird: Transformers for Longer Sequences", 2020.
  """
  fn = "bigbird_attention"
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  bs = checks.check_positive_int(block_size, name="block_size", fn=fn)
  counts = dict(num_window_blocks=num_window_blocks, num_global_blocks=num_global_blocks,
                num_random_blocks=num_random_blocks)

  def pattern(T: int, S: int) -> _Pattern:
    U = max(T, S)  # Shared grid: query i at U - T + i, key j at U - S + j.
    grid = masks_lib.bigbird_blocks(-(-U // bs), rng=rng, is_causal=is_causal, fn=fn, **counts)
    nb = grid.shape[0]
    g = min(num_global_blocks, nb)
    to_query = lambda u: np.where((u >= U - T) & (u < U), u - (U - T), T)  # noqa: E731
    grid_rows = tile_rows(nb * bs, bs)  # [nb, bs] grid positions.
    sparse_blocks = np.arange(g, nb)
    passes = (_Pass(_all_keys(to_query(grid_rows[:g].reshape(1, -1)), S)),) if g else ()
    if sparse_blocks.size:
      keys, valid = _layout_plan(grid[None], sparse_blocks, bs, S, key_offset=U - S)
      passes += (_Pass(Plan(to_query(grid_rows[sparse_blocks]), keys, valid)),)
    dense = lambda: masks_lib.bigbird(T, S, bs, rng=rng, is_causal=is_causal, **counts)  # noqa: E731
    return _Pattern(dense, passes)

  return _run(fn, query, key, value, implementation=implementation,
              is_causal=is_causal, scale=scale,
              key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
              pattern=pattern)


def _bigbird_rows(S: int, *, block_size: int, num_window_blocks: int, num_global_blocks: int,
                  num_random_blocks: int, rng: Any) -> RowKeys:
  """Decoding causal :func:`bigbird_attention` on a sequence of S keys: row i gathers the
  global, window and random blocks of its block row (the same draw from ``rng``)."""
  fn = "bigbird_attention"
  bs = checks.check_positive_int(block_size, name="block_size", fn=fn)
  grid = masks_lib.bigbird_blocks(-(-S // bs), num_window_blocks=num_window_blocks,
                                  num_global_blocks=num_global_blocks,
                                  num_random_blocks=num_random_blocks, rng=rng, is_causal=True,
                                  fn=fn)
  return RowKeys(blocks=_causal_table(grid[None]), block_size=bs)


# ------------------------------------------------------------ registry ---


def _squeeze_heads(grid: np.ndarray) -> np.ndarray:
  """A layout ``[P, nqb, nkb]`` as ``[nqb, nkb]`` when shared, ``[N, nqb, nkb]`` per head."""
  return grid[0] if grid.shape[0] == 1 else grid


def _init_local_like(query, key, value, *, window_size):
  B, _, K, H = key.shape
  return init_local_state(B, K, H, value.shape[-1], key.dtype, window_size=window_size)


def decode_rows(spec: AttentionSpec, S: int, num_heads: int,
                options: Mapping[str, Any]) -> RowKeys | None:
  """The keys each row of ``spec``'s causal pattern on a sequence of S keys visits, as the
  rows at traced positions of a decode step gather them; None for a variant without.

  Takes no arrays: ``options`` are the variant's (its function's defaults fill
  the others) and ``num_heads`` N (a per-head layout must have N).

  Raises:
    ValueError: for options the variant's function would refuse (e.g. a
      layout of the wrong shape for S, global positions past S).
  """
  build = spec.decode_rows
  if build is None:
    return None
  defaults = {name: p.default for name, p in inspect.signature(spec.function).parameters.items()
              if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}
  options = {**defaults, **spec.what_options(options), "num_heads": num_heads}
  return build(S, **accepted(build, options))


def _spec(name: str, function: Callable[..., Any], dense_mask: Callable[..., Any], *,
          how: tuple[str, ...] = ("implementation", "block_size"),
          rows: Callable[..., RowKeys] | None = None, **kw: Any) -> AttentionSpec:
  """Registers a sparse variant; its oracle is the same function's reference path; ``rows``
  says which keys a decoded row gathers (``AttentionSpec.decode_rows``)."""
  return register_attention(AttentionSpec(
      name=name, function=function,
      reference=functools.partial(function, implementation="reference"),
      how_options=frozenset(how), implementations=IMPLEMENTATIONS, dense_mask=dense_mask,
      forms_weights=True, decode_rows=rows, **kw))


_spec("local", local_attention,
      lambda T, S, *, is_causal, window_size: masks_lib.local(T, S, window_size),
      streaming=StreamingSpec(init=_init_local_like, step=local_attention_step,
                              state_passing=False))
_spec("strided", strided_attention,
      lambda T, S, *, is_causal, stride, window_size=None: masks_lib.strided(
          T, S, stride, window_size),
      rows=_strided_rows)
# Block-sparse and BigBird patterns are defined in blocks: block_size says what, not how.
_spec("block_sparse", block_sparse_attention, lambda T, S, *, is_causal, layout, block_size: (
          masks_lib.block_sparse(_squeeze_heads(_check_layout(layout, T, S, block_size,
                                                              "block_sparse")), block_size, T, S)),
      how=("implementation",), rows=_block_sparse_rows)
_spec("longformer", longformer_attention,
      lambda T, S, *, is_causal, window_size, global_positions=(): masks_lib.longformer(
          T, S, window_size, global_positions),
      rows=_longformer_rows)
_spec("bigbird", bigbird_attention,
      lambda T, S, *, is_causal, block_size, **counts: masks_lib.bigbird(
          T, S, block_size, is_causal=is_causal, **counts),
      how=("implementation",), rows=_bigbird_rows)
