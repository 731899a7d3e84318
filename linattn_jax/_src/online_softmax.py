"""Online (streaming) softmax accumulation, the core of blockwise attention.

Softmax-weighted sums can be built one block of scores at a time while
keeping only a running maximum ``m``, a running normaliser ``l`` and an
unnormalised accumulator ``a`` per row (Milakov & Gimelshein, 2018; Dao et al.,
FlashAttention, 2022). After blocks s_1..s_b with values v_1..v_b::

    m = max over all seen scores
    l = sum_j exp(s_j - m)
    a = sum_j exp(s_j - m) v_j
    out = a / l,     lse = m + log(l)

A new block rescales the old ``l`` and ``a`` by ``exp(m_old - m_new)``.
Masked scores are ``-inf``; a row that has seen only ``-inf`` keeps ``l = 0``
and finishes as zeros with ``lse = -inf`` (never NaN). State is float32
(float64 for float64 inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class SoftmaxCarry(NamedTuple):
  """Running state of an online softmax over rows R."""

  row_max: jax.Array  # [..., R] float32, max score seen so far (-inf: none).
  row_sum: jax.Array  # [..., R] float32, sum of exp(score - row_max).
  acc: jax.Array  # [..., R, D] float32, sum of exp(score - row_max) * value.


def init_softmax_carry(
    rows_shape: tuple[int, ...], value_dim: int, dtype: Any = jnp.float32, *, like: Any = None
) -> SoftmaxCarry:
  """Empty carry for ``rows_shape`` rows and value dim ``value_dim``.

  ``like``: an input array the carry is built from (``*_like``), so that
  inside ``shard_map`` it varies over the same devices as the inputs and a
  loop carrying it keeps one type.
  """
  like = jnp.zeros((), dtype) if like is None else like
  return SoftmaxCarry(
      row_max=jnp.full_like(like, -jnp.inf, dtype, shape=rows_shape),
      row_sum=jnp.zeros_like(like, dtype, shape=rows_shape),
      acc=jnp.zeros_like(like, dtype, shape=rows_shape + (value_dim,)),
  )


def exponent_shift(running_max: jax.Array) -> jax.Array:
  """A running max used as the shift in ``exp(x - shift)``: -inf (nothing seen yet) becomes 0.

  Every stabilised exponential in the toolkit (online softmax, the linear
  family's running log-scales, log-sum-exps) shifts by this, so an empty row
  gives ``exp(-inf - 0) = 0`` instead of ``exp(-inf + inf) = NaN``.
  """
  return jnp.where(running_max == -jnp.inf, 0.0, running_max)


def safe_divide(x: jax.Array, den: jax.Array) -> jax.Array:
  """``x / den`` (broadcasting), with 0 where ``den == 0`` and NaN-free gradients there.

  A row that has seen no key has a zero normaliser; it reads as zeros.
  """
  empty = den == 0
  return jnp.where(empty, 0.0, x / jnp.where(empty, 1.0, den))


def divide_rows(x: jax.Array, den: jax.Array) -> jax.Array:
  """``x [..., D] / den [...]``, row by row, with 0 where ``den == 0``.

  The product with ``1 / den`` is written as an einsum, so that its gradient
  with respect to ``den`` (``Σ_d g_d x_d``) is a batched product too: as a
  reduction over the minor axis it is XLA:CPU's slow path
  (docs/benchmarks.md#recurrent-core-timings). A row that saw no key
  (``den = 0``) reads 0, with finite gradients.
  """
  empty = den == 0
  return jnp.where(empty[..., None], 0.0,
                   jnp.einsum("...d,...->...d", x, 1 / jnp.where(empty, 1, den)))


# NaN-free log space: log 0 = -inf, and every -inf has a zero (never NaN) gradient.


def safe_log(x: jax.Array) -> jax.Array:
  """``log x`` for ``x > 0``, ``-inf`` elsewhere."""
  positive = x > 0
  return jnp.where(positive, jnp.log(jnp.where(positive, x, 1.0)), -jnp.inf)


def logsumexp(x: jax.Array, axis: int) -> jax.Array:
  """``log Σ exp(x)`` over ``axis``; ``-inf`` when every entry is ``-inf``."""
  m = jax.lax.stop_gradient(exponent_shift(jnp.max(x, axis=axis, keepdims=True)))
  return safe_log(jnp.sum(jnp.exp(x - m), axis=axis)) + jnp.squeeze(m, axis)


def logaddexp(a: jax.Array, b: jax.Array) -> jax.Array:
  """``log(exp(a) + exp(b))``, ``-inf`` for ``a = b = -inf``."""
  m = jax.lax.stop_gradient(exponent_shift(jnp.maximum(a, b)))
  return safe_log(jnp.exp(a - m) + jnp.exp(b - m)) + m


def softmax_block(scores: jax.Array,
                  weighted_sum: Callable[[jax.Array], jax.Array]) -> SoftmaxCarry:
  """The carry of one block of scores ``[..., R, C]`` (``-inf`` where masked).

  ``weighted_sum`` maps the block's probabilities ``exp(s - m)`` ``[..., R, C]``
  to their value-weighted sum ``[..., R, D]``, e.g. an einsum with the value
  block (the identity gives the weights themselves: a softmax is
  ``online_softmax_finish(softmax_block(s, lambda p: p))[0]``).
  """
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1))  # The result does not depend on it.
  probs = jnp.exp(scores - exponent_shift(row_max)[..., None])
  return SoftmaxCarry(row_max, jnp.sum(probs, axis=-1), weighted_sum(probs))


def merge(a: SoftmaxCarry, b: SoftmaxCarry) -> SoftmaxCarry:
  """The carry of ``a``'s keys and ``b``'s together: both rescaled to the larger running max.

  ``m = max(m_a, m_b)``, ``l = l_a e^(m_a - m) + l_b e^(m_b - m)``, likewise the
  accumulators. The one online-softmax merge: flash's blocks, a KV cache read
  with the new chunk, ring attention's devices. Associative; a side that saw
  no key (``m = -inf``) weighs 0. For finished partials ``(o, ℓ)``, ℓ the
  log-sum-exp (:func:`from_output`), it is ``ℓ = logaddexp(ℓ_a, ℓ_b)``,
  ``o = e^(ℓ_a - ℓ) o_a + e^(ℓ_b - ℓ) o_b``; two empty sides give ``ℓ = -inf``
  and zeros, never NaN.
  """
  row_max = jax.lax.stop_gradient(jnp.maximum(a.row_max, b.row_max))
  shift = exponent_shift(row_max)
  wa, wb = jnp.exp(a.row_max - shift), jnp.exp(b.row_max - shift)
  return SoftmaxCarry(row_max, a.row_sum * wa + b.row_sum * wb,
                      a.acc * wa[..., None] + b.acc * wb[..., None])


def from_output(out: jax.Array, lse: jax.Array) -> SoftmaxCarry:
  """The carry of a finished softmax: ``out [..., R, D]`` and its log-sum-exp ``[..., R]``."""
  seen = (lse > -jnp.inf).astype(out.dtype)
  return SoftmaxCarry(lse, seen, out * seen[..., None])


def online_softmax_update(
    carry: SoftmaxCarry,
    scores: jax.Array,
    weighted_sum: Callable[[jax.Array], jax.Array],
) -> SoftmaxCarry:
  """Folds one block of scores into the carry: ``merge(carry, softmax_block(...))``."""
  return merge(carry, softmax_block(scores, weighted_sum))


def online_softmax_finish(carry: SoftmaxCarry) -> tuple[jax.Array, jax.Array]:
  """Normalises the carry.

  Returns:
    ``(out, lse)``: ``out = acc / row_sum`` ``[..., R, D]`` (zeros for
    rows that saw no key) and the log-sum-exp ``[..., R]`` (``-inf`` there).
  """
  empty = carry.row_sum == 0.0
  out = divide_rows(carry.acc, carry.row_sum)
  lse = jnp.where(empty, -jnp.inf, carry.row_max + jnp.log(jnp.where(empty, 1.0, carry.row_sum)))
  return out, lse
