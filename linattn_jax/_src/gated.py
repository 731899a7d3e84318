"""Gated and delta-rule linear attention: recurrences that forget, on the chunk driver.

Letters: B batch, T queries, S keys, N query heads, K key/value heads (G = N / K
query heads share each), H query/key head dim, D value head dim, C chunk length.
The state of each key/value head is a matrix ``S [H, D]`` (no normaliser); a
query reads ``o_t = scale · q_tᵀ S_t``.

Gated linear attention (RetNet: a fixed decay per head; Mamba2 and simple GLA:
a data-dependent decay per head; GLA: one per key feature)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ                       g_t ≤ 0, [K] or [K, H]

The delta rule (DeltaNet; Gated DeltaNet with a decay ``g_t`` per head)::

    S' = exp(g_t) S_{t-1}     u_t = β_t (v_t - S'ᵀ k_t)     S_t = S' + k_t u_tᵀ

Both decay first, then write. Inside a chunk the decay from key j to query i is
``exp(Σ_{j<l≤i} g_l)``, formed from sums of log-decays that are never positive
(a decay of -1e4 is a clean reset, no ``exp`` overflows). The delta rule's chunk
form is the WY/UT representation (Yang et al., 2024): with ``Γ_i = exp(Σ_{l≤i} g_l)``
inside the chunk, ``U = (I + L)⁻¹ diag(β) (V - diag(Γ) K S_0)`` where
``L_ij = β_i (Γ_i / Γ_j) k_iᵀ k_j`` for ``j < i`` (one unit triangular inverse per
chunk, by halves), then ``S_C = Γ_C S_0 + Σ_j (Γ_C / Γ_j) k_j u_jᵀ``. GLA's decays per key
feature are not one matrix per chunk: its chunk is halved recursively and each
pair of positions decays through the point where it is split.

Keys past ``key_value_seq_lengths`` are identity steps (no decay, no write); T ≠ S
is bottom-right aligned, like every recurrent variant here.

References:
  Sun et al., "Retentive Network: A Successor to Transformer for Large Language
  Models", 2023. Yang et al., "Gated Linear Attention Transformers with
  Hardware-Efficient Training", 2024. Dao and Gu, "Transformers are SSMs"
  (Mamba2), 2024. Yang et al., "Parallelizing Linear Transformers with the
  Delta Rule over Sequence Length", 2024. Yang, Kautz and Hatamizadeh, "Gated
  Delta Networks: Improving Mamba2 with Delta Rule", 2025.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import checks, recurrence, registry
from linattn_jax._src.blocks import pad_axis
from linattn_jax._src.masks import length_predicate

GatedImplementation = Literal["reference", "scan", "associative_scan", "chunked"]
GATED_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(GatedImplementation)
DeltaImplementation = Literal["reference", "scan", "chunked"]
DELTA_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(DeltaImplementation)


class GatedState(NamedTuple):
  """The state of :func:`gated_linear_attention` and :func:`delta_rule_attention`.

  Attributes:
    kv: ``[B, K, H, D]`` (``[K, H, D]`` unbatched): ``S``, float32 (float64 for
      float64 inputs). Reading it: ``o = scale · qᵀ S``.

  Examples:
    >>> x = jnp.ones((1, 4, 2, 8))  # [B, T, N=K, H=D]
    >>> _, state = la.gated_linear_attention(x, x, x, jnp.zeros((1, 4, 2)), return_state=True)
    >>> state.kv.shape  # [B, K, H, D]
    (1, 2, 8, 8)
  """

  kv: jax.Array


class GatedSummary(NamedTuple):
  """What a span of keys does to a :class:`GatedState` under :func:`gated_linear_attention`.

  The span maps a state ``S`` to ``diag(exp(a)) S + B``: ``a`` is the sum of its
  log-decays, ``B`` its state from zero. Summaries compose associatively
  (:func:`combine_gated`); one from position 0 continues as a state (``S = B``),
  so ``initial_state`` takes either type.

  Attributes:
    kv: ``[B, K, H, D]``: ``B``, float32 (float64 for float64 inputs).
    log_decay: ``a``, ``[B, K]`` for per-head gates or ``[B, K, H]`` for per-feature ones.

  Examples:
    >>> x = jnp.ones((1, 4, 2, 8))  # [B, S, K, H=D]
    >>> s = la.get_spec("simple_gla").streaming.summarize(x, x, log_decay=jnp.full((1, 4, 2), -0.5))
    >>> s.kv.shape, s.log_decay  # [B, K, H, D]; four steps of -0.5
    ((1, 2, 8, 8), Array([[-2., -2.]], dtype=float32))
  """

  kv: jax.Array
  log_decay: jax.Array


class DeltaSummary(NamedTuple):
  """What a span of keys does to a :class:`GatedState` under :func:`delta_rule_attention`.

  The span maps ``S`` to ``A S + B`` with ``A = Π_t exp(g_t) (I - β_t k_t k_tᵀ)``
  (the latest token on the left) and ``B`` its state from zero; summaries compose
  by ``(A_l A_e, A_l B_e + B_l)`` (:func:`combine_gated`). Being affine in ``S``, the
  recurrence run from the state ``[B_e | A_e]`` ``[H, D + H]`` with values ``[v | 0]``
  leaves ``[A B_e + B | A A_e]``: that is how a summary continues over more keys.

  Attributes:
    kv: ``[B, K, H, D]``: ``B``, float32 (float64 for float64 inputs).
    transition: ``A``, ``[B, K, H, H]``.

  Examples:
    >>> k = jnp.zeros((1, 3, 1, 2)).at[..., 0].set(1.0)  # [B, S, K, H]: unit keys e_0
    >>> s = la.get_spec("delta_net").streaming.summarize(k, k, beta=jnp.ones((1, 3, 1)))
    >>> s.transition[0, 0]  # β = 1 erases what e_0 stored: I - e_0 e_0ᵀ
    Array([[0., 0.],
           [0., 1.]], dtype=float32)
  """

  kv: jax.Array
  transition: jax.Array


# Log-decays ------------------------------------------------------------------------------


def segment_sums(g: jax.Array, axis: int) -> jax.Array:
  """``out[..., i, j, ...] = Σ_{j<l≤i} g_l`` along ``axis`` (-inf where ``j > i``).

  The new axis j follows ``axis`` (i), and the axes after it keep their place: a
  per-feature ``g [..., C, H]`` gives ``[..., C, C, H]`` with H still minor, the
  layout the products that read it want (no transpose). Summed directly, not as a
  difference of prefix sums, so a large decay (a reset) does not cancel the small
  ones after it.
  """
  axis = axis % g.ndim
  C = g.shape[axis]
  position = jnp.arange(C)
  later = position[:, None] > position[None, :]  # [l, j]: l > j
  on_axes = lambda mask: mask.reshape((C, C) + (1,) * (g.ndim - 1 - axis))  # noqa: E731
  sums = jnp.cumsum(jnp.where(on_axes(later), jnp.expand_dims(g, axis + 1), 0), axis=axis)
  return jnp.where(on_axes(later | jnp.eye(C, dtype=bool)), sums, -jnp.inf)


def _suffix_sums(g: jax.Array, axis: int) -> jax.Array:
  """``Σ_{l>j} g_l`` along ``axis``: the log-decay from key j to the chunk's end (summed
  from the end, never as a difference: a reset at j does not cancel)."""
  later = jnp.concatenate([lax.slice_in_dim(g, 1, None, axis=axis),
                           jnp.zeros_like(lax.slice_in_dim(g, 0, 1, axis=axis))], axis=axis)
  return jnp.flip(jnp.cumsum(jnp.flip(later, axis), axis), axis)


# Gated linear attention: bodies on the chunk driver ---------------------------------------
# chunk.fq [B, K, G, C, H] (scaled queries), fk [B, K, C, H], v [B, K, C, D],
# gates = (g [B, K, C, H|1],); the carry is S [B, K, H, D].


def _gla_absorb(config, S, chunk: recurrence.Chunk) -> jax.Array:
  """``S <- exp(Σ g) S + Σ_j exp(Σ_{l>j} g_l) k_j v_jᵀ``."""
  del config
  (g,) = chunk.gates
  total = jnp.sum(g, axis=2)[..., None]  # [B, K, H|1, 1]
  decayed = chunk.fk * jnp.exp(_suffix_sums(g, 2))
  return jnp.exp(total) * S + jnp.einsum("bkjh,bkjd->bkhd", decayed, chunk.v)


def _gla_chunk(config, S, chunk: recurrence.Chunk):
  """C queries against the state and the chunk's C keys: ``(S_C, out [B, K, G, C, D])``."""
  (g,) = chunk.gates
  if g.shape[-1] > 1:
    return _gla_chunk_per_feature(S, chunk)
  q, k = chunk.fq, chunk.fk
  prefix = jnp.cumsum(g, axis=2)  # [B, K, C, 1]: Σ_{l≤i} g_l from the chunk's start.
  decay = jnp.exp(segment_sums(g[..., 0], 2))  # [B, K, C(i), C(j)]; 0 where j > i.
  a = jnp.einsum("bkgih,bkjh->bkgij", q, k) * decay[:, :, None]
  out = (jnp.einsum("bkgij,bkjd->bkgid", a, chunk.v)
         + jnp.einsum("bkgih,bkhd->bkgid", q * jnp.exp(prefix)[:, :, None], S))
  return _gla_absorb(config, S, chunk), out


