"""cosFormer: ReLU linear attention re-weighted by the distance between positions.

Query i attends to the keys j it sees with the weights

    w_ij = relu(q_i)·relu(k_j) · cos(π (i - j) / 2L)

    out_i = Σ_j w_ij v_j / (Σ_j w_ij + eps)

for a fixed length L (``max_length``). Since ``cos(a - b) = cos a cos b + sin a
sin b``, the weight is a product of features that each know their own position::

    φ(x_p) = [relu(x_p) cos(π p / 2L), relu(x_p) sin(π p / 2L)]   [M = 2H]

so cosFormer is kernel linear attention (``linear.py``) with a feature map that
reads the position of its row: the recurrent core (chunked scans, state
passing, alignment, the one-token step) runs it unchanged. The positions
travel with the queries and keys as one more channel of the rows the core cuts
into chunks; the feature map splits it off.

Positions. Key j of a call sits at ``P + j`` and query t at its aligned key's
position ``P + t + S - T`` (bottom-right, as ``masks.causal``), where P is the
number of keys the ``initial_state`` holds (0 without one). With
``segment_ids`` (packed sequences) positions restart at 0 where a segment
starts: each segment is re-weighted as if it were alone (only its first
segment continues the state's positions). For every pair a query sees,
``|i - j| < L`` keeps ``cos`` positive: it holds when ``P + max(T, S) <= L``
(each segment counted from its own start), which the functions check where the
numbers are known (shapes always; a concrete state's P eagerly). Positions in
``[0, L)`` also keep every feature non-negative, so the normaliser is a sum of
non-negative terms.

The state (:class:`CosformerState`) holds the two sums of linear attention over
these features, ``position`` (P: where the next key goes) and ``max_length``
(L). Two summaries of consecutive spans combine by rotating the later one's
sums by the earlier one's length: its keys were featurised from position 0,
and ``cos(a + θ)``, ``sin(a + θ)`` are a rotation of ``cos a``, ``sin a``.

References:
  Qin et al., "cosFormer: Rethinking Softmax in Attention", ICLR 2022.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import checks, kernel, recurrence
from linattn_jax._src.kernel import DEFAULT_EPS, KernelFamily
from linattn_jax._src.linear import IMPLEMENTATIONS, LinearImplementation
from linattn_jax._src.masks import causal
from linattn_jax._src.online_softmax import divide_rows
from linattn_jax._src.recurrence import Start


class CosformerState(NamedTuple):
  """Recurrent state of :func:`cosformer_attention`, per key/value head (accumulation dtype).

  With the features ``φ(k_j) = [relu(k_j) cos(π j / 2L), relu(k_j) sin(π j / 2L)]``
  (M = 2H) of the keys j seen so far (positions from the start of their segment)::

      kv = Σ_j φ(k_j) v_jᵀ   [B, K, M, D]        k_sum = Σ_j φ(k_j)   [B, K, M]

  ``position`` is where the next key goes (the number of positions since the segment
  started, padded ones included) and ``max_length`` the L the features were made
  with, both stored as floats ``[B, K]`` (exact integers). A call from this state puts
  its first key at ``position``; :func:`combine` reads ``max_length`` to rotate a later
  summary into place. Unbatched calls use the same fields without B.

  Attributes:
    kv: ``[B, K, M, D]``: ``Σ_j φ(k_j) v_jᵀ``.
    k_sum: ``[B, K, M]``: ``Σ_j φ(k_j)``.
    position: ``[B, K]``: the position of the next key (0 for an empty state).
    max_length: ``[B, K]``: L.
    reset: None, or ``[B]`` bool in a summary of packed keys (the registry's
      ``summarize`` with ``segment_ids``): True where the keys hold a segment start,
      so that ``combine`` drops the state before them. Ignored as ``initial_state``.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 6, 2, 4))  # [B, T, N=K, H=D]
    >>> _, state = la.cosformer_attention(x, x, x, max_length=16, is_causal=True,
    ...                                   return_state=True)
    >>> state.kv.shape, state.k_sum.shape, state.position.tolist()  # M = 2H.
    ((1, 2, 8, 4), (1, 2, 8), [[6.0, 6.0]])
  """

  kv: jax.Array  # [B, K, M, D]: Σ_j φ(k_j) v_jᵀ.
  k_sum: jax.Array  # [B, K, M]: Σ_j φ(k_j).
  position: jax.Array  # [B, K]: position of the next key.
  max_length: jax.Array  # [B, K]: L.
  reset: Any = None  # None, or [B] bool (summaries of packed keys).


# Positions --------------------------------------------------------------------


def _angle(position: jax.Array, max_length: Any) -> jax.Array:
  return position * (math.pi / 2) / max_length


def _features(x: jax.Array, position: jax.Array, max_length: Any) -> jax.Array:
  """``[relu(x) cos(π p / 2L), relu(x) sin(π p / 2L)]``: ``x [..., H]``, ``position [...]``."""
  r, angle = jax.nn.relu(x), _angle(position, max_length)[..., None]
  return jnp.concatenate([r * jnp.cos(angle), r * jnp.sin(angle)], axis=-1)


def _positions(offset: jax.Array, T: int, S: int,
               reset: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """``(query positions [B, K, T], key positions [B, K, S])`` from the state's ``offset
  [B, K]`` and the segment starts ``reset [B, S]`` (None: one segment)."""
  j = jnp.arange(S, dtype=offset.dtype)
  keys = offset[..., None] + j[None, None]
  if reset is None:
    return offset[..., None] + (jnp.arange(T, dtype=offset.dtype) + (S - T))[None, None], keys
  first = recurrence.segment_index(reset[..., None]) == 0  # [B, S]
  start = lax.cummax(jnp.where(reset, j[None], 0), axis=1)  # [B, S]: each segment's start.
  keys = jnp.where(first[:, None], keys, (j[None] - start)[:, None])
  return keys, keys  # T == S.


def _final_position(offset: jax.Array, S: int, reset: jax.Array | None) -> jax.Array:
  """``[B, K]``: where the next key goes after S positions from ``offset [B, K]`` (those of
  the last segment, after ``offset`` if that segment is the first). Padded keys hold their
  places, as they do in one pass: positions are indices, whatever the lengths."""
  if reset is None:
    return offset + S
  c = recurrence.segment_index(reset[..., None])  # [B, S]
  last = jnp.sum(c == c[:, -1:], axis=-1, dtype=offset.dtype)[:, None]  # [B, 1]
  return jnp.where((c[:, -1] == 0)[:, None], offset, 0) + last


def _check_max_length(max_length: Any, T: int, S: int, *, fn: str) -> int:
  """``max_length`` as an int covering the call's positions, or a ValueError."""
  L = checks.check_positive_int(max_length, name="max_length", fn=fn)
  if max(T, S) > L:
    raise ValueError(
        f"{fn}: max_length={L} must cover the call's positions: query length T={T} and key "
        f"length S={S} must both be <= max_length (cos(π(i - j) / 2L) turns negative for "
        "|i - j| >= L).")
  return L


