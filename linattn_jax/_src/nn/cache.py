"""Decode caches of :class:`MultiHeadAttention` and the kernels that advance them.

What a cache holds follows the variant's ``cache_kind``:

- ``"kv"`` (softmax, flash and the sparse patterns but local): keys and values
  of every position up to the capacity, :class:`KVCache`;
- ``"window"`` (local): a ring buffer of the last ``left + 1`` keys, the
  variant's ``LocalState``, in a :class:`StateCache`;
- ``"recurrent"`` (linear maps, linear_learned, performer, random_fourier,
  efficient, heinsen, and the gated recurrences retention, simple_gla, gla,
  delta_net, gated_delta_net): the variant's fixed-size state (``[B, K, M, D]``
  and its normaliser), whatever the position, in a :class:`StateCache`.

A decode call takes a chunk of any length (a prompt) or one token; a prefill
followed by single steps equals one causal call on the whole sequence.

Packed sequences: every cache also holds segment ids, the ids of the cached
positions (``[B, C]``, a :class:`KVCache`) or of the last position decoded
(``[B]``, a :class:`StateCache`). A decode call's positions carry their own ids
(or, without them, continue the last position's); a KV cache reads only the
keys of a query's own id, and a recurrent state restarts from the empty state
where a position's id differs from the one before it, so decoding a packed row
equals the packed call.

Letters: B batch, T query length, N query heads, K key/value heads, H head
dim (keys and values), C a KV cache's capacity.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax._src import checks, gather, sparse
from linattn_jax._src.online_softmax import merge, online_softmax_finish, softmax_block
from linattn_jax._src.registry import AttentionSpec, CacheKind, accepted, get_spec

# A sparse pattern without decoding rows (sparse.decode_rows: the built-in ones have them)
# decodes through its dense [C, C] pattern on a sequence of the cache's capacity C (a
# compile-time constant of C² bytes): capped here.
MAX_PATTERN_CAPACITY = 8192


class KVCache(NamedTuple):
  """Keys and values of every decoded position (softmax, flash, sparse patterns).

  The decode cache of :class:`MultiHeadAttention` for variants without a
  streaming state (``cache_kind(...) == "kv"``), made by ``init_cache((B, C,
  in))`` for a capacity of C positions.

  Attributes:
    key: ``[B, K, C, H]`` in the cache dtype (head-major: a step reads it in place).
    value: ``[B, K, C, H]`` (the layer's values have the head dim H too).
    index: ``[]`` int32: positions written so far.
    segment_ids: ``[B, C]`` int32: the segment id of each written position (packed
      sequences: a query reads the keys of its own id only); 0 before any is given.

  Examples:
    >>> layer = nn.MultiHeadAttention(4, 32, num_kv_heads=2, rngs=nnx.Rngs(0))  # softmax
    >>> layer.init_cache((1, 16, 32))  # (B, C, in)
    >>> cache = layer.cache.get_value()
    >>> isinstance(cache, nn.KVCache), cache.key.shape, int(cache.index)
    (True, (1, 2, 16, 8), 0)
    >>> _ = layer(jnp.ones((1, 3, 32)), is_causal=True, decode=True)
    >>> int(layer.cache.get_value().index)
    3
  """

  key: jax.Array  # [B, K, C, H] in the cache dtype (head-major: a step reads it in place).
  value: jax.Array  # [B, K, C, H]
  index: jax.Array  # [] int32: positions written so far.
  segment_ids: jax.Array  # [B, C] int32: each written position's segment id.


class StateCache(NamedTuple):
  """A streaming variant's state (recurrent, or local's ring buffer).

  The decode cache of :class:`MultiHeadAttention` for variants with a
  streaming protocol (``cache_kind(...)`` is ``"recurrent"`` or
  ``"window"``): its size does not grow with the position.

  Attributes:
    state: the variant's state NamedTuple, e.g. a ``LinearState`` with
      ``kv [B, K, M, H]`` and ``k_sum [B, K, M]``, or a ``LocalState`` ring
      buffer ``[B, W, K, H]``.
    index: ``[]`` int32: positions decoded so far.
    segment_id: ``[B]`` int32: the segment id of the last position decoded (packed
      sequences: a position with another id starts from the empty state); 0 at first.

  Examples:
    >>> layer = nn.MultiHeadAttention(4, 32, num_kv_heads=2, attention="linear_elu",
    ...                               rngs=nnx.Rngs(0))
    >>> layer.init_cache((1, 16, 32))  # (B, C, in); a state has no capacity.
    >>> cache = layer.cache.get_value()
    >>> isinstance(cache, nn.StateCache), type(cache.state).__name__, cache.state.kv.shape
    (True, 'LinearState', (1, 2, 8, 8))
  """

  state: Any  # The variant's state NamedTuple, e.g. LinearState [B, K, M, H] / [B, K, M].
  index: jax.Array  # [] int32: positions decoded so far.
  segment_id: jax.Array  # [B] int32: the last decoded position's segment id.


def cache_kind(attention: str) -> CacheKind:
  """What ``attention``'s decode cache holds: a :class:`CacheKind` (``"kv"``, ``"window"``, ...).

  Takes no arrays. ``"recurrent"``: a fixed-size state (e.g. ``[B, K, M, H]``
  and its normaliser) in a :class:`StateCache`; ``"window"``: local's ring
  buffer of the last ``left + 1`` keys ``[B, W, K, H]`` in a
  :class:`StateCache`; ``"kv"``: every key and value ``[B, K, C, H]`` in a
  :class:`KVCache`.

  Args:
    attention: a name from ``available_attentions()``.

  Raises:
    ValueError: for a name that is not registered.

  Examples:
    >>> [nn.cache_kind(name).value for name in ("softmax", "local", "linear_elu")]
    ['kv', 'window', 'recurrent']
    >>> nn.cache_kind("softmax") == "kv"
    True
  """
  return get_spec(attention).cache_kind


def empty(spec: AttentionSpec | None, *, batch: int, capacity: int, num_heads: int,
          num_kv_heads: int, head_dim: int, dtype: Any, options: Mapping[str, Any],
          value_shape: tuple[int, int] | None = None) -> KVCache | StateCache:
  """An empty cache for ``batch`` (B) sequences: a :class:`KVCache` ``[B, K, C, H]`` in
  ``dtype`` for ``spec=None`` (an injected Flax ``attention_fn``) and ``"kv"`` variants,
  else the variant's initial state (``options``: its options and arrays). ``value_shape``
  ``(V, D)``: value heads and their size, when they differ from ``(K, H)`` (grouped value
  heads of a recurrent state)."""
  B, C, N, K, H = batch, capacity, num_heads, num_kv_heads, head_dim
  zero = jnp.zeros((), jnp.int32)
  if spec is None or spec.cache_kind is CacheKind.KV:
    return KVCache(jnp.zeros((B, K, C, H), dtype), jnp.zeros((B, K, C, H), dtype), zero,
                   jnp.zeros((B, C), jnp.int32))
  q, k = jnp.zeros((B, 1, N, H), dtype), jnp.zeros((B, 1, K, H), dtype)
  v = k if value_shape is None else jnp.zeros((B, 1) + tuple(value_shape), dtype)
  return StateCache(_empty_state(spec, q, k, options, v), zero, jnp.zeros((B,), jnp.int32))


def _empty_state(spec: AttentionSpec, q: jax.Array, k: jax.Array,
                 options: Mapping[str, Any], v: jax.Array | None = None) -> Any:
  """The variant's initial state for queries like ``q [B, T, N, H]``, keys like ``k`` and
  values like ``v`` (default: like ``k``)."""
  init = spec.streaming.init
  return init(q, k, k if v is None else v, **accepted(init, options))


def segment_ids_of(cache: KVCache | StateCache, segment_ids: jax.Array | None,
                   T: int) -> jax.Array:
  """The ids ``[B, T]`` of the next T positions: ``segment_ids``, or the last decoded
  position's id for each (they continue its segment)."""
  if segment_ids is not None:
    return segment_ids
  if isinstance(cache, StateCache):
    last = cache.segment_id
  else:  # The id at index - 1 (any at index 0: no key is cached to compare with).
    last = lax.dynamic_index_in_dim(cache.segment_ids, jnp.maximum(cache.index - 1, 0),
                                    axis=1, keepdims=False)
  return jnp.broadcast_to(last[:, None], (last.shape[0], T))


