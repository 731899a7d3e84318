"""Feature maps φ for kernel (linear) attention, and random projections.

A feature map turns a query or key ``x`` of shape ``[..., H]`` into features
``φ(x)`` of shape ``[..., M]`` so that ``φ(q)·φ(k)`` stands in for a
similarity ``sim(q, k)``; linear attention then needs only the sums
``Σ_j φ(k_j) v_jᵀ`` and ``Σ_j φ(k_j)``. The calling convention is::

    phi(x, *, is_query=False) -> [..., M]

Deterministic maps (``elu_plus_one``, ``relu``, ``exp``) are plain functions.
The random-feature maps estimate the softmax kernel ``exp(q·k / √H)``
(Choromanski et al., 2021); with ``x̂ = x / H^(1/4)`` and projection rows
``w_1..w_M ~ N(0, I_H)``:

- ``favor_plus`` (positive features):
  ``φ(x) = exp(W x̂ - ‖x̂‖²/2) / √M``, since
  ``E_w[exp(w·(q̂ + k̂))] = exp(‖q̂ + k̂‖²/2)``;
- ``random_fourier`` (trigonometric, signed, size 2M):
  ``φ(x) = exp(‖x̂‖²/2) [sin(W x̂), cos(W x̂)] / √M``, since
  ``E_w[cos(w·(q̂ - k̂))] = exp(-‖q̂ - k̂‖²/2)``.

Both give ``E[φ(q)·φ(k)] = exp(q̂·k̂) = exp(q·k / √H)``.

Maps built by the factories here are small frozen dataclasses registered as
pytrees: their arrays (a projection, a weight and bias) are leaves, their kind
is the static structure. The attention functions pass those arrays to their
compiled programs as data, so a map with new values of the same shapes (a
redrawn projection, updated weights) reuses the compiled program, and a map
can itself be an argument of ``jax.jit`` or ``jax.grad``.

The random-feature maps also provide ``log_scaled(x, *, is_query) ->
(features, log_scale)`` with ``φ(x) = exp(log_scale)[..., None] * features``
and features of magnitude at most 1, which ``performer_attention`` uses to
keep the kernel finite for any input size.

References:
  Katharopoulos et al., "Transformers are RNNs: Fast Autoregressive
  Transformers with Linear Attention", 2020 (elu + 1).
  Choromanski et al., "Rethinking Attention with Performers", 2021 (FAVOR+,
  orthogonal random features).
  Rahimi & Recht, "Random Features for Large-Scale Kernel Machines", 2007.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp

from linattn_jax._src.blocks import num_blocks
from linattn_jax._src.checks import accumulation_dtype, check_positive_int


class FeatureMap(Protocol):
  """The feature-map protocol: ``phi(x, *, is_query=False) -> [..., M]`` for ``x`` ``[..., H]``.

  A feature map φ turns queries and keys into features whose dot product
  stands in for a similarity, ``φ(q)·φ(k) ≈ sim(q, k)``, so that kernel
  linear attention needs only ``Σ_j φ(k_j) v_jᵀ`` ``[M, D]`` and
  ``Σ_j φ(k_j)`` ``[M]``. ``is_query`` says whether ``x`` holds queries or
  keys (a map may treat them differently; the maps here do not). Any
  function with this signature works; the maps built by :func:`projected`,
  :func:`favor_plus` and :func:`random_fourier` are pytrees whose arrays the
  attention functions pass as data.

  Examples:
    A map of your own, with M = 2H features:

    >>> def both_signs(x, *, is_query=False):
    ...   return jnp.concatenate([jax.nn.elu(x) + 1, jax.nn.elu(-x) + 1], axis=-1)
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N, H]
    >>> out, state = la.linear_attention(x, x, x, feature_map=both_signs, is_causal=True,
    ...                                  return_state=True)
    >>> out.shape, state.kv.shape  # state.kv: [B, K, M, D]
    ((1, 8, 2, 4), (1, 2, 8, 4))
  """

  def __call__(self, x: jax.Array, *, is_query: bool = False) -> jax.Array:
    ...


# Deterministic maps ----------------------------------------------------------


def elu_plus_one(x: jax.Array, *, is_query: bool = False) -> jax.Array:
  """``elu(x) + 1``: ``x + 1`` for ``x > 0``, ``exp(x)`` otherwise (M = H).

  ``φ(x)_h = x_h + 1 if x_h > 0 else exp(x_h)``, elementwise: ``[..., H]`` to
  ``[..., H]``, in the dtype of ``x``. The default map of
  :func:`linear_attention`.

  Each branch is evaluated directly rather than as ``(exp(x) - 1) + 1``, which
  rounds to 0 in bfloat16 for moderately negative ``x``. The result is
  positive wherever ``exp(x)`` is representable. The ``exp`` branch sees
  ``where(x > 0, 0, x)``, not ``minimum(x, 0)``, whose derivative at a tie
  ``x = 0`` is 1/2: the derivative at 0 is 1, as on both sides.

  Args:
    x: queries or keys ``[..., H]``.
    is_query: unused (the map treats queries and keys alike).

  Returns:
    ``[..., H]`` positive features.

  Examples:
    >>> x = jnp.array([-10.0, 0.0, 2.0], jnp.bfloat16)
    >>> phi = feature_maps.elu_plus_one(x)
    >>> phi.shape, phi.dtype, bool(jnp.all(phi > 0))
    ((3,), dtype(bfloat16), True)
    >>> bool((jax.nn.elu(x) + 1)[0] == 0)  # The naive form rounds exp(-10) away.
    True

  References:
    Katharopoulos et al., "Transformers are RNNs", 2020.
  """
  del is_query
  return jnp.where(x > 0, x + 1, jnp.exp(jnp.where(x > 0, 0, x)))


def relu(x: jax.Array, *, is_query: bool = False) -> jax.Array:
  """``max(x, 0)`` (M = H). A row of zeros makes a query's kernel row zero.

  ``φ(x)_h = max(x_h, 0)``, elementwise: ``[..., H]`` to ``[..., H]``. A
  query whose features are all zero has an ``eps``-only normaliser in
  :func:`linear_attention`, and its output is zero.

  Args:
    x: queries or keys ``[..., H]``.
    is_query: unused.

  Returns:
    ``[..., H]`` non-negative features.

  Examples:
    >>> x = jnp.array([[-1.0, -2.0], [1.0, -3.0]])  # [T, H]: query 0 has no feature.
    >>> bool(jnp.array_equal(feature_maps.relu(x), jnp.maximum(x, 0)))
    True
    >>> out = la.linear_attention(x[:, None], x[:, None], x[:, None], feature_map=feature_maps.relu)
    >>> out.shape, bool(jnp.all(out[0] == 0))
    ((2, 1, 2), True)

  References:
    Qin et al., "cosFormer: Rethinking Softmax in Attention", ICLR 2022.
  """
  del is_query
  return jax.nn.relu(x)


def exp(x: jax.Array, *, is_query: bool = False) -> jax.Array:
  """``exp(x)`` elementwise (M = H); unbounded, so keep inputs moderate.

  ``φ(q)·φ(k) = Σ_h exp(q_h + k_h)``: the weights of Heinsen's attention.
  :func:`heinsen_attention` computes them stabilised, for inputs of any
  size; this plain map overflows float32 once ``q_h + k_h`` passes about 88.

  Args:
    x: queries or keys ``[..., H]``.
    is_query: unused.

  Returns:
    ``[..., H]`` positive features.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> bool(jnp.allclose(feature_maps.exp(x), jnp.exp(x)))
    True
    >>> plain = la.linear_attention(x, x, x, feature_map=feature_maps.exp, eps=0.0)
    >>> bool(jnp.allclose(plain, la.heinsen_attention(x, x, x), atol=1e-5))
    True

  References:
    Heinsen, "Softmax Attention with Constant Cost per Token", 2024.
  """
  del is_query
  return jnp.exp(x)


def _check_head_dim(x: jax.Array, shape: tuple[int, ...], axis: int, *, what: str,
                    fn: str) -> None:
  if shape[axis] != x.shape[-1]:
    raise ValueError(
        f"{fn}: {what} = {tuple(shape)} does not match inputs x of shape "
        f"{tuple(x.shape)} (head dim H={x.shape[-1]})."
    )


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weight", "bias"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True, eq=False)
class Projected:
  """A learnable map ``φ(x) = elu(x W + b) + 1`` (see :func:`projected`).

  ``[..., H]`` to ``[..., M]``. A frozen dataclass registered as a pytree
  whose leaves are ``weight`` and ``bias``: it can be an argument of
  ``jax.jit`` or ``jax.grad``, and new values of the same shapes reuse
  compiled attention programs. Calling it on inputs whose H is not the
  weight's raises ``ValueError``.

  Attributes:
    weight: ``[H, M]``.
    bias: ``[M]``.

  Examples:
    >>> phi = feature_maps.projected(jnp.zeros((4, 6)), jnp.zeros(6))
    >>> isinstance(phi, feature_maps.Projected), phi(jnp.ones((2, 4))).shape
    (True, (2, 6))
    >>> [leaf.shape for leaf in jax.tree.leaves(phi)]
    [(4, 6), (6,)]
  """

  weight: jax.Array  # [H, M]
  bias: jax.Array  # [M]

  def __call__(self, x: jax.Array, *, is_query: bool = False) -> jax.Array:
    _check_head_dim(x, self.weight.shape, 0, what="weight [H, M]", fn="projected")
    bias = jnp.reshape(self.bias.astype(x.dtype), (1,) * (x.ndim - 1) + self.bias.shape)
    return elu_plus_one(x @ self.weight.astype(x.dtype) + bias)


def projected(weight: Any, bias: Any) -> Projected:
  """A learnable feature map ``φ(x) = elu(x W + b) + 1``.

  Args:
    weight: ``[H, M]``.
    bias: ``[M]``.

  Returns:
    A feature map (a pytree with ``weight`` and ``bias`` as leaves): new
    values of the same shapes reuse compiled attention programs, and
    gradients flow to them.

  Raises:
    ValueError: if ``weight`` is not rank 2 or ``bias`` is not ``[M]`` (and,
      when the map is called, if its H differs from the inputs').

  Examples:
    Gradients reach the weights through the attention:

    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N, H]
    >>> w, b = 0.1 * jnp.ones((4, 6)), jnp.zeros(6)  # [H, M], [M]
    >>> def loss(w, b):
    ...   phi = feature_maps.projected(w, b)
    ...   return la.linear_attention(x, x, x, feature_map=phi, is_causal=True).sum()
    >>> dw, db = jax.grad(loss, argnums=(0, 1))(w, b)
    >>> dw.shape, db.shape
    ((4, 6), (6,))

  References:
    Kasai et al., "Finetuning Pretrained Transformers into RNNs", EMNLP 2021
    (a learned feature map).
  """
  weight, bias = jnp.asarray(weight), jnp.asarray(bias)
  if weight.ndim != 2 or bias.shape != weight.shape[1:]:
    raise ValueError(
        f"projected: weight must be [H, M] and bias [M]; got weight {weight.shape}, "
        f"bias {bias.shape}."
    )
  return Projected(weight, bias)


# Random features for the softmax kernel ---------------------------------------


def check_projection(projection: Any, *, query_shape: tuple[int, ...] | None = None,
                     fn: str) -> jax.Array:
  """``projection`` as an ``[M, H]`` array (H the last axis of ``query_shape`` when given)."""
  projection = jnp.asarray(projection)
  H = None if query_shape is None else query_shape[-1]
  if projection.ndim != 2 or H not in (None, projection.shape[1]):
    want = "" if H is None else f" with H={H} (the last axis of query {tuple(query_shape)})"
    raise ValueError(f"{fn}: projection must be [M, H]{want}; got {projection.shape}.")
  return projection


@dataclasses.dataclass(frozen=True, eq=False)
class _RandomFeatures:
  """Shared parts of the random-feature maps: ``x̂ = x / H^(1/4)`` and ``W x̂``."""

  projection: jax.Array  # [M, H], rows ~ N(0, I_H).
  name: ClassVar[str] = "random features"

  def _projected(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(W x̂, ‖x̂‖² / 2)`` in the accumulation dtype: ``[..., M]``, ``[...]``."""
    _check_head_dim(x, self.projection.shape, 1, what="projection [M, H]", fn=self.name)
    acc = accumulation_dtype(x.dtype)
    x_hat = x.astype(acc) * x.shape[-1] ** -0.25
    w_x = jnp.einsum("...h,mh->...m", x_hat, self.projection.astype(acc))
    return w_x, 0.5 * jnp.sum(x_hat * x_hat, axis=-1)

  def log_scaled(self, x: jax.Array, *, is_query: bool = False) -> tuple[jax.Array, jax.Array]:
    raise NotImplementedError

  def __call__(self, x: jax.Array, *, is_query: bool = False) -> jax.Array:
    features, log_scale = self.log_scaled(x, is_query=is_query)
    return (jnp.exp(log_scale)[..., None] * features).astype(x.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["projection"], meta_fields=[])