# GLA's chunk form weighs the pairs inside blocks of this many positions directly (C·4·H
# exponentials), and halves above them. Measured on CPU (T = 8192, C = 128, forward +
# backward, one run): 4 beat 2, 8 and 16 by 15-55%; the direct blocks grow as C·span·H, the
# levels below them are products too small to run fast.
_GLA_DIRECT_SPAN = 4


def _add_to_half(x: jax.Array, half: int, y: jax.Array) -> jax.Array:
  """``x [..., 2, span, ·]`` with ``y`` added to its first (``half=0``) or second half."""
  parts = [x[..., :1, :, :], x[..., 1:, :, :]]
  parts[half] = parts[half] + y
  return jnp.concatenate(parts, axis=-3)


def _gla_chunk_per_feature(S, chunk: recurrence.Chunk):
  """The chunk form of GLA (a decay per key feature) by recursive halving.

  With ``b_t = Σ_{l≤t} g_l`` inside the chunk, the weight of key s ≤ t for query t
  is ``A_ts = Σ_h q_th k_sh exp(b_th - b_sh)``. Inside blocks of 4 positions
  (``_GLA_DIRECT_SPAN``) it is formed directly, ``exp(Σ_{s<l≤t} g_l)`` from running
  sums. Above them, cut the chunk into halves, each half into halves, and so on down
  to the blocks (Yang et al.'s secondary chunking, applied at every scale): a pair
  s < t in different blocks is split at exactly one level, in a span whose first
  half F holds s and second half L holds t. With m the last position of F::

      b_t - b_s = (b_t - b_m) + (b_m - b_s) = Σ_{m<l≤t} g_l + Σ_{s<l≤m} g_l

  both sums of log-decays over a span inside one half, never a difference, so no
  exponent is positive and a reset cancels nothing. Each level is then a matrix
  product of ``q_t exp(b_t - b_m)`` (L) with ``k_s exp(b_m - b_s)`` (F). No
  ``[C, C, H]`` tensor is formed: the blocks cost ``4 C H`` exponentials, each
  level ``O(C H)``. The span sums of a level come from the level below (a half's
  prefix is its first half's, then that half's total plus the second's), and the
  last level's are the whole chunk's: they read and write the state.

  References:
    Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
    Training", 2024 (secondary-level chunking, section 4.2).
  """
  (g,) = chunk.gates  # [B, K, C, H]
  q, k, v = chunk.fq, chunk.fk, chunk.v
  C = q.shape[-2]
  padded = 1 << (C - 1).bit_length()  # Padded positions: identity steps (g = 0, k = v = 0).
  # [..., P, ·] as [..., P / (Π sizes), *sizes, ·]: blocks of `span`, pairs of halves.
  split = lambda x, *sizes: x.reshape(x.shape[:-2] + (-1, *sizes, x.shape[-1]))  # noqa: E731
  q, k, v, g = (pad_axis(x, x.ndim - 2, padded) for x in (q, k, v, g))
  # Blocks of `span` positions weigh their own pairs directly: [.., blocks, span(t), span(s), H]
  # holds Σ_{s<l≤t} g_l, a running sum down t of g_t where t > s (no difference is formed).
  span = min(_GLA_DIRECT_SPAN, padded)
  g_blocks = split(g, span)  # [B, K, blocks, span, H]
  weights = jnp.exp(segment_sums(g_blocks, 3))  # [.., t, s, H]: exp(b_t - b_s) for s ≤ t, else 0
  a = jnp.einsum("bkgnth,bknsh,bkntsh->bkgnts", split(q, span), split(k, span), weights)
  out = jnp.einsum("bkgnts,bknsd->bkgntd", a, split(v, span))
  out = out.reshape(q.shape[:-1] + v.shape[-1:])
  # Σ_{l≤t} g_l and Σ_{l>s} g_l within t's and s's span of `span` positions.
  prefix = jnp.cumsum(g_blocks, axis=-2).reshape(g.shape)
  suffix = _suffix_sums(g_blocks, 3).reshape(g.shape)
  while span < padded:
    halves = lambda x, span=span: split(x, 2, span)  # noqa: E731  [.., 2, span, ·]
    pre, suf = halves(prefix), halves(suffix)  # [B, K, padded / 2span, 2, span, H]
    total = pre[..., -1:, :]  # [.., 2, 1, H]: each half's Σ g, its prefix at its end.
    q_late = halves(q)[..., 1, :, :] * jnp.exp(pre[:, :, None, :, 1])  # exp(b_t - b_m)
    k_early = halves(k)[..., 0, :, :] * jnp.exp(suf[..., 0, :, :])  # exp(b_m - b_s)
    late = jnp.einsum("bkgnts,bknsd->bkgntd", jnp.einsum("bkgnth,bknsh->bkgnts", q_late, k_early),
                      halves(v)[..., 0, :, :])
    out = _add_to_half(halves(out), 1, late[..., None, :, :]).reshape(out.shape)
    prefix = _add_to_half(pre, 1, total[..., :1, :, :]).reshape(g.shape)
    suffix = _add_to_half(suf, 0, total[..., 1:, :, :]).reshape(g.shape)
    span *= 2
  # Now over the whole chunk: exp(b_t) reads the state, exp(b_C - b_s) writes to it.
  out = out + jnp.einsum("bkgth,bkhd->bkgtd", q * jnp.exp(prefix)[:, :, None], S)
  S = (jnp.exp(prefix[..., -1, :])[..., None] * S
       + jnp.einsum("bksh,bksd->bkhd", k * jnp.exp(suffix), v))
  return S, out[..., :C, :]


