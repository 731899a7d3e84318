"""Log-linear attention: gated linear attention over a Fenwick tree of states.

Letters as in ``gated.py``, with L the number of levels. A query ``i`` weighs the key
``j ≤ i`` by its own scale at the pair's level ``ℓ(i, j)``::

    o_i = scale · Σ_{j≤i} λ_i^{ℓ(i,j)} exp(Σ_{j<l≤i} g_l) (q_i · k_j) v_j
    ℓ(i, j) = bit_length(i XOR j)

(positions counted from 0). ``ℓ(i, i) = 0``; for ``j < i``, ``ℓ − 1`` is the highest bit
in which j differs from i, so the keys before i fall into the blocks of the Fenwick
tree of the prefix ``[0, i)``, one per set bit of i, the nearest the smallest. With
``λ`` all ones this is gated linear attention (Mamba-2's per-head decay). The state
before position t keeps one matrix per level, ``S^ℓ [H, D]`` (ℓ = 1..L-1: the decayed
``Σ k_j v_jᵀ`` over the keys at level ℓ from t), so a position costs O(log T), and a
query reads ``Σ_ℓ λ_t^ℓ q_tᵀ S^ℓ``. Moving on from t, whose lowest s bits are ones, the
token and levels 1..s merge into level s + 1, as a binary counter carries::

    S ← exp(g_t) S;  o_t = scale · (λ_t^0 (q_t · k_t) v_t + Σ_ℓ λ_t^ℓ q_tᵀ S^ℓ)
    S^{s+1} ← k_t v_tᵀ + Σ_{ℓ≤s} S^ℓ;  S^1 .. S^s ← 0

The chunked form (C = 2^c positions per chunk) weighs the pairs inside a chunk
densely (their levels are at most c) and carries only the levels above c from chunk to
chunk, merged the same way by chunk index.

References:
  Guo et al., "Log-Linear Attention", 2025.
"""

from __future__ import annotations

import typing
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import checks
from linattn_jax._src.decays import segment_sums, suffix_sums
from linattn_jax._src.registry import Role, TokenInput

LogLinearImplementation = Literal["reference", "scan", "chunked"]
_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(LogLinearImplementation)
_DECAY = TokenInput("log_decay", Role.DECAY)
# Positions per chunk of the chunked form when ``chunk_size=None``: the fastest measured on
# CPU (docs/benchmarks.md#chunk-size).
DEFAULT_CHUNK_SIZE = 64


class LogLinearState(NamedTuple):
  """The state of :func:`log_linear_attention` before a position.

  Attributes:
    levels: ``[B, K, L - 1, H, D]``: ``S^1 .. S^{L-1}``, float32 (float64 for float64
      inputs); level ℓ is empty unless bit ℓ - 1 of the position is set.
    position: ``[B]`` int32, the next position of each row (the tokens so far). A state
      of L - 1 levels serves positions below ``2^(L-1)``.

  Examples:
    >>> x = jnp.ones((1, 5, 2, 8))  # [B, T, N=K, H=D]
    >>> _, state = la.log_linear_attention(x, x, x, jnp.ones((1, 5, 2, 4)), is_causal=True,
    ...                                    return_state=True)
    >>> state.levels.shape, state.position  # L = 4 levels serve positions below 8.
    ((1, 2, 3, 8, 8), Array([5], dtype=int32))
  """

  levels: jax.Array
  position: jax.Array


def levels_needed(positions: int) -> int:
  """L for ``positions`` positions (0 .. positions - 1): ``bit_length(positions - 1) + 1``."""
  return max(positions - 1, 0).bit_length() + 1


def fenwick_levels(positions: jax.Array) -> jax.Array:
  """``ℓ(i, j) = bit_length(i XOR j)`` ``[..., i, j]`` for int positions ``[..., P]``."""
  x = positions[..., :, None] ^ positions[..., None, :]
  return 32 - lax.clz(x.astype(jnp.int32))