def _check_state_values(state: Any, L: int, S: int, *, fn: str) -> None:
  """Where ``state`` is concrete: its ``max_length`` is L and ``position + S <= L``."""
  fields = getattr(state, "_fields", ())
  if "position" not in fields or "max_length" not in fields:
    return  # The pipeline names what is missing.
  if any(isinstance(x, jax.core.Tracer) for x in (state.position, state.max_length)):
    return
  with jax.ensure_compile_time_eval():
    position, length = jnp.asarray(state.position), jnp.asarray(state.max_length)
    if position.size == 0 or not jnp.issubdtype(position.dtype, jnp.number):
      return
    position, lengths = float(jnp.max(position)), {float(x) for x in jnp.ravel(length)}
  if lengths - {float(L)}:
    raise ValueError(f"{fn}: initial_state was made with max_length {sorted(lengths)}; this "
                     f"call has max_length={L}.")
  if position + S > L:
    raise ValueError(
        f"{fn}: initial_state.position={position:g} plus key length S={S} exceeds "
        f"max_length={L}: positions must stay below max_length.")


# The family on the recurrent core --------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PositionFeatures:
  """Featurizer of the rows ``[..., H + 1]`` whose last channel is the row's position."""

  max_length: int

  def __call__(self, params: Any, x: jax.Array, *, is_query: bool):
    del params, is_query
    return _features(x[..., :-1], x[..., -1], self.max_length), None