def current(variable: Any) -> KVCache | StateCache:
  """The cache a layer holds in ``variable`` (its ``nnx.Cache``, or None before ``init_cache``).

  Raises:
    ValueError: when there is none yet.
  """
  if variable is None:
    raise ValueError("MultiHeadAttention: decoding needs a cache; call init_cache(input_shape) "
                     "(or nnx.view(..., decode=True, batch_size=..., max_length=...)) first.")
  return variable.get_value()


def flax_layout(x: jax.Array, batch: tuple[int, ...]) -> jax.Array:
  """A head-major cache array ``[B, K, C, H]`` in Flax's layout ``[*batch, C, K, H]``."""
  return x.swapaxes(1, 2).reshape(batch + x.shape[2:3] + x.shape[1:2] + x.shape[3:])


def check_fits(cache: KVCache | StateCache, k: jax.Array, batch: tuple[int, ...]) -> None:
  """The cache (made for batch dims ``batch``) was made for keys ``k [B, T, K, H]``."""
  leaf = cache.key if isinstance(cache, KVCache) else jax.tree.leaves(cache.state)[0]
  if k.shape[0] != leaf.shape[0]:
    raise ValueError(f"MultiHeadAttention: the cache was made for batch dims {batch}; got keys "
                     f"{k.shape} ([B, T, K, H] with the batch dims flattened). Call init_cache "
                     "for these inputs.")