@dataclasses.dataclass(frozen=True, eq=False)
class FavorPlus(_RandomFeatures):
  """Positive random features ``exp(W x̂ - ‖x̂‖²/2) / √M`` (see :func:`favor_plus`).

  ``[..., H]`` to ``[..., M]`` with ``x̂ = x / H^(1/4)``. A frozen dataclass
  registered as a pytree whose leaf is ``projection``; :meth:`log_scaled`
  returns the same features as ``(features, log_scale)`` with
  ``φ(x) = exp(log_scale)[..., None] * features`` and every row's largest
  feature 1, the form :func:`performer_attention` uses to stay finite.
  Calling it on inputs whose H is not the projection's raises ``ValueError``.

  Attributes:
    projection: ``[M, H]`` random directions.

  Examples:
    >>> w = feature_maps.orthogonal_random_projection(jax.random.key(1), 8, 4)  # [M, H]
    >>> phi = feature_maps.favor_plus(w)
    >>> x = jax.random.normal(jax.random.key(1), (3, 4))
    >>> features, log_scale = phi.log_scaled(x)
    >>> isinstance(phi, feature_maps.FavorPlus), features.shape, log_scale.shape
    (True, (3, 8), (3,))
    >>> bool(jnp.allclose(jnp.exp(log_scale)[:, None] * features, phi(x)))
    True
  """

  name: ClassVar[str] = "favor_plus"

  def log_scaled(self, x: jax.Array, *, is_query: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(exp(ℓ - max ℓ), max ℓ)`` with ``ℓ = W x̂ - ‖x̂‖²/2 - log √M``.

    The largest feature of every row is 1; the row maximum is a constant for
    differentiation (it cancels in ``φ``).
    """
    w_x, half_sq_norm = self._projected(x)
    logits = w_x - half_sq_norm[..., None] - 0.5 * math.log(self.projection.shape[0])
    log_scale = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    return jnp.exp(logits - log_scale[..., None]), log_scale


# π in three float32 parts (Cody-Waite): 201/64, 4058/2^22 and the rest, so that for
# |k| < 2^12 the products k·π₁ and k·π₂ are exact and x - k·π is exact to rounding.
_PI_PARTS = (3.140625, 9.67502593994140625e-4, 1.509957990978376432e-7)
# Taylor coefficients of sin r / r and (cos r - 1) / r² in r²: on |r| <= π/2 the first
# terms left out are below 1e-9.
_SIN_TERMS = tuple((-1) ** n / math.factorial(2 * n + 1) for n in range(1, 7))
_COS_TERMS = tuple((-1) ** n / math.factorial(2 * n) for n in range(1, 8))


def _polynomial(r2: jax.Array, terms: tuple[float, ...]) -> jax.Array:
  """``Σ_n terms[n] r2ⁿ`` (Horner)."""
  acc = jnp.asarray(terms[-1], r2.dtype)
  for c in terms[-2::-1]:
    acc = c + r2 * acc
  return acc


@jax.custom_jvp
def _sin_cos_float32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(sin x, cos x)`` in float32 from one shared range reduction.

  ``x = kπ + r`` with ``k = round(x / π)`` and ``|r| <= π/2``; then
  ``sin x = (-1)^k sin r`` and ``cos x = (-1)^k cos r``, each a polynomial in ``r``.
  On XLA:CPU this takes less than half the time of ``jnp.sin`` and ``jnp.cos`` (GPU: not
  timed). Against float64: within 2e-7 of the true values for |x| up to 10⁶
  (``jnp.sin``: 3e-8), and for any finite x within the values at a point one ulp of x
  away (``r`` is clipped to [-2, 2], so the results stay within [-1, 1]); ±inf and NaN
  give NaN, as ``jnp.sin`` does. The derivative is ``(cos x, -sin x)`` from these values.
  """
  k = jnp.round(x * (1 / math.pi))
  r = x
  for part in _PI_PARTS:
    r = r - k * part
  r = jnp.clip(r, -2.0, 2.0)
  sign = 1 - 2 * (k - 2 * jnp.floor(0.5 * k))  # (-1)^k
  r2 = r * r
  return (sign * (r + r * r2 * _polynomial(r2, _SIN_TERMS)),
          sign * (1 + r2 * _polynomial(r2, _COS_TERMS)))


@_sin_cos_float32.defjvp
def _sin_cos_float32_jvp(primals, tangents):
  sin, cos = _sin_cos_float32(*primals)
  (dx,) = tangents
  return (sin, cos), (cos * dx, -sin * dx)


def sin_cos(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(sin x, cos x)``: float32 by :func:`_sin_cos_float32`, other dtypes by ``jnp``."""
  if x.dtype == jnp.float32:
    return _sin_cos_float32(x)
  return jnp.sin(x), jnp.cos(x)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["projection"], meta_fields=[])
@dataclasses.dataclass(frozen=True, eq=False)
class RandomFourier(_RandomFeatures):
  """Trigonometric features ``exp(‖x̂‖²/2) [sin W x̂, cos W x̂] / √M`` (see :func:`random_fourier`).

  ``[..., H]`` to ``[..., 2M]`` with ``x̂ = x / H^(1/4)``. A frozen dataclass
  registered as a pytree whose leaf is ``projection``; :meth:`log_scaled`
  returns ``([sin W x̂, cos W x̂], ‖x̂‖²/2 - log √M)``, features of magnitude
  at most 1 and their log-scale. Calling it on inputs whose H is not the
  projection's raises ``ValueError``.

  Attributes:
    projection: ``[M, H]`` random directions.

  Examples:
    >>> w = feature_maps.gaussian_random_projection(jax.random.key(0), 8, 4)  # [M, H]
    >>> phi = feature_maps.random_fourier(w)
    >>> features, log_scale = phi.log_scaled(jnp.ones((3, 4)))
    >>> isinstance(phi, feature_maps.RandomFourier), features.shape, log_scale.shape
    (True, (3, 16), (3,))
  """

  name: ClassVar[str] = "random_fourier"

  def log_scaled(self, x: jax.Array, *, is_query: bool = False) -> tuple[jax.Array, jax.Array]:
    """``([sin W x̂, cos W x̂], ‖x̂‖²/2 - log √M)``: features ``[..., 2M]``."""
    w_x, half_sq_norm = self._projected(x)
    features = jnp.concatenate(sin_cos(w_x), axis=-1)
    return features, half_sq_norm - 0.5 * math.log(self.projection.shape[0])


def favor_plus(projection: Any) -> FavorPlus:
  """FAVOR+ positive random features for the softmax kernel.

  ``φ(x) = exp(W x̂ - ‖x̂‖²/2) / √M`` with ``x̂ = x / H^(1/4)``, so that for
  rows of W drawn from ``N(0, I_H)`` (or :func:`orthogonal_random_projection`)
  ``E[φ(q)·φ(k)] = exp(q·k / √H)``, and every estimate is positive.

  Args:
    projection: ``[M, H]`` random directions, e.g. from
      :func:`orthogonal_random_projection`.

  Returns:
    A feature map ``[..., H] -> [..., M]`` (a pytree; the projection is its leaf).

  Raises:
    ValueError: if ``projection`` is not rank 2 (and, when called, if its H
      differs from the inputs').

  Examples:
    >>> w = feature_maps.orthogonal_random_projection(jax.random.key(1), 8, 4)  # [M, H]
    >>> feature_maps.favor_plus(w)(jnp.ones((3, 4))).shape
    (3, 8)

    With many features the dot product estimates ``exp(q·k / √H)``:

    >>> q, k = 0.5 * jax.random.normal(jax.random.key(1), (2, 4))  # H = 4
    >>> phi = feature_maps.favor_plus(
    ...     feature_maps.orthogonal_random_projection(jax.random.key(2), 4096, 4))
    >>> bool(jnp.isclose(phi(q) @ phi(k), jnp.exp(q @ k / 2), rtol=0.05))
    True

  References:
    Choromanski et al., "Rethinking Attention with Performers", 2021, Lemma 1.
  """
  return FavorPlus(check_projection(projection, fn="favor_plus"))


def random_fourier(projection: Any) -> RandomFourier:
  """Trigonometric random features for the softmax kernel (size 2M).

  ``φ(x) = exp(‖x̂‖²/2) [sin(W x̂), cos(W x̂)] / √M`` with ``x̂ = x / H^(1/4)``:
  ``φ(q)·φ(k) = exp(‖q̂‖²/2 + ‖k̂‖²/2) · mean_m cos(w_m·(q̂ - k̂))``, an
  unbiased but signed estimate of ``exp(q·k / √H)`` (its normaliser can be
  near zero or negative; prefer :func:`favor_plus` for attention).

  Args:
    projection: ``[M, H]`` random directions.

  Returns:
    A feature map ``[..., H] -> [..., 2M]`` (a pytree; the projection is its leaf).

  Raises:
    ValueError: if ``projection`` is not rank 2 (and, when called, if its H
      differs from the inputs').

  Examples:
    >>> w = feature_maps.orthogonal_random_projection(jax.random.key(2), 4096, 4)
    >>> phi = feature_maps.random_fourier(w)
    >>> q, k = 0.5 * jax.random.normal(jax.random.key(1), (2, 4))  # H = 4
    >>> phi(q).shape  # 2M features.
    (8192,)
    >>> bool(jnp.isclose(phi(q) @ phi(k), jnp.exp(q @ k / 2), rtol=0.05))
    True

  References:
    Rahimi & Recht, "Random Features for Large-Scale Kernel Machines", 2007;
    Choromanski et al., "Rethinking Attention with Performers", 2021, eq. (5).
  """
  return RandomFourier(check_projection(projection, fn="random_fourier"))


def gaussian_random_projection(
    rng: jax.Array, num_features: int, head_dim: int, dtype: Any = jnp.float32
) -> jax.Array:
  """``[M, H]`` projection with independent ``N(0, 1)`` entries.

  Args:
    rng: a PRNG key.
    num_features: M, the number of random directions.
    head_dim: H.
    dtype: float dtype of the result.

  Returns:
    ``[M, H]`` in ``dtype``, for :func:`favor_plus` or :func:`random_fourier`.

  Raises:
    ValueError: on a non-positive ``num_features`` or ``head_dim``.

  Examples:
    >>> w = feature_maps.gaussian_random_projection(jax.random.key(0), 8, 4)
    >>> w.shape, w.dtype
    ((8, 4), dtype('float32'))

  References:
    Rahimi & Recht, "Random Features for Large-Scale Kernel Machines", 2007.
  """
  M = check_positive_int(num_features, name="num_features", fn="gaussian_random_projection")
  H = check_positive_int(head_dim, name="head_dim", fn="gaussian_random_projection")
  return jax.random.normal(rng, (M, H), dtype)


def orthogonal_random_projection(
    rng: jax.Array, num_features: int, head_dim: int, dtype: Any = jnp.float32
) -> jax.Array:
  """``[M, H]`` orthogonal random features (ORF).

  Rows come in blocks of H mutually orthogonal directions (the Q factor of a
  Gaussian ``[H, H]`` matrix, with signs fixed so that it is Haar
  distributed); the last block is truncated to give M rows. Each row is then
  rescaled to the norm of an independent ``N(0, I_H)`` vector (chi with H
  degrees of freedom), so every row is marginally ``N(0, I_H)`` — the
  estimators stay unbiased — while rows within a block are exactly
  orthogonal, which lowers their variance.

  Args:
    rng: a PRNG key.
    num_features: M.
    head_dim: H.
    dtype: float dtype of the result.

  Returns:
    ``[M, H]`` in ``dtype``, for :func:`favor_plus` or :func:`random_fourier`.
    The same ``rng`` gives the same projection, eagerly or under ``jax.jit``.

  Raises:
    ValueError: on a non-positive ``num_features`` or ``head_dim``.

  Examples:
    >>> w = feature_maps.orthogonal_random_projection(jax.random.key(1), 8, 4)  # [M, H]
    >>> w.shape
    (8, 4)
    >>> gram = w[:4] @ w[:4].T  # The first block of H = 4 rows: orthogonal.
    >>> bool(jnp.allclose(gram, jnp.diag(jnp.diag(gram)), atol=1e-4))
    True

  References:
    Yu et al., "Orthogonal Random Features", 2016; Choromanski et al., 2021, §2.4.
  """
  fn = "orthogonal_random_projection"
  M = check_positive_int(num_features, name="num_features", fn=fn)
  H = check_positive_int(head_dim, name="head_dim", fn=fn)
  return _orthogonal_random_projection(rng, M, H, jnp.dtype(dtype))


# Jitted so that eager and jitted callers draw bit-identical projections.
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _orthogonal_random_projection(rng: jax.Array, M: int, H: int, dtype: Any) -> jax.Array:
  block_rng, norm_rng = jax.random.split(rng)
  gaussian = jax.random.normal(block_rng, (num_blocks(M, H), H, H), dtype)
  q, r = jnp.linalg.qr(gaussian)  # Columns of q are orthonormal.
  q = q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
  rows = jnp.swapaxes(q, -1, -2).reshape(-1, H)[:M]
  norms = jnp.linalg.norm(jax.random.normal(norm_rng, (M, H), dtype), axis=-1)
  return rows * norms[:, None]
