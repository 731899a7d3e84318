"""Token mixers: the layers that released linear-attention models wrap around a recurrence.

A released model never runs the bare recurrence. Its token mixer projects q, k
and v, runs each through a short causal depthwise convolution, projects the
recurrence's gates from the input, and after the recurrence normalises each
head and multiplies it by an output gate. This module builds those layers from
a few small parts:

- :class:`ShortConvolution`: ``y_t = act(Σ_{i<W} w_i ⊙ x_{t-i} + b)``, its decode
  state the last ``W - 1`` inputs;
- :class:`TokenShift`: the previous token ``x_{t-1}`` (RWKV), its decode state the last
  input;
- :class:`GatedRMSNorm`: ``RMSNorm(o) ⊙ act(g)`` per head;
- :class:`LowRank`: ``act(x W_down) W_up + b``;
- :class:`RecurrentMixer`: the mixer of Gated DeltaNet, KDA, GLA, simple GLA, RetNet
  and DeltaNet, one class whose :class:`Recipe` says which parts each uses;
- :class:`RWKV7TimeMixer`: RWKV-7's time mixing (token shift, low-rank gates, value
  residual, group norm).

Every part resets at a packed document's boundary (``segment_ids``) and decodes on
the protocol of :class:`MultiHeadAttention`: ``init_cache(input_shape)``, then calls
with ``decode=True`` on the next positions (a prompt or one token).

Letters: B batch, T length, F model width (``hidden_size``), N query heads, K key heads,
V value heads (V = r·K: grouped value heads), H key head dim, D value head dim,
W convolution width, R a low rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Dtype, Initializer, PrecisionLike, Shape

from linattn_jax._src import checks
from linattn_jax._src.delta_product import delta_product_attention, steps_in_order
from linattn_jax._src.nn import cache as cache_lib
from linattn_jax._src.nn.gates import (
    GLA_GATE_NORMALIZER,
    GLA_GATE_RANK,
    l2_normalize,
    mamba2_decay_init,
)
from linattn_jax._src.registry import Role, get_spec

_DEFAULT_KERNEL_INIT = initializers.lecun_normal()
_ZEROS = initializers.zeros_init()
_ACTIVATIONS: dict[str | None, Callable[[jax.Array], jax.Array]] = {
    None: lambda x: x, "silu": jax.nn.silu, "swish": jax.nn.silu, "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh}


def _activation(name: str | None, *, fn: str) -> Callable[[jax.Array], jax.Array]:
  return _ACTIVATIONS[checks.check_choice(name, name="activation", choices=list(_ACTIVATIONS),
                                          fn=fn)]


def _lead(a: jax.Array, like: jax.Array) -> jax.Array:
  """``a`` with leading axes of size 1 up to ``like``'s rank (no implicit rank promotion)."""
  return a.reshape((1,) * (like.ndim - a.ndim) + a.shape)


def _check_inputs(x: jax.Array, features: int, segment_ids: Any, *, fn: str) -> Any:
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


class _CausalWindow(nnx.Module):
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