def _gla_token(S, x):
  q, k, v, g = x  # [B, K, G, H], [B, K, H], [B, K, D], [B, K, H|1]
  S = jnp.exp(g)[..., None] * S + k[..., None] * v[..., None, :]
  return S, jnp.einsum("bkgh,bkhd->bkgd", q, S)


def _by_token(token, S, chunk: recurrence.Chunk):
  """``token(S, (q, k, v, *gates)) -> (S, out)`` scanned over the chunk's positions."""
  xs = (jnp.moveaxis(chunk.fq, 3, 0), *(jnp.moveaxis(x, 2, 0)
                                        for x in (chunk.fk, chunk.v, *chunk.gates)))
  S, out = lax.scan(token, S, xs)
  return S, jnp.moveaxis(out, 0, 3)


def _gla_scan(config, S, chunk):
  del config
  return _by_token(_gla_token, S, chunk)


def _gla_associative_scan(config, S, chunk):
  """Prefix states by the associative ``(a1, S1) ∘ (a2, S2) = (a1 a2, a2 S1 + S2)``
  (``a`` as a log-decay)."""
  del config
  (g,) = chunk.gates

  def compose(earlier, later):
    return earlier[0] + later[0], jnp.exp(later[0])[..., None] * earlier[1] + later[1]

  writes = chunk.fk[..., None] * chunk.v[..., None, :]  # [B, K, C, H, D]
  log_a, states = lax.associative_scan(compose, (g, writes), axis=2)
  states = jnp.exp(log_a)[..., None] * S[:, :, None] + states  # [B, K, C, H, D]
  return states[:, :, -1], jnp.einsum("bkgih,bkihd->bkgid", chunk.fq, states)


_GLA_BODIES = {
    "scan": _gla_scan,
    "associative_scan": _gla_associative_scan,
    "chunked": _gla_chunk,
}


# The delta rule --------------------------------------------------------------------------
# gates = (g [B, K, C, 1], beta [B, K, C, 1]).


# The delta rule's inverse and its applications multiply in full float32 (no TF32 on GPUs):
# an inverse compounds rounding level by level.
_matmul = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)


def _unit_lower_inverse(M: jax.Array) -> jax.Array:
  """``M⁻¹`` for unit lower triangular ``M [..., C, C]``, by halves::

      [[A, 0], [L, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ L A⁻¹, D⁻¹]]

  with the two diagonal halves inverted together, one level per halving: matrix
  products only (a triangular solve is a sequential loop on some backends), in full
  float32 precision. A size that is not a power of two gets identity rows and
  columns up to the next one, dropped at the end.
  """
  C = M.shape[-1]
  padded = 1 << (C - 1).bit_length()
  if padded != C:
    pad = [(0, 0)] * (M.ndim - 2) + [(0, padded - C)] * 2
    ones = jnp.diag(jnp.arange(padded) >= C).astype(M.dtype)  # On the added diagonal.
    M = jnp.pad(M, pad) + ones.reshape((1,) * (M.ndim - 2) + ones.shape)
  return _unit_lower_inverse_by_halves(M)[..., :C, :C]


def _unit_lower_inverse_by_halves(M: jax.Array) -> jax.Array:
  """:func:`_unit_lower_inverse` for a power-of-two size."""
  C = M.shape[-1]
  if C == 1:
    return jnp.ones_like(M)
  h = C // 2
  halves = _unit_lower_inverse_by_halves(jnp.stack([M[..., :h, :h], M[..., h:, h:]], axis=-3))
  A_inv, D_inv = halves[..., 0, :, :], halves[..., 1, :, :]
  below = -_matmul(_matmul(D_inv, M[..., h:, :h]), A_inv)
  return jnp.concatenate([jnp.concatenate([A_inv, jnp.zeros_like(below)], axis=-1),
                          jnp.concatenate([below, D_inv], axis=-1)], axis=-2)


def _delta_writes(S, chunk: recurrence.Chunk):
  """The chunk's writes ``u [B, K, C, D]`` by one unit triangular inverse (the WY/UT form),
  ``U = (I + L)⁻¹ diag(β) (V - diag(Γ) K S_0)`` with ``L_ij = β_i (Γ_i / Γ_j) k_iᵀ k_j``
  (j < i); also the decays ``Γ_i / Γ_j`` ``[B, K, C, C]`` (0 where j > i), ``log Γ_i``
  ``[B, K, C]`` and the state after the chunk."""
  g, beta = (x[..., 0] for x in chunk.gates)  # [B, K, C]
  k = chunk.fk
  C = k.shape[2]
  prefix = jnp.cumsum(g, axis=2)  # [B, K, C]: log Γ_i
  decay = jnp.exp(segment_sums(g, 2))
  strictly_lower = jnp.tril(jnp.ones((C, C), bool), -1)
  L = jnp.where(strictly_lower, beta[..., None] * decay * jnp.einsum("bkih,bkjh->bkij", k, k), 0)
  system = L + jnp.eye(C, dtype=L.dtype)[None, None]
  read = jnp.exp(prefix)[..., None] * jnp.einsum("bkih,bkhd->bkid", k, S)  # Γ_i S_0ᵀ k_i
  u = _matmul(_unit_lower_inverse(system), beta[..., None] * (chunk.v - read))
  to_end = jnp.exp(_suffix_sums(g, 2))[..., None]  # [B, K, C, 1]: Γ_C / Γ_j
  S_end = (jnp.exp(prefix[:, :, -1])[..., None, None] * S
           + jnp.einsum("bkjh,bkjd->bkhd", k * to_end, u))
  return u, decay, prefix, S_end


