"""Heinsen's log-space attention: ``softmax_j(log(exp(Q) exp(K)ᵀ)) V`` in O(1) state per token.

Query t weighs key j by ``w_tj ∝ Σ_h exp(q_th + k_jh)``::

    out_t = Σ_j w_tj v_j,    w_tj = Σ_h exp(q_th + k_jh) / Σ_j' Σ_h exp(q_th + k_j'h)

This is linear attention with the elementwise feature map φ = exp (M = H):
``φ(q)·φ(k) = Σ_h exp(q_h) exp(k_h)``, so ``out_t = φ(q_t)ᵀ S / φ(q_t)ᵀ Z`` with
``S = Σ_j φ(k_j) v_jᵀ`` ``[H, D]`` and ``Z = Σ_j φ(k_j)`` ``[H]``. The exponentials overflow
float32 once ``q_h + k_h`` passes about 88, so everything is computed with log-sum-exps::

    log S_hd = logsumexp_j (k_jh + log v_jd)         log Z_h = logsumexp_j k_jh
    log num_td = logsumexp_h (q_th + log S_hd)       log den_t = logsumexp_h (q_th + log Z_h)
    out_td = exp(log num_td - log den_t)

No scale is applied (q and k enter as ``q_h + k_h``); scaling both beforehand is the same as
scaling inside, so there is no ``scale`` option.

Signed values. ``log v`` needs ``v > 0``; here ``v = v⁺ - v⁻`` with ``v⁺ = max(v, 0)`` and
``v⁻ = max(-v, 0)``, each summed as its own log-space stream, and ``out = out⁺ - out⁻``.
Internally the two value streams and the normaliser (a stream of ones, ``log 1 = 0``) share
one state ``[B, K, H, E]`` with ``E = 2D + 1`` columns ``[v⁺ | v⁻ | 1]``. A zero entry is
``log 0 = -inf`` in both streams: every log and log-sum-exp here uses the double-``where``
form, so forward and gradient stay free of NaN.

Value gradient. ``log`` has no derivative at 0, so autodiff through the streams gives a value
entry that is exactly 0 (dropout, ReLU) a zero gradient. But the output is linear in the
values, ``out = W v`` with ``∂out_t / ∂v_j = w_tj`` whatever ``v`` is, so a custom VJP keeps
autodiff's cotangents (exact for q, k, the initial state and nonzero values) and gives each
zero entry ``Σ_t w_tj ∂out_t`` from autodiff of a single log-space stream at ``v = 1``
(``log 1 = 0``, where ``∂out_t / ∂log u_j = w_tj``). That extra stream runs in the backward
pass only when ``v`` has an exact zero. The returned state is made of logs of sign-split
sums, not differentiable at ``v = 0``: a cotangent that reaches a zero value entry through
the returned state (and not through the output) is taken as 0.

Causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned, see ``masks.causal``).
The states become log-cumulative-sum-exps over time. "parallel" forms them for the whole
sequence at once (``[S, H, E]`` per kv head); "chunked" carries ``log S`` from one chunk of
C keys to the next and forms only ``[C, H, E]`` per chunk, under ``jax.checkpoint`` so that
the backward pass keeps one state per chunk. Keys past ``key_value_seq_lengths`` add
``-inf`` to every log-sum and leave the state unchanged. A query that sees no key returns
zeros.

Internal layout: queries ``[B, T, K, G, H]``, keys ``[B, S, K, H]``, log-values
``[B, S, K, E]``, states ``[B, K, H, E]``: grouped queries read their kv head's state and
K/V are never repeated.

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

from linattn_jax._src import checks
from linattn_jax._src import masks as masks_lib
from linattn_jax._src.blocks import merge_blocks, pad_axis, split_blocks
from linattn_jax._src.online_softmax import exponent_shift
from linattn_jax._src.registry import AttentionSpec, StreamingSpec, register_attention

HeinsenImplementation = Literal["reference", "parallel", "chunked"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(HeinsenImplementation)
DEFAULT_CHUNK_SIZE = 64
# `implementation=None` without is_causal picks "parallel" while its largest array,
# B · max(T·N, S·K) · H · E float32 elements, stays under this (64 MiB); else "chunked".
PARALLEL_MAX_ELEMENTS = 2**24


class HeinsenState(NamedTuple):
  """Log-space recurrent state of :func:`heinsen_attention`, per kv head.

  An empty state is all ``-inf`` (log 0). Float32 (float64 for float64 inputs).
  Unbatched calls use the same fields without the leading B.
  """

  log_pos: jax.Array  # [B, K, H, D] log Σ_j exp(k_jh) max(v_jd, 0)
  log_neg: jax.Array  # [B, K, H, D] log Σ_j exp(k_jh) max(-v_jd, 0)
  log_norm: jax.Array  # [B, K, H] log Σ_j exp(k_jh)


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


def _ratio(log_num: jax.Array, log_den: jax.Array) -> jax.Array:
  """``exp(log_num - log_den[..., None])``; 0 where the denominator is 0."""
  return jnp.exp(log_num - exponent_shift(log_den)[..., None])


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


# Array-level cores --------------------------------------------------------------------------
# Jitted, so that eager calls (decoding loops, tests) run one compiled program, not op by op.


def _key_mask(S: int, kv_len: jax.Array | None) -> jax.Array:
  """Valid keys ``[B|1, S]``."""
  return masks_lib.length_predicate(jnp.arange(S), kv_len)


def _empty_state(shape, columns: int, dtype) -> jax.Array:
  """An all ``-inf`` (log 0) state ``[*shape, columns]``."""
  return jnp.full(tuple(shape) + (columns,), -jnp.inf, dtype)


def _value_streams(value: jax.Array, log_space: bool) -> jax.Array:
  """``log u`` per stream, ``[B, S, K, E]``.

  Signed values: ``[log v⁺ | log v⁻ | log 1]`` (E = 2D + 1); log-values: ``[log v | log 1]``
  (E = D + 1). The last column, all ``log 1 = 0``, accumulates the normaliser.
  """
  ones = jnp.zeros_like(value[..., :1])
  if log_space:
    return jnp.concatenate([value, ones], axis=-1)
  return jnp.concatenate([_safe_log(value), _safe_log(-value), ones], axis=-1)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static arguments of the fast path (hashable: the custom_vjp nondiff arg)."""

  is_causal: bool
  chunk: int