class ShortConvolution(_CausalWindow):
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
    self.activation, self._act = activation, _activation(activation, fn=fn)
    self.dtype = dtype
    bound = 1.0 / math.sqrt(kernel_size)
    self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, features),
                                               param_dtype, -bound, bound))
    self.bias = nnx.Param(jax.random.uniform(rngs.params(), (features,), param_dtype, -bound,
                                             bound)) if use_bias else nnx.data(None)
    self.cache = nnx.data(None)
    self.cache_ids = nnx.data(None)

  def __call__(self, x: jax.Array, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """``x [B, T, F]`` -> ``[B, T, F]``; ``decode``: the next T positions after the cache."""
    fn = "ShortConvolution"
    ids = _check_inputs(x, self.features, segment_ids, fn=fn)
    dtype = self.dtype or x.dtype
    taps = self._taps(x.astype(dtype), decode=decode, segment_ids=ids, fn=fn)
    kernel = self.kernel.get_value().astype(dtype)
    y = sum(tap * _lead(kernel[i], tap) for i, tap in enumerate(taps))
    if self.bias is not None:
      y = y + _lead(self.bias.get_value().astype(dtype), y)
    return self._act(y)


class TokenShift(_CausalWindow):
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

  def __call__(self, x: jax.Array, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    ids = _check_inputs(x, self.features, segment_ids, fn="TokenShift")
    return self._taps(x, decode=decode, segment_ids=ids, fn="TokenShift")[0]


class GatedRMSNorm(nnx.Module):
  """``RMSNorm(x) ⊙ act(g)`` over the last axis: ``x / sqrt(mean(x²) + eps) ⊙ scale ⊙ act(g)``.

  The output norm of the gated token mixers, applied per head: ``x`` and ``g``
  ``[..., D]``, the last axis a head's D. Computed in float32, returned in ``dtype``
  (default: ``x``'s).

  Args:
    features: the last axis' size.
    epsilon: eps.
    activation: the gate's ``"swish"`` (Gated DeltaNet, GLA, RetNet), ``"sigmoid"``
      (KDA), or None for a norm without a gate.
    use_scale: learn ``scale [features]`` (ones at first).

  Examples:
    >>> norm = nn.GatedRMSNorm(4, rngs=nnx.Rngs(0))
    >>> o, g = jnp.array([1.0, -1.0, 1.0, -1.0]), jnp.full((4,), 20.0)
    >>> norm(o, g).round(3)  # swish(20) ≈ 20
    Array([ 20., -20.,  20., -20.], dtype=float32)

  Reference: Zhang and Sennrich, "Root Mean Square Layer Normalization", 2019.
  """

  def __init__(self, features: int, *, epsilon: float = 1e-5,
               activation: str | None = "swish", use_scale: bool = True,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    del rngs  # The scale starts at ones.
    self.features, self.epsilon, self.dtype = features, epsilon, dtype
    self.activation, self._act = activation, _activation(activation, fn="GatedRMSNorm")
    self.scale = nnx.Param(jnp.ones((features,), param_dtype)) if use_scale else nnx.data(None)

  def __call__(self, x: jax.Array, gate: jax.Array | None = None) -> jax.Array:
    if (gate is None) != (self.activation is None):
      need = "takes no gate" if self.activation is None else "needs a gate"
      raise ValueError(f"GatedRMSNorm: activation={self.activation!r} {need}.")
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    if self.scale is not None:
      y = y * _lead(self.scale.get_value().astype(jnp.float32), y)
    if gate is not None:
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
               down_init: Initializer = _DEFAULT_KERNEL_INIT,
               up_init: Initializer = _DEFAULT_KERNEL_INIT,
               bias_init: Initializer = _ZEROS, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
               rngs: nnx.Rngs):
    self.activation, self._act = activation, _activation(activation, fn="LowRank")
    self.down = nnx.Linear(in_features, rank, use_bias=False, kernel_init=down_init,
                           dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
    self.up = nnx.Linear(rank, out_features, use_bias=use_bias, kernel_init=up_init,
                         bias_init=bias_init, dtype=dtype, param_dtype=param_dtype,
                         precision=precision, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.up(self._act(self.down(x)))


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Which parts a paper's token mixer uses (see :class:`RecurrentMixer`); holds no arrays.

  Attributes:
    attention: the registered recurrence.
    reference: the reference layer (flash-linear-attention's class).
    decay: how the decay is projected: ``"mamba2"`` (per value head,
      ``-exp(A_log) softplus(x W_a + dt_bias)``), ``"kda"`` (per value head and key
      feature, ``-exp(A_log) softplus(x W_down W_up + dt_bias)``), ``"gla"`` (per key
      feature, ``log_sigmoid(x W_down W_up + b) / 16``), ``"logsigmoid"`` (per head,
      ``log_sigmoid(x W + b) / 16``) or None (none, or fixed in the recurrence).
    beta: a write strength ``sigmoid(x W_b)`` per value head (the delta rules).
    short_conv: the paper's default for the short convolutions on q, k and v.
    unit_qk: L2-normalised queries and keys per head.
    output_gate: the paper's default output gate: ``"swish"``, ``"sigmoid"`` or None
      (the norm alone).
    low_rank_gate: the output gate's projection goes through rank D (KDA).
    expand_v: the paper's default D / H.
    householder: the paper's default n, delta-rule steps per token (Gated DeltaProduct's
      n Householder factors; 1 for the others).
    neg_eigval: the paper's default for ``β = 2 σ(x W_b)`` (β in [0, 2], transitions
      with negative eigenvalues) rather than ``σ(x W_b)``.
    rotary: the paper's default for the rotary position embedding of q and k
      (:func:`rotary`, at each token's position in its document: RetNet's).

  Examples:
    >>> recipe = nn.RecurrentMixer("kda", 32, 2, rngs=nnx.Rngs(0)).recipe
    >>> recipe.attention, recipe.decay, recipe.output_gate
    ('kda', 'kda', 'sigmoid')
  """

  attention: str
  reference: str
  decay: str | None = None
  beta: bool = False
  short_conv: bool = True
  unit_qk: bool = False
  output_gate: str | None = "swish"
  low_rank_gate: bool = False
  expand_v: float = 1.0
  householder: int = 1
  neg_eigval: bool = False
  rotary: bool = False


RECIPES: Mapping[str, Recipe] = {
    "gated_deltanet": Recipe("gated_delta_net", "GatedDeltaNet", decay="mamba2", beta=True,
                             unit_qk=True, expand_v=2.0),
    # Gated DeltaNet over n steps per token (delta_product.py lays them out in order).
    "gated_deltaproduct": Recipe("gated_delta_net", "GatedDeltaProduct", decay="mamba2",
                                 beta=True, unit_qk=True, expand_v=2.0, householder=2,
                                 neg_eigval=True),
    "kda": Recipe("kda", "KimiDeltaAttention", decay="kda", beta=True, unit_qk=True,
                  output_gate="sigmoid", low_rank_gate=True),
    "gla": Recipe("gla", "GatedLinearAttention", decay="gla", short_conv=False),
    "simple_gla": Recipe("simple_gla", "SimpleGatedLinearAttention", decay="logsigmoid"),
    "retnet": Recipe("retention", "MultiScaleRetention", short_conv=False, expand_v=2.0,
                     rotary=True),
    "deltanet": Recipe("delta_net", "DeltaNet", beta=True, unit_qk=True, output_gate=None),
}


class RecurrentMixer(nnx.Module):
  """The token mixer of a gated or delta-rule paper (Gated DeltaNet, KDA, ...), by ``name``.

  ``out = o_proj(GatedRMSNorm(recurrence(q, k, v, gates), g))`` with, from the input
  ``x [B, T, F]``: ``q = conv_q(x W_q)`` ``[B, T, N, H]``, ``k = conv_k(x W_k)``
  ``[B, T, K, H]``, ``v = conv_v(x W_v)`` ``[B, T, V, D]`` (short causal convolutions
  with SiLU; without them, SiLU alone for the delta rules and nothing for the
  others, as the papers), q and k L2-normalised per head for the delta rules, the
  gates below, and the output gate ``g = x W_g`` per output head. ``name`` is one of
  the recipes below; each recipe names its recurrence and reference layer:

  ================== ==================== ========================== =====================
  name               recurrence           reference layer            decay
  ================== ==================== ========================== =====================
  gated_deltanet     ``gated_delta_net``  GatedDeltaNet              Mamba2, per head
  gated_deltaproduct ``gated_delta_net``  GatedDeltaProduct          Mamba2, per head
  kda                ``kda``              KimiDeltaAttention         KDA, per key feature
  gla                ``gla``              GatedLinearAttention       low-rank, per feature
  simple_gla         ``simple_gla``       SimpleGatedLinearAttention log-sigmoid, per head
  retnet             ``retention``        MultiScaleRetention        fixed per head
  deltanet           ``delta_net``        DeltaNet                   none
  ================== ==================== ========================== =====================

  Gated DeltaProduct writes n keys per token (``num_householder``, default 2): k, v and
  β are projected n times over, and the token's decay, then its n delta-rule writes, then
  its query run as :func:`~linattn_jax.delta_product_attention` (decoding: as n steps of
  Gated DeltaNet, laid out as that function lays them; the decode state is Gated
  DeltaNet's). Its β is ``2 σ(x W_b)`` by default (``allow_neg_eigval``), as the
  reference layer's.

  The parameters, with their names and shapes in the reference layers
  (flash-linear-attention's ``fla.layers``; a PyTorch ``Linear``'s ``weight`` is our
  ``kernel`` transposed, a ``ShortConvolution``'s ``weight [C, 1, W]`` our
  ``kernel [W, C]`` transposed). O = max(N, V) output heads, n steps per token (1 but
  for gated_deltaproduct):

  ======================== ============ =================================== =================
  ours                     shape        reference                           mixers
  ======================== ============ =================================== =================
  ``q_proj.kernel``        [F, N·H]     ``q_proj.weight``                   all
  ``k_proj.kernel``        [F, n·K·H]   ``k_proj.weight``                   all
  ``v_proj.kernel``        [F, n·V·D]   ``v_proj.weight``                   all
  ``q_conv.kernel``        [W, N·H]     ``q_conv1d.weight``                 with short_conv
  ``k_conv.kernel``        [W, n·K·H]   ``k_conv1d.weight``                 with short_conv
  ``v_conv.kernel``        [W, n·V·D]   ``v_conv1d.weight``                 with short_conv
  ``a_proj.kernel``        [F, V]       ``a_proj.weight``                   Mamba2 decays
  ``A_log``                [V]          ``A_log``                           Mamba2 decays, kda
  ``dt_bias``              [V]          ``dt_bias``                         Mamba2 decays
  ``dt_bias``              [V·H]        ``dt_bias``                         kda
  ``f_proj.down.kernel``   [F, D]       ``f_proj.0.weight``                 kda
  ``f_proj.up.kernel``     [D, V·H]     ``f_proj.1.weight``                 kda
  ``gk_proj.down.kernel``  [F, 16]      ``gk_proj.0.weight``                gla
  ``gk_proj.up.kernel``    [16, V·H]    ``gk_proj.1.weight``                gla
  ``gk_proj.up.bias``      [V·H]        ``gk_proj.1.bias``                  gla
  ``gk_proj.kernel``       [F, V]       ``gk_proj.weight``                  simple_gla
  ``gk_proj.bias``         [V]          ``gk_proj.bias``                    simple_gla
  ``b_proj.kernel``        [F, n·V]     ``b_proj.weight``                   delta rules
  ``g_proj.kernel``        [F, O·D]     ``g_proj.weight``                   with output_gate
  ``g_proj.down.kernel``   [F, D]       ``g_proj.0.weight``                 kda
  ``g_proj.up.kernel``     [D, O·D]     ``g_proj.1.weight``                 kda
  ``g_proj.up.bias``       [O·D]        ``g_proj.1.bias``                   kda
  ``o_norm.scale``         [D]          ``o_norm.weight`` /                 all
                                        ``g_norm_swish_gate.weight``
  ``o_proj.kernel``        [O·D, F]     ``o_proj.weight``                   all
  ======================== ============ =================================== =================

  The decays: ``-exp(A_log) softplus(x W_a + dt_bias)`` ``[B, T, V]`` (Gated
  DeltaNet, Mamba2's); ``-exp(A_log_v) softplus(x W_down W_up + dt_bias)``
  ``[B, T, V, H]`` (KDA); ``log_sigmoid(x W_down W_up + b) / 16`` ``[B, T, V, H]``
  (GLA); ``log_sigmoid(x W + b) / 16`` ``[B, T, V]`` (simple GLA); RetNet's fixed
  decays ``log(1 - 2^(-5 - h))`` live in its recurrence. The write strength of the
  delta rules is ``sigmoid(x W_b)`` ``[B, T, V]`` (``2 sigmoid(x W_b)`` with
  ``allow_neg_eigval``). ``A_log`` starts at ``log U(1, 16)``
  and ``dt_bias`` at the inverse softplus of a log-uniform dt in [0.001, 0.1].

  RetNet turns q and k by their positions (``rotary``: :func:`rotary`, base 10,000,
  halves layout, as the reference layer's ``RotaryEmbedding``); a position counts from
  its document's start, and from the cache's position when decoding.

  Not here: the reference GLA's ``feature_map`` and ``clamp_min`` options (off in its
  default configuration).

  Args:
    name: a recipe (the table above).
    hidden_size: F.
    num_heads: N (and K unless ``num_kv_heads``).
    head_dim: H (default F // N).
    num_kv_heads: K (default N): fewer key/value heads than query heads (GQA; gla,
      simple_gla, retnet).
    num_v_heads: V (default K): more value heads than key heads (grouped value heads,
      V = r·K with N = K; the gated family and the delta rules).
    expand_v: D / H (default the paper's: 2 for gated_deltanet and retnet, else 1).
    short_conv: short convolutions on q, k and v (default the paper's: off for gla and
      retnet).
    conv_size: their width W.
    num_householder: n, delta-rule steps per token (default the recipe's: 2 for
      gated_deltaproduct, else 1; more than 1 for the delta rules only).
    allow_neg_eigval: ``β = 2 σ(x W_b)`` in [0, 2] (default the recipe's: on for
      gated_deltaproduct; the delta rules only).
    rotary: the rotary position embedding of q and k (default the recipe's: on for
      retnet; H must be even).
    output_gate: multiply the normed output by its gate (default the paper's: off for
      deltanet only; on, its activation is the recipe's, swish unless kda).
    norm_eps: the output norm's eps.
    attention_options: the recurrence's options, e.g. ``{"chunk_size": 32}``.
    dtype, param_dtype, precision, kernel_init: the projections' settings, as in
      ``flax.nnx.Linear``.
    rngs: ``params`` draws the weights.

  Raises:
    ValueError: for an unknown ``name`` or recurrence option, head counts that do not
      divide, a D that is not an integer, ``num_householder`` or ``allow_neg_eigval``
      for a mixer without the delta rule, ``rotary`` with an odd H, or inputs that are
      not ``[B, T, F]``.

  Examples:
    >>> mixer = nn.RecurrentMixer("gated_deltanet", 32, num_heads=2, num_v_heads=4,
    ...                           rngs=nnx.Rngs(0))
    >>> mixer.v_proj.kernel.shape, mixer.A_log.shape  # [F, V·D] (D = 2·H = 32), [V]
    ((32, 128), (4,))
    >>> x = jax.random.normal(jax.random.key(0), (1, 6, 32))
    >>> full = mixer(x)
    >>> mixer.init_cache(x.shape)
    >>> steps = jnp.concatenate([mixer(x[:, :4], decode=True), mixer(x[:, 4:5], decode=True),
    ...                          mixer(x[:, 5:], decode=True)], axis=1)
    >>> bool(jnp.allclose(steps, full, atol=1e-5))
    True

  References:
    Yang et al., "Gated Delta Networks: Improving Mamba2 with Delta Rule", 2025.
    Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture", 2025.
    Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
    Training", 2024. Sun et al., "Retentive Network", 2023. Yang et al.,
    "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", 2024.
    Qwen Team, Qwen3-Next, 2025 (grouped value heads). Siems et al., "DeltaProduct:
    Improving State-Tracking in Linear RNNs via Householder Products", 2025. Grazzi et
    al., "Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues", 2025.
  """

  def __init__(self, name: str, hidden_size: int, num_heads: int, *,
               head_dim: int | None = None, num_kv_heads: int | None = None,
               num_v_heads: int | None = None, expand_v: float | None = None,
               short_conv: bool | None = None, conv_size: int = 4,
               num_householder: int | None = None, allow_neg_eigval: bool | None = None,
               rotary: bool | None = None, output_gate: bool | None = None,
               norm_eps: float = 1e-5,
               attention_options: Mapping[str, Any] | None = None,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None,
               kernel_init: Initializer = _DEFAULT_KERNEL_INIT, rngs: nnx.Rngs):
    fn = "RecurrentMixer"
    recipe = RECIPES[checks.check_choice(name, name="name", choices=list(RECIPES), fn=fn)]
    self.name, self.recipe = name, recipe
    F = self.hidden_size = checks.check_positive_int(hidden_size, name="hidden_size", fn=fn)
    N = checks.check_positive_int(num_heads, name="num_heads", fn=fn)
    K = N if num_kv_heads is None else checks.check_positive_int(num_kv_heads,
                                                                 name="num_kv_heads", fn=fn)
    V = K if num_v_heads is None else checks.check_positive_int(num_v_heads,
                                                                name="num_v_heads", fn=fn)
    H = F // N if head_dim is None else checks.check_positive_int(head_dim, name="head_dim",
                                                                  fn=fn)
    expand_v = recipe.expand_v if expand_v is None else expand_v
    D = int(round(H * expand_v))
    if N % K or V % K:
      raise ValueError(f"{fn}: num_heads={N} and num_v_heads={V} must be multiples of "
                       f"num_kv_heads={K}." if N % K else
                       f"{fn}: num_v_heads={V} must be a multiple of num_kv_heads={K}.")
    if V > K and N != K:
      raise ValueError(f"{fn}: grouped value heads (num_v_heads={V} > num_kv_heads={K}) "
                       f"take as many query heads as key heads; got num_heads={N}.")
    if D < 1 or not math.isclose(D, H * expand_v):
      raise ValueError(f"{fn}: the value head dim head_dim·expand_v = {H}·{expand_v} must "
                       "be a positive integer.")
    n = recipe.householder if num_householder is None else checks.check_positive_int(
        num_householder, name="num_householder", fn=fn)
    neg = recipe.neg_eigval if allow_neg_eigval is None else bool(allow_neg_eigval)
    if (n > 1 or neg) and not recipe.beta:
      raise ValueError(f"{fn}: num_householder={n} and allow_neg_eigval={neg} act on the "
                       f"delta rule's writes; {name!r} has none.")
    self.num_householder, self.allow_neg_eigval = n, neg
    self.rotary = recipe.rotary if rotary is None else bool(rotary)
    if self.rotary and H % 2:
      raise ValueError(f"{fn}: rotary turns pairs of features; head_dim={H} is odd.")
    self.num_heads, self.num_kv_heads, self.num_v_heads = N, K, V
    self.head_dim, self.value_dim = H, D
    O = max(N, V)  # Output heads: the queries' (GQA) or the values' (grouped values).
    self.dtype = dtype
    self._spec = spec = get_spec(recipe.attention)
    self.attention_options = dict(attention_options or {})
    spec.build(**self.attention_options)  # Unknown options raise here, naming them.
    roles = {x.role: x.name for x in spec.token_inputs}
    self._decay_name, self._beta_name = roles.get(Role.DECAY), roles.get(Role.WRITE_STRENGTH)
    self.short_conv = recipe.short_conv if short_conv is None else bool(short_conv)
    gate = recipe.output_gate if output_gate is None else (
        (recipe.output_gate or "swish") if output_gate else None)

    def linear(i, o, *, use_bias=False, dtype=dtype):
      return nnx.Linear(i, o, use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
                        param_dtype=param_dtype, precision=precision, rngs=rngs)

    self.q_proj, self.k_proj = linear(F, N * H), linear(F, n * K * H)
    self.v_proj = linear(F, n * V * D)
    conv = lambda c: ShortConvolution(c, conv_size, dtype=dtype,  # noqa: E731
                                      param_dtype=param_dtype, rngs=rngs)
    self.q_conv = conv(N * H) if self.short_conv else nnx.data(None)
    self.k_conv = conv(n * K * H) if self.short_conv else nnx.data(None)
    self.v_conv = conv(n * V * D) if self.short_conv else nnx.data(None)
    f32 = jnp.float32
    low_rank = lambda i, r, o, **kw: LowRank(  # noqa: E731
        i, r, o, down_init=kernel_init, up_init=kernel_init, dtype=f32,
        param_dtype=param_dtype, precision=precision, rngs=rngs, **kw)
    self.a_proj = self.f_proj = self.gk_proj = self.b_proj = nnx.data(None)
    self.A_log = self.dt_bias = nnx.data(None)
    if recipe.decay in ("mamba2", "kda"):
      dt_shape = (V,) if recipe.decay == "mamba2" else (V * H,)
      A_log, dt_bias = mamba2_decay_init(rngs, (V,), dt_shape, param_dtype)
      self.A_log, self.dt_bias = nnx.Param(A_log), nnx.Param(dt_bias)
    if recipe.decay == "mamba2":
      self.a_proj = linear(F, V, dtype=f32)
    elif recipe.decay == "kda":
      self.f_proj = low_rank(F, D, V * H, use_bias=False)
    elif recipe.decay == "gla":
      self.gk_proj = low_rank(F, GLA_GATE_RANK, V * H)
    elif recipe.decay == "logsigmoid":
      self.gk_proj = linear(F, V, use_bias=True, dtype=f32)
    if recipe.beta:
      self.b_proj = linear(F, n * V, dtype=f32)
    self.g_proj = nnx.data(None)
    if gate is not None:
      self.g_proj = (LowRank(F, D, O * D, down_init=kernel_init, up_init=kernel_init,
                             dtype=dtype, param_dtype=param_dtype, precision=precision,
                             rngs=rngs)
                     if recipe.low_rank_gate else linear(F, O * D))
    self.o_norm = GatedRMSNorm(D, epsilon=norm_eps, activation=gate, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
    self.o_proj = linear(O * D, F)
    self.cache = self.position = nnx.data(None)

  def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
    """An empty decode cache for inputs ``(B, C, F)``: the recurrence's float32 state
    ``[B, V, H, D]``, the convolutions' last inputs in ``dtype`` and, with ``rotary``,
    each row's next position in its document (``position [B]`` int32; C is not needed)."""
    B = input_shape[0]
    self.cache = nnx.Cache(cache_lib.empty(
        self._spec, batch=B, capacity=1, num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=jnp.dtype(dtype),
        options=self.attention_options, value_shape=(self.num_v_heads, self.value_dim)))
    for conv in (self.q_conv, self.k_conv, self.v_conv):
      if conv is not None:
        conv.init_cache(input_shape, self.dtype or dtype)
    if self.rotary:  # The next position in each row's document.
      self.position = nnx.Cache(jnp.zeros((B,), jnp.int32))

  def gates(self, x: jax.Array) -> dict[str, jax.Array]:
    """The recurrence's per-token inputs from ``x [B, T, F]``, by keyword, in float32
    (β ``[B, T, n, V]`` for n > 1 steps per token)."""
    recipe, V, H = self.recipe, self.num_v_heads, self.head_dim
    x = x.astype(jnp.float32)
    lead = x.shape[:-1]
    out = {}
    if recipe.decay == "mamba2":
      a = self.a_proj(x)
      dt = jax.nn.softplus(a + _lead(self.dt_bias.get_value().astype(jnp.float32), a))
      out[self._decay_name] = -_lead(jnp.exp(self.A_log.get_value().astype(jnp.float32)), dt) * dt
    elif recipe.decay == "kda":
      f = self.f_proj(x)
      f = (f + _lead(self.dt_bias.get_value().astype(jnp.float32), f)).reshape(lead + (V, H))
      a = jnp.exp(self.A_log.get_value().astype(jnp.float32))[:, None]  # [V, 1]
      out[self._decay_name] = -_lead(a, f) * jax.nn.softplus(f)
    elif recipe.decay == "gla":
      out[self._decay_name] = (jax.nn.log_sigmoid(self.gk_proj(x)) / GLA_GATE_NORMALIZER
                               ).reshape(lead + (V, H))
    elif recipe.decay == "logsigmoid":
      out[self._decay_name] = jax.nn.log_sigmoid(self.gk_proj(x)) / GLA_GATE_NORMALIZER
    if recipe.beta:
      beta = jax.nn.sigmoid(self.b_proj(x)) * (2.0 if self.allow_neg_eigval else 1.0)
      n = self.num_householder
      out[self._beta_name] = beta if n == 1 else beta.reshape(lead + (n, V))
    return out

  def __call__(self, x: jax.Array, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Mixes ``x [B, T, F]`` causally -> ``[B, T, F]``.

    ``segment_ids`` (int ``[B, T]``, non-decreasing): packed documents; the
    convolutions and the recurrence restart at each boundary, so each document mixes
    as if alone. ``decode`` (after :meth:`init_cache`): the next T positions of the
    sequences in the cache, which advances (ids omitted: they continue the last
    decoded position's document).
    """
    fn = "RecurrentMixer"
    ids = _check_inputs(x, self.hidden_size, segment_ids, fn=fn)
    B, T, _ = x.shape
    if decode and self.cache is None:
      raise ValueError(f"{fn}: decode=True needs a cache: call init_cache first.")
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if self.short_conv:
      q, k, v = (conv(y, decode=decode, segment_ids=ids)
                 for conv, y in ((self.q_conv, q), (self.k_conv, k), (self.v_conv, v)))
    elif self.recipe.unit_qk:  # The delta rules' SiLU, without the convolution.
      q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
    n = self.num_householder
    steps = () if n == 1 else (n,)  # Keys, values and β: [B, T, n, ·] for n steps.
    q = q.reshape(B, T, self.num_heads, self.head_dim)
    k = k.reshape((B, T) + steps + (self.num_kv_heads, self.head_dim))
    v = v.reshape((B, T) + steps + (self.num_v_heads, self.value_dim))
    if self.recipe.unit_qk:
      q, k = l2_normalize(q), l2_normalize(k)
    if self.rotary:
      if decode:
        positions = segment_positions(ids, (B, T), last_id=self.cache.get_value().segment_id,
                                      offset=self.position.get_value())
        self.position.set_value(positions[:, -1] + 1)
      else:
        positions = segment_positions(ids, (B, T))
      q, k = rotary(q, positions), rotary(k, positions)
    gates = self.gates(x)
    packed = lambda ids: {} if ids is None else {"segment_ids": ids}  # noqa: E731
    if n > 1 and not decode:  # DeltaProduct's chunked form reads each token's last step only.
      o = delta_product_attention(q, k, v, gates[self._beta_name],
                                  log_decay=gates.get(self._decay_name), is_causal=True,
                                  **packed(ids), **self.attention_options)
    else:
      if n > 1:  # The n·T steps in order: each token's decay on its first, query on its last.
        beta, g = gates[self._beta_name], gates.get(self._decay_name)
        q, k, v, beta, g, _, ids, _ = steps_in_order(q, k, v, beta, g, None, ids, fn=fn)
        gates = {self._beta_name: beta} | ({} if g is None else {self._decay_name: g})
      if decode:
        before = self.cache.get_value()
        cache, o = cache_lib.state_decode(self._spec, before, q, k, v,
                                          options=self.attention_options, gates=gates,
                                          segment_ids=ids)
        self.cache.set_value(cache._replace(index=before.index + T))  # Tokens, not steps.
      else:
        o = self._spec.function(q, k, v, is_causal=True, **packed(ids),
                                **self.attention_options, **gates)
      if n > 1:
        o = o.reshape((B, T, n) + o.shape[2:])[:, :, -1]  # Each token's last step.
    g = None
    if self.g_proj is not None:
      g = self.g_proj(x).reshape(o.shape)
    o = self.o_norm(o, g)
    return self.o_proj(o.reshape(B, T, -1))


def _rwkv7_rank(hidden_size: int, multiplier: float, factor: float = 1.0) -> int:
  """RWKV-7's default low rank: ``multiplier·sqrt(F)·factor`` rounded to a multiple of 32
  (at least 32)."""
  return max(32, int(round(multiplier * math.sqrt(hidden_size) * factor / 32) * 32))


class RWKV7TimeMixer(nnx.Module):
  """RWKV-7's time mixing ("Goose"): token shift, low-rank gates, the DPLR recurrence.

  From ``x [B, T, F]`` and its token shift ``δ = x_{t-1} - x_t``: six mixes
  ``x_c = x + δ ⊙ μ_c`` (c in r, w, k, v, a, g); ``r = x_r W_r``, ``k = x_k W_k``,
  ``v = x_v W_v``; the decay ``w = -exp(-1/2) sigmoid(lora_w(x_w))`` (a log decay in
  (-0.607, 0)); the in-context rate ``a = sigmoid(lora_a(x_a))``; the removal key
  ``κ̂ = normalize(k ⊙ k_k)`` per head, and the key ``k ← k ⊙ (1 + (a - 1) ⊙ k_a)``.
  Every layer but the first blends its value toward the first layer's (the value
  residual): ``v ← v + (v_first - v) ⊙ sigmoid(lora_v(x_v))``. The recurrence is
  ``rwkv7``: ``S_t = (diag(exp(w_t)) - κ̂_t (a_t ⊙ κ̂_t)ᵀ) S_{t-1} + k_t v_tᵀ``,
  ``o_t = r_tᵀ S_t`` (scale 1), then ``o ← (GroupNorm(o) + (Σ_h r ⊙ k ⊙ r_k) v) ⊙ g``
  with ``g = lora_g(x_g)`` (sigmoid inside) and ``out = o W_o``. One head count K with
  ``H = F / K`` (key and value dims), as the reference.

  ``__call__(x, v_first=None, ...)`` returns ``(out, v_first)``: the first layer
  (``layer_index=0``) returns its values for the later layers, which must be given them.

  Parameters, with flash-linear-attention's ``RWKV7Attention`` names (a ``Linear``'s
  ``weight`` is our ``kernel`` transposed; the ``x_*`` there are ``[1, 1, F]``):

  ========================= ============ ============================ ===============
  ours                      shape        reference                    note
  ========================= ============ ============================ ===============
  ``x_r`` … ``x_g`` (six)   [F]          ``x_r`` … ``x_g``            token-shift mix
  ``k_k``, ``k_a``          [K·H]        ``k_k``, ``k_a``
  ``r_k``                   [K, H]       ``r_k``                      bonus term
  ``r_proj.kernel``         [F, K·H]     ``r_proj.weight``
  ``k_proj.kernel``         [F, K·H]     ``k_proj.weight``
  ``v_proj.kernel``         [F, K·H]     ``v_proj.weight``
  ``w_lora.down.kernel``    [F, Rw]      ``w_lora.lora.0.weight``     tanh inside
  ``w_lora.up.kernel``      [Rw, K·H]    ``w_lora.lora.2.weight``
  ``w_lora.up.bias``        [K·H]        ``w_lora.lora.2.bias``
  ``a_lora.down.kernel``    [F, Ra]      ``a_lora.lora.0.weight``
  ``a_lora.up.kernel``      [Ra, K·H]    ``a_lora.lora.2.weight``
  ``a_lora.up.bias``        [K·H]        ``a_lora.lora.2.bias``
  ``v_lora.down.kernel``    [F, Rv]      ``v_lora.lora.0.weight``     layer_index > 0
  ``v_lora.up.kernel``      [Rv, K·H]    ``v_lora.lora.2.weight``     layer_index > 0
  ``v_lora.up.bias``        [K·H]        ``v_lora.lora.2.bias``       layer_index > 0
  ``g_lora.down.kernel``    [F, Rg]      ``g_lora.lora.0.weight``     sigmoid inside
  ``g_lora.up.kernel``      [Rg, K·H]    ``g_lora.lora.2.weight``
  ``g_norm.scale``          [K·H]        ``g_norm.weight``            eps = H·norm_eps
  ``g_norm.bias``           [K·H]        ``g_norm.bias``
  ``o_proj.kernel``         [K·H, F]     ``o_proj.weight``
  ========================= ============ ============================ ===============

  The ranks default to the reference's: Rw = Ra = 32·round(2.5·sqrt(F)·H/64 / 32),
  Rv with 1.7, Rg = 32·round(5·sqrt(F) / 32), each at least 32. The initial values
  follow the reference's (the mixes, ``k_k``, ``k_a``, ``r_k``, the low-rank biases
  and the norm's scale depend on ``layer_index`` of ``num_layers``; ``o_proj`` starts at
  zero, so a fresh mixer outputs zeros).

  Args:
    hidden_size: F.
    head_dim: H (default 64); K = F / H.
    layer_index: this layer's index (0: the first, which has no ``v_lora``).
    num_layers: the model's layer count (for the initial values).
    decay_rank, a_rank, v_rank, gate_rank: Rw, Ra, Rv, Rg (defaults above).
    norm_eps: the group norm's eps per unit of H.
    attention_options: the ``rwkv7`` recurrence's options, e.g. ``{"chunk_size": 32}``.
    dtype, param_dtype, precision: as in ``flax.nnx.Linear``.
    rngs: ``params`` draws the weights.

  Raises:
    ValueError: for H not dividing F, a ``layer_index`` outside ``[0, num_layers)``,
      a later layer called without ``v_first``, or inputs that are not ``[B, T, F]``.

  Examples:
    >>> first = nn.RWKV7TimeMixer(32, head_dim=8, num_layers=2, rngs=nnx.Rngs(0))
    >>> second = nn.RWKV7TimeMixer(32, head_dim=8, layer_index=1, num_layers=2,
    ...                            rngs=nnx.Rngs(1))
    >>> x = jax.random.normal(jax.random.key(0), (1, 6, 32))
    >>> h, v_first = first(x)
    >>> out, _ = second(x + h, v_first)
    >>> out.shape, second.r_k.shape  # [B, T, F], [K, H]
    ((1, 6, 32), (4, 8))

  Reference: Peng et al., "RWKV-7 'Goose' with Expressive Dynamic State Evolution", 2025.
  """

  def __init__(self, hidden_size: int, *, head_dim: int = 64, layer_index: int = 0,
               num_layers: int = 1, decay_rank: int | None = None, a_rank: int | None = None,
               v_rank: int | None = None, gate_rank: int | None = None,
               norm_eps: float = 1e-5, attention_options: Mapping[str, Any] | None = None,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None, rngs: nnx.Rngs):
    fn = "RWKV7TimeMixer"
    F = self.hidden_size = checks.check_positive_int(hidden_size, name="hidden_size", fn=fn)
    H = self.head_dim = checks.check_positive_int(head_dim, name="head_dim", fn=fn)
    num_layers = checks.check_positive_int(num_layers, name="num_layers", fn=fn)
    if F % H:
      raise ValueError(f"{fn}: head_dim={H} must divide hidden_size={F}.")
    if not 0 <= layer_index < num_layers:
      raise ValueError(f"{fn}: layer_index={layer_index} must be in [0, {num_layers}).")
    K = self.num_heads = F // H
    self.layer_index, self.dtype = layer_index, dtype
    self._spec = get_spec("rwkv7")
    self.attention_options = dict(attention_options or {})
    self._spec.build(**self.attention_options)
    f32 = jnp.float32
    # The reference's initial values, from the layer's depth.
    depth = layer_index / max(num_layers - 1, 1)  # 0 -> 1 over the layers.
    shallow = 1.0 - layer_index / num_layers  # 1 -> nearly 0.
    n = jnp.arange(F, dtype=f32)
    ddd = n / F
    linear = n / max(F - 1, 1) - 0.5
    zigzag = ((n % H) - (H - 1) / 2) / max((H - 1) / 2, 1)
    zigzag = zigzag * jnp.abs(zigzag)
    www = -6 + 6 * (n / max(F - 1, 1)) ** (1 + depth ** 0.3)
    for name, power in (("x_r", 0.2), ("x_w", 0.9), ("x_k", 0.7), ("x_v", 0.7), ("x_a", 0.9),
                        ("x_g", 0.2)):
      setattr(self, name, nnx.Param((1.0 - ddd ** (power * shallow)).astype(param_dtype)))
    self.k_k = nnx.Param((0.71 - linear * 0.1).astype(param_dtype))
    self.k_a = nnx.Param(jnp.full((F,), 1.02, param_dtype))
    self.r_k = nnx.Param(jnp.full((K, H), -0.04, param_dtype))
    init = initializers.lecun_normal()

    def linear_(i, o, kernel_init=init):
      return nnx.Linear(i, o, use_bias=False, kernel_init=kernel_init, dtype=dtype,
                        param_dtype=param_dtype, precision=precision, rngs=rngs)

    self.r_proj, self.k_proj, self.v_proj = linear_(F, F), linear_(F, F), linear_(F, F)
    self.o_proj = linear_(F, F, initializers.zeros_init())

    def lora(rank, activation, bias=None):
      orthogonal = initializers.orthogonal(0.1 * max(1.0, math.sqrt(F / rank)))
      return LowRank(F, rank, F, activation=activation, use_bias=bias is not None,
                     down_init=initializers.zeros_init(),  # QR in float32 (not in bfloat16):
                     up_init=lambda key, shape, dtype: orthogonal(key, shape).astype(dtype),
                     bias_init=(lambda *_: bias.astype(param_dtype)) if bias is not None
                     else initializers.zeros_init(),
                     dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

    factor = H / 64
    self.w_lora = lora(decay_rank or _rwkv7_rank(F, 2.5, factor), "tanh",
                       www + 0.5 + zigzag * 2.5)
    self.a_lora = lora(a_rank or _rwkv7_rank(F, 2.5, factor), None,
                       -0.19 + zigzag * 0.3 + linear * 0.4)
    self.v_lora = (lora(v_rank or _rwkv7_rank(F, 1.7, factor), None, 0.73 - linear * 0.4)
                   if layer_index > 0 else nnx.data(None))
    self.g_lora = lora(gate_rank or _rwkv7_rank(F, 5.0), "sigmoid")
    self.g_norm = nnx.GroupNorm(F, num_groups=K, epsilon=H * norm_eps, dtype=f32,
                                param_dtype=param_dtype, rngs=rngs)
    self.g_norm.scale.set_value(jnp.full((F,), ((layer_index + 1) / num_layers) ** 0.7,
                                         param_dtype))
    self.shift = TokenShift(F)
    self.cache = nnx.data(None)

  def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
    """An empty decode cache for inputs ``(B, C, F)``: the float32 state ``[B, K, H, H]``
    and the last input, in ``dtype`` (C is not needed)."""
    B, K, H = input_shape[0], self.num_heads, self.head_dim
    self.cache = nnx.Cache(cache_lib.empty(
        self._spec, batch=B, capacity=1, num_heads=K, num_kv_heads=K, head_dim=H,
        dtype=jnp.dtype(dtype), options=self.attention_options))
    self.shift.init_cache(input_shape, self.dtype or dtype)

  def __call__(self, x: jax.Array, v_first: jax.Array | None = None, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Mixes ``x [B, T, F]`` causally: ``(out [B, T, F], v_first [B, T, F])``.

    ``v_first``: the first layer's values (every layer but the first needs them; the
    first returns its own). ``segment_ids`` and ``decode`` as in :class:`RecurrentMixer`.
    """
    fn = "RWKV7TimeMixer"
    ids = _check_inputs(x, self.hidden_size, segment_ids, fn=fn)
    if (self.v_lora is not None) != (v_first is not None):
      raise ValueError(f"{fn}: layer_index={self.layer_index} "
                       + ("needs v_first, the first layer's values." if self.v_lora is not None
                          else "is the first layer: it takes no v_first."))
    B, T, F = x.shape
    K, H = self.num_heads, self.head_dim
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    delta = self.shift(x, decode=decode, segment_ids=ids) - x
    mix = {c: x + delta * _lead(getattr(self, f"x_{c}").get_value().astype(dtype), x)
           for c in "rwkvag"}
    r, k, v = self.r_proj(mix["r"]), self.k_proj(mix["k"]), self.v_proj(mix["v"])
    f32 = jnp.float32
    log_decay = -math.exp(-0.5) * jax.nn.sigmoid(self.w_lora(mix["w"]).astype(f32))
    if self.v_lora is None:
      v_first = v
    else:
      v = v + (v_first.astype(v.dtype) - v) * jax.nn.sigmoid(self.v_lora(mix["v"]))
    a = jax.nn.sigmoid(self.a_lora(mix["a"]).astype(f32))
    g = self.g_lora(mix["g"])
    heads = lambda y: y.reshape(B, T, K, H)  # noqa: E731
    kappa = l2_normalize(heads(k.astype(f32) * _lead(self.k_k.get_value().astype(f32), k)))
    k = k * (1 + (a.astype(k.dtype) - 1) * _lead(self.k_a.get_value().astype(k.dtype), k))
    r, k, v = heads(r), heads(k), heads(v)
    gates = {"a": -kappa, "b": kappa * heads(a), "log_decay": heads(log_decay)}
    options = {"scale": 1.0, **self.attention_options}
    if decode:
      if self.cache is None:
        raise ValueError(f"{fn}: decode=True needs a cache: call init_cache first.")
      cache, o = cache_lib.state_decode(self._spec, self.cache.get_value(), r, k, v,
                                        options=options, gates=gates, segment_ids=ids)
      self.cache.set_value(cache)
    else:
      packed = {} if ids is None else {"segment_ids": ids}
      o = self._spec.function(r, k, v, is_causal=True, **packed, **options, **gates)
    o = self.g_norm(o.astype(f32).reshape(B * T, F)).reshape(B, T, K, H)
    bonus = jnp.sum(r * k * _lead(self.r_k.get_value().astype(r.dtype), r), -1,
                    keepdims=True) * v
    o = ((o + bonus.astype(f32)).reshape(B, T, F) * g.astype(f32)).astype(dtype)
    return self.o_proj(o), v_first


def token_mixer(name: str, hidden_size: int, num_heads: int, *, layer_index: int = 0,
                num_layers: int = 1, **options: Any) -> nnx.Module:
  """A paper's token mixer by name (one of :func:`token_mixer_names`), for inputs ``[B, T, F]``.

  A :class:`RecurrentMixer` recipe, or ``"rwkv7"`` (:class:`RWKV7TimeMixer`, with
  ``head_dim = hidden_size // num_heads``). ``layer_index`` and ``num_layers`` reach
  RWKV-7 only (its value residual and initial values); ``options`` go to the class.

  Raises:
    ValueError: for an unknown name.

  Examples:
    >>> mixer = nn.token_mixer("gla", 32, 4, rngs=nnx.Rngs(0))
    >>> type(mixer).__name__, mixer.recipe.attention
    ('RecurrentMixer', 'gla')
  """
  if name == "rwkv7":
    return RWKV7TimeMixer(hidden_size, head_dim=hidden_size // num_heads,
                          layer_index=layer_index, num_layers=num_layers, **options)
  checks.check_choice(name, name="name", choices=list(RECIPES) + ["rwkv7"], fn="token_mixer")
  return RecurrentMixer(name, hidden_size, num_heads, **options)


MIXERS: tuple[str, ...] = tuple(RECIPES) + ("rwkv7",)


def token_mixer_names() -> tuple[str, ...]:
  """The names :func:`token_mixer` takes: the :class:`RecurrentMixer` recipes and ``"rwkv7"``.

  Takes no arrays.

  Examples:
    >>> print(*nn.token_mixer_names())
    gated_deltanet gated_deltaproduct kda gla simple_gla retnet deltanet rwkv7
  """
  return MIXERS