def write(cache: KVCache, k: jax.Array, v: jax.Array, *,
          at: jax.Array | None = None, segment_ids: jax.Array | None = None) -> KVCache:
  """``cache`` with keys ``k`` and values ``v`` ``[B, T, K, H]`` written at positions
  ``at .. at + T - 1`` (default ``cache.index``) with ids ``segment_ids [B, T]`` (default:
  the last written position's), and its index advanced by T.

  The one write into a :class:`KVCache`, of a registered variant's decode and of an
  injected Flax ``attention_fn``'s alike.
  """
  T = k.shape[1]
  ids = segment_ids_of(cache, segment_ids, T)
  at = cache.index if at is None else at
  put = lambda c, x: lax.dynamic_update_slice_in_dim(  # noqa: E731
      c, x.swapaxes(1, 2).astype(c.dtype), at, axis=2)
  return KVCache(put(cache.key, k), put(cache.value, v), cache.index + T,
                 lax.dynamic_update_slice_in_dim(cache.segment_ids, ids, at, axis=1))


def kv_decode(spec: AttentionSpec, cache: KVCache, q: jax.Array, k: jax.Array, v: jax.Array,
              *, options: Mapping[str, Any], mask: jax.Array | None,
              segment_ids: jax.Array | None = None) -> tuple[KVCache, jax.Array]:
  """Writes T keys at ``index``; query t reads positions ``<= index + t``.

  The read takes the cached positions ``< index`` from the cache as it was
  and the T new ones from the chunk itself; the write then waits for the
  read (``_after``), so that the updated cache is only carried and XLA
  updates it in place instead of copying it every step. A sparse pattern's
  row ``i = index + t`` reads only the L keys it names (``sparse.decode_rows``),
  gathered from the cache: a step costs O(L), not O(C). ``mask``
  (``[B|1, N|1, T, C]``, over the cache's positions) narrows both.

  ``segment_ids`` ``[B, T]`` (None: the last position's, see :func:`segment_ids_of`)
  are written with the keys, and a query reads only the keys of its own id, within
  its pattern's (whose positions are the cache's: those of the packed row).
  """
  B, K, C, H = cache.key.shape
  T = q.shape[1]
  if T > C:
    raise ValueError(f"MultiHeadAttention: {T} positions do not fit a KV cache of capacity {C}.")
  index = cache.index
  ids = segment_ids_of(cache, segment_ids, T)
  jax.debug.callback(_check_capacity, index, T, C)
  chunk_columns = lambda m: lax.dynamic_slice_in_dim(  # noqa: E731  [.., C] -> [.., T]
      jnp.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, T)]), index, T, axis=-1)
  new = jnp.tril(jnp.ones((T, T), bool))[None, None]  # [1, 1, T, T]: causal within the chunk.
  rows = None if spec.dense_mask is None else sparse.decode_rows(spec, C, q.shape[2], options)
  if rows is not None:  # Row i = index + t gathers its L keys: [1, P, T, L] (P = 1 or N).
    i = index + jnp.arange(T, dtype=index.dtype)
    at, old = gather.row_keys(rows, i)  # [P, T, L]
    old = (old & (at < index))[None]  # Cached before this chunk; the chunk's own are in `new`.
    new = new & gather.row_allows(rows, i, i)[None]
    if mask is not None:  # [B|1, N|1, T|1, C|1] at the rows' keys: [B|1, N|P, T, L].
      b, n = mask.shape[0], max(mask.shape[1], at.shape[0])
      mask = jnp.broadcast_to(mask, (b, n, T, C))
      old = old & jnp.take_along_axis(mask, jnp.broadcast_to(at, (b, n) + at.shape[1:]), axis=-1)
      new = new & chunk_columns(mask)
    cached_key, cached_value = (_gathered(c, at) for c in (cache.key, cache.value))
  else:
    old = (jnp.arange(C) < index)[None, None, None]  # [1, 1, 1, C]: cached before this chunk.
    pattern = _pattern_rows(spec, C, index, T, options)  # [1, N|1, T, C] or None
    if mask is not None:
      pattern = mask if pattern is None else pattern & mask
    if pattern is not None:  # The chunk's own columns are its columns index .. index + T - 1.
      old = old & pattern
      new = new & chunk_columns(pattern)
    cached_key, cached_value = cache.key, cache.value
  # Packed sequences: a query reads the keys of its own segment only.
  key_ids = (cache.segment_ids[:, None, None, :] if rows is None  # [B, 1, 1, C]
             else jnp.take(cache.segment_ids, at, axis=1, mode="clip"))  # [B, P, T, L]
  old = old & (key_ids == ids[:, None, :, None])
  new = new & (ids[:, None, None, :] == ids[:, None, :, None])  # [B, 1, T, T]
  scale = checks.resolve_scale(options.get("scale"), H)
  read = lambda: _cached_read(q, (cached_key, k), (cached_value, v), (old, new), scale)  # noqa: E731
  if spec.full_softmax and T > 1 and mask is None:
    packed = {} if segment_ids is None else {"segment_ids": ids}
    fresh = lambda: spec.function(q, k, v, is_causal=True, **packed, **options)  # noqa: E731
    out = lax.cond(index == 0, fresh, read)  # A prompt from position 0 needs no cache read.
  else:
    out = read()
  return write(cache, k, v, at=_after(index, out), segment_ids=ids), out