@dataclasses.dataclass(frozen=True)
class _CosformerFamily(KernelFamily):
  """Kernel linear attention whose rows carry their positions to the feature map."""

  def start(self, chunk, state, params, inputs, p, options, *, fn):
    del inputs, options
    d, dtype = p.dims, chunk.v.dtype
    M, L = 2 * d.H, self.featurizer.max_length
    if state is None:
      offset = jnp.zeros_like(chunk.v, shape=(d.B, d.K))
      carry = kernel.empty_carry(d.B, d.K, M, 1, d.D, dtype, like=chunk.v)
    else:
      lead = (d.B,) if p.batched else ()
      state = recurrence.check_state(
          state, CosformerState,
          {"kv": lead + (d.K, M, d.D), "k_sum": lead + (d.K, M), "position": lead + (d.K,),
           "max_length": lead + (d.K,)},
          dims=f"B={d.B}, K={d.K}, M={M}, D={d.D}" + ("" if p.batched else " (no B)"),
          what="initial_state", fn=fn)
      state = jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), state)
      state = state if p.batched else jax.tree.map(lambda x: x[None], state)
      offset = state.position
      carry = kernel.Carry(state.kv, state.k_sum, jnp.zeros_like(state.k_sum[..., :1]))
    reset = None if chunk.reset is None else chunk.reset[:, 0, :, 0]  # [B, S]
    pq, pk = _positions(offset, d.T, d.S, reset)
    chunk = chunk._replace(
        fq=jnp.concatenate([chunk.fq, jnp.broadcast_to(pq[:, :, None, :, None],
                                                       chunk.fq.shape[:-1] + (1,))], -1),
        fk=jnp.concatenate([chunk.fk, pk[..., None]], -1))
    final = _final_position(offset, d.S, reset)
    prepare = kernel.featurizing(lambda x, is_query: self.featurizer(params, x, is_query=is_query),
                                 dtype)
    return Start(chunk, prepare, carry, state=(final, jnp.full_like(final, L)))

  def finish(self, out, carry, state, chunk, options):
    del chunk, options
    position, max_length = state
    return out, CosformerState(carry.kv, carry.k_sum, position, max_length)


def _family(max_length: int) -> _CosformerFamily:
  return _CosformerFamily(_PositionFeatures(max_length), "kernel", CosformerState,
                          IMPLEMENTATIONS)


# Public API --------------------------------------------------------------------


def _cosformer(query, key, value, *, max_length, is_causal, key_value_seq_lengths, segment_ids,
               eps, implementation, chunk_size, initial_state, return_state, fn: str):
  """:func:`cosformer_attention` with errors naming ``fn``."""
  q_shape, k_shape = jnp.shape(query), jnp.shape(key)
  S = k_shape[-3] if len(k_shape) >= 3 else 0
  if len(q_shape) in (3, 4) and len(k_shape) == len(q_shape):
    L = _check_max_length(max_length, q_shape[-3], S, fn=fn)
  else:  # The pipeline names the ranks.
    L = checks.check_positive_int(max_length, name="max_length", fn=fn)
  result = recurrence.recurrent_attention(
      _family(L), query, key, value, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids, eps=eps,
      implementation=implementation, chunk_size=chunk_size, initial_state=initial_state,
      return_state=return_state, fn=fn)
  if initial_state is not None:  # After the pipeline's checks of its shapes.
    _check_state_values(initial_state, L, S, fn=fn)
  return result