def _stream_numerators(cfg: _Config, q, k, log_u, kv_len, state):
  """Log-numerators ``[B, T, K, G, E]`` of the streams ``log_u`` ``[B, S, K, E]`` and the state.

  ``q`` ``[B, T, N, H]`` and ``k`` ``[B, S, K, H]`` in the accumulation dtype; keys at or past
  ``kv_len`` are dropped (``log u = -inf``).
  """
  B, T, N, H = q.shape
  _, S, K, _ = k.shape
  log_u = jnp.where(_key_mask(S, kv_len)[:, :, None, None], log_u, -jnp.inf)
  q = q.reshape(B, T, K, N // K, H)  # head n reads kv head n // G.
  return _log_numerators(q, k, log_u, state, is_causal=cfg.is_causal, chunk=cfg.chunk)


def _signed_forward(cfg: _Config, q, k, v, kv_len, state):
  """``out = out⁺ - out⁻`` ``[B, T, K, G, D]`` and the final state ``[B, K, H, 2D + 1]``."""
  D = v.shape[-1]
  log_num, state = _stream_numerators(
      cfg, q, k, _value_streams(v, log_space=False), kv_len, state)
  log_den = log_num[..., 2 * D]
  return _ratio(log_num[..., :D], log_den) - _ratio(log_num[..., D:2 * D], log_den), state


def _value_vjp(cfg: _Config, q, k, kv_len, log_norm, ct):
  """``Σ_t w_tj ct_t`` ``[B, S, K, D]``: the VJP of ``v ↦ W v`` for ``ct`` ``[B, T, K, G, D]``.

  ``W`` does not depend on ``v``, so this is autodiff of one log-space stream at ``v = 1``
  (``log u = 0``), where ``∂out_td / ∂log u_jd = w_tj u_jd = w_tj``. The initial state enters
  through its normaliser ``log_norm`` ``[B, K, H, 1]`` only.
  """
  B, S, K, _ = k.shape
  D = ct.shape[-1]
  state = jnp.concatenate([_empty_state(log_norm.shape[:-1], D, log_norm.dtype), log_norm], -1)

  def ones_stream(log_u):
    log_num, _ = _stream_numerators(
        cfg, q, k, _value_streams(log_u, log_space=True), kv_len, state)
    return _ratio(log_num[..., :D], log_num[..., D])

  _, pullback = jax.vjp(ones_stream, jnp.zeros((B, S, K, D), ct.dtype))
  return pullback(ct)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _signed_attention(cfg: _Config, q, k, v, kv_len, state):
  """:func:`_signed_forward` with the exact value gradient where ``v = 0``.

  Autodiff through ``log v±`` gives a value entry that is exactly 0 a zero gradient. The
  backward pass keeps autodiff's cotangents (exact for q, k, the state, and nonzero values)
  and replaces those of the zero value entries by :func:`_value_vjp`, run only if there are
  any.
  """
  return _signed_forward(cfg, q, k, v, kv_len, state)


def _signed_attention_fwd(cfg: _Config, q, k, v, kv_len, state):
  outs, pullback = jax.vjp(
      lambda q, k, v, state: _signed_forward(cfg, q, k, v, kv_len, state), q, k, v, state)
  return outs, (pullback, q, k, v, kv_len, state[..., -1:])


def _signed_attention_bwd(cfg: _Config, res, cts):
  pullback, q, k, v, kv_len, log_norm = res
  dq, dk, dv, dstate = pullback(cts)
  zero = v == 0
  dv = lax.cond(
      jnp.any(zero),
      lambda: jnp.where(zero, _value_vjp(cfg, q, k, kv_len, log_norm, cts[0]), dv),
      lambda: dv)
  return dq, dk, dv, None, dstate


_signed_attention.defvjp(_signed_attention_fwd, _signed_attention_bwd)


@functools.partial(jax.jit, static_argnames=("is_causal", "chunk", "log_space"))
def _log_space_attention(query, key, value, kv_len, state, *, is_causal: bool, chunk: int,
                         log_space: bool):
  """The fast path on validated arrays: ``(out [B, T, N, D], state [B, K, H, E])``.

  Takes ``[B, T, N, H]`` / ``[B, S, K, H]`` / ``[B, S, K, D]`` arrays (log-values if
  ``log_space``, then the output is a log-output too) and a packed initial state.
  """
  acc = checks.accumulation_dtype(query.dtype)
  B, T, N, _ = query.shape
  D = value.shape[-1]
  cfg = _Config(is_causal=is_causal, chunk=chunk)
  q, k, v = (x.astype(acc) for x in (query, key, value))
  if log_space:
    log_num, state = _stream_numerators(
        cfg, q, k, _value_streams(v, log_space=True), kv_len, state)
    out = log_num[..., :D] - exponent_shift(log_num[..., D:])
  else:
    out, state = _signed_attention(cfg, q, k, v, kv_len, state)
  return out.reshape(B, T, N, D).astype(query.dtype), state


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


# Arguments ----------------------------------------------------------------------------------


def _pack(state: HeinsenState) -> jax.Array:
  return jnp.concatenate([state.log_pos, state.log_neg, state.log_norm[..., None]], axis=-1)


def _unpack(packed: jax.Array, value_dim: int) -> HeinsenState:
  D = value_dim
  return HeinsenState(packed[..., :D], packed[..., D:2 * D], packed[..., 2 * D])


def _check_state(state: Any, p: checks.Prepared, acc, fn: str) -> jax.Array:
  """The initial state packed ``[B, K, H, 2D + 1]`` (checked against the inputs)."""
  B, _, _, _, K, H, D = p.dims
  if not (isinstance(state, tuple) and len(state) == 3):
    raise ValueError(f"{fn}: initial_state must be a HeinsenState; got {type(state).__name__}.")
  state = HeinsenState(*(jnp.asarray(x) for x in state))
  lead = (B,) if p.batched else ()
  want = HeinsenState(lead + (K, H, D), lead + (K, H, D), lead + (K, H))
  for name, x, shape in zip(HeinsenState._fields, state, want, strict=True):
    if x.shape != shape:
      raise ValueError(
          f"{fn}: initial_state.{name} must have shape {shape} for key {p.key.shape} "
          f"and value {p.value.shape}; got {x.shape}."
      )
  packed = _pack(state).astype(acc)
  return packed if p.batched else packed[None]


def _dispatch(query, key, value, *, fn: str, log_space: bool, is_causal, key_value_seq_lengths,
              implementation, chunk_size, initial_state=None, return_state=False):
  """Validates, picks the implementation, runs it and restores unbatched shapes."""
  checks.check_choice(
      implementation, name="implementation", choices=(None,) + IMPLEMENTATIONS, fn=fn)
  chunk_size = checks.check_positive_int(chunk_size, name="chunk_size", fn=fn)
  p = checks.prepare_qkv(query, key, value, fn=fn)
  kv_len = checks.check_lengths(
      p, fn=fn, key_value_seq_lengths=key_value_seq_lengths)["key_value_seq_lengths"]
  B, T, S, N, K, H, D = p.dims
  if implementation is None:
    size = B * max(T * N, S * K) * H * (2 * D + 1)
    small = not is_causal and size <= PARALLEL_MAX_ELEMENTS
    implementation = "parallel" if small else "chunked"
  if implementation == "reference":
    checks.reject_unsupported(fn, "reference", initial_state=initial_state,
                              return_state=return_state)
    return p.restore(_reference(p.query, p.key, p.value, kv_len, is_causal=is_causal,
                                log_space=log_space))
  acc = checks.accumulation_dtype(p.query.dtype)
  if initial_state is None:
    state = _empty_state((B, K, H), D + 1 if log_space else 2 * D + 1, acc)
  else:
    state = _check_state(initial_state, p, acc, fn)
  out, state = _log_space_attention(
      p.query, p.key, p.value, kv_len, state, is_causal=is_causal,
      chunk=max(T, S) if implementation == "parallel" else chunk_size, log_space=log_space)
  if not return_state:
    return p.restore(out)
  state = _unpack(state, D)
  return p.restore(out), state if p.batched else HeinsenState(*(x[0] for x in state))


# Public API ---------------------------------------------------------------------------------


def heinsen_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
) -> jax.Array:
  """The oracle: explicit ``[B, T, S, N]`` weights, O(T·S·H) memory, never optimised.

  ``log w_tj = logsumexp_h(q_th + k_jh)``, masked, normalised over j in log space, then
  ``out = Σ_j w_tj v_j`` with ``v`` kept linear. Same arguments and result as
  :func:`heinsen_attention` (without state passing).
  """
  return heinsen_attention(
      query, key, value, is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
      implementation="reference")


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
  """Heinsen's attention, ``softmax_j(log(exp(Q) exp(K)ᵀ)) V``, in log space.

  ``out_t = Σ_j w_tj v_j`` with ``w_tj ∝ Σ_h exp(q_th + k_jh)`` over the visible keys: linear
  attention with the feature map φ = exp, computed with log-sum-exps so that it never
  overflows (see the module docstring). Values may have any sign (positive and negative
  parts are separate log-space streams). No scale is applied.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA; one state per kv head).
    value: ``[B, S, K, D]``; any sign (exact zeros included: the output's gradient is
      exact there too), D may differ from H.
    is_causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned: for S > T the
      first S - T keys are seen by every query, for T > S the first T - S queries see only
      ``initial_state``).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are ignored.
    implementation: ``"reference"`` (explicit weights, O(T·S·H)), ``"parallel"`` (one
      log-sum over all keys, or one log-cumulative-sum for causal: materialises
      ``[max(T, S), N, H, 2D + 1]`` per batch entry), ``"chunked"`` (chunks of
      ``chunk_size`` positions, ``[C, N, H, 2D + 1]`` at a time, one state per chunk kept for
      the backward pass), or None: ``"chunked"`` for causal calls; ``"parallel"`` otherwise
      unless its arrays would exceed ``PARALLEL_MAX_ELEMENTS``.
    chunk_size: positions per chunk for ``"chunked"`` (static).
    initial_state: a :class:`HeinsenState` of earlier keys, seen by every query. Not with
      ``"reference"``.
    return_state: also return the state after all (valid) keys. Not with ``"reference"``.
      Its logs have no derivative at a value entry that is exactly 0: a gradient through
      the state gives such an entry 0 (see the module docstring).

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype, zeros for queries that see no
    key; with ``return_state`` the pair ``(out, state)``. Splitting a causal sequence
    anywhere and passing the state on gives the same outputs as one pass.

  Raises:
    ValueError: on bad shapes, dtypes or lengths, an unknown implementation, a bad
      ``chunk_size``, a malformed ``initial_state``, or state passing with ``"reference"``.

  Examples:
    >>> q = jnp.ones((2, 16, 8, 32)); k = jnp.ones((2, 16, 2, 32)); v = jnp.ones((2, 16, 2, 48))
    >>> heinsen_attention(q, k, v, is_causal=True, chunk_size=8).shape
    (2, 16, 8, 48)

  References:
    Heinsen, "Softmax Attention with Constant Cost per Token", 2024.
  """
  return _dispatch(
      query, key, value, fn="heinsen_attention", log_space=False, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, implementation=implementation,
      chunk_size=chunk_size, initial_state=initial_state, return_state=return_state)