def _delta_chunk(config, S, chunk: recurrence.Chunk):
  """C queries against the state and the chunk's writes: ``(S_C, out [B, K, G, C, D])``."""
  del config
  u, decay, prefix, S_end = _delta_writes(S, chunk)
  q = chunk.fq
  a = jnp.einsum("bkgih,bkjh->bkgij", q, chunk.fk) * decay[:, :, None]
  out = (jnp.einsum("bkgij,bkjd->bkgid", a, u)
         + jnp.einsum("bkgih,bkhd->bkgid", q * jnp.exp(prefix)[:, :, None, :, None], S))
  return S_end, out


def _delta_token(S, x):
  q, k, v, g, beta = x  # [B, K, G, H], [B, K, H], [B, K, D], [B, K, 1], [B, K, 1]
  S = jnp.exp(g)[..., None] * S
  u = beta * (v - jnp.einsum("bkh,bkhd->bkd", k, S))
  S = S + k[..., None] * u[..., None, :]
  return S, jnp.einsum("bkgh,bkhd->bkgd", q, S)


def _delta_scan(config, S, chunk):
  del config
  return _by_token(_delta_token, S, chunk)


def _delta_absorb(config, S, chunk):
  del config
  return _delta_writes(S, chunk)[-1]


_DELTA_BODIES = {"scan": _delta_scan, "chunked": _delta_chunk}


# Shared entry ----------------------------------------------------------------------------


def _gate(x: Any, *, name: str, p: checks.Prepared, per_feature: bool, fn: str) -> jax.Array:
  """A per-key input ``[B, S, K]`` (or ``[B, S, K, H]`` when ``per_feature``) as
  ``[B, K, S, H|1]`` float32; unbatched calls pass it without B."""
  B, _, S, _, K, H, _ = p.dims
  x = jnp.asarray(x)
  shapes = [(B, S, K)] + ([(B, S, K, H)] if per_feature else [])
  if not p.batched:
    x = x[None]
  if x.shape not in shapes or not jnp.issubdtype(x.dtype, jnp.floating):
    lead = "" if p.batched else " without B"
    want = " or ".join(str(s if p.batched else s[1:]) for s in shapes)
    raise ValueError(f"{fn}: {name} must be a float array {want}{lead} for key {p.key.shape}; "
                     f"got {x.dtype} {x.shape if p.batched else x.shape[1:]}.")
  x = x.astype(checks.accumulation_dtype(p.query.dtype))
  return (x[..., None] if x.ndim == 3 else x).transpose(0, 2, 1, 3)


def _initial(state: Any, p: checks.Prepared, dtype: Any, *, delta: bool, per_feature: bool,
             fn: str) -> GatedState | GatedSummary | DeltaSummary:
  """``initial_state`` checked against the arrays, batched and in ``dtype``: a
  :class:`GatedState`, or the family's summary (whose ``kv`` is the state it leaves)."""
  B, _, _, _, K, H, D = p.dims
  lead = (B,) if p.batched else ()
  summary_cls = DeltaSummary if delta else GatedSummary
  want = {"kv": lead + (K, H, D)}
  if isinstance(state, summary_cls):
    cls = summary_cls
    want.update({"transition": lead + (K, H, H)} if delta else
                {"log_decay": lead + (K,) + ((H,) if per_feature else ())})
  elif isinstance(state, GatedState):
    cls = GatedState
  else:
    raise ValueError(
        f"{fn}: initial_state must be a {summary_cls.__name__} (fields "
        f"{', '.join(summary_cls._fields)}) or a GatedState (field kv); got "
        f"{type(state).__name__}.")
  state = recurrence.check_state(state, cls, want, what="initial_state", fn=fn,
                                 dims=f"B={B}, K={K}, H={H}, D={D}"
                                 + ("" if p.batched else " (no B)"))
  return jax.tree.map(lambda x: (x if p.batched else x[None]).astype(dtype), state)


@functools.partial(jax.jit, static_argnames=("delta", "implementation", "chunk_size",
                                             "return_state", "fn"))
def _attention(query, key, value, log_decay, beta, scale, lengths, state, *, delta: bool,
               implementation: str, chunk_size: int, return_state: bool, fn: str):
  p = checks.prepare_qkv(query, key, value, fn=fn)
  (lengths,) = checks.check_lengths(p, fn=fn, key_value_seq_lengths=lengths).values()
  B, T, S, N, K, H, D = p.dims
  dtype = checks.accumulation_dtype(p.query.dtype)
  scale = checks.resolve_scale(scale, H)
  g = (jnp.zeros((B, K, S, 1), dtype) if log_decay is None else
       _gate(log_decay, name="log_decay", p=p, per_feature=not delta, fn=fn))
  gates = (g,) if beta is None else (g, _gate(beta, name="beta", p=p, per_feature=False, fn=fn))
  valid = length_predicate(jnp.arange(S), lengths)[:, None, :, None]  # [B|1, 1, S, 1]
  hide = lambda x: jnp.where(valid, x, 0)  # noqa: E731  A padded key: no decay, no write.
  q = (p.query.astype(dtype) * scale).reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
  k = hide(p.key.astype(dtype).transpose(0, 2, 1, 3))
  v = hide(p.value.astype(dtype).transpose(0, 2, 1, 3))
  if state is None:
    S0 = jnp.zeros_like(v, shape=(B, K, H, D))
  else:
    state = _initial(state, p, dtype, delta=delta, per_feature=g.shape[-1] > 1, fn=fn)
    S0 = state.kv
  transition = isinstance(state, DeltaSummary) and return_state
  if transition:
    # The keys act on a state as S ↦ A S + B, so the same recurrence run from [S_0 | A_0]
    # with values [v | 0] leaves [A S_0 + B | A A_0]: the summary composed with the keys'.
    v = jnp.concatenate([v, jnp.zeros_like(v, shape=v.shape[:-1] + (H,))], axis=-1)
    S0 = jnp.concatenate([S0, state.transition], axis=-1)
  chunk = recurrence.Chunk(q, None, k, None, v, tuple(hide(x) for x in gates))
  if implementation == "reference":
    out, S_end = (_delta_reference if delta else _gla_reference)(S0, chunk)
  else:
    bodies = recurrence.Bodies(
        (_DELTA_BODIES if delta else _GLA_BODIES)[implementation],
        _delta_absorb if delta else _gla_absorb, None)
    out, S_end = recurrence.run_chunks(bodies, None, S0, chunk, is_causal=True,
                                       chunk_size=chunk_size)
  out = out[..., :D].transpose(0, 3, 1, 2, 4).reshape(B, T, N, D).astype(p.query.dtype)
  final = GatedState(S_end)
  if transition:
    final = DeltaSummary(S_end[..., :D], S_end[..., D:])
  elif isinstance(state, GatedSummary):  # Given a summary, return one: it composes with the span.
    total = jnp.sum(chunk.gates[0], axis=2)  # [B, K, H|1]: the span's log-decay.
    final = GatedSummary(S_end, state.log_decay + (total if g.shape[-1] > 1 else total[..., 0]))
  return p.restore(out), final if p.batched else jax.tree.map(lambda x: x[0], final)