def cosformer_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    max_length: int,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | None = None,
    eps: float = DEFAULT_EPS,
    initial_state: CosformerState | None = None,
    return_state: bool = False,
    implementation: LinearImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, CosformerState]:
  """cosFormer attention: ReLU linear attention re-weighted by ``cos(π(i - j) / 2L)``.

  ``out_i = Σ_j w_ij v_j / (Σ_j w_ij + eps)`` with
  ``w_ij = relu(q_i)·relu(k_j) cos(π(i - j) / 2L)`` over the keys j query i
  sees, computed in O(T) as linear attention with the features
  ``φ(x_p) = [relu(x_p) cos(πp / 2L), relu(x_p) sin(πp / 2L)]`` (M = 2H) of each
  row's position p (see the module docstring). Sums and the state are float32
  (float64 for float64 inputs).

  Positions: key j at ``P + j``, query t at ``P + t + S - T`` (bottom-right
  aligned), with P the ``initial_state``'s ``position`` (0 without one); with
  ``segment_ids`` they restart at 0 at each segment start (the first segment
  continues from P). L must cover them: ``P + max(T, S) <= max_length``.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA / MQA).
    value: ``[B, S, K, D]``.
    max_length: L, a static positive int: the length the re-weighting spans
      (the paper's sequence length). Fixed for a stream: a state is tied to it.
    is_causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it count
      nowhere and add nothing to the state, but hold their places: positions are
      indices, and the state's ``position`` advances by S.
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S, ``is_causal=True``): the state is dropped where the id changes and
      positions restart at 0, so each segment is attended as if it were alone;
      ``initial_state`` seeds each row's first segment and the returned state is its
      last segment's. Their order is checked only where concrete (not under
      ``jax.jit``).
    eps: added to the normaliser (static float >= 0).
    initial_state: a :class:`CosformerState` of earlier keys, which every query
      sees; this call's keys continue at its ``position``. Splitting a sequence
      and carrying the state equals one pass.
    return_state: also return the state after the last valid key.
    implementation: ``"reference"``, ``"parallel"`` (non-causal only),
      ``"scan"``, ``"associative_scan"``, ``"chunked"``, or None: ``"chunked"``
      if causal, else ``"parallel"`` (as :func:`linear_attention`).
    chunk_size: C of the causal forms (None: the backend's measured best, as
      :func:`linear_attention`'s).

  Returns:
    ``[B, T, N, D]`` in the input dtype, or ``(out, CosformerState)`` with
    ``return_state``. Queries that see no key (and no state) return zeros.

  Raises:
    ValueError: on bad shapes, dtypes or lengths, a ``max_length`` that is not a
      positive int or is below T or S (or, for a concrete ``initial_state``, below
      its ``position`` + S, or not the state's own), an unknown implementation,
      ``"parallel"`` with ``is_causal=True``, a non-positive ``chunk_size``, a
      negative ``eps``, bad ``segment_ids``, or an ``initial_state`` that is not a
      :class:`CosformerState` of float arrays of the shapes above.

  Examples:
    >>> q = jnp.ones((2, 100, 8, 16)); kv = jnp.ones((2, 100, 2, 16))
    >>> la.cosformer_attention(q, kv, kv, max_length=128, is_causal=True).shape
    (2, 100, 8, 16)

    The weights are ReLU kernel weights times ``cos(π(i - j) / 2L)``:

    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 1, 4))  # [B, T, N, H]
    >>> i = jnp.arange(8.0)
    >>> w = jnp.einsum("th,sh->ts", jax.nn.relu(x[0, :, 0]), jax.nn.relu(x[0, :, 0]))
    >>> w = w * jnp.cos(jnp.pi * (i[:, None] - i[None, :]) / 16)  # L = 8.
    >>> want = (w @ x[0, :, 0]) / (w.sum(-1, keepdims=True) + 1e-6)
    >>> got = la.cosformer_attention(x, x, x, max_length=8)
    >>> bool(jnp.allclose(got[0, :, 0], want, atol=1e-5))
    True

  References:
    Qin et al., "cosFormer: Rethinking Softmax in Attention", ICLR 2022.
  """
  return _cosformer(
      query, key, value, max_length=max_length, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids, eps=eps,
      implementation=implementation, chunk_size=chunk_size, initial_state=initial_state,
      return_state=return_state, fn="cosformer_attention")


