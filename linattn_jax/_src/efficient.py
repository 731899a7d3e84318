"""Shen et al.'s "efficient attention": a softmax over features times a softmax over keys.

    out = softmax_H(Q) · (softmax_S(K)ᵀ V)

The query softmax runs over the H features of each query; the key softmax runs,
for every feature h separately, over the key positions. Their product with the
values is a small ``[H, D]`` matrix per key/value head, so the non-causal form
costs O((T + S)·H·D) and never compares queries with keys. No logit scale is
applied (the paper has none; each softmax is over one tensor only, so a
temperature is a multiplication of ``query`` or ``key`` by the caller).

Causal form: query t sees the keys ``j <= t + S - T`` (bottom-right aligned,
see ``masks.causal``), and the key softmax of feature h runs over exactly
those keys::

    out_t = Σ_h softmax_H(q_t)_h · Σ_{j vis} exp(k_jh - m_th) v_j / Σ_{j vis} exp(k_jh - m_th)

with ``m_th`` the running maximum of ``k_jh`` over the visible keys. Per key
head this is an online softmax with one row per feature h
(``online_softmax``): the recurrent state is ``(m [H], numerator [H, D],
denominator [H])``, so large keys neither overflow nor, since only visible
keys enter the maxima, leak the future.

Letters: B batch, T query length, S key length, N query heads, K key/value
heads (G = N // K), H query/key head dim, D value head dim, C chunk length.
The G query heads of one key/value head share its state without copying it.
Masked keys never advance the state. States, maxima and normalisers are
float32 (float64 for float64 inputs).

References:
  Shen, Zhang, Zhao, Yi, Li, "Efficient Attention: Attention with Linear
  Complexities", WACV 2021.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import checks, recurrence
from linattn_jax._src.kernel import KernelFamily, combine_states, empty_carry
from linattn_jax._src.masks import causal_predicate, length_predicate
from linattn_jax._src.online_softmax import exponent_shift, safe_divide

EfficientImplementation = Literal["reference", "parallel", "scan", "chunked"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(EfficientImplementation)


class EfficientState(NamedTuple):
  """Recurrent state of :func:`efficient_attention`: a key softmax per feature, kept online.

  For each key/value head and feature h, the keys seen so far in the units of
  their running maximum ``m_h = max_j k_jh``::

      kv_h = Σ_j exp(k_jh - m_h) v_j   [B, K, H, D]      k_sum_h = Σ_j exp(k_jh - m_h)   [B, K, H]

  so ``softmax_S(K)ᵀ V`` row h is ``kv_h / k_sum_h``. Float32 (float64 for
  float64 inputs); unbatched calls use the same fields without B.

  Attributes:
    kv: ``[B, K, H, D]``: ``Σ_j exp(k_jh - running_max_h) v_j``.
    k_sum: ``[B, K, H]``: ``Σ_j exp(k_jh - running_max_h)``.
    running_max: ``[B, K, H]``: ``max_j k_jh`` over the keys seen (``-inf``: none yet).
    reset: None, or ``[B]`` bool in a summary of packed keys (the registry's
      ``summarize`` with ``segment_ids``): True where the keys hold a segment start,
      so that ``combine`` drops the state before them. Ignored as ``initial_state``.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> _, state = la.efficient_attention(x, x, x, is_causal=True, return_state=True)
    >>> state.kv.shape, state.k_sum.shape, state.running_max.shape
    ((1, 2, 4, 4), (1, 2, 4), (1, 2, 4))
  """

  kv: jax.Array  # [B, K, H, D]: Σ_j exp(k_jh - running_max_h) v_j.
  k_sum: jax.Array  # [B, K, H]: Σ_j exp(k_jh - running_max_h).
  running_max: jax.Array  # [B, K, H]: max_j k_jh over the keys seen (-inf: none yet).
  reset: Any = None  # None, or [B] bool (summaries of packed keys).


def init_efficient_state(
    batch: int, num_kv_heads: int, head_dim: int, value_dim: int, dtype: Any = jnp.float32
) -> EfficientState:
  """The empty :class:`EfficientState`: no key seen (zero sums, ``running_max = -inf``).

  Zeros ``kv [B, K, H, D]`` and ``k_sum [B, K, H]``, and ``running_max
  [B, K, H]`` of ``-inf``: the state from which :func:`efficient_attention_step`
  decodes.

  Args:
    batch: B.
    num_kv_heads: K.
    head_dim: H, the query/key feature count.
    value_dim: D.
    dtype: state dtype; float32 (float64 for float64 runs).

  Returns:
    An :class:`EfficientState` ``([B, K, H, D], [B, K, H], [B, K, H])``.

  Raises:
    ValueError: if ``batch``, ``num_kv_heads``, ``head_dim`` or ``value_dim``
      is not a positive int.

  Examples:
    >>> state = la.init_efficient_state(batch=1, num_kv_heads=2, head_dim=8, value_dim=4)
    >>> state.kv.shape, state.k_sum.shape, state.running_max.shape
    ((1, 2, 8, 4), (1, 2, 8), (1, 2, 8))
  """
  B, K, H, D = checks.positive_sizes(
      batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, value_dim=value_dim,
      fn="init_efficient_state")
  return EfficientState(*empty_carry(B, K, H, H, D, dtype))


@dataclasses.dataclass(frozen=True)
class _Softmaxes:
  """Featurizer of the core: queries ``softmax_H(q)``; keys features 1, log-scale ``k``."""

  def __call__(self, params: Any, x: jax.Array, *, is_query: bool):
    del params
    if is_query:
      return jax.nn.softmax(x, axis=-1), None
    return jnp.ones(x.shape[:-1] + (1,), x.dtype), x


_FAMILY = KernelFamily(_Softmaxes(), "per_feature", EfficientState, IMPLEMENTATIONS)


# Reference -------------------------------------------------------------------


def _reference(p: checks.Prepared, is_causal: bool, lengths: jax.Array | None,
               ids: jax.Array | None = None) -> jax.Array:
  """Explicit masked key softmax over j for every (t, k, h): O(T·S·K·H) memory; ``ids
  [B, S]``: packed segments (query t sees key j only if ``ids[t] == ids[j]``)."""
  B, T, S, N, K, H, D = p.dims
  acc = checks.accumulation_dtype(p.query.dtype)
  q, k, v = (x.astype(acc) for x in p[:3])
  q_soft = jax.nn.softmax(q, axis=-1).reshape(B, T, K, N // K, H)
  visible = length_predicate(jnp.arange(S), lengths)[:, None, :]  # [B|1, 1, S]
  if is_causal:
    visible = visible & causal_predicate(jnp.arange(T)[:, None], jnp.arange(S)[None], T, S)[None]
  if ids is not None:
    visible = visible & (ids[:, :, None] == ids[:, None, :])
  s = jnp.where(visible[..., None, None], k[:, None], -jnp.inf)  # [B, T, S, K, H]
  m = lax.stop_gradient(jnp.max(s, axis=2, keepdims=True))
  e = jnp.exp(s - exponent_shift(m))
  w = safe_divide(e, jnp.sum(e, axis=2, keepdims=True))  # softmax over visible j
  out = jnp.einsum("btkgh,btskh,bskd->btkgd", q_soft, w, v)
  return out.reshape(B, T, N, D).astype(p.query.dtype)


@checks.compiled("is_causal", concrete_checks={"segment_ids": checks.check_segment_order})
def efficient_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | None = None,
) -> jax.Array:
  """The oracle of :func:`efficient_attention`: a masked key softmax per (query, feature).

  ``out_t = Σ_h softmax_H(q_t)_h · Σ_j softmax_j(k_jh over the keys t sees) v_j``,
  with the ``[B, T, S, K, H]`` key weights formed at once: plain einsums,
  O(T·S·K·H) memory. Same arguments (minus state passing and the ``how``
  options) and result as :func:`efficient_attention`. Never optimised.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``.
    is_causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are masked.
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S, ``is_causal=True``): the state is dropped where the id changes, so a
      query sees only its own segment's keys; ``initial_state`` seeds each row's first
      segment and the returned state is its last segment's. Their order is checked
      only where concrete (not under ``jax.jit``).

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype; rows with no
    visible key are zero.

  Raises:
    ValueError: on bad ranks, mixed or unsupported dtypes, mismatched
      batch, length or head sizes, or lengths that are not ``[B]`` ints.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> fast = la.efficient_attention(x, x, x, is_causal=True)
    >>> slow = la.efficient_attention_reference(x, x, x, is_causal=True)
    >>> bool(jnp.allclose(fast, slow, atol=1e-5))
    True

  References:
    Shen et al., "Efficient Attention: Attention with Linear Complexities", WACV 2021.
  """
  fn = "efficient_attention_reference"
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  p = checks.prepare_qkv(query, key, value, fn=fn)
  lengths = checks.check_lengths(p, fn=fn, key_value_seq_lengths=key_value_seq_lengths)
  ids = recurrence.check_segment_ids(segment_ids, p, is_causal=is_causal, fn=fn)
  return p.restore(_reference(p, is_causal, lengths["key_value_seq_lengths"], ids))


# Public functions ------------------------------------------------------------


@checks.compiled("is_causal", "implementation", "chunk_size", "return_state",
                 concrete_checks={"segment_ids": checks.check_segment_order})
def efficient_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | None = None,
    initial_state: EfficientState | None = None,
    return_state: bool = False,
    implementation: EfficientImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, EfficientState]:
  """Efficient attention: ``softmax_H(Q) · (softmax_S(K)ᵀ V)`` in linear time.

  ``out[b, t, n] = Σ_h softmax_h(q[b, t, n])_h · Σ_j softmax_j(k[b, :, n // G, h])_j
  v[b, j, n // G]``, the key softmax taken over the keys query t sees. No
  scale is applied (the paper uses none); scale ``query`` / ``key`` to set a
  temperature.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA; K = 1 is MQA). Never repeated.
    value: ``[B, S, K, D]``; D may differ from H.
    is_causal: query i's key softmax runs only over keys ``j <= i + S - T``
      (bottom-right aligned: the first S - T keys are a prefix every query
      sees; for T > S the first T - S queries see none and return zeros).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are
      masked out of the key softmax and do not advance the state.
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S, ``is_causal=True``): the state is dropped where the id changes, so a
      query sees only its own segment's keys; ``initial_state`` seeds each row's first
      segment and the returned state is its last segment's. Their order is checked
      only where concrete (not under ``jax.jit``).
    initial_state: an :class:`EfficientState` summarising keys before this
      call, seen by every query, causal or not (the rule of every recurrent
      variant). Unbatched calls take an unbatched state.
    return_state: also return the state after this call's keys.
    implementation: ``"reference"`` (the O(T·S·H) oracle), ``"parallel"``
      (non-causal only: one key softmax and two small matrix products),
      ``"scan"`` (token recurrence within checkpointed chunks), ``"chunked"``
      (chunks of ``chunk_size``: the states scanned from chunk to chunk, then
      every chunk's masked ``[C, C]`` weights at once; causal, it is
      differentiable in reverse mode only, ``"scan"`` in both), or None:
      ``"chunked"`` when causal, else ``"parallel"``. ``"scan"`` and
      ``"chunked"`` compute the non-causal form like ``"parallel"``.
    chunk_size: chunk length C of the causal forms (static). None: the default
      backend's measured best, 64 (docs/benchmarks.md#chunk-size).

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype, rows with no
    visible key zero; with ``return_state``, ``(out, state)``.

  Raises:
    ValueError: on bad shapes, dtypes, lengths or chunk size, an unknown
      implementation, ``is_causal=True`` with ``"parallel"``, or a state
      whose shapes do not match.

  Examples:
    >>> q = jnp.ones((2, 100, 8, 32)); kv = jnp.ones((2, 100, 2, 32))
    >>> out, state = la.efficient_attention(q, kv, kv, is_causal=True, return_state=True)
    >>> out.shape, state.kv.shape
    ((2, 100, 8, 32), (2, 2, 32, 32))

    Non-causal, it is two softmaxes and two small matrix products:

    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> q_soft = jax.nn.softmax(x, axis=-1)  # Over the H features of each query.
    >>> k_soft = jax.nn.softmax(x, axis=1)  # Over the S positions, per feature.
    >>> context = jnp.einsum("bskh,bskd->bkhd", k_soft, x)  # [B, K, H, D]
    >>> by_hand = jnp.einsum("btkh,bkhd->btkd", q_soft, context)
    >>> bool(jnp.allclose(la.efficient_attention(x, x, x), by_hand, atol=1e-5))
    True

  References:
    Shen et al., "Efficient Attention: Attention with Linear Complexities", WACV 2021.
  """
  fn = "efficient_attention"  # is_causal is a static bool: checked by checks.compiled.
  checks.check_choice(
      implementation, name="implementation", choices=(None,) + IMPLEMENTATIONS, fn=fn)
  return recurrence.recurrent_attention(
      _FAMILY, query, key, value, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids, eps=0.0,
      implementation=implementation,
      chunk_size=chunk_size, initial_state=initial_state,
      return_state=return_state, fn=fn)


def efficient_attention_step(
    state: EfficientState, query: Any, key: Any, value: Any
) -> tuple[EfficientState, jax.Array]:
  """One causal decoding step: absorb one key/value, then read one query.

  Equivalent to row t of ``efficient_attention(..., is_causal=True)`` when
  ``state`` holds keys 0..t-1; ``lax.scan``-compatible (the state keeps its dtype).

  Args:
    state: an :class:`EfficientState` from :func:`init_efficient_state`,
      an earlier step, or ``efficient_attention(..., return_state=True)``.
    query: ``[B, N, H]``.
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.

  Returns:
    ``(state, out)`` with ``out`` ``[B, N, D]`` in the input dtype.

  Raises:
    ValueError: on inputs that are not rank 3, mismatched shapes or dtypes,
      or a state of the wrong shapes.

  Examples:
    >>> state = la.init_efficient_state(1, 2, 16, 16)
    >>> state, out = la.efficient_attention_step(
    ...     state, jnp.ones((1, 4, 16)), jnp.ones((1, 2, 16)), jnp.ones((1, 2, 16)))
    >>> out.shape
    (1, 4, 16)

    Scanned over T tokens, the steps equal one causal call:

    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> def step(state, x_t):
    ...   return la.efficient_attention_step(state, x_t, x_t, x_t)
    >>> empty = la.init_efficient_state(1, 2, 4, 4)
    >>> state, outs = jax.lax.scan(step, empty, x.swapaxes(0, 1))
    >>> full = la.efficient_attention(x, x, x, is_causal=True)
    >>> bool(jnp.allclose(outs.swapaxes(0, 1), full, atol=1e-5))
    True

  References:
    Shen et al., "Efficient Attention: Attention with Linear Complexities", WACV 2021.
  """
  return recurrence.one_token_step(efficient_attention, state, query, key, value)


def _init_like(query: jax.Array, key: jax.Array, value: jax.Array) -> EfficientState:
  """An empty state for ``[B, T, N, H]`` / ``[B, S, K, H]`` / ``[B, S, K, D]`` inputs."""
  B, _, K, H = key.shape
  return init_efficient_state(
      B, K, H, value.shape[-1], checks.accumulation_dtype(query.dtype))


def _summarize(key: Any, value: Any, *, key_value_seq_lengths: Any = None,
               segment_ids: Any = None) -> EfficientState:
  """The :class:`EfficientState` of ``key`` / ``value`` (the registry's ``summarize``)."""
  return recurrence.summarize_keys(efficient_attention, key, value,
                                   segment_ids=segment_ids,
                                   key_value_seq_lengths=key_value_seq_lengths)


recurrence.register_recurrent(
    "efficient", function=efficient_attention, reference=efficient_attention_reference,
    init=_init_like, step=efficient_attention_step, summarize=_summarize, family=_FAMILY,
    combine=combine_states)
