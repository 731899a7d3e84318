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
from linattn_jax._src.kernel import KernelFamily, combine_states, empty_carry, featurizing
from linattn_jax._src.online_softmax import exponent_shift, logaddexp, logsumexp

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
    reset: None, or ``[B]`` bool in a summary of packed keys (the registry's
      ``summarize`` with ``segment_ids``): True where the keys hold a segment start,
      so that ``combine`` drops the state before them. Ignored as ``initial_state``.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> _, state = la.heinsen_attention(x, x, x, is_causal=True, return_state=True)
    >>> state.kv.shape, state.k_sum.shape, state.running_max.shape
    ((1, 2, 4, 4), (1, 2, 4), (1, 2, 4))
  """

  kv: jax.Array  # [B, K, H, D]: Σ_j exp(k_jh - running_max_h) v_j.
  k_sum: jax.Array  # [B, K, H]: Σ_j exp(k_jh - running_max_h).
  running_max: jax.Array  # [B, K, H]: max_j k_jh over the keys so far (-inf before any key).
  reset: Any = None  # None, or [B] bool (summaries of packed keys).


@dataclasses.dataclass(frozen=True)
class _Exp:
  """Featurizer of the core: ``φ(x) = exp(x)`` as features 1 with a log-scale ``x`` per feature."""

  def __call__(self, params: Any, x: jax.Array, *, is_query: bool):
    del params, is_query
    return jnp.ones(x.shape[:-1] + (1,), x.dtype), x


# Its causal "parallel" is every position's prefix state at once (the paper's form).
_FAMILY = KernelFamily(_Exp(), "kernel", HeinsenState, IMPLEMENTATIONS, form="per_feature",
                       causal_parallel=True)


# The log-value path: its own bodies on the core's chunk driver ---------------------------
# The carry is log S [B, K, H, E]; a chunk's v holds the log-values [log v | log 1] (E = D + 1,
# the last column accumulates the normaliser) and lk the keys (-inf where hidden).


def _log_terms(chunk: recurrence.Chunk) -> jax.Array:
  """``k_jh + log u_je`` for each key: ``[B, K, C, H, E]``."""
  return chunk.lk[..., :, None] + chunk.v[..., None, :]


def _log_read(config, log_states: jax.Array, chunk: recurrence.Chunk) -> jax.Array:
  """``logsumexp_h(q_h + log S_he)`` ``[B, K, G, C, E]`` from one state ``[B, K, H, E]`` or one
  per query ``[B, K, C, H, E]``."""
  del config
  if log_states.ndim == 4:
    log_states = log_states[:, :, None]
  return logsumexp(chunk.lq[..., None] + log_states[:, :, None], axis=-2)


def _log_absorb(config, log_state: jax.Array, chunk: recurrence.Chunk) -> jax.Array:
  """``log S <- log(S + Σ_j exp(k_j) u_j)``."""
  del config
  return logaddexp(log_state, logsumexp(_log_terms(chunk), axis=2))


def _log_causal(config, log_state: jax.Array, chunk: recurrence.Chunk):
  """C aligned queries and keys: per-position states (a cumulative log-sum-exp), each query
  reads its own. Packed: a segment start drops the sums before it."""
  terms = _log_terms(chunk)
  if chunk.reset is None:
    prefix = lax.associative_scan(logaddexp, terms, axis=2)
    prefix = logaddexp(log_state[:, :, None], prefix)  # [B, K, C, H, E]
  else:  # (log-sums, reset) pairs: (x, r) ∘ (y, s) = (y if s else x ⊕ y, r | s).
    def compose(a, b):
      return jnp.where(b[1], b[0], logaddexp(a[0], b[0])), a[1] | b[1]

    reset = chunk.reset[..., None]  # [B, 1, C, 1, 1]
    prefix, reset = lax.associative_scan(compose, (terms, reset), axis=2)
    prefix = jnp.where(reset, prefix, logaddexp(log_state[:, :, None], prefix))
  return prefix[:, :, -1], _log_read(config, prefix, chunk)


_LOG_BODIES = recurrence.Bodies(_log_causal, _log_absorb, _log_read)


@dataclasses.dataclass(frozen=True)
class _LogValues(recurrence.Family):
  """:func:`log_heinsen_attention` on the entry pipeline: log-space bodies, log-values
  ``[log v | log 1]`` (the last column accumulates the normaliser), no public state."""

  implementations = LOG_IMPLEMENTATIONS

  def chunk_form(self, token_inputs):
    del token_inputs
    return "log_value"

  def default_implementation(self, is_causal):
    del is_causal
    return "chunked"

  def start(self, chunk, state, params, inputs, p, options, *, fn):
    del state, params, inputs, options, fn
    chunk = featurizing(functools.partial(_Exp(), ()), chunk.v.dtype)(chunk)
    chunk = chunk._replace(v=jnp.concatenate([chunk.v, jnp.zeros_like(chunk.v[..., :1])], -1))
    d = p.dims  # The carry: log S [B, K, H, D + 1], from log 0.
    return recurrence.Start(chunk, None, jnp.full_like(chunk.v, -jnp.inf,
                                                       shape=(d.B, d.K, d.H, d.D + 1)))

  def attend(self, carry, chunk, prepare, options):
    whole = options.implementation == "parallel"
    C = max(chunk.num_queries, chunk.num_keys) if whole else options.chunk_size
    return recurrence.run_chunks(_LOG_BODIES, None, carry, chunk, is_causal=options.is_causal,
                                 chunk_size=C, prepare=prepare)  # [B, K, G, T, E]

  def finish(self, out, carry, state, chunk, options):
    del carry, state, chunk, options
    return out[..., :-1] - exponent_shift(out[..., -1:]), None


@functools.partial(jax.jit, static_argnames=("is_causal", "log_space"))
def _reference(query, key, value, kv_len, ids, *, is_causal: bool, log_space: bool):
  """Explicit weights ``[B, T, S, N]``, masked and normalised in log space::

      log w_tj = logsumexp_h(q_th + k_jh) - logsumexp_j' logsumexp_h(q_th + k_j'h)

  then ``Σ_j w_tj v_j`` (``v`` kept linear), or ``logsumexp_j(log w_tj + log v_j)``.
  """
  acc = checks.accumulation_dtype(query.dtype)
  _, T, N, _ = query.shape
  _, S, K, _ = key.shape
  q = query.astype(acc)
  k, v = (jnp.repeat(x.astype(acc), N // K, axis=2) for x in (key, value))  # [B, S, N, ·]
  logits = logsumexp(q[:, :, None] + k[:, None], axis=-1)  # [B, T, S, N]
  valid = masks_lib.length_predicate(jnp.arange(S), kv_len)[:, None, :]  # [B|1, 1, S]
  if is_causal:
    valid = valid & masks_lib.causal(T, S)[None]
  if ids is not None:  # Packed: query t sees key j only in its own segment.
    valid = valid & (ids[:, :, None] == ids[:, None, :])
  logits = jnp.where(valid[..., None], logits, -jnp.inf)
  log_w = logits - exponent_shift(logsumexp(logits, axis=2))[:, :, None]
  if log_space:
    out = logsumexp(log_w[..., None] + v[:, None], axis=2)
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
    segment_ids: ArrayLike | None = None,
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
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S, ``is_causal=True``): the state is dropped where the id changes, so a
      query sees only its own segment's keys; ``initial_state`` seeds each row's first
      segment and the returned state is its last segment's. Their order is checked
      only where concrete (not under ``jax.jit``).

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
                 key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids)


def _oracle(query, key, value, *, fn: str, log_space: bool, is_causal: bool,
            key_value_seq_lengths: Any, segment_ids: Any) -> jax.Array:
  p = checks.prepare_qkv(query, key, value, fn=fn)
  kv_len = checks.check_lengths(
      p, fn=fn, key_value_seq_lengths=key_value_seq_lengths)["key_value_seq_lengths"]
  ids = recurrence.check_segment_ids(segment_ids, p, is_causal=is_causal, fn=fn)
  return p.restore(_reference(p.query, p.key, p.value, kv_len, ids, is_causal=is_causal,
                              log_space=log_space))


@checks.compiled("is_causal", "implementation", "chunk_size", "return_state",
                 concrete_checks={"segment_ids": checks.check_segment_order})
def heinsen_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | None = None,
    initial_state: HeinsenState | None = None,
    return_state: bool = False,
    implementation: HeinsenImplementation | None = None,
    chunk_size: int | None = None,
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
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S, ``is_causal=True``): the state is dropped where the id changes, so a
      query sees only its own segment's keys; ``initial_state`` seeds each row's first
      segment and the returned state is its last segment's. Their order is checked
      only where concrete (not under ``jax.jit``).
    initial_state: a :class:`HeinsenState` of earlier keys, seen by every query.
    return_state: also return the state after all (valid) keys.
    implementation: ``"reference"`` (explicit weights, O(T·S·H)), ``"parallel"`` (one
      summary of all keys; causal: the prefix states of every position at once by
      ``lax.associative_scan``, ``[T, H, D]`` per kv head),
      ``"scan"`` (token recurrence), ``"associative_scan"`` (per chunk), ``"chunked"``
      (chunks of ``chunk_size``: the states scanned from chunk to chunk, then every
      chunk's masked ``[C, C]`` weights at once; causal, it is differentiable in reverse
      mode only, the other forms in both), or None: ``"chunked"`` when causal, else
      ``"parallel"``.
    chunk_size: positions per chunk of the causal forms (static). None: the default
      backend's measured best, 64 (docs/benchmarks.md#chunk-size).

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype, zeros for queries that see no
    key; with ``return_state`` the pair ``(out, state)``. Splitting a causal sequence
    anywhere and passing the state on gives the same outputs as one pass.

  Raises:
    ValueError: on bad shapes, dtypes or lengths, an unknown implementation, a bad
      ``chunk_size``, or a state that is not a matching :class:`HeinsenState`.

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
  return recurrence.recurrent_attention(
      _FAMILY, query, key, value, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids, eps=0.0,
      implementation=implementation,
      chunk_size=chunk_size, initial_state=initial_state,
      return_state=return_state, fn=fn)


@checks.compiled("is_causal", "implementation", "chunk_size",
                 concrete_checks={"segment_ids": checks.check_segment_order})
def log_heinsen_attention(
    query: ArrayLike,
    key: ArrayLike,
    log_value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | None = None,
    implementation: LogHeinsenImplementation | None = None,
    chunk_size: int | None = None,
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
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S, ``is_causal=True``): the state is dropped where the id changes, so a
      query sees only its own segment's keys; ``initial_state`` seeds each row's first
      segment and the returned state is its last segment's. Their order is checked
      only where concrete (not under ``jax.jit``).
    implementation: ``"reference"`` (explicit weights), ``"parallel"`` (log-sums over the
      whole sequence at once, ``[max(T, S), N, H, D + 1]`` per batch entry), ``"chunked"``
      (``[C, N, H, D + 1]`` at a time), or None: ``"chunked"``.
    chunk_size: positions per chunk for ``"chunked"``. None: the default backend's
      measured best, 32.

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
  recurrence.check_chunk_size(chunk_size, form="log_value", fn=fn)  # Every form checks it.
  if implementation == "reference":
    return _oracle(query, key, log_value, fn=fn, log_space=True, is_causal=is_causal,
                   key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids)
  return recurrence.recurrent_attention(
      _LogValues(), query, key, log_value, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
      implementation=implementation,
      chunk_size=chunk_size, initial_state=None, fn=fn)


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
  B, K, H, D = checks.positive_sizes(
      batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, value_dim=value_dim,
      fn="init_heinsen_state")
  return HeinsenState(*empty_carry(B, K, H, H, D, dtype))


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


def _summarize(key: Any, value: Any, *, key_value_seq_lengths: Any = None,
               segment_ids: Any = None) -> HeinsenState:
  """The :class:`HeinsenState` of ``key`` / ``value`` (the registry's ``summarize``)."""
  return recurrence.summarize_keys(heinsen_attention, key, value,
                                   segment_ids=segment_ids,
                                   key_value_seq_lengths=key_value_seq_lengths)


# Causal "parallel" is the associative scan over every position, so no form is non-causal only.
recurrence.register_recurrent(
    "heinsen", function=heinsen_attention, reference=heinsen_attention_reference,
    init=_init_state_like, step=heinsen_attention_step, summarize=_summarize, family=_FAMILY,
    combine=combine_states)