@checks.compiled("is_causal", "implementation", "chunk_size")
def log_heinsen_attention(
    query: ArrayLike,
    key: ArrayLike,
    log_value: ArrayLike,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    implementation: HeinsenImplementation | None = None,
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
    implementation: as in :func:`heinsen_attention`.
    chunk_size: positions per chunk for ``"chunked"``.

  Returns:
    ``[B, T, N, D]`` log-outputs in the input dtype; ``-inf`` (log 0) for queries that see no
    key.

  Raises:
    ValueError: as :func:`heinsen_attention`.

  References:
    Heinsen, "Softmax Attention with Constant Cost per Token", 2024.
  """
  return _dispatch(
      query, key, log_value, fn="log_heinsen_attention", log_space=True, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, implementation=implementation,
      chunk_size=chunk_size)


def init_heinsen_state(
    batch: int, num_kv_heads: int, head_dim: int, value_dim: int, dtype: Any = jnp.float32
) -> HeinsenState:
  """The empty :class:`HeinsenState` (all ``-inf``) for B, K, H and D.

  Use float32 for float32/bfloat16/float16 inputs and float64 for float64 ones.
  """
  fn = "init_heinsen_state"
  B, K, H, D = (checks.check_positive_int(x, name=name, fn=fn) for x, name in (
      (batch, "batch"), (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"),
      (value_dim, "value_dim")))
  return _unpack(_empty_state((B, K, H), 2 * D + 1, dtype), D)


def heinsen_attention_step(
    state: HeinsenState, query: Any, key: Any, value: Any
) -> tuple[HeinsenState, jax.Array]:
  """One causal token: adds ``(key, value)`` to the state, then reads it with ``query``.

  ``log S <- logaddexp(log S, k + log v±)``, ``log Z <- logaddexp(log Z, k)``, then
  ``out = exp(logsumexp_h(q_h + log S_h) - logsumexp_h(q_h + log Z_h))`` (for each sign).
  Constant time and memory per token; ``lax.scan``-compatible (the new state keeps the
  dtype of ``state``).

  Args:
    state: a :class:`HeinsenState` (from :func:`init_heinsen_state` or ``return_state``).
    query: ``[B, N, H]`` (or ``[N, H]``).
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.

  Returns:
    ``(state, out)`` with ``out`` ``[B, N, D]`` in the input dtype.

  Raises:
    ValueError: on bad ranks or shapes, or a state that does not match them.
  """
  arrays = tuple(jnp.asarray(x) for x in (query, key, value))
  if len({x.ndim for x in arrays}) != 1 or arrays[0].ndim not in (2, 3):
    raise ValueError(
        "heinsen_attention_step: query, key and value must all be rank 3 [B, heads, dim] or "
        f"all rank 2 [heads, dim]; got {', '.join(str(x.shape) for x in arrays)}."
    )
  one_token = (jnp.expand_dims(x, -3) for x in arrays)
  out, new_state = heinsen_attention(*one_token, is_causal=True, initial_state=state,
                                     return_state=True, implementation="parallel")
  dtypes = (jnp.result_type(x) for x in state)
  new_state = HeinsenState(*(x.astype(d) for x, d in zip(new_state, dtypes, strict=True)))
  return new_state, out[..., 0, :, :]


def _init_state_like(query: Any, key: Any, value: Any) -> HeinsenState:
  """Empty state for ``[B, T, N, H]`` / ``[B, S, K, H]`` / ``[B, S, K, D]`` arrays."""
  B, _, K, H = jnp.shape(key)
  return init_heinsen_state(B, K, H, jnp.shape(value)[-1],
                            checks.accumulation_dtype(jnp.result_type(query)))


register_attention(AttentionSpec(
    name="heinsen",
    function=heinsen_attention,
    reference=heinsen_attention_reference,
    how_options=frozenset({"implementation", "chunk_size"}),
    implementations=IMPLEMENTATIONS,
    suite_implementations=("parallel", "chunked"),  # The oracle is what they are judged by.
    test_options={"chunk_size": 4},
    streaming=StreamingSpec(init=_init_state_like, step=heinsen_attention_step),
))
