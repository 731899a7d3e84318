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
Internal layout: queries ``[B, K, G, T, H]``, keys ``[B, K, S, H]``, values
``[B, K, S, D]``, so the G query heads of one key/value head share its state
without copying it. Masked keys are ``-inf`` and never advance the state.
States, maxima and normalisers are float32 (float64 for float64 inputs).

References:
  Shen, Zhang, Zhao, Yi, Li, "Efficient Attention: Attention with Linear
  Complexities", WACV 2021.
"""

from __future__ import annotations

import typing
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import checks
from linattn_jax._src.blocks import merge_blocks, pad_axis, split_blocks
from linattn_jax._src.masks import causal_predicate, length_predicate
from linattn_jax._src.online_softmax import (
  SoftmaxCarry,
  exponent_shift,
  online_softmax_finish,
  online_softmax_update,
)
from linattn_jax._src.registry import AttentionSpec, StreamingSpec, register_attention

EfficientImplementation = Literal["reference", "parallel", "scan", "chunked"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(EfficientImplementation)
DEFAULT_CHUNK_SIZE = 64


class EfficientState(NamedTuple):
  """Per-feature online key softmax over the keys seen so far (accumulation dtype)."""

  m: jax.Array  # [B, K, H] running max of k_jh over seen keys (-inf: none yet).
  numerator: jax.Array  # [B, K, H, D] Σ_j exp(k_jh - m_h) v_j.
  denominator: jax.Array  # [B, K, H] Σ_j exp(k_jh - m_h).


def init_efficient_state(
    batch: int, num_kv_heads: int, head_dim: int, value_dim: int, dtype: Any = jnp.float32
) -> EfficientState:
  """The empty state: no key seen (``m = -inf``, zero sums).

  Args:
    batch: B.
    num_kv_heads: K.
    head_dim: H, the query/key feature count.
    value_dim: D.
    dtype: state dtype; float32 (float64 for float64 runs).

  Returns:
    An :class:`EfficientState` ``([B, K, H], [B, K, H, D], [B, K, H])``.
  """
  fn = "init_efficient_state"
  B, K, H, D = (checks.check_positive_int(x, name=name, fn=fn) for x, name in (
      (batch, "batch"), (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"),
      (value_dim, "value_dim")))
  return EfficientState(
      m=jnp.full((B, K, H), -jnp.inf, dtype),
      numerator=jnp.zeros((B, K, H, D), dtype),
      denominator=jnp.zeros((B, K, H), dtype),
  )


# State algebra: absorbing keys and reading with queries ---------------------


def _absorb(state: EfficientState, k: jax.Array, v: jax.Array) -> EfficientState:
  """Folds L keys ``[B, K, L, H]`` (-inf = masked) and values ``[B, K, L, D]`` into the state.

  Each feature h is one row of an online softmax whose scores are ``k_jh``.
  """
  carry = SoftmaxCarry(row_max=state.m, row_sum=state.denominator, acc=state.numerator)
  carry = online_softmax_update(
      carry, jnp.swapaxes(k, -1, -2), lambda p: jnp.einsum("bkhl,bkld->bkhd", p, v))
  return EfficientState(m=carry.row_max, numerator=carry.acc, denominator=carry.row_sum)


def _read(state: EfficientState, q_soft: jax.Array) -> jax.Array:
  """``Σ_h q_soft_h · numerator_h / denominator_h``: ``[B, K, G, L, H]`` -> ``[B, K, G, L, D]``.

  A state that has seen no key reads as zeros.
  """
  carry = SoftmaxCarry(row_max=state.m, row_sum=state.denominator, acc=state.numerator)
  context, _ = online_softmax_finish(carry)  # [B, K, H, D] = softmax_S(K)ᵀ V
  return jnp.einsum("bkglh,bkhd->bkgld", q_soft, context)


def _fold(state: EfficientState, k: jax.Array, v: jax.Array, block: int) -> EfficientState:
  """Absorbs ``[B, K, L, H]`` keys ``block`` positions at a time (one absorb if block >= L)."""
  L = k.shape[2]
  if block >= L:
    return _absorb(state, k, v)
  k_blocks = split_blocks(pad_axis(k, 2, block, -jnp.inf), 2, block)  # [n, B, K, block, H]
  v_blocks = split_blocks(v, 2, block)  # [n, B, K, block, D]
  state, _ = lax.scan(lambda s, kv: (_absorb(s, *kv), None), state, (k_blocks, v_blocks))
  return state


def _safe_divide(x: jax.Array, den: jax.Array) -> jax.Array:
  """``x / den`` with zeros where ``den == 0`` (no visible key), NaN-free gradients."""
  empty = den == 0
  return jnp.where(empty, 0.0, x / jnp.where(empty, 1.0, den))


# Causal forms over aligned positions (query i sees keys 0..i) -----------------


def _token_step(state: EfficientState, qkv) -> tuple[EfficientState, jax.Array]:
  """One aligned token: ``[B, K, G, H]``, ``[B, K, H]``, ``[B, K, D]`` -> out ``[B, K, G, D]``."""
  q_soft, k, v = qkv
  state = _absorb(state, k[:, :, None], v[:, :, None])
  return state, _read(state, q_soft[:, :, :, None])[:, :, :, 0]


def _scan_causal(state, q_soft, k, v):
  """Token recurrence over aligned ``[B, K, G, L, H]`` / ``[B, K, L, H]`` / ``[B, K, L, D]``."""
  state, out = lax.scan(
      _token_step, state, (jnp.moveaxis(q_soft, 3, 0), jnp.moveaxis(k, 2, 0),
                           jnp.moveaxis(v, 2, 0)))
  return state, jnp.moveaxis(out, 0, 3)  # [B, K, G, L, D]


def _chunk_step(state: EfficientState, blk) -> tuple[EfficientState, jax.Array]:
  """One causal chunk of C aligned tokens, in O(C²·H + H·D) memory.

  Row i of the chunk shifts by ``m_i = max(m_prev, cummax_{j<=i} k_j)`` per
  feature, so every exponent is <= 0. With ``decay_i = exp(m_prev - m_i)``,
  ``w_ij = exp(k_j - m_i)`` for j <= i and ``a_i = q_soft_i / den_i``::

      den_i = den_prev · decay_i + Σ_{j<=i} w_ij
      out_i = Σ_h a_ih (decay_ih · num_prev_h + Σ_{j<=i} w_ijh v_j)

  The query side is contracted first, so no ``[H, D]`` matrix per token is formed.
  """
  q_soft, k, v = blk  # [B, K, G, C, H], [B, K, C, H] (-inf = masked), [B, K, C, D]
  C = k.shape[2]
  m_prev = state.m[:, :, None]  # [B, K, 1, H]
  # The output does not depend on the shift, so no gradient flows through it.
  running_max = jnp.maximum(m_prev, lax.cummax(k, axis=2))  # [B, K, C, H]
  shift = lax.stop_gradient(exponent_shift(running_max))
  decay = jnp.exp(m_prev - shift)  # [B, K, C, H]; 0 where nothing came before.
  lower = jnp.tril(jnp.ones((C, C), bool))[:, :, None]  # [C(i), C(j), 1]
  # Future entries are set to -inf before exp, so a huge future key is never exponentiated.
  logits = jnp.where(lower, k[:, :, None] - shift[:, :, :, None], -jnp.inf)
  w = jnp.exp(logits)  # [B, K, C(i), C(j), H]
  den = state.denominator[:, :, None] * decay + jnp.sum(w, axis=3)  # [B, K, C, H]
  a = _safe_divide(q_soft, den[:, :, None])  # [B, K, G, C, H]
  from_prev = jnp.einsum("bkgih,bkhd->bkgid", a * decay[:, :, None], state.numerator)
  weights = jnp.einsum("bkgih,bkijh->bkgij", a, w)  # [B, K, G, C, C]
  out = from_prev + jnp.einsum("bkgij,bkjd->bkgid", weights, v)
  return _absorb(state, k, v), out


def _chunked_causal(state, q_soft, k, v, chunk: int):
  """Chunk scan over aligned tokens; chunk bodies are recomputed in the backward pass.

  The backward pass keeps one state per chunk, never one ``[H, D]`` state per token.
  """
  L = k.shape[2]
  blocks = (split_blocks(q_soft, 3, chunk),  # [n, B, K, G, C, H]
            split_blocks(pad_axis(k, 2, chunk, -jnp.inf), 2, chunk),  # [n, B, K, C, H]
            split_blocks(v, 2, chunk))  # [n, B, K, C, D]
  state, out = lax.scan(jax.checkpoint(_chunk_step, prevent_cse=False), state, blocks)
  return state, merge_blocks(out, 3, L)


def _run(implementation: str, chunk: int, state, q_soft, k, v, is_causal: bool):
  """Dispatch on internal-layout arrays; returns ``(out [B, K, G, T, D], state)``.

  Non-causal: every query reads the state after all keys. Causal with
  ``P = S - T``: for P > 0 the first P keys are a prefix all queries see and
  are folded first; for P < 0 the first -P queries read the incoming state
  (zeros if empty); the rest pairs query i with key i + P.
  """
  T, S = q_soft.shape[3], k.shape[2]
  block = {"parallel": S, "scan": 1, "chunked": chunk}[implementation]
  if not is_causal:
    state = _fold(state, k, v, block)
    return _read(state, q_soft), state
  P = S - T
  head = []
  if P > 0:
    state = _fold(state, k[:, :, :P], v[:, :, :P], block)
    k, v = k[:, :, P:], v[:, :, P:]
  elif P < 0:
    head = [_read(state, q_soft[:, :, :, :-P])]
    q_soft = q_soft[:, :, :, -P:]
  if implementation == "scan":
    state, out = _scan_causal(state, q_soft, k, v)
  else:
    state, out = _chunked_causal(state, q_soft, k, v, min(chunk, k.shape[2]))
  return jnp.concatenate(head + [out], axis=3), state


# Reference -------------------------------------------------------------------


def _reference(p: checks.Prepared, is_causal: bool, lengths: jax.Array | None) -> jax.Array:
  """Explicit masked key softmax over j for every (t, k, h): O(T·S·K·H) memory."""
  B, T, S, N, K, H, D = p.dims
  acc = checks.accumulation_dtype(p.query.dtype)
  q, k, v = (x.astype(acc) for x in p[:3])
  q_soft = jax.nn.softmax(q, axis=-1).reshape(B, T, K, N // K, H)
  visible = length_predicate(jnp.arange(S), lengths)[:, None, :]  # [B|1, 1, S]
  if is_causal:
    visible = visible & causal_predicate(jnp.arange(T)[:, None], jnp.arange(S)[None], T, S)
  s = jnp.where(visible[..., None, None], k[:, None], -jnp.inf)  # [B, T, S, K, H]
  m = lax.stop_gradient(jnp.max(s, axis=2, keepdims=True))
  e = jnp.exp(s - exponent_shift(m))
  w = _safe_divide(e, jnp.sum(e, axis=2, keepdims=True))  # softmax over visible j
  out = jnp.einsum("btkgh,btskh,bskd->btkgd", q_soft, w, v)
  return out.reshape(B, T, N, D).astype(p.query.dtype)


def efficient_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
) -> jax.Array:
  """The oracle: per (query, feature) masked key softmax, plain einsum, O(T·S·H).

  Same arguments (minus state passing and the ``how`` options) and result
  as :func:`efficient_attention`. Never optimised.
  """
  fn = "efficient_attention_reference"
  p = checks.prepare_qkv(query, key, value, fn=fn)
  lengths = checks.check_lengths(p, fn=fn, key_value_seq_lengths=key_value_seq_lengths)
  return p.restore(_reference(p, bool(is_causal), lengths["key_value_seq_lengths"]))


# Public functions ------------------------------------------------------------


def _check_state(state: Any, dims: checks.Dims, *, batched: bool, fn: str) -> EfficientState:
  """Validates a state for these dims; returns it batched."""
  B, _, _, _, K, H, D = dims
  lead = (B,) if batched else ()
  want = (lead + (K, H), lead + (K, H, D), lead + (K, H))
  try:
    state = EfficientState(*(jnp.asarray(x) for x in state))
    ok = tuple(x.shape for x in state) == want
  except (TypeError, ValueError):
    ok = False
  if not ok:
    got = tuple(getattr(x, "shape", x) for x in state) if isinstance(state, tuple) else state
    raise ValueError(
        f"{fn}: the state must be an EfficientState of shapes m {want[0]}, "
        f"numerator {want[1]}, denominator {want[2]} ([B, K, H], [B, K, H, D], "
        f"[B, K, H]); got {got}."
    )
  return state if batched else EfficientState(*(x[None] for x in state))


def _internal(p: checks.Prepared, lengths: jax.Array | None):
  """Internal layout: softmaxed queries ``[B, K, G, T, H]``, masked keys, values."""
  B, T, S, N, K, H, D = p.dims
  acc = checks.accumulation_dtype(p.query.dtype)
  q, k, v = (x.astype(acc) for x in p[:3])
  q_soft = jax.nn.softmax(q, axis=-1).reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
  valid = length_predicate(jnp.arange(S), lengths)  # [B|1, S]
  k = jnp.where(valid[:, :, None, None], k, -jnp.inf).transpose(0, 2, 1, 3)
  return q_soft, k, v.transpose(0, 2, 1, 3)


@checks.compiled("is_causal", "implementation", "chunk_size", "return_state")
def efficient_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    implementation: EfficientImplementation | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: EfficientState | None = None,
    return_state: bool = False,
) -> Any:
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
    implementation: ``"reference"`` (the O(T·S·H) oracle), ``"parallel"``
      (non-causal only: one key softmax and two small matrix products),
      ``"scan"`` (token recurrence; its gradient stores one ``[H, D]`` state
      per token), ``"chunked"`` (chunks of ``chunk_size`` with per-feature
      running maxima by cumulative max; O(C²·H) working memory, chunk bodies
      recomputed in the backward pass), or None: ``"chunked"`` when causal,
      else ``"parallel"``. ``"scan"`` and ``"chunked"`` compute the
      non-causal form by folding all keys into one state.
    chunk_size: chunk length C of ``"chunked"`` (static).
    initial_state: an :class:`EfficientState` summarising keys before this
      call (causal only; not with ``"reference"``). Unbatched calls take an
      unbatched state.
    return_state: also return the state after this call's keys (causal only).

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype, rows with no
    visible key zero; with ``return_state``, ``(out, state)``.

  Raises:
    ValueError: on bad shapes, dtypes, lengths or chunk size, an unknown
      implementation, ``is_causal=True`` with ``"parallel"``, state options
      without ``is_causal`` or with ``"reference"``, or a state whose shapes
      do not match.

  Examples:
    >>> q = jnp.ones((2, 100, 8, 32)); kv = jnp.ones((2, 100, 2, 32))
    >>> out, state = efficient_attention(q, kv, kv, is_causal=True, return_state=True)
    >>> out.shape, state.numerator.shape
    ((2, 100, 8, 32), (2, 2, 32, 32))

  References:
    Shen et al., "Efficient Attention: Attention with Linear Complexities", WACV 2021.
  """
  fn = "efficient_attention"  # is_causal is a static bool: checked by checks.compiled.
  implementation = checks.check_implementation(
      implementation, choices=IMPLEMENTATIONS, is_causal=is_causal, fn=fn)
  implementation = implementation or ("chunked" if is_causal else "parallel")
  chunk = checks.check_positive_int(chunk_size, name="chunk_size", fn=fn)
  p = checks.prepare_qkv(query, key, value, fn=fn)
  lengths = checks.check_lengths(
      p, fn=fn, key_value_seq_lengths=key_value_seq_lengths)["key_value_seq_lengths"]
  if not is_causal and (initial_state is not None or return_state):
    raise ValueError(
        f"{fn}: initial_state and return_state need is_causal=True (the state "
        "summarises a causal prefix)."
    )
  if implementation == "reference":
    checks.reject_unsupported(
        fn, implementation, initial_state=initial_state, return_state=return_state)
    return p.restore(_reference(p, is_causal, lengths))
  B, _, _, _, K, H, D = p.dims
  acc = checks.accumulation_dtype(p.query.dtype)
  if initial_state is None:
    state = init_efficient_state(B, K, H, D, acc)
  else:
    state = _check_state(initial_state, p.dims, batched=p.batched, fn=fn)
    state = EfficientState(*(x.astype(acc) for x in state))
  out, state = _run(implementation, chunk, state, *_internal(p, lengths), is_causal)
  out = p.restore(out.transpose(0, 3, 1, 2, 4).reshape(p.dims.B, p.dims.T, p.dims.N, D))
  out = out.astype(p.query.dtype)
  if not return_state:
    return out
  return out, (state if p.batched else EfficientState(*(x[0] for x in state)))


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
    >>> state = init_efficient_state(1, 2, 16, 16)
    >>> state, out = efficient_attention_step(
    ...     state, jnp.ones((1, 4, 16)), jnp.ones((1, 2, 16)), jnp.ones((1, 2, 16)))
    >>> out.shape
    (1, 4, 16)
  """
  fn = "efficient_attention_step"
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  if not query.ndim == key.ndim == value.ndim == 3:
    raise ValueError(
        f"{fn}: query [B, N, H], key [B, K, H] and value [B, K, D] must be rank 3; "
        f"got query {query.shape}, key {key.shape}, value {value.shape}."
    )
  p = checks.prepare_qkv(query[:, None], key[:, None], value[:, None], fn=fn)
  B, _, _, N, K, H, D = p.dims
  state = _check_state(state, p.dims, batched=True, fn=fn)
  acc = jnp.promote_types(checks.accumulation_dtype(query.dtype), state.m.dtype)
  q = jax.nn.softmax(query.astype(acc), axis=-1).reshape(B, K, N // K, H)
  new, out = _token_step(EfficientState(*(x.astype(acc) for x in state)),
                         (q, key.astype(acc), value.astype(acc)))
  new = EfficientState(*(x.astype(old.dtype) for x, old in zip(new, state, strict=True)))
  return new, out.reshape(B, N, D).astype(query.dtype)


def _init_like(query: jax.Array, key: jax.Array, value: jax.Array) -> EfficientState:
  """An empty state for ``[B, T, N, H]`` / ``[B, S, K, H]`` / ``[B, S, K, D]`` inputs."""
  B, _, K, H = key.shape
  return init_efficient_state(
      B, K, H, value.shape[-1], checks.accumulation_dtype(query.dtype))


register_attention(AttentionSpec(
    name="efficient",
    function=efficient_attention,
    reference=efficient_attention_reference,
    how_options=frozenset({"implementation", "chunk_size"}),
    implementations=IMPLEMENTATIONS,
    # The oracle is judged by its own tests; the default dispatch by test_efficient.
    suite_implementations=("parallel", "scan", "chunked"),
    noncausal_only=frozenset({"parallel"}),
    test_options={"chunk_size": 4},
    streaming=StreamingSpec(init=_init_like, step=efficient_attention_step),
))