def cosformer_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    max_length: int,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | None = None,
    eps: float = DEFAULT_EPS,
    initial_state: CosformerState | None = None,
    return_state: bool = False,
) -> jax.Array | tuple[jax.Array, CosformerState]:
  """The oracle of :func:`cosformer_attention`: the masked ``[T, S]`` weights, plain einsums.

  ``w_ij = relu(q_i)·relu(k_j) cos(π(i - j) / 2L)`` formed at once
  (``[B, N, T, S]``: O(T·S) memory) from the positions themselves, not from the
  features the fast forms split it into, masked for causality, padding and
  segments; ``out_i = (Σ_j w_ij v_j + φ(q_i)ᵀ kv) / (Σ_j w_ij + φ(q_i)ᵀ k_sum + eps)``
  with the ``initial_state``'s sums (for queries of a row's first segment). In
  float32 (float64 for float64 inputs); never optimised.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``.
    max_length, is_causal, key_value_seq_lengths, segment_ids, eps, initial_state,
      return_state: as in :func:`cosformer_attention`.

  Returns:
    ``[B, T, N, D]`` in the input dtype, or ``(out, CosformerState)``.

  Raises:
    ValueError: as :func:`cosformer_attention`: bad shapes, dtypes, lengths or
      ``segment_ids``, a ``max_length`` that does not cover the positions, a
      negative ``eps``, or an ``initial_state`` that is not a
      :class:`CosformerState` of float arrays of the right shapes.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> fast = la.cosformer_attention(x, x, x, max_length=8, is_causal=True)
    >>> slow = la.cosformer_attention_reference(x, x, x, max_length=8, is_causal=True)
    >>> bool(jnp.allclose(fast, slow, atol=1e-5))
    True

  References:
    Qin et al., "cosFormer: Rethinking Softmax in Attention", ICLR 2022.
  """
  # One compiled program; the values of a concrete initial_state are judged after it (its
  # shapes and the options first, as the program traces).
  result = _reference(query, key, value, max_length=max_length, is_causal=is_causal,
                      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                      eps=eps, initial_state=initial_state, return_state=return_state)
  if initial_state is not None:
    _check_state_values(initial_state, max_length, jnp.shape(key)[-3], fn=_REFERENCE)
  return result


_REFERENCE = "cosformer_attention_reference"


@checks.compiled("max_length", "is_causal", "eps", "return_state",
                 concrete_checks={"segment_ids": checks.check_segment_order}, name=_REFERENCE)