def _trailing_ones(n: jax.Array) -> jax.Array:
  """The number of lowest bits of ``n`` that are ones (``n XOR (n + 1) = 2^(s+1) - 1``)."""
  return lax.population_count(n ^ (n + 1)) - 1


def _merge(levels: jax.Array, write: jax.Array, n: jax.Array) -> jax.Array:
  """The levels after step (or chunk) ``n [B]``: ``write`` and levels 1..s merge into
  level s + 1 (s = the trailing ones of n), levels 1..s empty. ``levels [B, K, M, H, D]``;
  a merge above level M is dropped (the caller checks that none is read)."""
  s = _trailing_ones(n)[:, None, None, None, None]
  level = jnp.arange(1, levels.shape[2] + 1)[None, None, :, None, None]
  merged = write[:, :, None] + jnp.sum(jnp.where(level <= s, levels, 0), 2, keepdims=True)
  return jnp.where(level == s + 1, merged, jnp.where(level <= s, 0, levels))


def _token(scale, carry, x):
  """One position of the recurrence: ``x = (q [B, K, G, H], k [B, K, H], v [B, K, D],
  λ [B, K, G, L], g [B, K])``, ``carry = (levels [B, K, L-1, H, D], position [B])``."""
  levels, position = carry
  q, k, v, lam, g = x
  levels = jnp.exp(g)[..., None, None, None] * levels
  own = jnp.einsum("bkgh,bkh->bkg", q, k)[..., None] * v[:, :, None]
  read = jnp.einsum("bkgh,bkmhd,bkgm->bkgd", q, levels, lam[..., 1:])
  out = scale * (lam[..., :1] * own + read)
  levels = _merge(levels, k[..., None] * v[..., None, :], position)
  return (levels, position + 1), out


def _scan_tokens(scale, carry, q, k, v, lam, g):
  """:func:`_token` over axis 2 of the internal layout; ``out [B, K, G, T, D]``."""
  xs = (jnp.moveaxis(q, 3, 0), jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0),
        jnp.moveaxis(lam, 3, 0), jnp.moveaxis(g, 2, 0))
  carry, out = lax.scan(lambda c, x: _token(scale, c, x), carry, xs)
  return carry, jnp.moveaxis(out, 0, 3)


def _chunk(scale, c, carry, x):
  """One chunk of C = 2^c positions: ``x`` as :func:`_token`'s with a C axis before the
  last; ``carry = (levels above c [B, K, M, H, D], chunk index [B])``."""
  levels, n = carry
  q, k, v, lam, g = x  # [B, K, G, C, H], [B, K, C, H], [B, K, C, D], [B, K, G, C, L], [B, K, C]
  C = k.shape[2]
  local = fenwick_levels(jnp.arange(C))  # [C, C]: at most c.
  at_level = (local[..., None] == jnp.arange(c + 1)[None, None]).astype(q.dtype)  # [C, C, c + 1]
  weights = (jnp.einsum("bkgih,bkjh->bkgij", q, k) * jnp.exp(segment_sums(g, -1))[:, :, None]
             * jnp.einsum("bkgil,ijl->bkgij", lam[..., :c + 1], at_level))
  out = jnp.einsum("bkgij,bkjd->bkgid", weights, v)
  prefix = jnp.cumsum(g, axis=-1)  # Decay from the chunk's start to i.
  out = out + jnp.einsum("bkgih,bkmhd,bkgim->bkgid", q * jnp.exp(prefix)[:, :, None, :, None],
                         levels, lam[..., c + 1:])
  write = jnp.einsum("bkjh,bkjd->bkhd", k * jnp.exp(suffix_sums(g, -1))[..., None], v)
  levels = _merge(jnp.exp(prefix[:, :, -1])[..., None, None, None] * levels, write, n)
  return (levels, n + 1), scale * out


def _empty(k, v, lam):
  """The state at position 0: zero levels ``[B, K, L - 1, H, D]`` and positions ``[B]``."""
  B, K, _, H = k.shape
  return (jnp.zeros((B, K, lam.shape[-1] - 1, H, v.shape[-1]), k.dtype),
          jnp.zeros((B,), jnp.int32))


