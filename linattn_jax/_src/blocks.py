"""Padding, block (chunk) reshapes and prefix sums along one axis.

``split_blocks`` turns a length-L axis into ``[L / C, ..., C, ...]`` with the
block index first, ready for ``lax.scan`` / ``lax.map``; ``merge_blocks`` is
its inverse. Lengths that are not a multiple of the block are padded first.
``prefix_sums`` is a cumulative sum over a block's C positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def num_blocks(length: int, block: int) -> int:
  """``ceil(length / block)``."""
  return -(-length // block)


def pad_axis(x: jax.Array, axis: int, multiple: int, value: float = 0) -> jax.Array:
  """Pads ``axis`` at the end up to a multiple of ``multiple``."""
  axis = axis % x.ndim
  extra = num_blocks(x.shape[axis], multiple) * multiple - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def split_blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
  """``[..., L, ...]`` -> ``[ceil(L / block), ..., block, ...]`` (zero padded)."""
  axis = axis % x.ndim
  x = pad_axis(x, axis, block)
  n = x.shape[axis] // block
  x = x.reshape(x.shape[:axis] + (n, block) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def merge_blocks(x: jax.Array, axis: int, length: int) -> jax.Array:
  """Inverse of :func:`split_blocks`.

  ``x`` is ``[n, ..., block, ...]`` with the block axis at position
  ``axis + 1``; the result has ``length`` entries on the non-negative
  ``axis`` (padding is cropped).
  """
  n = x.shape[0]
  x = jnp.moveaxis(x, 0, axis)
  block = x.shape[axis + 1]
  x = x.reshape(x.shape[:axis] + (n * block,) + x.shape[axis + 2:])
  return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def prefix_sums(x: jax.Array, axis: int) -> jax.Array:
  """``out_i = Σ_{l≤i} x_l`` along ``axis``, as a product with the ``[C, C]`` lower triangle.

  For a chunk's C positions, not a sequence (the product costs C² per column).
  ``jnp.cumsum`` lowers to a reduce-window on XLA:CPU, which inside a chunk body
  (C = 32, 4 heads of 64 features) took longer than the rest of the prefix's work,
  forward and backward; the product and its transpose (the upper triangle) are two
  small matmuls. ``HIGHEST`` precision: no TF32 rounding of float32 on GPUs.
  """
  axis = axis % x.ndim
  C = x.shape[axis]
  lower = jnp.tril(jnp.ones((C, C), x.dtype))
  summed = jnp.tensordot(lower, x, axes=(1, axis), precision=lax.Precision.HIGHEST)
  return jnp.moveaxis(summed, 0, axis)
