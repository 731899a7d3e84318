"""The small parts the token mixers are built from.

- :class:`ShortConvolution`: ``y_t = act(Σ_{i<W} w_i ⊙ x_{t-i} + b)``, its decode
  state the last ``W - 1`` inputs;
- :class:`TokenShift`: the previous token ``x_{t-1}`` (RWKV), its decode state the last
  input;
- :class:`GatedRMSNorm`: ``RMSNorm(o) ⊙ act(g)`` per head (or Mamba-2's
  ``RMSNorm(o ⊙ act(g))`` over groups of features);
- :class:`LowRank`: ``act(x W_down) W_up + b``;
- :func:`rotary` and :func:`segment_positions`: RoPE at each token's position in its
  document.

Every part resets at a packed document's boundary (``segment_ids``) and decodes on
the protocol of :class:`MultiHeadAttention`: ``init_cache(input_shape)``, then calls
with ``decode=True`` on the next positions (a prompt or one token).

Letters: B batch, T length, F features, W convolution width, R a low rank, H head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Dtype, Initializer, PrecisionLike, Shape

from linattn_jax._src import checks
from linattn_jax._src.nn.compiled import compiled_call

DEFAULT_KERNEL_INIT = initializers.lecun_normal()
ZEROS = initializers.zeros_init()
_ACTIVATIONS: dict[str | None, Callable[[jax.Array], jax.Array]] = {
    None: lambda x: x, "silu": jax.nn.silu, "swish": jax.nn.silu, "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh}


def activation_fn(name: str | None, *, fn: str) -> Callable[[jax.Array], jax.Array]:
  return _ACTIVATIONS[checks.check_choice(name, name="activation", choices=list(_ACTIVATIONS),
                                          fn=fn)]


def expand_to(a: jax.Array, like: jax.Array) -> jax.Array:
  """``a`` with leading axes of size 1 up to ``like``'s rank (no implicit rank promotion)."""
  return a.reshape((1,) * (like.ndim - a.ndim) + a.shape)


def check_inputs(x: jax.Array, features: int, segment_ids: Any, *, fn: str) -> Any:
  """``x`` must be ``[B, T, features]``; ``segment_ids`` None or int ``[B, T]`` (returned
  as int32)."""
  if jnp.ndim(x) != 3 or jnp.shape(x)[-1] != features:
    raise ValueError(f"{fn}: inputs must be [B, T, {features}]; got shape {jnp.shape(x)}.")
  if segment_ids is None:
    return None
  ids = jnp.asarray(segment_ids)
  if ids.shape != x.shape[:2] or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{fn}: segment_ids must be integers [B, T] = {x.shape[:2]}; got "
                     f"{ids.dtype} of shape {ids.shape}.")
  checks.check_segment_order(ids, fn=fn)
  return ids.astype(jnp.int32)


# RoPE's base (Su et al.): the frequency of feature pair i is ROPE_BASE^(-2i / H).
ROPE_BASE = 10000.0