def _run(query, key, value, log_decay, beta, *, scale, is_causal, key_value_seq_lengths,
         initial_state, return_state, implementation, chunk_size, choices, fn):
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  if not is_causal:
    raise ValueError(f"{fn}: is_causal=False is not supported: these are recurrences, each "
                     "output reads the state of the keys up to its own position.")
  implementation = checks.check_implementation(
      implementation, choices=choices, is_causal=True, fn=fn) or "chunked"
  per_feature = beta is None and log_decay is not None and jnp.ndim(log_decay) == jnp.ndim(key)
  chunk_size = recurrence.check_chunk_size(chunk_size, form="gla" if per_feature else "kernel",
                                           fn=fn)
  out, state = _attention(query, key, value, log_decay, beta, scale, key_value_seq_lengths,
                          initial_state, delta=beta is not None, implementation=implementation,
                          chunk_size=chunk_size, return_state=bool(return_state), fn=fn)
  return (out, state) if return_state else out


def gated_linear_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    log_decay: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    key_value_seq_lengths: ArrayLike | None = None,
    initial_state: GatedState | None = None,
    return_state: bool = False,
    implementation: GatedImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """Linear attention with a decaying state (RetNet, simple GLA, Mamba2, GLA).

  ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ`` from ``S_0 = 0`` (or
  ``initial_state``) and ``o_t = scale · q_tᵀ S_t``: step t decays before it
  writes. No normaliser.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``.
    log_decay: ``g``, ``[B, S, K]`` (one decay per head: constant for RetNet,
      data-dependent for simple GLA / Mamba2) or ``[B, S, K, H]`` (one per key
      feature: GLA); every entry ≤ 0 (``-inf`` or a large negative value resets).
    scale: multiplies the query; default ``1 / sqrt(H)``.
    is_causal: must be True (these are recurrences).
    key_value_seq_lengths: optional ``[B]``: keys at or past it are identity steps.
    initial_state: a :class:`GatedState` to continue from, or a
      :class:`GatedSummary` (continued from its ``kv``).
    return_state: also return the final state: a :class:`GatedState`, or for a
      summary ``initial_state`` that summary followed by these keys.
    implementation: ``"reference"`` (the quadratic ``(Q Kᵀ ⊙ Γ) V`` with the
      decay matrix Γ), ``"scan"`` (token by token), ``"associative_scan"``, or
      ``"chunked"`` (the default: chunkwise parallel, O(T) memory).
    chunk_size: positions per chunk of ``"scan"``, ``"associative_scan"`` and ``"chunked"``.
      None: the default backend's measured best, 64 on CPU and 256 on GPU; with a decay
      per key feature (GLA's recursive halving) 128 on CPU.

  Returns:
    ``[B, T, N, D]`` in the input dtype; with ``return_state`` the pair
    ``(out, state)``. T ≠ S is bottom-right aligned.

  Raises:
    ValueError: for ``is_causal=False``, bad shapes or dtypes of the arrays or
      ``log_decay``, an unknown implementation, a bad ``chunk_size`` or a
      state that does not match.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))  # [B, T, N=K, H=D]
    >>> g = jnp.full((1, 16, 2), jnp.log(0.9))  # RetNet: a fixed decay per head
    >>> la.gated_linear_attention(x, x, x, g).shape
    (1, 16, 2, 8)

  References:
    Sun et al., "Retentive Network: A Successor to Transformer for Large
    Language Models", 2023. Yang et al., "Gated Linear Attention Transformers
    with Hardware-Efficient Training", 2024. Dao and Gu, "Transformers are
    SSMs: Generalized Models and Efficient Algorithms Through Structured State
    Space Duality", 2024.
  """
  return _run(query, key, value, log_decay, None, scale=scale, is_causal=is_causal,
              key_value_seq_lengths=key_value_seq_lengths, initial_state=initial_state,
              return_state=return_state, implementation=implementation, chunk_size=chunk_size,
              choices=GATED_IMPLEMENTATIONS, fn="gated_linear_attention")


def delta_rule_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    beta: ArrayLike,
    *,
    log_decay: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = True,
    key_value_seq_lengths: ArrayLike | None = None,
    initial_state: GatedState | None = None,
    return_state: bool = False,
    implementation: DeltaImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """The delta rule (DeltaNet; Gated DeltaNet with ``log_decay``).

  ``S' = exp(g_t) S_{t-1}``, ``u_t = β_t (v_t - S'ᵀ k_t)``,
  ``S_t = S' + k_t u_tᵀ``, ``o_t = scale · q_tᵀ S_t``: each write replaces
  part of what the key already stores. The keys are used as given (the
  papers' layers L2-normalise them first).

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``.
    beta: ``[B, S, K]`` write strengths in [0, 1].
    log_decay: optional ``g`` ``[B, S, K]``, ≤ 0 (None: no decay, DeltaNet).
    scale: multiplies the query; default ``1 / sqrt(H)``.
    is_causal: must be True (these are recurrences).
    key_value_seq_lengths: optional ``[B]``: keys at or past it are identity steps.
    initial_state: a :class:`GatedState` to continue from, or a
      :class:`DeltaSummary` (continued from its ``kv``).
    return_state: also return the final state: a :class:`GatedState`, or for a
      summary ``initial_state`` that summary followed by these keys.
    implementation: ``"reference"`` (token by token, every state kept), ``"scan"``
      (token by token on ``lax.scan``) or ``"chunked"`` (the default: the
      WY/UT chunk form, one unit triangular inverse per chunk).
    chunk_size: positions per chunk of ``"scan"`` and ``"chunked"``.
      None: the default backend's measured best, 64 on CPU and 256 on GPU.

  Returns:
    ``[B, T, N, D]`` in the input dtype; with ``return_state`` the pair
    ``(out, state)``. T ≠ S is bottom-right aligned.

  Raises:
    ValueError: for ``is_causal=False``, bad shapes or dtypes of the arrays,
      ``beta`` or ``log_decay``, an unknown implementation, a bad
      ``chunk_size`` or a state that does not match.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))  # [B, T, N=K, H=D]
    >>> k = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    >>> la.delta_rule_attention(x, k, x, jnp.full((1, 16, 2), 0.5)).shape
    (1, 16, 2, 8)

  References:
    Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length", 2024. Yang, Kautz and Hatamizadeh, "Gated Delta
    Networks: Improving Mamba2 with Delta Rule", 2025.
  """
  return _run(query, key, value, log_decay, beta, scale=scale, is_causal=is_causal,
              key_value_seq_lengths=key_value_seq_lengths, initial_state=initial_state,
              return_state=return_state, implementation=implementation, chunk_size=chunk_size,
              choices=DELTA_IMPLEMENTATIONS, fn="delta_rule_attention")


