"""Softmax attention over gathered key sets: the engine of the sparse family.

A sparse pattern is described statically (numpy, at trace time) by a plan:
query rows are grouped into R groups of Q rows (usually consecutive blocks),
and each group gathers the same L key positions (a window, some blocks, some
summary columns). Scores are formed only for those ``R x Q x L`` pairs, so
cost and memory follow the pattern (``T·L``), not ``T·S``::

    out[rows of group r] = softmax(Q_r · K[index_r]ᵀ · scale, masked) V[index_r]

An element-level mask (the exact pattern inside the gathered blocks, the
causal rule, padding slots, key lengths and, for packed sequences, equal
segment ids, read at the same gathered positions) is applied before the softmax, which
is the single-block case of the online softmax: rows that see nothing return
zeros. Gradients come from autodiff: what is saved is again ``O(T·L)``.

Decoding reads rows whose positions are known only when the program runs (a
cache's index plus t): :class:`RowKeys` says which L keys a row at position
i visits (a window before it, static columns, the key blocks its block row
lists), :func:`row_keys` gives them for the rows at hand (:func:`row_allows` the
pattern on keys not gathered, a decoded chunk's own), so a step's cost
follows the pattern, not the cache's length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax._src import checks
from linattn_jax._src.masks import causal_predicate
from linattn_jax._src.online_softmax import (
    init_softmax_carry,
    online_softmax_finish,
    online_softmax_update,
)


class Plan(NamedTuple):
  """Static description of which keys each group of query rows visits.

  ``P`` is 1 when all heads share the pattern, N for one pattern per query head.
  """

  rows: np.ndarray  # [R, Q] int: query positions of each group (>= T: padding row).
  keys: np.ndarray  # [P, R, L] int: key positions gathered by each group.
  valid: np.ndarray  # [P, R, L] bool: False for padding or duplicate slots.


def dedupe(keys: np.ndarray, valid: np.ndarray, S: int) -> np.ndarray:
  """``valid`` with out-of-range and repeated key slots switched off (per row)."""
  valid = valid & (keys >= 0) & (keys < S)
  order = np.argsort(np.where(valid, keys, S), axis=-1, kind="stable")
  sorted_keys = np.take_along_axis(np.where(valid, keys, S), order, axis=-1)
  repeat = np.zeros_like(valid)
  repeat[..., 1:] = sorted_keys[..., 1:] == sorted_keys[..., :-1]
  first = np.empty_like(valid)
  np.put_along_axis(first, order, ~repeat, axis=-1)
  return valid & first


def block_table(layout: np.ndarray) -> np.ndarray:
  """The key blocks each block row of ``layout [P, R, nkb]`` lists: ``[P, R, M]`` block ids in
  ascending order, -1 past a row's count; M is the longest row's (at least 1)."""
  P, R, _ = layout.shape
  counts = layout.sum(-1)
  table = np.full((P, R, max(1, int(counts.max(initial=0)))), -1, np.int64)
  for p in range(P):
    for r in range(R):
      blocks = np.flatnonzero(layout[p, r])
      table[p, r, :blocks.size] = blocks
  return table


class RowKeys(NamedTuple):
  """The keys a query row at a traced position i visits, among S keys (decoding).

  A superset of the row's pattern, gathered and then masked: the keys
  ``i - window .. i``, the static ``columns`` (those inside the window are not
  gathered twice), and the key blocks that ``blocks`` lists for block row
  ``i // block_size``. ``rule`` is the exact pattern among them; its keys for
  row i must lie among the gathered ones. Positions are those of one
  sequence (query i is key i); only keys ``<= i`` are kept (causal).
  """

  window: int | None = None  # Keys i - window .. i (window + 1 of them); None: no window.
  columns: np.ndarray = np.zeros(0, np.int64)  # [L_c] sorted unique static key positions.
  blocks: np.ndarray | None = None  # [P, R, M] key blocks of block row r (-1: none).
  block_size: int = 1  # Of ``blocks``, on both axes.
  rule: Callable[[jax.Array, jax.Array], jax.Array] | None = None  # (q_pos, k_pos) -> bool.


def row_keys(rows: RowKeys, i: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Key positions ``[P, T, L]`` the rows at positions ``i [T]`` gather, and which count.

  The second array ``[P, T, L]`` is True for a key of the row's pattern
  (``rows.rule``), at or before the row (``0 <= j <= i``), gathered once.
  The positions of the others are clipped into ``[0, i]``, so that they can
  be gathered.
  """
  T = i.shape[0]
  q = i[:, None]  # [T, 1]
  parts = []  # ([P|1, T, L_part] positions, [P|1, T, L_part] first time gathered)
  if rows.window is not None:
    pos = q - rows.window + jnp.arange(rows.window + 1, dtype=i.dtype)[None, :]
    parts.append((pos[None], jnp.ones((1,) + pos.shape, bool)))
  if rows.columns.size:
    pos = jnp.broadcast_to(jnp.asarray(rows.columns, i.dtype)[None, :], (T, rows.columns.size))
    again = False if rows.window is None else (pos >= q - rows.window) & (pos <= q)
    parts.append((pos[None], jnp.broadcast_to(~jnp.asarray(again), pos.shape)[None]))
  if rows.blocks is not None:
    bs = rows.block_size
    listed = jnp.asarray(rows.blocks, i.dtype)[:, i // bs]  # [P, T, M]
    pos = listed[..., None] * bs + jnp.arange(bs, dtype=i.dtype)[None, None, None, :]
    listed_ok = jnp.broadcast_to((listed >= 0)[..., None], pos.shape)
    parts.append((pos.reshape(pos.shape[:2] + (-1,)), listed_ok.reshape(pos.shape[:2] + (-1,))))
  P = max(p.shape[0] for p, _ in parts)
  pos = jnp.concatenate([jnp.broadcast_to(p, (P,) + p.shape[1:]) for p, _ in parts], -1)
  ok = jnp.concatenate([jnp.broadcast_to(f, (P,) + f.shape[1:]) for _, f in parts], -1)
  ok = ok & (pos >= 0) & (pos <= q[None])
  if rows.rule is not None:
    ok = ok & rows.rule(q[None], pos)
  return jnp.clip(pos, 0, q[None]), ok


def row_allows(rows: RowKeys, i: jax.Array, j: jax.Array) -> jax.Array:
  """``[P, T, J]``: whether row ``i [T]``'s pattern holds key ``j [J]`` (and ``j <= i``).

  For keys not gathered by :func:`row_keys` (e.g. a decoded chunk's own):
  ``rows.rule`` when given, else membership of the window, columns and blocks.
  """
  q, k = i[:, None], j[None, :]  # [T, 1], [1, J]
  causal = (k <= q)[None]
  if rows.rule is not None:
    return causal & rows.rule(q, k)[None]
  hit = jnp.zeros((1,) + causal.shape[1:], bool)
  if rows.window is not None:
    hit = hit | ((k >= q - rows.window) & (k <= q))[None]
  if rows.columns.size:
    hit = hit | (k[..., None] == jnp.asarray(rows.columns, j.dtype)[None, None, :]).any(-1)[None]
  if rows.blocks is not None:
    listed = jnp.asarray(rows.blocks, i.dtype)[:, i // rows.block_size]  # [P, T, M]
    hit = hit | (listed[:, :, None, :] == (k // rows.block_size)[None, :, :, None]).any(-1)
  return causal & hit


def tile_rows(T: int, Q: int) -> np.ndarray:
  """``[ceil(T / Q), Q]`` consecutive query positions (the last block padded past T)."""
  return np.arange(-(-T // Q) * Q).reshape(-1, Q)


def window_start(positions: np.ndarray, stride: int) -> int | None:
  """``c`` when row r of ``positions [R, L]`` is ``c + r·stride + arange(L)``, else None."""
  R, L = positions.shape
  c = int(positions[0, 0])
  want = c + stride * np.arange(R)[:, None] + np.arange(L)[None, :]
  return c if np.array_equal(positions, want) else None


def _span(x: jax.Array, start: int, n: int) -> jax.Array:
  """``x[:, start:start + n]``, with zeros at positions outside ``x``'s axis 1."""
  a = min(max(start, 0), start + n)  # The part inside x: a .. b - 1.
  b = max(min(start + n, x.shape[1]), a)
  return jnp.pad(x[:, a:b], [(0, 0), (a - start, start + n - b)] + [(0, 0)] * (x.ndim - 2))


def windows(x: jax.Array, start: int, stride: int, R: int, L: int) -> jax.Array:
  """``x[:, start + r·stride + l]`` for ``r < R``, ``l < L``: ``[B, R, L, ...]``, zeros at
  positions outside ``x``'s axis 1.

  The same as gathering those positions, built from ``min(R, ⌈L / stride⌉)``
  slices: one per window when there are few (a group of rows that reads every
  key), else one per block of ``stride`` positions that a window spans (local
  attention). On CPU a gather, and the scatter-add that is its gradient, visit
  one element at a time; slices and their transposes (pads) copy whole rows.
  """
  m = -(-L // stride)  # Blocks a window spans.
  if R <= m:
    span = _span(x, start, (R - 1) * stride + L)
    return jnp.stack([span[:, r * stride:r * stride + L] for r in range(R)], axis=1)
  blocks = _span(x, start, (R + m - 1) * stride)
  blocks = blocks.reshape(x.shape[0], R + m - 1, stride, *x.shape[2:])
  return jnp.concatenate([blocks[:, j:j + R] for j in range(m)], axis=2)[:, :, :L]


def read_positions(x: jax.Array, positions: np.ndarray, stride: int) -> jax.Array:
  """``x[:, positions]`` for a static table ``positions [R, L]``: ``[B, R, L, ...]``.

  A window sliding by ``stride`` per row is read by :func:`windows` (zeros
  outside ``x``); any other table is gathered at positions clipped into ``x``.
  Either way the caller masks the positions outside the sequence.
  """
  start = window_start(positions, stride)
  if start is not None:
    return windows(x, start, stride, *positions.shape)
  return jnp.take(x, np.clip(positions, 0, x.shape[1] - 1), axis=1)


def _same_segment(segment_ids: tuple[jax.Array, jax.Array], plan: Plan, Q: int,
                  dims: checks.Dims) -> jax.Array:
  """Whether each (row, gathered key) pair of ``plan`` lies in one packed segment:
  ``[B, K, G, R, Q, L]`` for per-head keys (``P = N``), else ``[B, 1, 1, R, Q, L]``."""
  B, _, S, N, K, _, _ = dims
  P, R, L = plan.keys.shape
  q_ids, kv_ids = segment_ids
  row_ids = read_positions(q_ids, plan.rows, Q)  # [B, R, Q]
  if P == 1:
    key_ids = read_positions(kv_ids, plan.keys[0], Q)  # [B, R, L]
    return (row_ids[..., None] == key_ids[:, :, None, :]).reshape(B, 1, 1, R, Q, L)
  key_ids = jnp.take(kv_ids, np.clip(plan.keys, 0, S - 1), axis=1)  # [B, P, R, L]
  same = row_ids[:, None, :, :, None] == key_ids[:, :, :, None, :]  # [B, N, R, Q, L]
  return same.reshape(B, K, N // K, R, Q, L)


def attend(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    plan: Plan,
    *,
    dims: checks.Dims,
    scale: float,
    is_causal: bool,
    key_value_seq_lengths: jax.Array | None,
    pattern: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """Attention of the plan's query rows over their gathered keys.

  Args:
    query: ``[B, T, N, H]``; key ``[B, S, K, H]``; value ``[B, S, K, D]``.
    plan: the static :class:`Plan`.
    dims: the call's sizes.
    scale: logit scale.
    is_causal: also apply ``masks.causal_predicate`` (bottom-right aligned).
    key_value_seq_lengths: optional ``[B]`` int32.
    pattern: optional static element rule ``pattern(q_pos, k_pos) -> bool``
      on broadcastable numpy positions, refining the gathered sets.
    segment_ids: optional ``(query_ids [B, T], kv_ids [B, S])`` int32 (as
      ``checks.check_segment_ids`` returns them): a row keeps only the gathered
      keys whose id equals its own. The ids are read at the plan's rows and keys
      as the queries and keys are, so the cost is ``B·R·Q·L`` comparisons.

  Returns:
    ``[B, R, Q, N, D]`` in the accumulation dtype; padding rows are zero.
  """
  B, T, S, N, K, H, D = dims
  G = N // K
  P, R, L = plan.keys.shape
  Q = plan.rows.shape[1]
  acc = checks.accumulation_dtype(query.dtype)

  # Consecutive rows, and local attention's windows, are slices of blocks (read_positions).
  q = read_positions(query, plan.rows, Q)  # [B, R, Q, N, H]
  q = q.reshape(B, R, Q, K, G, H).transpose(0, 3, 4, 1, 2, 5).astype(acc)  # [B, K, G, R, Q, H]
  if P == 1:  # [B, K, 1, R, L, *]: heads of one kv group share the gathered keys.
    gather = lambda x: read_positions(x, plan.keys[0], Q).transpose(0, 3, 1, 2, 4)[:, :, None]  # noqa: E731
  else:  # [B, K, G, R, L, *]: each query head gathers from its kv head.
    keys = np.clip(plan.keys, 0, S - 1)
    kv_head = (np.arange(N) // G)[:, None, None]
    gather = lambda x: x[:, keys, kv_head].reshape(B, K, G, R, L, -1)  # noqa: E731
  k, v = gather(key).astype(acc), gather(value).astype(acc)

  q_pos = plan.rows[None, :, :, None]  # [1, R, Q, 1]
  k_pos = plan.keys[:, :, None, :]  # [P, R, 1, L]
  ok = plan.valid[:, :, None, :] & (q_pos < T)
  if pattern is not None:
    ok = ok & pattern(q_pos, k_pos)
  if is_causal:
    ok = ok & causal_predicate(q_pos, k_pos, T, S)
  ok = jnp.asarray(np.broadcast_to(ok, (P, R, Q, L)).reshape((1, K, G, R, Q, L)
                                                              if P == N else (1, 1, 1, R, Q, L)))
  if key_value_seq_lengths is not None:
    lengths = jnp.reshape(key_value_seq_lengths, (B, 1, 1, 1, 1))
    in_len = k_pos[None].astype(lengths.dtype) < lengths  # [B, P, R, 1, L]
    ok = ok & in_len.reshape((B, K, G, R, 1, L) if P == N else (B, 1, 1, R, 1, L))
  if segment_ids is not None:
    ok = ok & _same_segment(segment_ids, plan, Q, dims)

  s = jnp.where(ok, jnp.matmul(q, jnp.swapaxes(k, -1, -2)) * scale, -jnp.inf)
  carry = init_softmax_carry((B, K, G, R, Q), D, acc)
  out, _ = online_softmax_finish(online_softmax_update(carry, s, lambda p: jnp.matmul(p, v)))
  return out.transpose(0, 3, 4, 1, 2, 5).reshape(B, R, Q, N, D)