def _chunked(scale, C, q, k, v, lam, g):
  """Whole chunks of C, then the last ``T mod C`` positions token by token."""
  T, D = k.shape[2], v.shape[-1]
  c = C.bit_length() - 1
  whole = T // C * C
  zeros, position = _empty(k, v, lam)
  carry = (zeros[:, :, c:], position)
  outs = []
  if whole:
    cut = lambda x, axis: jnp.moveaxis(  # noqa: E731
        x.reshape(x.shape[:axis] + (whole // C, C) + x.shape[axis + 1:]), axis, 0)
    xs = (cut(q[:, :, :, :whole], 3), cut(k[:, :, :whole], 2), cut(v[:, :, :whole], 2),
          cut(lam[:, :, :, :whole], 3), cut(g[:, :, :whole], 2))
    carry, out = lax.scan(jax.checkpoint(lambda cr, x: _chunk(scale, c, cr, x)), carry, xs)
    outs.append(jnp.moveaxis(out, 0, 3).reshape(out.shape[1:4] + (whole, D)))
  # Levels 1..c are empty at a multiple of C; the position counts tokens again.
  carry = (jnp.concatenate([zeros[:, :, :c], carry[0]], axis=2), carry[1] * C)
  if whole < T:
    carry, out = _scan_tokens(scale, carry, q[:, :, :, whole:], k[:, :, whole:],
                              v[:, :, whole:], lam[:, :, :, whole:], g[:, :, whole:])
    outs.append(out)
  return carry, jnp.concatenate(outs, axis=3)


def _reference(scale, q, k, v, lam, g):
  """The definition, densely: every pair's level, decay and scale ``[B, K, G, T, T]``."""
  T = k.shape[2]
  level = fenwick_levels(jnp.arange(T))
  per_pair = jnp.take_along_axis(lam, jnp.broadcast_to(level, lam.shape[:3] + (T, T)), -1)
  weights = (jnp.einsum("bkgih,bkjh->bkgij", q, k) * jnp.exp(segment_sums(g, -1))[:, :, None]
             * per_pair)
  return scale * jnp.einsum("bkgij,bkjd->bkgid", weights, v)


def _check(query, key, value, level_scales, log_decay, *, is_causal, fn):
  """The arrays checked and laid out: ``(prepared, λ [B, K, G, T, L], g [B, K, S])``."""
  if not is_causal:
    raise ValueError(f"{fn}: log-linear attention is causal only; pass is_causal=True.")
  p = checks.prepare_qkv(query, key, value, fn=fn)
  B, T, S, N, K, H, D = p.dims
  if T != S:
    raise ValueError(f"{fn}: query and key lengths must be equal (T == S; the levels count "
                     f"positions from 0); got T={T}, S={S}.")
  lam = jnp.asarray(level_scales)
  lam = lam if p.batched else lam[None]
  L = levels_needed(T)
  if (lam.ndim != 4 or lam.shape[:3] != (B, T, N) or lam.shape[3] < L
      or not jnp.issubdtype(lam.dtype, jnp.floating)):
    raise ValueError(f"{fn}: level_scales must be a float array [B, T, N, L] = ({B}, {T}, "
                     f"{N}, L) with L ≥ {L} levels for T = {T}; got {lam.dtype} "
                     f"{jnp.shape(level_scales)}.")
  if log_decay is None:
    g = jnp.zeros((B, S, K))
  else:
    g = _DECAY.check(log_decay, p.key.shape if p.batched else p.key.shape[1:], fn=fn)
    g = jnp.asarray(g) if p.batched else jnp.asarray(g)[None]
  acc = checks.accumulation_dtype(p.query.dtype)
  G = N // K
  q = p.query.astype(acc).reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)
  lam = lam.astype(acc).reshape(B, T, K, G, -1).transpose(0, 2, 3, 1, 4)
  k, v = (x.astype(acc).transpose(0, 2, 1, 3) for x in (p.key, p.value))
  return p, (q, k, v, lam, g.astype(acc).transpose(0, 2, 1))


@checks.compiled("scale", "is_causal", "return_state", "implementation", "chunk_size", "fn")
def _log_linear(query, key, value, level_scales, log_decay, *, scale, is_causal,
                return_state, implementation, chunk_size, fn):
  p, (q, k, v, lam, g) = _check(query, key, value, level_scales, log_decay,
                                is_causal=is_causal, fn=fn)
  B, T, S, N, K, H, D = p.dims
  scale = checks.resolve_scale(scale, H)
  L = lam.shape[-1]
  if return_state and T >= 2 ** (L - 1):
    raise ValueError(f"{fn}: the state after T = {T} tokens serves position {T}, which "
                     f"needs L ≥ {levels_needed(T + 1)} levels in level_scales; got L = {L}.")
  if implementation == "reference":
    if return_state:
      raise ValueError(f"{fn}: implementation='reference' returns no state; use 'scan' or "
                       "'chunked' with return_state=True.")
    out, state = _reference(scale, q, k, v, lam, g), None
  elif implementation == "scan":
    state, out = _scan_tokens(scale, _empty(k, v, lam), q, k, v, lam, g)
  else:
    state, out = _chunked(scale, chunk_size, q, k, v, lam, g)
  out = p.restore(out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, D).astype(p.query.dtype))
  if not return_state:
    return out
  state = LogLinearState(*state)
  return out, state if p.batched else LogLinearState(state.levels[0], state.position[0])


def log_linear_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    level_scales: ArrayLike,
    *,
    log_decay: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    return_state: bool = False,
    implementation: LogLinearImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, LogLinearState]:
  """Log-linear attention (the Mamba-2 form: a decay per head), causal.

  ``o_i = scale · Σ_{j≤i} λ_i^{ℓ(i,j)} exp(Σ_{j<l≤i} g_l) (q_i · k_j) v_j`` with
  ``ℓ(i, j) = bit_length(i XOR j)``: the keys before a query fall into the blocks of a
  Fenwick tree, and each query scales each block (level) by its own ``λ``. Its state
  holds one matrix per level, O(log T) per position; ``λ = 1`` is
  :func:`gated_linear_attention` with a decay per head.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, T, K, H]``; K must divide N.
    value: ``[B, T, K, D]``.
    level_scales: ``λ`` ``[B, T, N, L]``, a scale per query head and level, with
      ``L ≥ bit_length(T - 1) + 1`` (more levels than the positions reach are unused; with
      ``return_state``, ``L ≥ bit_length(T) + 1``, the levels of the next position).
    log_decay: optional ``g`` ``[B, T, K]``, ≤ 0 (checked where concrete); None: no decay.
    scale: multiplies the query (a static float); default ``1 / sqrt(H)``.
    is_causal: must be True; the default False raises, as for every causal-only variant.
    return_state: also return the :class:`LogLinearState` before position T, from which
      :func:`log_linear_attention_step` decodes.
    implementation: ``"reference"`` (the dense definition, ``[T, T]`` weights),
      ``"scan"`` (token by token on ``lax.scan``) or ``"chunked"`` (the default: dense
      inside chunks, the levels above the chunk's carried from chunk to chunk).
    chunk_size: positions per chunk of ``"chunked"``, a power of two; None: 64. A last
      partial chunk runs token by token.

  Returns:
    ``[B, T, N, D]`` in the input dtype; with ``return_state`` the pair ``(out, state)``.

  Raises:
    ValueError: for ``is_causal=False``, T ≠ S, bad shapes or dtypes, too few levels, a
      positive ``log_decay`` (where concrete), a traced ``scale``, an unknown
      implementation, a ``chunk_size`` that is not a power of two, or
      ``return_state`` with the reference.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))  # [B, T, N=K, H=D]
    >>> lam = jnp.ones((1, 16, 2, 5))  # L = bit_length(15) + 1 = 5 levels, all weighed 1
    >>> g = jnp.full((1, 16, 2), -0.1)
    >>> out = la.log_linear_attention(x, x, x, lam, log_decay=g, is_causal=True)
    >>> bool(jnp.allclose(out, la.gated_linear_attention(x, x, x, g, is_causal=True),
    ...                   atol=1e-5))
    True

  References:
    Guo et al., "Log-Linear Attention", 2025.
  """
  fn = "log_linear_attention"
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  implementation = checks.check_implementation(implementation, choices=_IMPLEMENTATIONS,
                                               is_causal=is_causal, fn=fn) or "chunked"
  chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else checks.check_positive_int(
      chunk_size, name="chunk_size", fn=fn)
  if chunk_size & (chunk_size - 1):
    raise ValueError(f"{fn}: chunk_size must be a power of two (chunks align with the "
                     f"levels); got {chunk_size}.")
  if log_decay is not None:
    _DECAY.check_bounds(log_decay, fn=fn)
  return _log_linear(query, key, value, level_scales, log_decay,
                     scale=checks.check_scale(scale, fn=fn), is_causal=is_causal,
                     return_state=checks.check_static_bool(return_state, name="return_state",
                                                           fn=fn),
                     implementation=implementation, chunk_size=chunk_size, fn=fn)