# Decoding --------------------------------------------------------------------------------


def init_gated_state(batch: int, num_kv_heads: int, head_dim: int, value_dim: int,
                     dtype: Any = jnp.float32) -> GatedState:
  """The empty :class:`GatedState`: zeros ``kv [B, K, H, D]``.

  Args:
    batch: B.
    num_kv_heads: K.
    head_dim: H.
    value_dim: D.
    dtype: the state's dtype (float32 for float32, bfloat16 and float16 inputs).

  Returns:
    A :class:`GatedState` of zeros.

  Raises:
    ValueError: if a size is not a positive int.

  Examples:
    >>> la.init_gated_state(batch=2, num_kv_heads=1, head_dim=4, value_dim=3).kv.shape
    (2, 1, 4, 3)
  """
  sizes = checks.positive_sizes(batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                value_dim=value_dim, fn="init_gated_state")
  return GatedState(jnp.zeros(sizes, dtype))


def _one_token(fn, state, query, key, value, gates, **options):
  """:func:`recurrence.one_token_step` with per-key gates ``[B, K(, H)]`` (no B unbatched)
  given a position axis like the arrays."""
  at = jnp.ndim(query) - 2  # The position axis: after B (if any); bad ranks are named there.
  gates = {name: None if x is None else jnp.expand_dims(jnp.asarray(x), at)
           for name, x in gates.items()}
  return recurrence.one_token_step(fn, state, query, key, value, **gates, **options)


def gated_linear_attention_step(state: GatedState, query: ArrayLike, key: ArrayLike,
                                value: ArrayLike, log_decay: ArrayLike, *,
                                scale: float | None = None) -> tuple[GatedState, jax.Array]:
  """One decoding step of :func:`gated_linear_attention`: ``S <- diag(exp(g)) S + k vᵀ``.

  Args:
    state: the :class:`GatedState` so far (``kv [B, K, H, D]``).
    query: ``[B, N, H]`` (no B when unbatched, like the state).
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.
    log_decay: ``[B, K]`` or ``[B, K, H]``, ≤ 0.
    scale: multiplies the query; default ``1 / sqrt(H)``.

  Returns:
    ``(state, out [B, N, D])``, the state in the dtype it came in.

  Raises:
    ValueError: on ranks or shapes that do not match each other or the state.

  Examples:
    >>> state = la.init_gated_state(batch=1, num_kv_heads=2, head_dim=4, value_dim=4)
    >>> x = jnp.ones((1, 2, 4))  # [B, N=K, H=D]
    >>> state, out = la.gated_linear_attention_step(state, x, x, x, jnp.full((1, 2), -0.1))
    >>> out.shape
    (1, 2, 4)

  References:
    Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
    Training", 2024.
  """
  return _one_token(gated_linear_attention, state, query, key, value,
                    {"log_decay": log_decay}, scale=scale)


def delta_rule_attention_step(state: GatedState, query: ArrayLike, key: ArrayLike,
                              value: ArrayLike, beta: ArrayLike, *,
                              log_decay: ArrayLike | None = None,
                              scale: float | None = None) -> tuple[GatedState, jax.Array]:
  """One decoding step of :func:`delta_rule_attention`.

  ``S' = exp(g) S``, ``u = β (v - S'ᵀ k)``, ``S <- S' + k uᵀ``, ``o = scale · qᵀ S``.

  Args:
    state: the :class:`GatedState` so far (``kv [B, K, H, D]``).
    query: ``[B, N, H]`` (no B when unbatched, like the state).
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.
    beta: ``[B, K]`` in [0, 1].
    log_decay: optional ``[B, K]``, ≤ 0.
    scale: multiplies the query; default ``1 / sqrt(H)``.

  Returns:
    ``(state, out [B, N, D])``, the state in the dtype it came in.

  Raises:
    ValueError: on ranks or shapes that do not match each other or the state.

  Examples:
    >>> state = la.init_gated_state(batch=1, num_kv_heads=2, head_dim=4, value_dim=4)
    >>> x = jnp.ones((1, 2, 4)) / 2  # [B, N=K, H=D]; a unit key
    >>> state, out = la.delta_rule_attention_step(state, x, x, x, jnp.ones((1, 2)))
    >>> bool(jnp.allclose(state.kv[0, 0].T @ x[0, 0], x[0, 0]))  # β = 1 stores v at k
    True

  References:
    Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length", 2024.
  """
  return _one_token(delta_rule_attention, state, query, key, value,
                    {"beta": beta, "log_decay": log_decay}, scale=scale)


# Oracles ---------------------------------------------------------------------------------


def _aligned(chunk: recurrence.Chunk) -> recurrence.Chunk:
  """Keys aligned with the queries (bottom-right): T - S hidden keys in front for T > S."""
  T, S = chunk.num_queries, chunk.num_keys
  return chunk.pad_keys(front=max(T - S, 0))


def _gla_reference(S0, chunk: recurrence.Chunk):
  """``(Q Kᵀ ⊙ Γ) V + (Q ⊙ exp(G)) S_0`` with ``Γ_ij = exp(G_i - G_j)``, ``G`` the prefix
  sums of the log-decays, all positions at once (float32; moderate decays only)."""
  chunk = _aligned(chunk)
  (g,) = chunk.gates
  T, S = chunk.num_queries, chunk.num_keys
  G = jnp.cumsum(g, axis=2)  # [B, K, S, H|1]
  Gq = G[:, :, S - T:]  # query i sits at key position i + S - T.
  visible = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + S - T  # [T, S]
  gamma = jnp.exp(jnp.where(visible[..., None], Gq[:, :, :, None] - G[:, :, None], -jnp.inf))
  a = jnp.einsum("bkgih,bkjh,bkijh->bkgij", chunk.fq, chunk.fk,
                 jnp.broadcast_to(gamma, gamma.shape[:-1] + (chunk.fk.shape[-1],)))
  out = (jnp.einsum("bkgij,bkjd->bkgid", a, chunk.v)
         + jnp.einsum("bkgih,bkhd->bkgid", chunk.fq * jnp.exp(Gq)[:, :, None], S0))
  to_end = jnp.exp(G[:, :, -1:] - G)  # [B, K, S, H|1]
  S_end = (jnp.exp(G[:, :, -1])[..., None] * S0
           + jnp.einsum("bkjh,bkjd->bkhd", chunk.fk * to_end, chunk.v))
  return out, S_end