def _reference(query, key, value, *, max_length, is_causal, key_value_seq_lengths, segment_ids,
               eps, initial_state, return_state):
  fn = _REFERENCE
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  p = checks.prepare_qkv(query, key, value, fn=fn)
  d = p.dims
  L = _check_max_length(max_length, d.T, d.S, fn=fn)
  if isinstance(eps, bool) or not isinstance(eps, int | float) or eps < 0:
    raise ValueError(f"{fn}: eps must be a non-negative float; got {eps!r}.")
  (lengths,) = checks.check_lengths(p, fn=fn, key_value_seq_lengths=key_value_seq_lengths
                                    ).values()
  ids = recurrence.check_segment_ids(segment_ids, p, is_causal=is_causal, fn=fn)
  dtype = checks.accumulation_dtype(p.query.dtype)
  M = 2 * d.H
  if initial_state is None:
    state = CosformerState(jnp.zeros((d.B, d.K, M, d.D), dtype), jnp.zeros((d.B, d.K, M), dtype),
                           jnp.zeros((d.B, d.K), dtype), jnp.full((d.B, d.K), L, dtype))
  else:
    lead = (d.B,) if p.batched else ()
    state = recurrence.check_state(
        initial_state, CosformerState,
        {"kv": lead + (d.K, M, d.D), "k_sum": lead + (d.K, M), "position": lead + (d.K,),
         "max_length": lead + (d.K,)},
        dims=f"B={d.B}, K={d.K}, M={M}, D={d.D}", what="initial_state", fn=fn)
    state = jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), state)
    state = state if p.batched else jax.tree.map(lambda x: x[None], state)
  q, k, v = (x.astype(dtype) for x in (p.query, p.key, p.value))
  G = d.G
  reset = None if ids is None else recurrence.segment_resets(ids)  # [B, S]
  pq, pk = _positions(state.position, d.T, d.S, reset)  # [B, K, T], [B, K, S]
  valid = (jnp.ones((d.B, d.S), bool) if lengths is None
           else jnp.arange(d.S, dtype=jnp.int32)[None] < lengths[:, None])  # [B, S]
  visible = valid[:, None, None, :]  # [B, 1, T, S]
  if is_causal:
    visible = visible & causal(d.T, d.S)[None, None]
  seeded = jnp.ones((d.B, 1, d.T), bool)  # Queries the state reaches.
  if reset is not None:
    c = recurrence.segment_index(reset[..., None])  # [B, S] (T == S)
    visible = visible & (c[:, :, None] == c[:, None, :])[:, None]
    seeded = (c == 0)[:, None]
  per_query = lambda x: jnp.repeat(x, G, axis=1)  # [B, K, ...] -> [B, N, ...]  # noqa: E731
  qpos, kpos = per_query(pq), per_query(pk)  # [B, N, T], [B, N, S]
  rq, rk = jax.nn.relu(q), jnp.repeat(jax.nn.relu(k), G, axis=2)  # [B, T|S, N, H]
  cosine = jnp.cos(_angle(qpos[..., :, None] - kpos[..., None, :], L))  # [B, N, T, S]
  w = jnp.where(visible, jnp.einsum("btnh,bsnh->bnts", rq, rk) * cosine, 0)
  fq = _features(q, qpos.transpose(0, 2, 1), L)  # [B, T, N, M]
  fq = jnp.where(seeded.transpose(0, 2, 1)[..., None], fq, 0)
  num = (jnp.einsum("bnts,bsnd->btnd", w, jnp.repeat(v, G, axis=2))
         + jnp.einsum("btnm,bnmd->btnd", fq, per_query(state.kv)))
  den = (jnp.einsum("bnts->btn", w) + jnp.einsum("btnm,bnm->btn", fq, per_query(state.k_sum)))
  out = p.restore(divide_rows(num, den + eps).astype(p.query.dtype))
  if not return_state:
    return out
  keep = jnp.broadcast_to(valid[:, None], (d.B, d.K, d.S))  # [B, K, S]
  carried = jnp.ones((d.B, 1, 1), bool)
  if reset is not None:
    keep = keep & (c == c[:, -1:])[:, None]
    carried = (c[:, -1] == 0)[:, None, None]
  fk = _features(k, pk.transpose(0, 2, 1), L)  # [B, S, K, M]
  fk = jnp.where(keep.transpose(0, 2, 1)[..., None], fk, 0)
  new = CosformerState(
      jnp.einsum("bskm,bskd->bkmd", fk, v) + jnp.where(carried[..., None], state.kv, 0),
      jnp.einsum("bskm->bkm", fk) + jnp.where(carried, state.k_sum, 0),
      _final_position(state.position, d.S, reset),
      jnp.full_like(state.max_length, L))
  return out, new if p.batched else jax.tree.map(lambda x: x[0], new)