def log_linear_attention_reference(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, level_scales: ArrayLike, *,
    log_decay: ArrayLike | None = None, scale: float | None = None, is_causal: bool = False,
) -> jax.Array:
  """The oracle of :func:`log_linear_attention`: its definition with dense weights.

  Every pair's level, decay and scale in a ``[T, T]`` matrix, float32.

  Takes the arrays ``[B, T, N, H]``, ``[B, T, K, H]``, ``[B, T, K, D]``, ``[B, T, N, L]``
  and the options of :func:`log_linear_attention` but the state and the implementation.

  Raises:
    ValueError: as :func:`log_linear_attention`, under this name.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> lam = jnp.broadcast_to(jnp.linspace(1.0, 0.5, 4), (1, 8, 2, 4))  # Far levels weigh less.
    >>> fast = la.log_linear_attention(x, x, x, lam, is_causal=True)
    >>> bool(jnp.allclose(fast, la.log_linear_attention_reference(x, x, x, lam, is_causal=True),
    ...                   atol=1e-5))
    True

  References:
    Guo et al., "Log-Linear Attention", 2025.
  """
  fn = "log_linear_attention_reference"
  if log_decay is not None:
    _DECAY.check_bounds(log_decay, fn=fn)
  return _log_linear(query, key, value, level_scales, log_decay,
                     scale=checks.check_scale(scale, fn=fn),
                     is_causal=checks.check_static_bool(is_causal, name="is_causal", fn=fn),
                     return_state=False, implementation="reference", chunk_size=None, fn=fn)