def _delta_reference(S0, chunk: recurrence.Chunk):
  """The delta rule token by token, written out: one ``lax.scan`` step per key (every
  key's state kept, ``[S, B, K, H, D]``: small S only), then each query reads its own."""
  chunk = _aligned(chunk)
  T, S = chunk.num_queries, chunk.num_keys

  def token(state, x):
    k, v, g, beta = x  # [B, K, H], [B, K, D], [B, K, 1], [B, K, 1]
    state = jnp.exp(g)[..., None] * state
    u = beta * (v - jnp.einsum("bkh,bkhd->bkd", k, state))
    state = state + jnp.einsum("bkh,bkd->bkhd", k, u)
    return state, state

  keys = tuple(jnp.moveaxis(x, 2, 0) for x in (chunk.fk, chunk.v, *chunk.gates))
  state, states = lax.scan(token, S0, keys)
  return jnp.einsum("bkgth,tbkhd->bkgtd", chunk.fq, states[S - T:]), state


def gated_linear_attention_reference(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                                     log_decay: ArrayLike, **options: Any):
  """The oracle of :func:`gated_linear_attention`: ``(Q Kᵀ ⊙ Γ) V`` at once, float32.

  ``Γ_ij = exp(G_i - G_j)`` for the prefix sums ``G`` of ``log_decay`` (moderate
  decays: a reset's large sums cancel here, not in the fast forms). Takes the
  arrays ``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, D]``, ``[B, S, K(, H)]``
  and the options of :func:`gated_linear_attention` but ``implementation``.

  Raises:
    ValueError: as :func:`gated_linear_attention`, under this name.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> g = jnp.full((1, 8, 2), -0.1)
    >>> fast = la.gated_linear_attention(x, x, x, g)
    >>> bool(jnp.allclose(fast, la.gated_linear_attention_reference(x, x, x, g), atol=1e-5))
    True

  References:
    Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
    Training", 2024.
  """
  return _reference_call(query, key, value, log_decay, None, options,
                         fn="gated_linear_attention_reference")


def delta_rule_attention_reference(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                                   beta: ArrayLike, **options: Any):
  """The oracle of :func:`delta_rule_attention`: the token recurrence written out.

  One step per key, keeping every state (small S only), float32. Takes the arrays
  ``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, D]``, ``[B, S, K]`` and the
  options of :func:`delta_rule_attention` but ``implementation``.

  Raises:
    ValueError: as :func:`delta_rule_attention`, under this name.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> beta = jnp.full((1, 8, 2), 0.5)
    >>> fast = la.delta_rule_attention(x, x, x, beta)
    >>> bool(jnp.allclose(fast, la.delta_rule_attention_reference(x, x, x, beta), atol=1e-5))
    True

  References:
    Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length", 2024.
  """
  log_decay = options.pop("log_decay", None)
  return _reference_call(query, key, value, log_decay, beta, options,
                         fn="delta_rule_attention_reference")


def _reference_call(query, key, value, log_decay, beta, options, *, fn):
  if "implementation" in options:
    raise ValueError(f"{fn}: takes no implementation (it is the reference).")
  defaults = dict(scale=None, is_causal=True, key_value_seq_lengths=None, initial_state=None,
                  return_state=False, chunk_size=None)
  unknown = set(options) - set(defaults)
  if unknown:
    raise ValueError(f"{fn}: unknown options {sorted(unknown)}.")
  return _run(query, key, value, log_decay, beta, **{**defaults, **options},
              implementation="reference", choices=("reference",), fn=fn)


# Summaries, their combine and the registry entries ----------------------------------------


def combine_gated(earlier: Any, later: Any) -> Any:
  """The summary of ``earlier``'s keys followed by ``later``'s (the registry's ``combine``).

  Gated: ``(B_e, a_e) ∘ (B_l, a_l) = (diag(exp(a_l)) B_e + B_l, a_e + a_l)``; delta rule:
  ``(B_e, A_e) ∘ (B_l, A_l) = (A_l B_e + B_l, A_l A_e)``. Associative, so summaries of
  consecutive spans combine into the summary of all. ``earlier`` may also be a
  :class:`GatedState` (the state of the keys so far): the result is then the state
  after ``later``'s keys.

  Raises:
    ValueError: for other or mixed types, or fields whose shapes differ.
  """
  cls = type(later)
  if cls not in (GatedSummary, DeltaSummary) or type(earlier) not in (cls, GatedState):
    raise ValueError(
        "combine: later must be a GatedSummary or a DeltaSummary and earlier one of the same "
        f"type or a GatedState; got {type(earlier).__name__} and {cls.__name__}.")
  for field in type(earlier)._fields:
    a, b = jnp.shape(getattr(earlier, field)), jnp.shape(getattr(later, field))
    if a != b:
      raise ValueError(f"combine: {cls.__name__}.{field} has shapes {a} and {b}.")
  kv = earlier.kv
  if cls is DeltaSummary:
    kv = jnp.einsum("...hi,...id->...hd", later.transition, kv) + later.kv
  else:
    decay = jnp.exp(later.log_decay)
    rank = jnp.ndim(kv) - decay.ndim
    if rank not in (1, 2):
      raise ValueError(f"combine: GatedSummary.log_decay {decay.shape} must be [B, K] or "
                       f"[B, K, H] for kv {jnp.shape(kv)}.")
    kv = (decay[..., None, None] if rank == 2 else decay[..., None]) * kv + later.kv
  if type(earlier) is GatedState:
    return GatedState(kv)
  if cls is DeltaSummary:
    return DeltaSummary(kv, jnp.einsum("...hi,...ij->...hj", later.transition,
                                       earlier.transition))
  return GatedSummary(kv, earlier.log_decay + later.log_decay)


def _identity(key: Any, value: Any, *, delta: bool, per_feature: bool) -> Any:
  """The summary of no keys (zero ``kv``; zero log-decay or identity transition) for
  ``key [B, S, K, H]`` / ``value [B, S, K, D]`` (no B unbatched); None for bad ranks."""
  key, value = jnp.asarray(key), jnp.asarray(value)
  if key.ndim not in (3, 4) or value.ndim != key.ndim:
    return None  # The attention call names the ranks.
  lead, (K, H), D = key.shape[:-3], key.shape[-2:], value.shape[-1]
  dtype = checks.accumulation_dtype(key.dtype)
  # zeros_like: inside shard_map the summary varies over the devices as the keys do.
  zeros = functools.partial(jnp.zeros_like, key, dtype)
  kv = zeros(shape=lead + (K, H, D))
  if delta:
    eye = jnp.eye(H, dtype=dtype).reshape((1,) * (len(lead) + 1) + (H, H))
    return DeltaSummary(kv, zeros(shape=lead + (K, H, H)) + eye)
  return GatedSummary(kv, zeros(shape=lead + (K,) + ((H,) if per_feature else ())))