def init_cosformer_state(
    batch: int, num_kv_heads: int, head_dim: int, value_dim: int, dtype: Any = jnp.float32, *,
    max_length: int,
) -> CosformerState:
  """The empty :class:`CosformerState`: zeros ``kv [B, K, M, D]``, ``k_sum [B, K, M]``.

  The state of no keys (M = 2H), with ``position`` 0 and ``max_length`` L, from
  which :func:`cosformer_attention_step` decodes.

  Args:
    batch: B.
    num_kv_heads: K.
    head_dim: H.
    value_dim: D.
    dtype: the state's dtype: float32 for float32, bfloat16 and float16 inputs,
      float64 for float64 ones.
    max_length: L, as :func:`cosformer_attention_step` will be given it.

  Returns:
    A :class:`CosformerState`.

  Raises:
    ValueError: if a size or ``max_length`` is not a positive int.

  Examples:
    >>> state = la.init_cosformer_state(2, 1, 4, 3, max_length=64)
    >>> state.kv.shape, state.k_sum.shape, state.position.tolist()
    ((2, 1, 8, 3), (2, 1, 8), [[0.0], [0.0]])
  """
  fn = "init_cosformer_state"
  B, K, H, D = checks.positive_sizes(batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     value_dim=value_dim, fn=fn)
  L = checks.check_positive_int(max_length, name="max_length", fn=fn)
  return CosformerState(jnp.zeros((B, K, 2 * H, D), dtype), jnp.zeros((B, K, 2 * H), dtype),
                        jnp.zeros((B, K), dtype), jnp.full((B, K), L, dtype))


def cosformer_attention_step(
    state: CosformerState,
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    max_length: int,
    eps: float = DEFAULT_EPS,
) -> tuple[CosformerState, jax.Array]:
  """One causal decoding step at the state's position: adds one key/value, reads one query.

  The token sits at ``p = state.position``: ``kv ← kv + φ(k) vᵀ``,
  ``k_sum ← k_sum + φ(k)`` with ``φ(k) = [relu(k) cos(πp / 2L), relu(k) sin(πp / 2L)]``,
  ``position ← p + 1``, then ``out = φ(q)ᵀ kv / (φ(q)ᵀ k_sum + eps)``. Scanned
  over T tokens from :func:`init_cosformer_state` it equals
  ``cosformer_attention(..., is_causal=True)``.

  Args:
    state: a :class:`CosformerState` ``[B, K, M, D]`` / ``[B, K, M]`` / ``[B, K]``.
    query: ``[B, N, H]`` (or unbatched ``[N, H]``, with an unbatched state).
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.
    max_length: L, the state's (a concrete state at position L cannot take a token).
    eps: as in :func:`cosformer_attention`.

  Returns:
    ``(state, out)`` with out ``[B, N, D]`` in the input dtype; the new state keeps
    the dtype of ``state`` (``lax.scan``-compatible).

  Raises:
    ValueError: if query, key and value are not all rank 3 (or all rank 2), and as
      :func:`cosformer_attention` for bad shapes or a state that does not match.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> def step(state, x_t):
    ...   return la.cosformer_attention_step(state, x_t, x_t, x_t, max_length=8)
    >>> empty = la.init_cosformer_state(1, 2, 4, 4, max_length=8)
    >>> state, outs = jax.lax.scan(step, empty, x.swapaxes(0, 1))
    >>> full = la.cosformer_attention(x, x, x, max_length=8, is_causal=True)
    >>> bool(jnp.allclose(outs.swapaxes(0, 1), full, atol=1e-5)), state.position.tolist()
    (True, [[8.0, 8.0]])

  References:
    Qin et al., "cosFormer: Rethinking Softmax in Attention", ICLR 2022.
  """
  return recurrence.one_token_step(cosformer_attention, state, query, key, value,
                                   max_length=max_length, eps=eps)