def _gathered(cache: jax.Array, at: jax.Array) -> jax.Array:
  """The cache ``[B, K, C, H]`` at positions ``at [P, T, L]``: ``[B, K, 1|G, T, L, H]``.

  ``P = 1``: every query head reads the same positions of its key/value head;
  ``P = N``: query head n reads its own, from key/value head ``n // G``.
  """
  B, K, C, H = cache.shape
  P, T, L = at.shape
  if P == 1:
    return jnp.take(cache, at[0], axis=2, mode="clip")[:, :, None]
  at = at.reshape(K, P // K, T, L) + (jnp.arange(K, dtype=at.dtype) * C)[:, None, None, None]
  return jnp.take(cache.reshape(B, K * C, H), at, axis=1, mode="clip")


def _after(index: jax.Array, out: jax.Array) -> jax.Array:
  """``index`` (``[]`` int32), computed after ``out``: a cache write at it waits for the reads.

  ``index + min(any(isnan(out)), 0)`` is ``index``, but XLA cannot fold the
  term away, so the write into the cache ``[B, K, C, H]`` depends on the
  read that made ``out``. Without that order XLA:CPU's copy insertion cannot
  prove the read of the old cache ends before the in-place update, and
  copies the whole cache twice per step inside a decode loop (a
  ``lax.optimization_barrier`` is expanded away before that pass on CPU).
  """
  return index + jnp.minimum(jnp.isnan(out).any().astype(index.dtype), 0)


def _cached_read(q: jax.Array, keys: tuple[jax.Array, jax.Array],
                 values: tuple[jax.Array, jax.Array], masks: tuple[jax.Array, jax.Array],
                 scale: float) -> jax.Array:
  """``softmax(q kᵀ·scale, mask) v`` over the cache and the new chunk, in float32.

  ``q [B, T, N, H]``; ``keys``/``values``: the head-major cache ``[B, K, C, H]``
  (or the L keys gathered for each row, ``[B, K, 1|G, T, L, H]``) and the
  chunk's own ``[B, T, K, H]``; ``masks``: ``[B|1, N|1, T, C|L]`` and
  ``[B|1, N|1, T, T]``. The cache is read where it lies (a transposed copy
  would dominate a decode step); a row that sees no key gives zeros.
  """
  B, T, N, H = q.shape
  K = keys[0].shape[1]
  G = N // K
  f32 = jnp.float32

  def grouped(mask):  # [B|1, N|1, T, X] -> [B|1, K|1, G|1, T, X]
    b, n = mask.shape[:2]
    return mask.reshape((b, K, G) + mask.shape[2:] if n > 1 else (b, 1, 1) + mask.shape[2:])

  qg = q.reshape(B, T, K, G, H)
  cached_key, cached_value = keys[0], values[0]
  if cached_key.ndim == 4:  # The whole cache [B, K, C, H], shared by the rows.
    cached_scores = jnp.einsum("btkgh,bkch->bkgtc", qg.astype(cached_key.dtype), cached_key,
                               preferred_element_type=f32)

    def cached_sum(p):  # [B, K, G, T, C] -> [B, K, G, T, H]
      # One row (G·T = 1: a single token, no GQA) makes this a vector-matrix product,
      # which XLA:CPU's own dot code runs at a fraction of memory speed (its library,
      # YNNPACK, takes no vectors); a zero second row makes it a matrix product that
      # reads the cache at memory speed (3x faster at C = 65536). The row is dropped.
      pad = [(0, 0)] * 3 + [(0, int(G * T == 1)), (0, 0)]
      out = jnp.einsum("bkgtc,bkch->bkgth", jnp.pad(p.astype(cached_value.dtype), pad),
                       cached_value, preferred_element_type=f32)
      return out[:, :, :, :T]
  else:  # Each row's L gathered keys [B, K, 1|G, T, L, H].
    per_head = cached_key.shape[2] > 1
    kv = "bkgtlh" if per_head else "bktlh"
    cached_key, cached_value = (x if per_head else x[:, :, 0] for x in (cached_key, cached_value))
    cached_scores = jnp.einsum(f"btkgh,{kv}->bkgtl", qg.astype(cached_key.dtype), cached_key,
                               preferred_element_type=f32)
    cached_sum = lambda p: jnp.einsum(  # noqa: E731
        f"bkgtl,{kv}->bkgth", p.astype(cached_value.dtype), cached_value,
        preferred_element_type=f32)
  scores = (
      cached_scores,
      jnp.einsum("btkgh,bskh->bkgts", qg, keys[1].astype(q.dtype), preferred_element_type=f32),
  )
  # Batch dims first in the output: XLA:CPU then multiplies in place (3x faster here).
  weighted_sums = (
      cached_sum,
      lambda p: jnp.einsum("bkgts,bskh->bkgth", p, values[1].astype(f32),
                           preferred_element_type=f32))
  cached, fresh = (softmax_block(jnp.where(grouped(m), x * scale, -jnp.inf), weighted_sum)
                   for x, m, weighted_sum in zip(scores, masks, weighted_sums, strict=True))
  out, _ = online_softmax_finish(merge(cached, fresh))  # [B, K, G, T, H]
  return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)