def init_log_linear_state(batch: int, num_kv_heads: int, head_dim: int, value_dim: int,
                          num_levels: int) -> LogLinearState:
  """The empty :class:`LogLinearState`: position 0, zero ``levels [B, K, L - 1, H, D]``.

  float32; it serves positions below ``2^(L-1)``.

  Args:
    batch: B.
    num_kv_heads: K.
    head_dim: H.
    value_dim: D.
    num_levels: L, the last axis of the ``level_scales`` the steps take.

  Raises:
    ValueError: if a size is not a positive int.

  Examples:
    >>> la.init_log_linear_state(1, 2, 4, 3, num_levels=5).levels.shape
    (1, 2, 4, 4, 3)
  """
  B, K, H, D, L = checks.positive_sizes(batch=batch, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim, value_dim=value_dim,
                                        num_levels=num_levels, fn="init_log_linear_state")
  return LogLinearState(jnp.zeros((B, K, L - 1, H, D)), jnp.zeros((B,), jnp.int32))


def log_linear_attention_step(state: LogLinearState, query: ArrayLike, key: ArrayLike,
                              value: ArrayLike, level_scales: ArrayLike, *,
                              log_decay: ArrayLike | None = None,
                              scale: float | None = None) -> tuple[LogLinearState, jax.Array]:
  """One decoding step of :func:`log_linear_attention` at the state's position t.

  ``S ← exp(g) S``, ``o = scale · (λ^0 (q · k) v + Σ_ℓ λ^ℓ qᵀ S^ℓ)``, then the token and
  levels 1..s merge into level s + 1 (s: the lowest bits of t that are ones).

  Args:
    state: the :class:`LogLinearState` so far (``levels [B, K, L - 1, H, D]``).
    query: ``[B, N, H]``.
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.
    level_scales: ``[B, N, L]``, L one more than the state's levels.
    log_decay: optional ``[B, K]``, ≤ 0.
    scale: multiplies the query; default ``1 / sqrt(H)``.

  Returns:
    ``(state, out [B, N, D])``. A state of L - 1 levels serves positions below
    ``2^(L-1)``: past them (under ``jax.jit``, where the position cannot be checked) its
    levels become NaN rather than wrong.

  Raises:
    ValueError: on shapes that do not match each other or the state, or (where
      concrete) a positive ``log_decay`` or a position the state cannot serve.

  Examples:
    >>> state = la.init_log_linear_state(1, 2, 4, 4, num_levels=3)
    >>> x = jnp.ones((1, 2, 4))  # [B, N=K, H=D]
    >>> state, out = la.log_linear_attention_step(state, x, x, x, jnp.ones((1, 2, 3)))
    >>> state.position
    Array([1], dtype=int32)

  References:
    Guo et al., "Log-Linear Attention", 2025.
  """
  fn = "log_linear_attention_step"
  if not isinstance(state, LogLinearState):
    raise ValueError(f"{fn}: state must be a LogLinearState (fields levels, position); got "
                     f"{type(state).__name__}.")
  position = state.position
  if not isinstance(position, jax.core.Tracer) and jnp.ndim(state.levels) == 5:
    M = jnp.shape(state.levels)[2]
    furthest = int(jnp.max(jnp.asarray(position)))
    if furthest >= 2 ** M:
      raise ValueError(f"{fn}: a state of {M} levels serves positions below {2 ** M}; got "
                       f"position {furthest}.")
  if log_decay is not None:
    _DECAY.check_bounds(log_decay, fn=fn)
  return _step(state, query, key, value, level_scales, log_decay,
               scale=checks.check_scale(scale, fn=fn), fn=fn)