def combine_states(earlier: CosformerState, later: CosformerState) -> CosformerState:
  """The state of ``earlier``'s keys followed by ``later``'s (associative).

  ``later``'s keys were featurised from position 0; in the sequence they follow
  ``earlier.position`` keys, so its sums are rotated by ``θ = π P / 2L``
  (``cos(a + θ) = cos a cos θ - sin a sin θ``, ``sin(a + θ) = sin a cos θ + cos a
  sin θ``) and added; positions add. Where ``later.reset`` is True the result is
  ``later`` itself, its ``reset`` kept.

  Raises:
    ValueError: for states that are not both :class:`CosformerState`, or whose
      fields' shapes differ.
  """
  cls = CosformerState
  if type(earlier) is not cls or type(later) is not cls:
    raise ValueError(f"combine: both states must be the same variant's state; got "
                     f"{type(earlier).__name__} and {type(later).__name__}.")
  for field in cls._fields[:-1]:
    a, b = jnp.shape(getattr(earlier, field)), jnp.shape(getattr(later, field))
    if a != b:
      raise ValueError(f"combine: {cls.__name__}.{field} has shapes {a} and {b}.")
  theta = _angle(earlier.position, later.max_length)[..., None]  # [..., K, 1]

  def rotate(x, axis):  # The cos half and the sin half of M (on ``axis``) turned by θ.
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    if axis == -2:
      cos, sin = cos[..., None], sin[..., None]
    c, s = jnp.split(x, 2, axis=axis)
    return jnp.concatenate([c * cos - s * sin, s * cos + c * sin], axis=axis)

  kv = earlier.kv + rotate(later.kv, -2)
  k_sum = earlier.k_sum + rotate(later.k_sum, -1)
  position = earlier.position + later.position
  if later.reset is not None:
    drop = jnp.asarray(later.reset)
    pick = lambda a, b: jnp.where(drop.reshape(drop.shape + (1,) * (a.ndim - drop.ndim)),  # noqa: E731
                                  b, a)
    kv, k_sum, position = pick(kv, later.kv), pick(k_sum, later.k_sum), pick(
        position, later.position)
  resets = [jnp.asarray(r) for r in (earlier.reset, later.reset) if r is not None]
  reset = None if not resets else (resets[0] if len(resets) == 1 else resets[0] | resets[1])
  return cls(kv, k_sum, position, later.max_length, reset)


# Registry ----------------------------------------------------------------------


def _init_like(query, key, value, *, max_length: int) -> CosformerState:
  """The empty state for arrays shaped like ``query``, ``key``, ``value`` (streaming init)."""
  p = checks.prepare_qkv(query, key, value, fn="init_cosformer_state")
  d = p.dims
  return init_cosformer_state(d.B, d.K, d.H, d.D, checks.accumulation_dtype(p.query.dtype),
                              max_length=max_length)


def _summarize(key, value, *, max_length: int, key_value_seq_lengths: Any = None,
               segment_ids: Any = None) -> CosformerState:
  """The :class:`CosformerState` of ``key`` / ``value`` from position 0 (the registry's
  ``summarize``)."""
  return recurrence.summarize_keys(cosformer_attention, key, value, max_length=max_length,
                                   segment_ids=segment_ids,
                                   key_value_seq_lengths=key_value_seq_lengths)


recurrence.register_recurrent(
    "cosformer", family=_family(1), function=cosformer_attention,
    reference=cosformer_attention_reference, init=_init_like, step=cosformer_attention_step,
    summarize=_summarize, combine=combine_states, positional=True)