def _check_capacity(index: Any, T: int, C: int) -> None:
  if int(index) + T > C:
    raise ValueError(f"MultiHeadAttention: decoding positions {int(index)}..{int(index) + T - 1} "
                     f"is past the KV cache's capacity {C}; init_cache with a longer input_shape.")


def _pattern_rows(spec: AttentionSpec, C: int, index: jax.Array, T: int,
                  options: Mapping[str, Any]) -> jax.Array | None:
  """Rows ``index .. index + T - 1`` of a sparse pattern on a sequence of the capacity C:
  ``[1, N|1, T, C]``, or None for a variant without a pattern."""
  if spec.dense_mask is None:
    return None
  if C > MAX_PATTERN_CAPACITY:
    raise ValueError(f"MultiHeadAttention: decoding attention={spec.name!r} builds its [C, C] "
                     f"pattern; C={C} is above MAX_PATTERN_CAPACITY={MAX_PATTERN_CAPACITY}. Use a "
                     "smaller cache, or 'local' (a ring buffer) for long sequences.")
  what = accepted(spec.dense_mask, spec.what_options(options))
  with jax.ensure_compile_time_eval():  # A static pattern, also inside a trace.
    dense_ = jnp.asarray(spec.dense_mask(C, C, is_causal=True, **what))
  dense_ = dense_.reshape((1,) * (4 - dense_.ndim) + dense_.shape)
  return lax.dynamic_slice_in_dim(dense_, index, T, axis=-2)


