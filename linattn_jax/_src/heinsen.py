"""Heinsen's attention: ``softmax_j(log(exp(Q) exp(K)ᵀ)) V`` at linear-attention cost.

Query t weighs key j by ``w_tj ∝ Σ_h exp(q_th + k_jh)``::

    out_t = Σ_j w_tj v_j,    w_tj = Σ_h exp(q_th + k_jh) / Σ_j' Σ_h exp(q_th + k_j'h)

This is linear attention with the elementwise feature map φ = exp (M = H):
``φ(q)·φ(k) = Σ_h exp(q_h) exp(k_h)``, so ``out_t = φ(q_t)ᵀ S / φ(q_t)ᵀ Z`` with
``S = Σ_j φ(k_j) v_jᵀ`` ``[H, D]`` and ``Z = Σ_j φ(k_j)`` ``[H]``. The exponentials overflow
float32 once ``q_h + k_h`` passes about 88, so ``heinsen_attention`` runs on the recurrent
core (``recurrence.py``) with a log-scale per feature: the state keeps
``Σ_j exp(k_jh - m_h) v_j`` and ``Σ_j exp(k_jh - m_h)`` with ``m_h`` the running max of the
visible keys' feature h, and a query reads it with the coefficients
``exp(q_h + m_h - max_h'(q_h' + m_h'))``. Nothing overflows for keys and queries of any
size, the future never enters through the stabiliser, and values of any sign (or exact
zeros) enter linearly, so forward and gradient are exact. A term dropped by underflow is
``e^-87`` below a kept term of the same feature. The cost is that of linear attention:
``T·H`` exponentials and matrix products, no ``[T, H, D]`` log-space arrays.

``log_heinsen_attention`` takes log-values and returns log-outputs, the form of the paper's
own implementation; there the values themselves are logs, so it keeps the log-space
computation::

    log S_hd = logsumexp_j (k_jh + log v_jd)         log Z_h = logsumexp_j k_jh
    out_td = logsumexp_h (q_th + log S_hd) - logsumexp_h (q_th + log Z_h)

It forms ``[C, H, D + 1]`` log-sums per chunk of C keys ("chunked"; the backward pass keeps
one state per chunk) or for the whole sequence ("parallel"). Every log and log-sum-exp uses
the double-``where`` form, so ``log 0 = -inf`` entries stay free of NaN.

No scale is applied (q and k enter as ``q_h + k_h``). Causal: query t sees keys
``j <= t + S - T`` (bottom-right aligned, see ``masks.causal``). Keys past
``key_value_seq_lengths`` count nowhere. A query that sees no key returns zeros
(``log_heinsen_attention``: ``-inf``).

References:
  F. A. Heinsen, "Softmax Attention with Constant Cost per Token", 2024 (arXiv:2404.05843).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import checks, recurrence
from linattn_jax._src import masks as masks_lib
from linattn_jax._src.blocks import merge_blocks, pad_axis, split_blocks
from linattn_jax._src.online_softmax import exponent_shift
from linattn_jax._src.recurrence import DEFAULT_PER_FEATURE_CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from linattn_jax._src.registry import AttentionSpec, StreamingSpec, register_attention

HeinsenImplementation = Literal["reference", "parallel", "scan", "associative_scan", "chunked"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(HeinsenImplementation)
# log_heinsen_attention's own (log-space) forms.
LogHeinsenImplementation = Literal["reference", "parallel", "chunked"]
LOG_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(LogHeinsenImplementation)


class HeinsenState(NamedTuple):
  """Recurrent state of :func:`heinsen_attention` per kv head, in units of ``exp(running_max)``.

  The sums it stands for, per feature h, are::

      Σ_j exp(k_jh) v_j = exp(running_max_h) · kv_h    Σ_j exp(k_jh) = exp(running_max_h) · k_sum_h

  i.e. ``exp(running_max[..., None]) * kv`` and ``exp(running_max) * k_sum``; a query
  reads them with the weights ``exp(q_h)``. Float32 (float64 for float64 inputs); unbatched
  calls use the same fields without the leading B.

  Attributes:
    kv: ``[B, K, H, D]``: ``Σ_j exp(k_jh - running_max_h) v_j``.
    k_sum: ``[B, K, H]``: ``Σ_j exp(k_jh - running_max_h)``.
    running_max: ``[B, K, H]``: ``max_j k_jh`` over the keys so far (``-inf`` before any key).

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> _, state = la.heinsen_attention(x, x, x, is_causal=True, return_state=True)
    >>> state.kv.shape, state.k_sum.shape, state.running_max.shape
    ((1, 2, 4, 4), (1, 2, 4), (1, 2, 4))
  """

  kv: jax.Array  # [B, K, H, D]: Σ_j exp(k_jh - running_max_h) v_j.
  k_sum: jax.Array  # [B, K, H]: Σ_j exp(k_jh - running_max_h).
  running_max: jax.Array  # [B, K, H]: max_j k_jh over the keys so far (-inf before any key).


@dataclasses.dataclass(frozen=True)
class _Exp:
  """Featurizer of the core: ``φ(x) = exp(x)`` as features 1 with a log-scale ``x`` per feature."""

  def __call__(self, params: Any, x: jax.Array, *, is_query: bool):
    del params, is_query
    return jnp.ones(x.shape[:-1] + (1,), x.dtype), x


# NaN-free log-space primitives ------------------------------------------------------------


def _safe_log(x: jax.Array) -> jax.Array:
  """``log x`` for ``x > 0``, ``-inf`` elsewhere, with a zero (never NaN) gradient there."""
  positive = x > 0
  return jnp.where(positive, jnp.log(jnp.where(positive, x, 1.0)), -jnp.inf)


def _logsumexp(x: jax.Array, axis: int) -> jax.Array:
  """``log Σ exp(x)`` over ``axis``; ``-inf`` (zero gradient) when every entry is ``-inf``."""
  m = lax.stop_gradient(exponent_shift(jnp.max(x, axis=axis, keepdims=True)))
  return _safe_log(jnp.sum(jnp.exp(x - m), axis=axis)) + jnp.squeeze(m, axis)


def _logaddexp(a: jax.Array, b: jax.Array) -> jax.Array:
  """``log(exp(a) + exp(b))``, NaN-free for ``a = b = -inf``."""
  m = lax.stop_gradient(exponent_shift(jnp.maximum(a, b)))
  return _safe_log(jnp.exp(a - m) + jnp.exp(b - m)) + m


def _cumlogsumexp(x: jax.Array, axis: int) -> jax.Array:
  """Log-cumulative-sum-exp; entry i combines entries ``<= i`` only."""
  return lax.associative_scan(_logaddexp, x, axis=axis)


# Chunk bodies -------------------------------------------------------------------------------


def _key_terms(k: jax.Array, log_v: jax.Array) -> jax.Array:
  """``k_jh + log u_je`` for each key: ``[B, C, K, H]``, ``[B, C, K, E]`` -> ``[B, C, K, H, E]``."""
  return k[..., :, None] + log_v[..., None, :]


def _read(states: jax.Array, q: jax.Array) -> jax.Array:
  """``logsumexp_h(q_h + log S_he)``: ``[B, C, K, G, E]``.

  ``states`` is ``[B, C|1, K, H, E]`` (one per query, or one shared), ``q`` ``[B, C, K, G, H]``.
  """
  return _logsumexp(q[..., None] + states[:, :, :, None], axis=-2)


def _fold_chunk(state, chunk):
  """Adds C keys to the state: ``log S <- log(S + Σ_j exp(k_j) u_j)``."""
  k, log_v = chunk
  return _logaddexp(state, _logsumexp(_key_terms(k, log_v), axis=1)), None


def _read_chunk(state, chunk):
  """C queries read the (fixed) state."""
  (q,) = chunk
  return state, _read(state[:, None], q)


def _causal_chunk(state, chunk):
  """C aligned queries and keys: per-position states, each query reads its own."""
  q, k, log_v = chunk
  prefix = _logaddexp(state[:, None], _cumlogsumexp(_key_terms(k, log_v), axis=1))
  return prefix[:, -1], _read(prefix, q)


def _scan_chunks(body, state, xs, length: int, chunk: int, fills):
  """Runs ``body`` over time chunks of the ``[B, L, ...]`` arrays ``xs``.

  Each array is padded along L with its ``fills`` entry, cut into ``ceil(L / chunk)`` chunks
  and scanned with ``body`` under ``jax.checkpoint`` (the backward pass stores one state per
  chunk and recomputes the rest). A single chunk is processed directly.
  Returns the final state and the per-chunk outputs merged back to ``[B, L, ...]``.
  """
  chunk = min(chunk, length)
  blocks = tuple(split_blocks(pad_axis(x, 1, chunk, fill), 1, chunk)
                 for x, fill in zip(xs, fills, strict=True))
  if blocks[0].shape[0] == 1:
    state, out = body(state, tuple(b[0] for b in blocks))
    out = None if out is None else out[None]
  else:
    state, out = lax.scan(jax.checkpoint(body), state, blocks)
  return state, None if out is None else merge_blocks(out, 1, length)


def _fold(state, k, log_v, chunk: int):
  if k.shape[1] == 0:
    return state
  return _scan_chunks(_fold_chunk, state, (k, log_v), k.shape[1], chunk, (0.0, -jnp.inf))[0]


def _read_all(state, q, chunk: int):
  return _scan_chunks(_read_chunk, state, (q,), q.shape[1], chunk, (0.0,))[1]


def _causal_aligned(state, q, k, log_v, chunk: int):
  """T == S causal: query t sees keys ``<= t`` and the initial state."""
  state, log_num = _scan_chunks(
      _causal_chunk, state, (q, k, log_v), q.shape[1], chunk, (0.0, 0.0, -jnp.inf))
  return log_num, state


def _log_numerators(q, k, log_v, state, *, is_causal: bool, chunk: int):
  """``log Σ_visible j Σ_h exp(q_th + k_jh) u_je`` ``[B, T, K, G, E]`` and the final state.

  Bottom-right alignment reduces every causal call to the T == S case: for S > T the first
  S - T keys are folded into the state (every query sees them); for T > S the first T - S
  queries see only the initial state.
  """
  T, S = q.shape[1], k.shape[1]
  if not is_causal:
    state = _fold(state, k, log_v, chunk)
    return _read_all(state, q, chunk), state
  offset = S - T
  if offset >= 0:
    state = _fold(state, k[:, :offset], log_v[:, :offset], chunk)
    return _causal_aligned(state, q, k[:, offset:], log_v[:, offset:], chunk)
  early = _read_all(state, q[:, :-offset], chunk)
  log_num, state = _causal_aligned(state, q[:, -offset:], k, log_v, chunk)
  return jnp.concatenate([early, log_num], axis=1), state


# Log-value path -------------------------------------------------------------------------


def _key_mask(S: int, kv_len: jax.Array | None) -> jax.Array:
  """Valid keys ``[B|1, S]``."""
  return masks_lib.length_predicate(jnp.arange(S), kv_len)


@functools.partial(jax.jit, static_argnames=("is_causal", "chunk"))
def _log_space_attention(query, key, log_value, kv_len, *, is_causal: bool, chunk: int):
  """Log-outputs ``[B, T, N, D]`` from validated ``[B, T, N, H]`` / ``[B, S, K, H]`` /
  ``[B, S, K, D]`` arrays: log-numerators of the streams ``[log v | log 1]`` (E = D + 1,
  the last column accumulates the normaliser), minus the log-normaliser."""
  acc = checks.accumulation_dtype(query.dtype)
  B, T, N, H = query.shape
  _, S, K, D = log_value.shape
  q, k, log_v = (x.astype(acc) for x in (query, key, log_value))
  log_u = jnp.concatenate([log_v, jnp.zeros_like(log_v[..., :1])], axis=-1)
  log_u = jnp.where(_key_mask(S, kv_len)[:, :, None, None], log_u, -jnp.inf)
  q = q.reshape(B, T, K, N // K, H)  # head n reads kv head n // G.
  empty = jnp.full((B, K, H, D + 1), -jnp.inf, acc)  # log 0
  log_num, _ = _log_numerators(q, k, log_u, empty, is_causal=is_causal, chunk=chunk)
  out = log_num[..., :D] - exponent_shift(log_num[..., D:])
  return out.reshape(B, T, N, D).astype(query.dtype)


@functools.partial(jax.jit, static_argnames=("is_causal", "log_space"))
def _reference(query, key, value, kv_len, *, is_causal: bool, log_space: bool):
  """Explicit weights ``[B, T, S, N]``, masked and normalised in log space::

      log w_tj = logsumexp_h(q_th + k_jh) - logsumexp_j' logsumexp_h(q_th + k_j'h)

  then ``Σ_j w_tj v_j`` (``v`` kept linear), or ``logsumexp_j(log w_tj + log v_j)``.
  """
  acc = checks.accumulation_dtype(query.dtype)
  _, T, N, _ = query.shape
  _, S, K, _ = key.shape
  q = query.astype(acc)
  k, v = (jnp.repeat(x.astype(acc), N // K, axis=2) for x in (key, value))  # [B, S, N, ·]
  logits = _logsumexp(q[:, :, None] + k[:, None], axis=-1)  # [B, T, S, N]
  valid = _key_mask(S, kv_len)[:, None, :]  # [B|1, 1, S]
  if is_causal:
    valid = valid & masks_lib.causal(T, S)[None]
  logits = jnp.where(valid[..., None], logits, -jnp.inf)
  log_w = logits - exponent_shift(_logsumexp(logits, axis=2))[:, :, None]
  if log_space:
    out = _logsumexp(log_w[..., None] + v[:, None], axis=2)
  else:
    out = jnp.einsum("btsn,bsnd->btnd", jnp.exp(log_w), v)
  return out.astype(query.dtype)


# Public API ---------------------------------------------------------------------------------


def heinsen_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
) -> jax.Array:
  """The oracle of :func:`heinsen_attention`: explicit ``[B, T, S, N]`` weights, never optimised.

  ``log w_tj = logsumexp_h(q_th + k_jh)``, masked, normalised over j in log space, then
  ``out = Σ_j w_tj v_j`` with ``v`` kept linear: O(T·S·H) memory. Same arguments and
  result as :func:`heinsen_attention` with ``implementation="reference"`` (without state
  passing).

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``.
    is_causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are ignored.

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype; zeros for queries that see no
    key.

  Raises:
    ValueError: on bad ranks, mixed or unsupported dtypes, mismatched batch, length or head
      sizes, or lengths that are not ``[B]`` ints.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> fast = la.heinsen_attention(x, x, x, is_causal=True)
    >>> slow = la.heinsen_attention_reference(x, x, x, is_causal=True)
    >>> bool(jnp.allclose(fast, slow, atol=1e-5))
    True

  References:
    Heinsen, "Softmax Attention with Constant Cost per Token", 2024.
  """
  fn = "heinsen_attention_reference"
  return _oracle(query, key, value, fn=fn, log_space=False,
                 is_causal=checks.check_static_bool(is_causal, name="is_causal", fn=fn),
                 key_value_seq_lengths=key_value_seq_lengths)


def _oracle(query, key, value, *, fn: str, log_space: bool, is_causal: bool,
            key_value_seq_lengths: Any) -> jax.Array:
  p = checks.prepare_qkv(query, key, value, fn=fn)
  kv_len = checks.check_lengths(
      p, fn=fn, key_value_seq_lengths=key_value_seq_lengths)["key_value_seq_lengths"]
  return p.restore(_reference(p.query, p.key, p.value, kv_len, is_causal=is_causal,
                              log_space=log_space))


@checks.compiled("is_causal", "implementation", "chunk_size", "return_state")
def heinsen_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    implementation: HeinsenImplementation | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: HeinsenState | None = None,
    return_state: bool = False,
) -> jax.Array | tuple[jax.Array, HeinsenState]:
  """Heinsen's attention, ``softmax_j(log(exp(Q) exp(K)ᵀ)) V``, at linear-attention cost.

  ``out_t = Σ_j w_tj v_j`` with ``w_tj ∝ Σ_h exp(q_th + k_jh)`` over the visible keys: linear
  attention with the feature map φ = exp, kept finite for inputs of any size by a running
  max per feature (see the module docstring). Values may have any sign. No scale is applied.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA; one state per kv head).
    value: ``[B, S, K, D]``; any sign, D may differ from H.
    is_causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned: for S > T the
      first S - T keys are seen by every query, for T > S the first T - S queries see only
      ``initial_state``).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are ignored.
    implementation: ``"reference"`` (explicit log-space weights, O(T·S·H); no state
      passing), ``"parallel"`` (one summary of all keys; causal: the prefix states of every
      position at once by ``lax.associative_scan``, ``[T, H, D]`` per kv head),
      ``"scan"`` (token recurrence), ``"associative_scan"`` (per chunk), ``"chunked"``
      (chunks of ``chunk_size``: masked ``[C, C]`` weights within, the state across; one
      state per chunk kept for the backward pass), or None: ``"chunked"`` when causal,
      else ``"parallel"``.
    chunk_size: positions per chunk of the causal forms (static).
    initial_state: a :class:`HeinsenState` of earlier keys, seen by every query.
    return_state: also return the state after all (valid) keys.

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype, zeros for queries that see no
    key; with ``return_state`` the pair ``(out, state)``. Splitting a causal sequence
    anywhere and passing the state on gives the same outputs as one pass.

  Raises:
    ValueError: on bad shapes, dtypes or lengths, an unknown implementation, a bad
      ``chunk_size``, a state that is not a matching :class:`HeinsenState`, or state
      passing with ``"reference"``.

  Examples:
    >>> q = jnp.ones((2, 16, 8, 32)); k = jnp.ones((2, 16, 2, 32)); v = jnp.ones((2, 16, 2, 48))
    >>> la.heinsen_attention(q, k, v, is_causal=True, chunk_size=8).shape
    (2, 16, 8, 48)

    The weights are those of the elementwise feature map exp, so it equals linear attention
    with ``feature_maps.exp`` (on inputs small enough for that to stay finite):

    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> linear = la.linear_attention(x, x, x, feature_map=feature_maps.exp, eps=0.0)
    >>> bool(jnp.allclose(la.heinsen_attention(x, x, x), linear, atol=1e-5))
    True

  References:
    Heinsen, "Softmax Attention with Constant Cost per Token", 2024.
  """
  fn = "heinsen_attention"
  checks.check_choice(
      implementation, name="implementation", choices=(None,) + IMPLEMENTATIONS, fn=fn)
  if implementation == "reference":
    checks.reject_unsupported(fn, "reference", initial_state=initial_state,
                              return_state=return_state)
    return _oracle(query, key, value, fn=fn, log_space=False, is_causal=is_causal,
                   key_value_seq_lengths=key_value_seq_lengths)
  if implementation == "parallel" and is_causal:  # Every position's prefix state at once.
    T = jnp.shape(query)[-3] if jnp.ndim(query) >= 3 else 1  # Bad ranks are named later.
    implementation, chunk_size = "associative_scan", max(T, 1)
  out, state = recurrence.recurrent_attention(
      query, key, value, featurizer=_Exp(), params=(), read="kernel", state_cls=HeinsenState,
      is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths, eps=0.0,
      implementation=implementation, implementations=IMPLEMENTATIONS, chunk_size=chunk_size,
      initial_state=initial_state, fn=fn)
  return (out, state) if return_state else out


@checks.compiled("is_causal", "implementation", "chunk_size")
def log_heinsen_attention(
    query: ArrayLike,
    key: ArrayLike,
    log_value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    implementation: LogHeinsenImplementation | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> jax.Array:
  """Heinsen's attention on log-values: ``log heinsen_attention(q, k, exp(log_value))``.

  ``log out_td = logsumexp_h(q_th + log S_hd) - logsumexp_h(q_th + log Z_h)``, the form of
  the paper's own implementation: positive values given and returned as logs, so outputs far
  below the float range (and ``log_value = -inf``, a zero value) are represented exactly.

  Args:
    query: ``[B, T, N, H]`` (or ``[T, N, H]``).
    key: ``[B, S, K, H]``.
    log_value: ``[B, S, K, D]``, the log of positive values (``-inf`` for 0).
    is_causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are ignored.
    implementation: ``"reference"`` (explicit weights), ``"parallel"`` (log-sums over the
      whole sequence at once, ``[max(T, S), N, H, D + 1]`` per batch entry), ``"chunked"``
      (``[C, N, H, D + 1]`` at a time), or None: ``"chunked"``.
    chunk_size: positions per chunk for ``"chunked"``.

  Returns:
    ``[B, T, N, D]`` log-outputs in the input dtype; ``-inf`` (log 0) for queries that see no
    key.

  Raises:
    ValueError: on bad shapes, dtypes or lengths, an unknown implementation or a bad
      ``chunk_size``.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N, H], N = K
    >>> v = jnp.exp(jax.random.normal(jax.random.key(1), (1, 8, 2, 4)))  # Positive values.
    >>> log_out = la.log_heinsen_attention(x, x, jnp.log(v), is_causal=True)
    >>> log_out.shape
    (1, 8, 2, 4)
    >>> out = la.heinsen_attention(x, x, v, is_causal=True)
    >>> bool(jnp.allclose(jnp.exp(log_out), out, rtol=1e-4))
    True

  References:
    Heinsen, "Softmax Attention with Constant Cost per Token", 2024.
  """
  fn = "log_heinsen_attention"
  checks.check_choice(
      implementation, name="implementation", choices=(None,) + LOG_IMPLEMENTATIONS, fn=fn)
  chunk_size = checks.check_positive_int(chunk_size, name="chunk_size", fn=fn)
  if implementation == "reference":
    return _oracle(query, key, log_value, fn=fn, log_space=True, is_causal=is_causal,
                   key_value_seq_lengths=key_value_seq_lengths)
  p = checks.prepare_qkv(query, key, log_value, fn=fn)
  kv_len = checks.check_lengths(
      p, fn=fn, key_value_seq_lengths=key_value_seq_lengths)["key_value_seq_lengths"]
  chunk = max(p.dims.T, p.dims.S) if implementation == "parallel" else chunk_size
  return p.restore(_log_space_attention(p.query, p.key, p.value, kv_len, is_causal=is_causal,
                                        chunk=chunk))


def init_heinsen_state(
    batch: int, num_kv_heads: int, head_dim: int, value_dim: int, dtype: Any = jnp.float32
) -> HeinsenState:
  """The empty :class:`HeinsenState` (zero sums, ``running_max = -inf``) for B, K, H and D.

  Zeros ``kv [B, K, H, D]`` and ``k_sum [B, K, H]`` and ``running_max [B, K, H]`` of
  ``-inf``: the state of no keys, from which :func:`heinsen_attention_step` decodes.

  Args:
    batch: B.
    num_kv_heads: K.
    head_dim: H.
    value_dim: D.
    dtype: the state's dtype: float32 for float32/bfloat16/float16 inputs, float64 for
      float64 ones.

  Returns:
    A :class:`HeinsenState`.

  Raises:
    ValueError: if ``batch``, ``num_kv_heads``, ``head_dim`` or ``value_dim`` is not a
      positive int.

  Examples:
    >>> state = la.init_heinsen_state(batch=1, num_kv_heads=2, head_dim=8, value_dim=3)
    >>> state.kv.shape, state.k_sum.shape, state.running_max.shape
    ((1, 2, 8, 3), (1, 2, 8), (1, 2, 8))
  """
  B, K, H, D = checks.positive_sizes("init_heinsen_state", batch=batch, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, value_dim=value_dim)
  return HeinsenState(*recurrence.empty_carry(B, K, H, H, D, dtype))


def heinsen_attention_step(
    state: HeinsenState, query: Any, key: Any, value: Any
) -> tuple[HeinsenState, jax.Array]:
  """One causal token: adds ``(key, value)`` to the state, then reads it with ``query``.

  Per feature h, ``kv_h ← kv_h + exp(k_h) v`` and ``k_sum_h ← k_sum_h + exp(k_h)`` (kept in
  units of the running max), then ``out = Σ_h exp(q_h) kv_h / Σ_h exp(q_h) k_sum_h``.
  Constant time and memory per token; ``lax.scan``-compatible (the new state keeps the
  dtype of ``state``). Scanned over T tokens from :func:`init_heinsen_state` it equals
  ``heinsen_attention(..., is_causal=True)``.

  Args:
    state: a :class:`HeinsenState` (from :func:`init_heinsen_state` or ``return_state``).
    query: ``[B, N, H]`` (or ``[N, H]``).
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.

  Returns:
    ``(state, out)`` with ``out`` ``[B, N, D]`` in the input dtype.

  Raises:
    ValueError: on bad ranks or shapes, or a state that does not match them.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> def step(state, x_t):
    ...   return la.heinsen_attention_step(state, x_t, x_t, x_t)
    >>> empty = la.init_heinsen_state(1, 2, 4, 4)
    >>> state, outs = jax.lax.scan(step, empty, x.swapaxes(0, 1))
    >>> full = la.heinsen_attention(x, x, x, is_causal=True)
    >>> bool(jnp.allclose(outs.swapaxes(0, 1), full, atol=1e-5))
    True

  References:
    Heinsen, "Softmax Attention with Constant Cost per Token", 2024.
  """
  return recurrence.one_token_step(heinsen_attention, state, query, key, value)


def _init_state_like(query: Any, key: Any, value: Any) -> HeinsenState:
  """Empty state for ``[B, T, N, H]`` / ``[B, S, K, H]`` / ``[B, S, K, D]`` arrays."""
  B, _, K, H = jnp.shape(key)
  return init_heinsen_state(B, K, H, jnp.shape(value)[-1],
                            checks.accumulation_dtype(jnp.result_type(query)))


def _summarize(key: Any, value: Any, *, key_value_seq_lengths: Any = None) -> HeinsenState:
  """The :class:`HeinsenState` of ``key`` / ``value`` (the registry's ``summarize``)."""
  return recurrence.summarize_keys(heinsen_attention, key, value,
                                   key_value_seq_lengths=key_value_seq_lengths)


register_attention(AttentionSpec(
    name="heinsen",
    function=heinsen_attention,
    reference=heinsen_attention_reference,
    how_options=frozenset({"implementation", "chunk_size"}),
    implementations=IMPLEMENTATIONS,
    # The core's every form runs in the suite through "performer"; these are Heinsen's
    # per-feature log-scale in the summary / whole-sequence prefix form and the chunked
    # one (the scan form runs through the streaming step).
    suite_implementations=("parallel", "chunked"),
    test_options={"chunk_size": 4},
    streaming=StreamingSpec(init=_init_state_like, step=heinsen_attention_step,
                            summarize=_summarize, combine=recurrence.combine_states),
))