@checks.compiled("scale", "fn")
def _step(state, query, key, value, level_scales, log_decay, *, scale, fn):
  levels, position = (jnp.asarray(x) for x in state)
  q, k, v = (jnp.asarray(x)[:, None] for x in (query, key, value))  # T = 1
  B, K, M, H, D = levels.shape if levels.ndim == 5 else (None,) * 5
  if (levels.ndim != 5 or position.shape != (B,) or k.shape[::2] != (B, K)
      or v.shape[2] != K):
    raise ValueError(f"{fn}: the state (levels {levels.shape}, position {position.shape}) "
                     f"does not match key {jnp.shape(key)} and value {jnp.shape(value)}: "
                     "levels [B, K, L - 1, H, D], position [B], key [B, K, H], value [B, K, D].")
  lam = jnp.asarray(level_scales)
  if lam.ndim != 3 or lam.shape[-1] != M + 1:
    raise ValueError(f"{fn}: level_scales must be [B, N, L] with L = {M + 1} (one more "
                     f"than the state's levels); got {lam.shape}.")
  g = None if log_decay is None else jnp.asarray(log_decay)[:, None]
  _, (q, k, v, lam, g) = _check(q, k, v, lam[:, None], g, is_causal=True, fn=fn)
  scale = checks.resolve_scale(scale, H)
  x = (q[:, :, :, 0], k[:, :, 0], v[:, :, 0], lam[:, :, :, 0], g[:, :, 0])
  (new, position), out = _token(scale, (levels.astype(q.dtype), position), x)
  new = jnp.where((position < 2 ** M)[:, None, None, None, None], new, jnp.nan)
  N = out.shape[1] * out.shape[2]
  return LogLinearState(new.astype(levels.dtype), position), out.reshape(B, N, D).astype(
      jnp.asarray(query).dtype)