def state_decode(spec: AttentionSpec, cache: StateCache, q: jax.Array, k: jax.Array,
                 v: jax.Array, *, options: Mapping[str, Any], gates: Mapping[str, jax.Array],
                 segment_ids: jax.Array | None = None) -> tuple[StateCache, jax.Array]:
  """Advances a streaming state by T positions: one step, a stateful pass, or a scan.

  ``options``: the variant's options and arrays; ``gates``: a gated variant's
  per-token inputs ``[B, T, K(, H)]``; a step takes each token's ``[B, K(, H)]``.

  ``segment_ids`` ``[B, T]`` (recurrent states only; None: the positions continue the
  last one's segment): where the first position's id differs from the last decoded
  one's, the state restarts from the empty state; boundaries inside a chunk are the
  variant function's to honour (it takes them as ``segment_ids``).

  A ring buffer holds keys and values in the cache's dtype: the chunk is
  attended in that dtype and the output cast back to the inputs'.
  """
  streaming = spec.streaming
  step_options = accepted(streaming.step, options)
  T = q.shape[1]
  dtype = q.dtype
  ids = segment_ids_of(cache, segment_ids, T)
  state = cache.state
  packed = {}
  if segment_ids is not None:
    restart = ids[:, 0] != cache.segment_id  # [B]
    empty_ = _empty_state(spec, q, k, options, v)
    state = jax.tree.map(
        lambda x, e: jnp.where(restart.reshape((-1,) + (1,) * (x.ndim - 1)), e.astype(x.dtype), x),
        state, empty_)
    packed = {"segment_ids": ids}
  if spec.cache_kind is CacheKind.WINDOW:
    q, k, v = (x.astype(jax.tree.leaves(cache.state)[0].dtype) for x in (q, k, v))

  def steps(state):
    def body(state, xs):
      qkv, token_gates = xs
      return streaming.step(state, *qkv, **step_options, **token_gates)

    xs = (tuple(x.swapaxes(0, 1) for x in (q, k, v)),
          {name: x.swapaxes(0, 1) for name, x in gates.items()})
    state, out = lax.scan(body, state, xs)
    return state, out.swapaxes(0, 1)

  def cast_like(state, like):
    return jax.tree.map(lambda x, y: x.astype(y.dtype), state, like)

  if T == 1:
    state, out = steps(state)
  elif spec.cache_kind is CacheKind.RECURRENT:
    out, state = spec.function(q, k, v, is_causal=True, initial_state=state,
                               return_state=True, **packed, **options, **gates)
  else:  # A ring buffer: a prompt from position 0 is one blocked pass, later chunks scan.
    def fresh(state):
      out, new = spec.function(q, k, v, is_causal=True, return_state=True, **options)
      return cast_like(new, state), out.astype(q.dtype)

    state, out = lax.cond(cache.index == 0, fresh, steps, state)
  state = cast_like(state, cache.state)
  return StateCache(state, cache.index + T, ids[:, -1]), out.astype(dtype)