def _identity_like(query: Any, key: Any, value: Any, *, delta: bool, per_feature: bool) -> Any:
  """The empty summary for ``[B, T, N, H]`` / ``[B, S, K, H]`` / ``[B, S, K, D]`` arrays
  (the registry's ``identity``, for context parallelism): steps from it return summaries."""
  p = checks.prepare_qkv(query, key, value, fn="init_gated_state")
  return _identity(p.key, p.value, delta=delta, per_feature=per_feature)


def _init_like(query: Any, key: Any, value: Any) -> GatedState:
  """The empty :class:`GatedState` ``[B, K, H, D]`` for arrays shaped like ``query``, ``key``,
  ``value`` (the registry's ``init``): what decoding carries, without a summary's decays or
  ``[K, H, H]`` transitions."""
  p = checks.prepare_qkv(query, key, value, fn="init_gated_state")
  return GatedState(_identity(p.key, p.value, delta=False, per_feature=False).kv)


def _gated_summarize(key: Any, value: Any, log_decay: Any, *, key_value_seq_lengths: Any = None,
                     chunk_size: int | None = None) -> GatedSummary:
  """The :class:`GatedSummary` of ``key [B, S, K, H]`` / ``value [B, S, K, D]``."""
  identity = _identity(key, value, delta=False,
                       per_feature=jnp.ndim(log_decay) == jnp.ndim(key))
  return recurrence.summarize_keys(gated_linear_attention, key, value, log_decay=log_decay,
                                   initial_state=identity, chunk_size=chunk_size,
                                   key_value_seq_lengths=key_value_seq_lengths)


def _delta_summarize(key: Any, value: Any, beta: Any, *, log_decay: Any = None,
                     key_value_seq_lengths: Any = None,
                     chunk_size: int | None = None) -> DeltaSummary:
  """The :class:`DeltaSummary` of ``key [B, S, K, H]`` / ``value [B, S, K, D]`` (the
  recurrence run from the identity summary, as :class:`DeltaSummary` says)."""
  return recurrence.summarize_keys(delta_rule_attention, key, value, beta=beta,
                                   log_decay=log_decay, chunk_size=chunk_size,
                                   initial_state=_identity(key, value, delta=True,
                                                           per_feature=False),
                                   key_value_seq_lengths=key_value_seq_lengths)


def _fixed_log_decays(key: Any) -> jax.Array:
  """RetNet's ``log γ_i`` with ``γ_i = 1 - 2^(-5-i)`` for key/value head i, broadcast to
  ``key``'s shape without H (``[B, S, K]``, or ``[B, K]`` for one token)."""
  shape = jnp.shape(key)
  dtype = checks.accumulation_dtype(jnp.result_type(key))
  if len(shape) < 2:
    return jnp.zeros(shape[:-1], dtype)  # The attention call names the ranks.
  log_gamma = np.log1p(-np.exp2(-5.0 - np.arange(shape[-2])))
  return jnp.broadcast_to(jnp.asarray(log_gamma, dtype), shape[:-1])


def _entry(fn: Any, *, name: str, key_at: int, inputs: tuple[tuple[str, str], ...],
           gates: Any = None) -> Any:
  """``fn`` as registered under ``name``: its per-token inputs are the keyword-only
  ``inputs`` (names and declared shapes), checked against the key (the positional
  argument at ``key_at``) and passed on as ``fn``'s ``log_decay`` / ``beta``; a variant
  without inputs computes them as ``gates(key)``. Gates outside ``inputs`` are refused."""
  declared, inputs = inputs, tuple(n for n, _ in inputs)
  signature = inspect.signature(fn)
  params = [p for p in signature.parameters.values() if p.name not in ("log_decay", "beta")]
  positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
  rest = [p for p in params if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD]
  extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in inputs]

  @functools.wraps(fn)
  def entry(*args: Any, **kwargs: Any) -> Any:
    given = {n: kwargs.pop(n) for n in inputs if n in kwargs}
    missing = [n for n in inputs if n not in given]
    refused = [n for n in ("log_decay", "beta") if n in kwargs]
    if missing or refused:
      raise ValueError(f"{name}: takes the per-token input(s) {list(inputs)} as keyword "
                       f"arguments; missing {missing}, not taken {refused}.")
    key = args[key_at] if len(args) > key_at else kwargs.get("key")
    if gates is not None:
      return fn(*args, **gates(key), **kwargs)
    if jnp.ndim(key) >= 2:  # Else the function names the ranks it needs.
      given = registry.check_extra_inputs(name, declared, given, jnp.shape(key))
    return fn(*args, **given, **kwargs)

  entry.__signature__ = signature.replace(parameters=positional + extra + rest)
  return entry


def _register(name: str, *, delta: bool, inputs: tuple[tuple[str, str], ...], gates: Any = None,
              per_feature: bool = False) -> None:
  if delta:
    function, reference, step, summarize = (delta_rule_attention, delta_rule_attention_reference,
                                            delta_rule_attention_step, _delta_summarize)
  else:
    function, reference, step, summarize = (gated_linear_attention,
                                            gated_linear_attention_reference,
                                            gated_linear_attention_step, _gated_summarize)
  entry = functools.partial(_entry, name=name, inputs=inputs, gates=gates)
  recurrence.register_recurrent(
      name, function=entry(function, key_at=1), reference=entry(reference, key_at=1),
      init=_init_like,
      identity=functools.partial(_identity_like, delta=delta, per_feature=per_feature),
      step=entry(step, key_at=2), summarize=entry(summarize, key_at=0),
      implementations=DELTA_IMPLEMENTATIONS if delta else GATED_IMPLEMENTATIONS,
      noncausal_only=frozenset(), supports_noncausal=False, extra_inputs=inputs,
      combine=combine_gated)


# RetNet: a fixed decay per head, no gate inputs.
_register("retention", delta=False, inputs=(),
          gates=lambda key: {"log_decay": _fixed_log_decays(key)})
_register("simple_gla", delta=False, inputs=(("log_decay", "[B, S, K]"),))
_register("gla", delta=False, inputs=(("log_decay", "[B, S, K, H]"),), per_feature=True)
_register("delta_net", delta=True, inputs=(("beta", "[B, S, K]"),))
_register("gated_delta_net", delta=True,
          inputs=(("beta", "[B, S, K]"), ("log_decay", "[B, S, K]")))