def rotary(x: jax.Array, positions: jax.Array) -> jax.Array:
  """The rotary position embedding of ``x [B, T, ..., H]`` at ``positions [B, T]``.

  Each pair of features ``(x_i, x_{i + H/2})`` (halves, not interleaved) turns by the
  angle ``p θ_i`` with ``θ_i = ROPE_BASE^(-2i / H)``, in float32::

      (x_i, x_{i+H/2}) ↦ (x_i cos pθ_i - x_{i+H/2} sin pθ_i, x_{i+H/2} cos pθ_i + x_i sin pθ_i)

  so that ``rotary(q, p)ᵀ rotary(k, s)`` depends on p - s only. H must be even.

  References:
    Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
  """
  half = x.shape[-1] // 2
  theta = ROPE_BASE ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
  angle = positions.astype(jnp.float32)[..., None] * theta[None, None]  # [B, T, H/2]
  angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + (half,))
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def segment_positions(segment_ids: jax.Array | None, shape: tuple[int, int], *,
                      last_id: jax.Array | None = None,
                      offset: jax.Array | None = None) -> jax.Array:
  """Each token's position in its document, ``[B, T]`` int32 for ``shape = (B, T)``.

  Positions count from 0 where a document starts (where ``segment_ids`` changes).
  Decoding: ``last_id [B]`` is the last decoded token's id and ``offset [B]`` the next
  position in its document; the tokens that continue it count on from ``offset``
  (without ids, every token does).
  """
  B, T = shape
  t = jnp.arange(T, dtype=jnp.int32)
  offset = jnp.zeros((B,), jnp.int32) if offset is None else offset.astype(jnp.int32)
  if segment_ids is None:
    return offset[:, None] + t[None]
  before = segment_ids[:, :1] if last_id is None else last_id[:, None]
  starts = segment_ids != jnp.concatenate([before, segment_ids[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(starts, t[None], -1), axis=1)  # -1: no start yet.
  return jnp.where(start < 0, offset[:, None] + t[None], t[None] - start)


class CausalWindow(nnx.Module):
  """The last ``width`` inputs of each position within its document, and their decode cache.

  ``_taps(x, decode, segment_ids)`` returns ``width`` arrays like ``x [B, T, F]``, tap i
  holding ``x_{t - (width - 1 - i)}`` where that input lies in ``x_t``'s document and
  zero elsewhere (before the sequence, or in an earlier document). In decoding the
  cache holds the last ``width - 1`` inputs and their ids.
  """

  width: int
  features: int

  def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
    """An empty cache for inputs ``(B, C, F)`` (the length C is not needed: the cache holds
    the last ``width - 1`` inputs)."""
    B = input_shape[0]
    self.cache = nnx.Cache(jnp.zeros((B, self.width - 1, self.features), dtype))
    self.cache_ids = nnx.Cache(jnp.zeros((B, self.width - 1), jnp.int32))

  def _taps(self, x: jax.Array, *, decode: bool, segment_ids: jax.Array | None,
            fn: str) -> list[jax.Array]:
    B, T, F = x.shape
    past_len = self.width - 1
    if decode:
      if self.cache is None:
        raise ValueError(f"{fn}: decode=True needs a cache: call init_cache first.")
      past, past_ids = self.cache.get_value(), self.cache_ids.get_value()
      if segment_ids is None:  # The inputs continue the last one's document.
        segment_ids = jnp.broadcast_to(past_ids[:, -1:], (B, T))
    else:
      past = jnp.zeros((B, past_len, F), x.dtype)
      # Zeros before the row: whatever id they carry, they add nothing.
      past_ids = None if segment_ids is None else jnp.broadcast_to(segment_ids[:, :1],
                                                                   (B, past_len))
    full = jnp.concatenate([past.astype(x.dtype), x], axis=1)  # [B, W - 1 + T, F]
    full_ids = None if segment_ids is None else jnp.concatenate([past_ids, segment_ids], 1)
    if decode:
      self.cache.set_value(full[:, T:].astype(self.cache.get_value().dtype))
      self.cache_ids.set_value(full_ids[:, T:])
    taps = []
    for i in range(self.width):
      tap = full[:, i:i + T]
      if full_ids is not None:
        tap = jnp.where((full_ids[:, i:i + T] == segment_ids)[..., None], tap, 0)
      taps.append(tap)
    return taps


class ShortConvolution(CausalWindow):
  """A causal depthwise convolution: ``y_t = act(Σ_{i<W} w_i ⊙ x_{t-i} + b)``.

  ``kernel [W, F]``: row ``W - 1 - i`` weighs ``x_{t-i}`` (the layout of a PyTorch
  ``Conv1d(F, F, W, groups=F)``'s ``weight [F, 1, W]``, transposed). A tap that reaches
  before the sequence or into an earlier packed document (``segment_ids [B, T]``) reads
  zero. Decoding (after :meth:`init_cache`) keeps the last ``W - 1`` inputs and their
  ids: a position whose id differs from the cache's starts its document afresh.

  Args:
    features: F.
    kernel_size: W (4 in the models here).
    activation: ``"silu"`` (the default), ``"swish"``, ``"sigmoid"``, ``"tanh"`` or None.
    use_bias: add ``bias [F]``.
    dtype: the computation's dtype (default: the inputs').
    param_dtype: the parameters'.
    rngs: ``params`` draws the kernel, ``U(±1/sqrt(W))`` as PyTorch's default.

  Examples:
    >>> conv = nn.ShortConvolution(8, 4, rngs=nnx.Rngs(0))
    >>> conv.kernel.shape  # [W, F]
    (4, 8)
    >>> x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    >>> full = conv(x)
    >>> conv.init_cache(x.shape)
    >>> steps = jnp.concatenate([conv(x[:, :3], decode=True), conv(x[:, 3:], decode=True)], 1)
    >>> bool(jnp.allclose(steps, full, atol=1e-6))
    True

  Reference: Arora et al., "Simple linear attention language models balance the
  recall-throughput tradeoff" (Based), 2024; Yang et al., "Gated Delta Networks", 2025.
  """

  def __init__(self, features: int, kernel_size: int = 4, *, activation: str | None = "silu",
               use_bias: bool = False, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    fn = "ShortConvolution"
    self.features = checks.check_positive_int(features, name="features", fn=fn)
    self.width = checks.check_positive_int(kernel_size, name="kernel_size", fn=fn)
    self.activation, self._act = activation, activation_fn(activation, fn=fn)
    self.dtype = dtype
    bound = 1.0 / math.sqrt(kernel_size)
    self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, features),
                                               param_dtype, -bound, bound))
    self.bias = nnx.Param(jax.random.uniform(rngs.params(), (features,), param_dtype, -bound,
                                             bound)) if use_bias else nnx.data(None)
    self.cache = nnx.data(None)
    self.cache_ids = nnx.data(None)

  @compiled_call
  def __call__(self, x: jax.Array, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """``x [B, T, F]`` -> ``[B, T, F]``; ``decode``: the next T positions after the cache."""
    fn = "ShortConvolution"
    ids = check_inputs(x, self.features, segment_ids, fn=fn)
    dtype = self.dtype or x.dtype
    taps = self._taps(x.astype(dtype), decode=decode, segment_ids=ids, fn=fn)
    kernel = self.kernel.get_value().astype(dtype)
    y = sum(tap * expand_to(kernel[i], tap) for i, tap in enumerate(taps))
    if self.bias is not None:
      y = y + expand_to(self.bias.get_value().astype(dtype), y)
    return self._act(y)


class TokenShift(CausalWindow):
  """RWKV's token shift: the previous token of each position (zero at a document's start).

  ``x [B, T, F]`` -> ``x_{t-1}`` ``[B, T, F]``. No parameters; decoding keeps the last
  input and its id.

  Examples:
    >>> shift = nn.TokenShift(1)
    >>> x = jnp.arange(1.0, 6.0).reshape(1, 5, 1)
    >>> shift(x)[0, :, 0]
    Array([0., 1., 2., 3., 4.], dtype=float32)
    >>> shift(x, segment_ids=jnp.array([[0, 0, 1, 1, 1]]))[0, :, 0]  # A document from t = 2.
    Array([0., 1., 0., 3., 4.], dtype=float32)
  """

  def __init__(self, features: int):
    self.features = checks.check_positive_int(features, name="features", fn="TokenShift")
    self.width = 2
    self.cache = nnx.data(None)
    self.cache_ids = nnx.data(None)

  @compiled_call
  def __call__(self, x: jax.Array, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    ids = check_inputs(x, self.features, segment_ids, fn="TokenShift")
    return self._taps(x, decode=decode, segment_ids=ids, fn="TokenShift")[0]


class GatedRMSNorm(nnx.Module):
  """``RMSNorm(x) ⊙ act(g)`` over the last axis: ``x / sqrt(mean(x²) + eps) ⊙ scale ⊙ act(g)``.

  The output norm of the gated token mixers, applied per head: ``x`` and ``g``
  ``[..., D]``, the last axis a head's D. Computed in float32, returned in ``dtype``
  (default: ``x``'s). Mamba-2's norm gates first and normalises groups of features:
  with ``gate_first``, ``RMSNorm(x ⊙ act(g)) ⊙ scale``; with ``group_size`` c, the mean
  of squares is taken over each run of c features of the last axis (``features / c``
  groups, each normalised on its own).

  Args:
    features: the last axis' size.
    epsilon: eps.
    activation: the gate's ``"swish"`` (Gated DeltaNet, GLA, RetNet, Mamba-2),
      ``"sigmoid"`` (KDA), or None for a norm without a gate.
    use_scale: learn ``scale [features]`` (ones at first).
    gate_first: multiply by ``act(g)`` before normalising (Mamba-2's
      ``norm_before_gate=False``).
    group_size: normalise each run of this many features (default: all of them); must
      divide ``features``.

  Examples:
    >>> norm = nn.GatedRMSNorm(4, rngs=nnx.Rngs(0))
    >>> o, g = jnp.array([1.0, -1.0, 1.0, -1.0]), jnp.full((4,), 20.0)
    >>> norm(o, g).round(3)  # swish(20) ≈ 20
    Array([ 20., -20.,  20., -20.], dtype=float32)
    >>> groups = nn.GatedRMSNorm(4, gate_first=True, group_size=2, rngs=nnx.Rngs(0))
    >>> y = groups(jnp.array([3.0, 4.0, 1.0, 1.0]), jnp.full((4,), 20.0))  # [3, 4] / 3.54
    >>> (100 * y).round()
    Array([ 85., 113., 100., 100.], dtype=float32)

  Reference: Zhang and Sennrich, "Root Mean Square Layer Normalization", 2019; Dao and
  Gu, "Transformers are SSMs" (Mamba-2), 2024.
  """

  def __init__(self, features: int, *, epsilon: float = 1e-5,
               activation: str | None = "swish", use_scale: bool = True,
               gate_first: bool = False, group_size: int | None = None,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    del rngs  # The scale starts at ones.
    fn = "GatedRMSNorm"
    self.features = checks.check_positive_int(features, name="features", fn=fn)
    self.epsilon, self.dtype = epsilon, dtype
    self.activation, self._act = activation, activation_fn(activation, fn=fn)
    self.gate_first = bool(gate_first)
    self.group_size = features if group_size is None else checks.check_positive_int(
        group_size, name="group_size", fn=fn)
    if features % self.group_size:
      raise ValueError(f"{fn}: group_size={group_size} must divide features={features}.")
    self.scale = nnx.Param(jnp.ones((features,), param_dtype)) if use_scale else nnx.data(None)

  @compiled_call
  def __call__(self, x: jax.Array, gate: jax.Array | None = None) -> jax.Array:
    if (gate is None) != (self.activation is None):
      need = "takes no gate" if self.activation is None else "needs a gate"
      raise ValueError(f"GatedRMSNorm: activation={self.activation!r} {need}.")
    if x.shape[-1] != self.features:
      raise ValueError(f"GatedRMSNorm: inputs must end in features={self.features}; got shape "
                       f"{x.shape}.")
    y = x.astype(jnp.float32)
    if gate is not None and self.gate_first:
      y = y * self._act(gate.astype(jnp.float32))
    c = self.group_size
    groups = y.reshape(y.shape[:-1] + (self.features // c, c))
    groups = groups * jax.lax.rsqrt(jnp.mean(groups * groups, axis=-1, keepdims=True)
                                    + self.epsilon)
    y = groups.reshape(y.shape)
    if self.scale is not None:
      y = y * expand_to(self.scale.get_value().astype(jnp.float32), y)
    if gate is not None and not self.gate_first:
      y = y * self._act(gate.astype(jnp.float32))
    return y.astype(self.dtype or x.dtype)


class LowRank(nnx.Module):
  """``act(x W_down) W_up + b``: a projection through rank R (``down [in, R]``, ``up [R, out]``).

  ``x [..., in]`` -> ``[..., out]``.
  KDA's decay and output gate, GLA's decay and RWKV-7's low-rank gates (their
  "LoRA") are this, as ``nn.Sequential(Linear, act, Linear)`` in PyTorch.

  Examples:
    >>> low = nn.LowRank(32, 4, 64, activation="tanh", rngs=nnx.Rngs(0))
    >>> low.down.kernel.shape, low.up.kernel.shape, low.up.bias.shape
    ((32, 4), (4, 64), (64,))
    >>> low(jnp.ones((2, 32))).shape
    (2, 64)
  """

  def __init__(self, in_features: int, rank: int, out_features: int, *,
               activation: str | None = None, use_bias: bool = True,
               down_init: Initializer = DEFAULT_KERNEL_INIT,
               up_init: Initializer = DEFAULT_KERNEL_INIT,
               bias_init: Initializer = ZEROS, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
               rngs: nnx.Rngs):
    self.activation, self._act = activation, activation_fn(activation, fn="LowRank")
    self.down = nnx.Linear(in_features, rank, use_bias=False, kernel_init=down_init,
                           dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
    self.up = nnx.Linear(rank, out_features, use_bias=use_bias, kernel_init=up_init,
                         bias_init=bias_init, dtype=dtype, param_dtype=param_dtype,
                         precision=precision, rngs=rngs)

  @compiled_call
  def __call__(self, x: jax.Array) -> jax.Array:
    return self.up(self._act(self.down(x)))
