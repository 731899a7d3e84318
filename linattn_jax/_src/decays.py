"""Sums of log-decays, and the decayed pair weights of the gated recurrences.

A gated recurrence decays its state by ``exp(g_l)`` at each step l (``g_l ≤ 0``,
one per head or one per key feature). Between a key j and a later position i the
decay is ``exp(Σ_{j<l≤i} g_l)``. Every function here forms those sums directly,
never as a difference of prefix sums, so a large decay (a reset, -1e4) does not
cancel the small ones after it and no exponent is positive.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax._src.blocks import pad_axis


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


def suffix_sums(g: jax.Array, axis: int) -> jax.Array:
  """``Σ_{l>j} g_l`` along ``axis``: the log-decay from key j to the chunk's end (summed
  from the end, never as a difference: a reset at j does not cancel)."""
  later = jnp.concatenate([lax.slice_in_dim(g, 1, None, axis=axis),
                           jnp.zeros_like(lax.slice_in_dim(g, 0, 1, axis=axis))], axis=axis)
  return jnp.flip(jnp.cumsum(jnp.flip(later, axis), axis), axis)


# Pair weights inside a chunk, by recursive halving above blocks of this many positions
# (formed directly: C · span · H exponentials).
_DIRECT_SPAN = 4


def pair_weights(x: jax.Array, y: jax.Array, g: jax.Array) -> jax.Array:
  """``A [..., C(i), C(j)]`` with ``A_ij = Σ_h x_ih y_jh exp(Σ_{j<l≤i} g_lh)`` for j ≤ i, else 0.

  ``x``, ``y`` ``[..., C, H]`` and ``g`` ``[..., C, H|1]`` broadcast against each other on
  their leading axes. With one decay per head (``g [..., C, 1]``) this is ``(x yᵀ) ⊙ Γ``
  for the decay matrix ``Γ_ij = exp(Σ_{j<l≤i} g_l)``. With one per feature no such
  matrix exists: the positions are cut into halves, each half into halves, down to
  blocks of 4, whose pairs are weighed directly. A pair j < i in different blocks is
  split at exactly one level, j in the first half F of a span and i in its second half
  L; with m the last position of F::

      Σ_{j<l≤i} g_l = Σ_{m<l≤i} g_l + Σ_{j<l≤m} g_l

  two sums inside one half each, so the level's block of A is one matrix product of
  ``x_i exp(Σ_{m<l≤i} g_l)`` (L) with ``y_j exp(Σ_{j<l≤m} g_l)`` (F), and no
  ``[C, C, H]`` tensor is formed. A half's running sums come from the level below.

  References:
    Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
    Training", 2024 (secondary-level chunking, section 4.2).
  """
  if g.shape[-1] == 1:  # Γ for each product: broadcast over several, Γ's gradient was a
    # sum over them of [C, C] arrays (slow on XLA:CPU); g's is a sum of [C] ones.
    lead = jnp.broadcast_shapes(x.shape[:-2], y.shape[:-2], g.shape[:-2])
    g = jnp.broadcast_to(g[..., 0], lead + g.shape[-2:-1])
    return jnp.einsum("...ih,...jh->...ij", x, y) * jnp.exp(segment_sums(g, -1))
  C = x.shape[-2]
  # One leading shape for all three: einsum's broadcasting of size-1 leading axes, under
  # grad inside lax.scan, made XLA:CPU (jaxlib 0.10, its YNNPACK dot fusion) crash.
  lead = jnp.broadcast_shapes(x.shape[:-2], y.shape[:-2], g.shape[:-2])
  x, y, g = (jnp.broadcast_to(z, lead + z.shape[-2:]) for z in (x, y, g))
  padded = 1 << (C - 1).bit_length()  # Added positions: g = 0, x = y = 0 (no weight).
  x, y, g = (pad_axis(z, z.ndim - 2, padded) for z in (x, y, g))
  span = min(_DIRECT_SPAN, padded)
  # [..., P, ·] as [..., P / (Π sizes), *sizes, ·]: blocks of `span`, then pairs of halves.
  split = lambda z, *sizes: z.reshape(z.shape[:-2] + (-1, *sizes, z.shape[-1]))  # noqa: E731
  blocks = split(g, span)  # [..., n, span, H]
  A = jnp.einsum("...nth,...nsh,...ntsh->...nts", split(x, span), split(y, span),
                 jnp.exp(segment_sums(blocks, -2)))  # [..., n, span(i), span(j)]
  prefix = jnp.cumsum(blocks, axis=-2)  # Σ_{l≤i} g_l inside i's block.
  suffix = suffix_sums(blocks, -2)  # Σ_{l>j} g_l inside j's block.
  while span < padded:
    halves = lambda z, span=span: z.reshape(z.shape[:-3] + (-1, 2, span, z.shape[-1]))  # noqa: E731
    A, pre, suf = halves(A), halves(prefix), halves(suffix)  # [..., n/2, 2, span, ·]
    late = split(x, 2, span)[..., 1, :, :] * jnp.exp(pre[..., 1, :, :])
    early = split(y, 2, span)[..., 0, :, :] * jnp.exp(suf[..., 0, :, :])
    across = jnp.einsum("...ih,...jh->...ij", late, early)  # [..., n/2, span, span]
    first, second = A[..., 0, :, :], A[..., 1, :, :]
    A = jnp.concatenate([jnp.concatenate([first, jnp.zeros_like(across)], axis=-1),
                         jnp.concatenate([across, second], axis=-1)], axis=-2)
    total = pre[..., -1:, :]  # [..., n/2, 2, 1, H]: each half's Σ g.
    prefix = jnp.concatenate([pre[..., 0, :, :], pre[..., 1, :, :] + total[..., 0, :, :]], -2)
    suffix = jnp.concatenate([suf[..., 0, :, :] + total[..., 1, :, :], suf[..., 1, :, :]], -2)
    span *= 2
  return A[..., 0, :C, :C]
