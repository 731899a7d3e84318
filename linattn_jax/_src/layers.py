"""Flax NNX attention layers over the registry, with one decode cache protocol.

``MultiHeadAttention`` follows ``flax.nnx.MultiHeadAttention``: the same
``query``/``key``/``value`` projections ``[in, N|K, H]`` and output projection
``[N, H, out]``, GQA through ``num_kv_heads``, and any registered variant
(``attention=`` a name from ``available_attentions()``) in place of the dense
softmax.

Decoding (``decode=True`` after ``init_cache``) keeps what the variant needs:

- ``"kv"`` (softmax, flash and the sparse patterns but local): keys and values
  of every position up to the capacity, ``KVCache``;
- ``"window"`` (local): a ring buffer of the last ``left + 1`` keys, the
  variant's ``LocalState``;
- ``"recurrent"`` (linear maps, linear_learned, performer, random_fourier,
  efficient, heinsen, and the gated recurrences retention, simple_gla, gla,
  delta_net, gated_delta_net): the variant's fixed-size state (``[B, K, M, D]``
  and its normaliser), whatever the position.

A decode call takes a chunk of any length (a prompt) or one token; a prefill
followed by single steps equals one causal call on the whole sequence.
Letters: B batch, T query length, S key length, N query heads, K key/value
heads, H head dim (keys and values), C a KV cache's capacity.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as flax_dtypes
from flax.nnx.nn import initializers
from flax.typing import DotGeneralT, Dtype, Initializer, PrecisionLike, PromoteDtypeFn, Shape
from jax import lax

from linattn_jax._src import checks, dense, gather, sparse
from linattn_jax._src.online_softmax import merge, online_softmax_finish, softmax_block
from linattn_jax._src.parallel import ContextParallel
from linattn_jax._src.registry import AttentionSpec, CacheKind, accepted, get_spec

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()

# Options the layer owns: it passes them itself (state, call arguments); so too a
# variant's own arrays and the seed `rng` they would otherwise be drawn from.
_LAYER_OWNED = ("initial_state", "return_state", "is_causal", "key_value_seq_lengths")
# A sparse pattern without decoding rows (sparse.decode_rows: the built-in ones have them)
# decodes through its dense [C, C] pattern on a sequence of the cache's capacity C (a
# compile-time constant of C² bytes): capped here.
MAX_PATTERN_CAPACITY = 8192
# How the layer projects a gated recurrence's per-token inputs, read off the spec's
# extra_inputs: a log-decay per kv head gets Mamba2's parameterisation, -exp(A_log)
# softplus(x W_a + dt_bias); one per key feature GLA's low-rank gate, log_sigmoid(x W_1 W_2 +
# b) / GLA_GATE_NORMALIZER. A variant taking a beta is a delta rule: its queries and keys
# are L2-normalised per head.
_DECAY_PROJECTIONS = {"[B, S, K]": "mamba2", "[B, S, K, H]": "low_rank"}
GLA_GATE_RANK = 16  # GLA's low-rank gate: W_1 [in, 16], W_2 [16, K·H].
GLA_GATE_NORMALIZER = 16.0  # GLA divides the log-sigmoid gate by 16: decays near 1.


class FeatureProjection(nnx.Variable):
  """A variant's random projection: drawn from ``rngs``, redrawn, never trained.

  The kind of ``nnx.Variable`` in which :class:`MultiHeadAttention` keeps the
  ``[M, H]`` projection of ``"performer"`` and ``"random_fourier"``. It is
  not an ``nnx.Param``, so an optimizer over ``nnx.Param`` leaves it alone;
  :meth:`MultiHeadAttention.redraw` replaces it with a new draw. It reaches
  the attention function as data: a new value never recompiles.

  Examples:
    >>> layer = nn.MultiHeadAttention(2, 16, attention="performer",
    ...                               attention_options={"num_features": 8}, rngs=nnx.Rngs(0))
    >>> isinstance(layer.projection, nn.FeatureProjection)
    True
    >>> before = layer.projection.get_value()
    >>> before.shape  # [M, H]
    (8, 8)
    >>> layer.redraw(jax.random.key(1))
    >>> bool(jnp.array_equal(before, layer.projection.get_value()))
    False
  """


class KVCache(NamedTuple):
  """Keys and values of every decoded position (softmax, flash, sparse patterns).

  The decode cache of :class:`MultiHeadAttention` for variants without a
  streaming state (``cache_kind(...) == "kv"``), made by ``init_cache((B, C,
  in))`` for a capacity of C positions.

  Attributes:
    key: ``[B, K, C, H]`` in the cache dtype (head-major: a step reads it in place).
    value: ``[B, K, C, H]`` (the layer's values have the head dim H too).
    index: ``[]`` int32: positions written so far.

  Examples:
    >>> layer = nn.MultiHeadAttention(4, 32, num_kv_heads=2, rngs=nnx.Rngs(0))  # softmax
    >>> layer.init_cache((1, 16, 32))  # (B, C, in)
    >>> cache = layer.cache.get_value()
    >>> isinstance(cache, nn.KVCache), cache.key.shape, int(cache.index)
    (True, (1, 2, 16, 8), 0)
    >>> _ = layer(jnp.ones((1, 3, 32)), is_causal=True, decode=True)
    >>> int(layer.cache.get_value().index)
    3
  """

  key: jax.Array  # [B, K, C, H] in the cache dtype (head-major: a step reads it in place).
  value: jax.Array  # [B, K, C, H]
  index: jax.Array  # [] int32: positions written so far.


class StateCache(NamedTuple):
  """A streaming variant's state (recurrent, or local's ring buffer).

  The decode cache of :class:`MultiHeadAttention` for variants with a
  streaming protocol (``cache_kind(...)`` is ``"recurrent"`` or
  ``"window"``): its size does not grow with the position.

  Attributes:
    state: the variant's state NamedTuple, e.g. a ``LinearState`` with
      ``kv [B, K, M, H]`` and ``k_sum [B, K, M]``, or a ``LocalState`` ring
      buffer ``[B, W, K, H]``.
    index: ``[]`` int32: positions decoded so far.

  Examples:
    >>> layer = nn.MultiHeadAttention(4, 32, num_kv_heads=2, attention="linear_elu",
    ...                               rngs=nnx.Rngs(0))
    >>> layer.init_cache((1, 16, 32))  # (B, C, in); a state has no capacity.
    >>> cache = layer.cache.get_value()
    >>> isinstance(cache, nn.StateCache), type(cache.state).__name__, cache.state.kv.shape
    (True, 'LinearState', (1, 2, 8, 8))
  """

  state: Any  # The variant's state NamedTuple, e.g. LinearState [B, K, M, H] / [B, K, M].
  index: jax.Array  # [] int32: positions decoded so far.


def cache_kind(attention: str) -> CacheKind:
  """What ``attention``'s decode cache holds: a :class:`CacheKind` (``"kv"``, ``"window"``, ...).

  Takes no arrays. ``"recurrent"``: a fixed-size state (e.g. ``[B, K, M, H]``
  and its normaliser) in a :class:`StateCache`; ``"window"``: local's ring
  buffer of the last ``left + 1`` keys ``[B, W, K, H]`` in a
  :class:`StateCache`; ``"kv"``: every key and value ``[B, K, C, H]`` in a
  :class:`KVCache`.

  Args:
    attention: a name from ``available_attentions()``.

  Raises:
    ValueError: for a name that is not registered.

  Examples:
    >>> [nn.cache_kind(name).value for name in ("softmax", "local", "linear_elu")]
    ['kv', 'window', 'recurrent']
    >>> nn.cache_kind("softmax") == "kv"
    True
  """
  return get_spec(attention).cache_kind


class MultiHeadAttention(nnx.Module):
  """Multi-head attention with any registered variant: ``flax.nnx.MultiHeadAttention``'s interface.

  ``out = W_o · attention(x_q W_q, x_k W_k, x_v W_v)`` with ``W_q [in, N, H]``,
  ``W_k``, ``W_v [in_kv, K, H]`` and ``W_o [N, H, out]``. Every constructor and
  call argument of ``flax.nnx.MultiHeadAttention`` is taken, in its order and
  with its meaning (same parameter names, shapes and draws, so a Flax
  checkpoint loads and the same seed gives the same layer); the additions
  are ``attention`` (a name from ``available_attentions()``) with its
  ``attention_options``, and ``context_parallel``. Arrays a variant owns
  live in the layer: a random projection (performer, random_fourier) as a
  :class:`FeatureProjection` drawn from ``rngs`` (see :meth:`redraw`), a
  learnable feature map (linear_learned) as ``nnx.Param``; both reach the
  attention function as data, so new values never recompile.

  The gated recurrences get their per-token inputs from the key/value input
  ``x [B, S, in_kv]`` through gate projections, ``nnx.Param``s computed in
  float32 (retention has none: its decays are fixed per head):

  - simple_gla, gated_delta_net (Mamba2 / Gated DeltaNet, one gate per kv
    head): ``log_decay = -exp(A_log) · softplus(x W_a + dt_bias)`` ``[B, S, K]``,
    with ``a_kernel`` W_a ``[in_kv, K]`` (``kernel_init``), ``A_log [K]`` =
    log(U(1, 16)) and ``dt_bias [K]`` the inverse softplus of a log-uniform
    dt in [0.001, 0.1];
  - gla (one gate per key feature, rank 16): ``log_decay = log_sigmoid(x W_1
    W_2 + b) / 16`` ``[B, S, K, H]``, with ``gk_kernel_1`` W_1 ``[in_kv, 16]``,
    ``gk_kernel_2`` W_2 ``[16, K·H]`` (``kernel_init``) and ``gk_bias`` b
    ``[K·H]`` (``bias_init``);
  - delta_net, gated_delta_net: ``beta = sigmoid(x W_b)`` ``[B, S, K]`` with
    ``b_kernel`` W_b ``[in_kv, K]`` (``kernel_init``), and queries and keys
    L2-normalised per head over H (``q / sqrt(Σ_h q_h² + 1e-6)``) before the
    delta rule, as the DeltaNet layers do.

  Decoding a gated variant carries its ``[B, K, H, D]`` state; each token's
  gates come from that token's input.

  What a variant cannot honour raises a ``ValueError`` naming the argument
  and the variant: attention dropout, a general ``mask`` and the weights'
  ``sow_weights`` need a variant that forms softmax weights (softmax and the
  sparse patterns; a kernel variant sows the weights it implies); the
  recurrent variants take causal and padding masks as ``is_causal`` and
  ``key_value_seq_lengths``.

  Args:
    num_heads: N.
    in_features: size of the query inputs' last axis.
    qkv_features: N·H (default ``in_features``); must divide by N.
    out_features: output size (default ``in_features``).
    num_kv_heads: K (default N); must divide N (GQA; 1 is MQA).
    in_kv_features: size of the key/value inputs' last axis (default ``in_features``).
    dtype, param_dtype, precision, kernel_init, out_kernel_init, bias_init,
      out_bias_init, use_bias, qkv_promote_dtype, out_promote_dtype,
      ln_promote_dtype, qkv_dot_general, out_dot_general,
      qkv_dot_general_cls, out_dot_general_cls, kernel_metadata,
      out_kernel_metadata, bias_metadata, out_bias_metadata,
      query_ln_scale_metadata, key_ln_scale_metadata: the projections' and
      norms' settings, as in ``flax.nnx.MultiHeadAttention``.
    broadcast_dropout: one dropout pattern for every batch entry and head.
    dropout_rate: attention dropout on the weights (variants that form them).
    deterministic: no dropout; a call's ``deterministic`` takes precedence.
    attention_fn: a Flax ``attention_fn`` used instead of a registered variant
      (then ``attention`` stays ``"softmax"`` with no options).
    decode: decode by default (a call's ``decode`` takes precedence).
    normalize_qk: LayerNorm (no bias) of queries and keys per head: ``query_ln``, ``key_ln``.
    rngs: ``nnx.Rngs``: ``params`` draws the weights and projections, ``dropout`` the dropout.
    keep_rngs: keep a forked dropout stream in the layer (when ``dropout_rate > 0``).
    attention: a name from ``available_attentions()``.
    attention_options: that variant's options, e.g. ``{"window_size": (64, 0)}``
      or ``{"num_features": 128}``; not ``rng``, ``initial_state`` or the
      variant's arrays, which the layer owns.
    context_parallel: a ``linattn_jax.parallel.ContextParallel`` (a mesh and
      the axis that splits the sequence): self-attention calls then run
      with context parallelism, ring attention for softmax and flash, the
      state-passing form for recurrent variants (a gated one's projected
      gates are split along T with the keys). Decoding is unaffected.

  Raises:
    ValueError: for an unknown variant or option, an option the layer owns,
      a required option left out, ``num_heads`` or ``num_kv_heads`` that is
      not a positive int, ``qkv_features`` not divisible by N, N not
      divisible by K, a ``dropout_rate`` outside [0, 1) or one for a variant
      that forms no weights, ``attention_fn`` with another variant, a
      ``context_parallel`` that is not a ``ContextParallel``, a variant
      ``context_parallel`` cannot run (the sparse patterns), or a
      variant with per-token inputs (``AttentionSpec.extra_inputs``) the
      layer has no gate projections for (any but the gated recurrences above).

  Examples:
    >>> layer = nn.MultiHeadAttention(4, 32, attention="linear_elu", rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 10, 32)), is_causal=True).shape
    (2, 10, 32)

    Decoding a prompt and then single tokens equals one causal call:

    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 32))  # [B, T, in]
    >>> full = layer(x, is_causal=True)
    >>> layer.init_cache(x.shape)
    >>> prompt = layer(x[:, :4], decode=True)
    >>> steps = [layer(x[:, t:t + 1], decode=True) for t in (4, 5)]
    >>> bool(jnp.allclose(jnp.concatenate([prompt, *steps], axis=1), full, atol=1e-5))
    True

    A gated variant projects its gates from the inputs:

    >>> gated = nn.MultiHeadAttention(4, 32, num_kv_heads=2, attention="gated_delta_net",
    ...                               rngs=nnx.Rngs(0))
    >>> gated.a_kernel.shape, gated.A_log.shape, gated.b_kernel.shape  # [in, K], [K], [in, K]
    ((32, 2), (2,), (32, 2))
    >>> gated(x, is_causal=True).shape
    (2, 6, 32)

  References:
    Vaswani et al., "Attention Is All You Need", 2017. Ainslie et al., "GQA:
    Training Generalized Multi-Query Transformer Models from Multi-Head
    Checkpoints", 2023. Dehghani et al., "Scaling Vision Transformers to 22
    Billion Parameters", 2023 (normalize_qk). Yang et al., "Gated Linear
    Attention Transformers with Hardware-Efficient Training", 2024 (gla).
    Dao and Gu, "Transformers are SSMs", 2024 (Mamba2's gate). Yang et al.,
    "Parallelizing Linear Transformers with the Delta Rule over Sequence
    Length", 2024 (delta_net). Yang et al., "Gated Delta Networks: Improving
    Mamba2 with Delta Rule", 2025 (gated_delta_net).
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      num_kv_heads: int | None = None,
      in_kv_features: int | None = None,
      *,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      broadcast_dropout: bool = True,
      dropout_rate: float = 0.0,
      deterministic: bool | None = None,
      precision: PrecisionLike = None,
      kernel_init: Initializer = default_kernel_init,
      out_kernel_init: Initializer | None = None,
      bias_init: Initializer = default_bias_init,
      out_bias_init: Initializer | None = None,
      use_bias: bool = True,
      attention_fn: Callable[..., jax.Array] | None = None,
      decode: bool | None = None,
      normalize_qk: bool = False,
      qkv_promote_dtype: PromoteDtypeFn = flax_dtypes.promote_dtype,
      out_promote_dtype: PromoteDtypeFn = flax_dtypes.promote_dtype,
      ln_promote_dtype: PromoteDtypeFn = flax_dtypes.promote_dtype,
      qkv_dot_general: DotGeneralT | None = None,
      out_dot_general: DotGeneralT | None = None,
      qkv_dot_general_cls: Any = None,
      out_dot_general_cls: Any = None,
      rngs: nnx.Rngs,
      keep_rngs: bool = True,
      kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
      out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      query_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
      key_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
      attention: str = "softmax",
      attention_options: Mapping[str, Any] | None = None,
      context_parallel: ContextParallel | None = None,
  ):
    fn = "MultiHeadAttention"
    N = checks.check_positive_int(num_heads, name="num_heads", fn=fn)
    K = N if num_kv_heads is None else checks.check_positive_int(
        num_kv_heads, name="num_kv_heads", fn=fn)
    features = in_features if qkv_features is None else qkv_features
    if N % K:
      raise ValueError(f"{fn}: num_heads={N} must be divisible by num_kv_heads={K}.")
    if features % N:
      raise ValueError(f"{fn}: qkv_features={features} must be divisible by num_heads={N}.")
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"{fn}: dropout_rate must be in [0, 1); got {dropout_rate}.")
    self.num_heads, self.num_kv_heads, self.head_dim = N, K, features // N
    self.in_features, self.qkv_features = in_features, features
    self.in_kv_features = in_features if in_kv_features is None else in_kv_features
    self.out_features = in_features if out_features is None else out_features
    self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
    self.broadcast_dropout, self.dropout_rate = broadcast_dropout, dropout_rate
    self.deterministic, self.decode = deterministic, decode
    self.use_bias, self.normalize_qk = use_bias, normalize_qk
    self.attention = attention
    self._spec = spec = get_spec(attention)  # Resolved once; the layer asks it, not the name.
    self._gated = _gate_projections(spec, fn)
    self.attention_options = _check_attention_options(spec, attention_options or {})
    if attention_fn is not None and (attention != "softmax" or self.attention_options):
      raise ValueError(f"{fn}: attention_fn replaces the registered attention; it cannot be "
                       f"combined with attention={attention!r} or attention_options.")
    self.attention_fn = attention_fn
    if dropout_rate > 0 and attention_fn is None and not spec.forms_weights:
      raise ValueError(f"{fn}: dropout_rate={dropout_rate} drops attention weights, which "
                       f"attention={attention!r} never forms; use 0.0 (or dropout elsewhere).")
    if context_parallel is not None:
      if not isinstance(context_parallel, ContextParallel):
        raise ValueError(f"{fn}: context_parallel must be a linattn_jax.parallel."
                         f"ContextParallel; got {type(context_parallel).__name__}.")
      if attention_fn is not None:
        raise ValueError(f"{fn}: context_parallel runs a registered attention, not attention_fn.")
      context_parallel.check(attention, self.attention_options)
    self.context_parallel = context_parallel

    linear = functools.partial(
        nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
        bias_init=bias_init, use_bias=use_bias, precision=precision,
        promote_dtype=qkv_promote_dtype, dot_general=qkv_dot_general,
        dot_general_cls=qkv_dot_general_cls, kernel_metadata=kernel_metadata,
        bias_metadata=bias_metadata, rngs=rngs)
    H = self.head_dim
    self.query = linear(in_features, (N, H))
    self.key = linear(self.in_kv_features, (K, H))
    self.value = linear(self.in_kv_features, (K, H))
    if normalize_qk:
      norm = functools.partial(nnx.LayerNorm, H, use_bias=False, dtype=dtype,
                               param_dtype=param_dtype, promote_dtype=ln_promote_dtype, rngs=rngs)
      self.query_ln = norm(scale_metadata=query_ln_scale_metadata)
      self.key_ln = norm(scale_metadata=key_ln_scale_metadata)
    else:
      self.query_ln = nnx.data(None)
      self.key_ln = nnx.data(None)
    self.out = nnx.LinearGeneral(
        (N, H), self.out_features, axis=(-2, -1), kernel_init=out_kernel_init or kernel_init,
        bias_init=out_bias_init or bias_init, use_bias=use_bias, dtype=dtype,
        param_dtype=param_dtype, precision=precision, promote_dtype=out_promote_dtype,
        dot_general=out_dot_general, dot_general_cls=out_dot_general_cls,
        kernel_metadata=out_kernel_metadata or kernel_metadata,
        bias_metadata=out_bias_metadata or bias_metadata, rngs=rngs)
    if spec.params is not None:
      kind = nnx.Param if spec.params.trainable else FeatureProjection
      for name, array in self._draw(rngs.params()).items():
        setattr(self, name, kind(array.astype(param_dtype)))
    if self._gated is not None:
      self._init_gates(rngs, kernel_init, bias_init)
    self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None
    self.cache = nnx.data(None)
    self.cache_batch_shape: tuple[int, ...] = ()

  # -- variant-owned arrays ---------------------------------------------------

  def _draw(self, rng: jax.Array) -> dict[str, jax.Array]:
    spec = self._spec
    return dict(spec.params.init(rng, self.head_dim,
                                 **accepted(spec.params.init, self.attention_options)))

  def _init_gates(self, rngs: nnx.Rngs, kernel_init: Initializer,
                  bias_init: Initializer) -> None:
    """The gate projections' ``nnx.Param``s (see the class docstring)."""
    decay, beta = self._gated
    F, K, H, dtype = self.in_kv_features, self.num_kv_heads, self.head_dim, self.param_dtype
    if decay == "mamba2":
      self.a_kernel = nnx.Param(kernel_init(rngs.params(), (F, K), dtype))
      self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (K,), jnp.float32,
                                                        1.0, 16.0)).astype(dtype))
      dt = jnp.exp(jax.random.uniform(rngs.params(), (K,), jnp.float32,
                                      math.log(1e-3), math.log(1e-1)))
      # Inverse softplus: softplus(dt_bias) = dt.
      self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(dtype))
    elif decay == "low_rank":
      self.gk_kernel_1 = nnx.Param(kernel_init(rngs.params(), (F, GLA_GATE_RANK), dtype))
      self.gk_kernel_2 = nnx.Param(kernel_init(rngs.params(), (GLA_GATE_RANK, K * H), dtype))
      self.gk_bias = nnx.Param(bias_init(rngs.params(), (K * H,), dtype))
    if beta:
      self.b_kernel = nnx.Param(kernel_init(rngs.params(), (F, K), dtype))

  def _gates(self, x: jax.Array) -> dict[str, jax.Array]:
    """A gated variant's per-token inputs from the key/value input ``x [..., S, in_kv]``:
    ``log_decay [..., S, K]`` (``[..., S, K, H]`` for gla) ≤ 0 and ``beta [..., S, K]`` in
    (0, 1), float32; ``{}`` for other variants."""
    if self._gated is None:
      return {}
    decay, beta = self._gated
    f32 = jnp.float32
    x = jnp.asarray(x, f32)
    param = lambda name: getattr(self, name).get_value().astype(f32)  # noqa: E731
    per_row = lambda a: a.reshape((1,) * (x.ndim - 1) + a.shape)  # noqa: E731  [K] -> [1.., K]
    dot = lambda a, b: jnp.matmul(a, b, precision=self.precision)  # noqa: E731
    gates = {}
    if decay == "mamba2":
      dt = jax.nn.softplus(dot(x, param("a_kernel")) + per_row(param("dt_bias")))
      gates["log_decay"] = -jnp.exp(per_row(param("A_log"))) * dt
    elif decay == "low_rank":
      logit = dot(dot(x, param("gk_kernel_1")), param("gk_kernel_2")) + per_row(param("gk_bias"))
      gates["log_decay"] = (jax.nn.log_sigmoid(logit) / GLA_GATE_NORMALIZER).reshape(
          x.shape[:-1] + (self.num_kv_heads, self.head_dim))
    if beta:
      gates["beta"] = jax.nn.sigmoid(dot(x, param("b_kernel")))
    return gates

  def redraw(self, rng: jax.Array) -> None:
    """Draws the random projection anew from ``rng`` (same rng, same projection).

    Raises:
      ValueError: if the variant has no random projection (learned feature
        maps are trained, not redrawn).
    """
    spec = self._spec
    if spec.params is None or spec.params.trainable:
      raise ValueError(f"MultiHeadAttention.redraw: attention={self.attention!r} has no "
                       "random projection to redraw.")
    for name, array in self._draw(rng).items():
      getattr(self, name).set_value(array.astype(self.param_dtype))

  def _options(self) -> dict[str, Any]:
    """The variant's options plus its arrays (as data)."""
    params = self._spec.params
    names = () if params is None else params.names
    arrays = {name: getattr(self, name).get_value() for name in names}
    return {**self.attention_options, **arrays}

  # -- calls ------------------------------------------------------------------

  def __call__(
      self,
      inputs_q: jax.Array,
      inputs_k: jax.Array | None = None,
      inputs_v: jax.Array | None = None,
      *,
      mask: jax.Array | None = None,
      deterministic: bool | None = None,
      rngs: nnx.Rngs | nnx.RngStream | None = None,
      sow_weights: bool = False,
      decode: bool | None = None,
      is_causal: bool | None = None,
      key_value_seq_lengths: jax.Array | None = None,
      out_sharding: Any = None,
      qkv_sharding: Any = None,
  ) -> jax.Array:
    """Attends ``inputs_q [..., T, in]`` to ``inputs_k``/``inputs_v [..., S, in_kv]``.

    Any number of leading batch dimensions (none included). Self-attention
    when ``inputs_k`` and ``inputs_v`` are omitted (``inputs_v`` defaults to
    ``inputs_k``). ``is_causal``: query t sees keys ``j <= t + S - T``;
    ``key_value_seq_lengths`` ``[...]``: keys at or past it are masked;
    ``mask`` (broadcastable to ``[..., N, T, S]``, True or nonzero = attend)
    for variants that form weights. With ``decode`` (this call's, else the
    layer's), after :meth:`init_cache`, the inputs are the next T positions of
    one sequence (a prompt or one token), causal by construction; the cache
    advances by T. ``deterministic``, ``rngs`` (dropout), ``sow_weights``
    (the weights ``[..., N, T, S]`` into ``nnx.Intermediate`` as
    ``attention_weights``), ``out_sharding`` and ``qkv_sharding`` are Flax's.

    Returns:
      ``[..., T, out_features]``.

    Raises:
      ValueError: for inputs whose last axis is not ``in_features`` /
        ``in_kv_features`` or whose batch dims differ, ``inputs_v`` without
        ``inputs_k``, a mask, dropout or ``sow_weights`` the variant cannot
        honour, dropout without ``rngs``, or a decode call without a cache,
        with cross-attention inputs, lengths, ``is_causal=False`` on several
        positions, or inputs that do not match the cache. A KV cache's
        capacity is checked when the program runs: going past it raises a
        runtime error that names it.
    """
    fn = "MultiHeadAttention"
    if inputs_k is None and inputs_v is not None:
      raise ValueError(f"{fn}: inputs_v given without inputs_k; pass inputs_k (inputs_v "
                       "defaults to it).")
    self_attention = inputs_k is None
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    for name, x, size in (("inputs_q", inputs_q, self.in_features),
                          ("inputs_k", inputs_k, self.in_kv_features),
                          ("inputs_v", inputs_v, self.in_kv_features)):
      if jnp.ndim(x) < 2 or jnp.shape(x)[-1] != size:
        raise ValueError(f"{fn}: {name} must be [..., length, {size}]; got shape "
                         f"{jnp.shape(x)}.")
    batch = jnp.shape(inputs_q)[:-2]
    if jnp.shape(inputs_k)[:-2] != batch or jnp.shape(inputs_v)[:-2] != batch:
      raise ValueError(f"{fn}: inputs_q, inputs_k and inputs_v must share their batch dims; "
                       f"got {jnp.shape(inputs_q)}, {jnp.shape(inputs_k)}, {jnp.shape(inputs_v)}.")
    q = self.query(inputs_q, out_sharding=qkv_sharding)
    k = self.key(inputs_k, out_sharding=qkv_sharding)
    v = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      q, k = self.query_ln(q), self.key_ln(k)
    if self._gated is not None and self._gated[1]:  # A delta rule: unit queries and keys.
      q, k = _l2_normalize(q), _l2_normalize(k)
    gates = {name: _flat(x, batch) for name, x in self._gates(inputs_k).items()}
    decode = bool(self.decode) if decode is None else decode
    dropout_rng = self._dropout_rng(deterministic, rngs)
    if self.attention_fn is not None:
      out = self._flax_attention_fn(q, k, v, mask, is_causal, decode, dropout_rng, sow_weights,
                                    lengths=key_value_seq_lengths, batch=batch)
    elif decode:
      if not self_attention or key_value_seq_lengths is not None:
        raise ValueError(f"{fn}: decode continues one causal self-attention sequence: pass no "
                         "inputs_k/inputs_v and no key_value_seq_lengths.")
      if is_causal is False and q.shape[-3] > 1:
        raise ValueError(f"{fn}: decoding is causal; is_causal=False with {q.shape[-3]} "
                         "positions at once cannot be honoured.")
      if dropout_rng is not None or sow_weights:
        raise ValueError(f"{fn}: decoding forms no weights to drop or sow; call it with "
                         "deterministic=True and sow_weights=False.")
      out = self._decode(*(_flat(x, batch) for x in (q, k, v)), mask=_flat_mask(mask, batch),
                         gates=gates)
    else:
      out = self._attend(*(_flat(x, batch) for x in (q, k, v)), mask=_flat_mask(mask, batch),
                         is_causal=bool(is_causal), dropout_rng=dropout_rng,
                         lengths=None if key_value_seq_lengths is None else jnp.reshape(
                             jnp.asarray(key_value_seq_lengths), (-1,)),
                         sow_as=batch if sow_weights else None, gates=gates)
    if self.attention_fn is None:
      out = out.reshape(batch + out.shape[1:])
    return self.out(out, out_sharding=out_sharding)

  def _dropout_rng(self, deterministic: bool | None,
                   rngs: nnx.Rngs | nnx.RngStream | None) -> jax.Array | None:
    """A key for this call's dropout, or None when no dropout applies (Flax's rules)."""
    if self.dropout_rate == 0.0:
      return None
    deterministic = self.deterministic if deterministic is None else deterministic
    if deterministic is None:
      raise ValueError("MultiHeadAttention: dropout_rate > 0 needs `deterministic`, in the "
                       "constructor, the call or through nnx.view.")
    if deterministic:
      return None
    stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
    stream = self.rngs if stream is None else stream
    if stream is None:
      raise ValueError("MultiHeadAttention: dropout needs `rngs` in the call when the layer "
                       "keeps none (keep_rngs=False).")
    return stream()

  def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None,
              is_causal: bool, dropout_rng: jax.Array | None, lengths: jax.Array | None,
              sow_as: tuple[int, ...] | None, gates: Mapping[str, jax.Array]) -> jax.Array:
    """One call on ``[B, T, N, H]`` arrays: the variant, or the weights when needed; ``gates``
    (a gated variant's ``[B, S, K(, H)]`` inputs) go to the function by name."""
    spec, options, fn = self._spec, self._options(), "MultiHeadAttention"
    general = mask is not None or dropout_rng is not None or sow_as is not None
    if general and self.context_parallel is not None:
      raise ValueError(f"{fn}: context_parallel takes no mask, dropout or sow_weights.")
    if spec.forms_weights and general:
      return self._softmax_weights(q, k, v, mask=mask, is_causal=is_causal,
                                   dropout_rng=dropout_rng, lengths=lengths, sow_as=sow_as)
    if mask is not None:
      raise ValueError(f"{fn}: attention={self.attention!r} cannot honour a general `mask`; "
                       "pass causal and padding masks as is_causal and key_value_seq_lengths.")
    if sow_as is not None:
      if spec.weights is None:
        raise ValueError(f"{fn}: sow_weights: attention={self.attention!r} forms no "
                         "attention weights to sow.")
      implied = spec.weights(q, k, is_causal=is_causal, key_value_seq_lengths=lengths,
                             **spec.what_options(options))
      w = implied.weights / implied.normalizer[..., None]  # [B, N, T, S]
      self.sow(nnx.Intermediate, "attention_weights",
               w.astype(q.dtype).reshape(sow_as + w.shape[1:]))
    if self.context_parallel is not None:
      return self.context_parallel.attend(self.attention, q, k, v, is_causal=is_causal,
                                          key_value_seq_lengths=lengths, **options, **gates)
    return spec.function(q, k, v, is_causal=is_causal, key_value_seq_lengths=lengths,
                         **options, **gates)

  def _softmax_weights(self, q, k, v, *, mask, is_causal, dropout_rng, lengths,
                       sow_as) -> jax.Array:
    """Softmax over the variant's pattern and ``mask``; dropout and sowing on the weights."""
    spec, options = self._spec, self.attention_options
    if spec.dense_mask is None and dropout_rng is None and sow_as is None:
      return spec.function(q, k, v, mask=mask, is_causal=is_causal,
                           key_value_seq_lengths=lengths, **options)
    if spec.dense_mask is not None:
      T, S = q.shape[1], k.shape[1]
      what = accepted(spec.dense_mask, spec.what_options(options))
      pattern = jnp.asarray(spec.dense_mask(T, S, is_causal=is_causal, **what))
      pattern = pattern.reshape((1,) * (4 - pattern.ndim) + pattern.shape)  # [1, N|1, T, S]
      mask = pattern if mask is None else mask & pattern
    a = dense.prepare(q, k, v, bias=None, mask=mask, is_causal=is_causal,
                      scale=options.get("scale"), query_seq_lengths=None,
                      key_value_seq_lengths=lengths, fn="MultiHeadAttention")
    w = dense.weights(a)  # [B, N, T, S] float32
    if sow_as is not None:
      self.sow(nnx.Intermediate, "attention_weights",
               w.astype(q.dtype).reshape(sow_as + w.shape[1:]))
    if dropout_rng is not None:
      keep_prob = 1.0 - self.dropout_rate
      shape = (1, 1) + w.shape[2:] if self.broadcast_dropout else w.shape
      keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
      w = w * (keep.astype(w.dtype) / keep_prob)
    return dense.apply_weights(a, w)

  def _flax_attention_fn(self, q, k, v, mask, is_causal, decode, dropout_rng, sow_weights, *,
                         lengths, batch) -> jax.Array:
    """Flax's call of an injected ``attention_fn``, decoding through the KV cache as Flax does."""
    fn = "MultiHeadAttention"
    if lengths is not None:
      raise ValueError(f"{fn}: key_value_seq_lengths reaches registered attentions only; with "
                       "attention_fn pass a mask.")
    if decode:
      cache = self._cache_or_raise()
      B, K, C, H = cache.key.shape
      if q.shape[-3] != 1:
        raise ValueError(f"{fn}: with attention_fn, decode takes one position at a time; got "
                         f"{q.shape[-3]}.")
      _check_cache_fits(self, _flat(k, batch), KVCache)
      write = lambda c, x: lax.dynamic_update_slice_in_dim(  # noqa: E731
          c, _flat(x, batch).swapaxes(1, 2).astype(c.dtype), cache.index, axis=2)
      cache = KVCache(write(cache.key, k), write(cache.value, v), cache.index + 1)
      self.cache.set_value(cache)
      flax_layout = lambda c: c.swapaxes(1, 2).reshape(batch + (C, K, H)).astype(q.dtype)  # noqa: E731
      k, v = flax_layout(cache.key), flax_layout(cache.value)
      seen = jnp.arange(C) < cache.index
      seen = jnp.broadcast_to(seen, batch + (1, 1, C))
      mask = seen if mask is None else jnp.logical_and(mask, seen)
    return self.attention_fn(
        q, k, v, mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout, deterministic=dropout_rng is None,
        dtype=self.dtype, precision=self.precision, module=self if sow_weights else None,
        is_causal=bool(is_causal))

  # -- decoding -----------------------------------------------------------------

  def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
    """Allocates an empty decode cache for inputs of ``input_shape = (..., C, in)``.

    Any number of leading batch dims, as in Flax. A KV cache holds ``C``
    positions (its capacity) of keys and values in ``dtype`` (default
    float32, as Flax); a ring buffer holds the window; a recurrent state has
    no capacity and accumulates in float32. For softmax-type variants the
    cache reads as Flax's ``cached_key`` / ``cached_value`` ``[..., C, K, H]``
    and ``cache_index``.

    Raises:
      ValueError: for an ``input_shape`` of fewer than two dims.

    Examples:
      >>> layer = nn.MultiHeadAttention(4, 32, num_kv_heads=2, rngs=nnx.Rngs(0))  # softmax
      >>> layer.init_cache((3, 16, 32))  # (B, C, in)
      >>> layer.cached_key.shape  # Flax's layout [B, C, K, H]
      (3, 16, 2, 8)
      >>> _ = layer(jnp.ones((3, 1, 32)), decode=True)
      >>> int(layer.cache_index)
      1
    """
    if len(input_shape) < 2:
      raise ValueError(f"MultiHeadAttention.init_cache: input_shape must be (..., C, in); got "
                       f"{input_shape}.")
    batch, C = tuple(input_shape[:-2]), input_shape[-2]
    B = math.prod(batch)
    dtype = jnp.dtype(dtype)
    N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
    zero = jnp.zeros((), jnp.int32)
    if self.attention_fn is not None or self._spec.cache_kind is CacheKind.KV:
      cache = KVCache(jnp.zeros((B, K, C, H), dtype), jnp.zeros((B, K, C, H), dtype), zero)
    else:
      streaming = self._spec.streaming
      q, kv = jnp.zeros((B, 1, N, H), dtype), jnp.zeros((B, 1, K, H), dtype)
      cache = StateCache(streaming.init(q, kv, kv, **accepted(streaming.init, self._options())),
                         zero)
    self.cache = nnx.Cache(cache)
    self.cache_batch_shape = batch

  def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
               batch_size: int | Shape | None = None, max_length: int | None = None) -> None:
    """For ``nnx.view``: sets ``deterministic`` / ``decode``; with ``batch_size`` and
    ``max_length``, also allocates the cache (see :meth:`init_cache`).

    Raises:
      ValueError: for ``batch_size`` without ``max_length`` or the reverse.
    """
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      self.decode = decode
    if (batch_size is None) != (max_length is None):
      raise ValueError("MultiHeadAttention.set_view: give batch_size and max_length together.")
    if decode and batch_size is not None:
      batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
      self.init_cache(batch + (max_length, self.in_features))

  def _cache_or_raise(self) -> KVCache | StateCache:
    if self.cache is None:
      raise ValueError("MultiHeadAttention: decoding needs a cache; call init_cache(input_shape) "
                       "(or nnx.view(..., decode=True, batch_size=..., max_length=...)) first.")
    return self.cache.get_value()

  def _kv_view(self, field: str) -> jax.Array:
    cache = self._cache_or_raise()
    if not isinstance(cache, KVCache):
      raise AttributeError(f"MultiHeadAttention: attention={self.attention!r} keeps a "
                           f"{type(cache).__name__}, not keys and values; read layer.cache.")
    if field == "index":
      return cache.index
    x = getattr(cache, field)  # [B, K, C, H]
    return x.swapaxes(1, 2).reshape(self.cache_batch_shape + x.shape[2:3] + x.shape[1:2]
                                    + x.shape[3:])

  @property
  def cached_key(self) -> jax.Array:
    """The cached keys in Flax's layout ``[..., C, K, H]`` (a view of :attr:`cache`)."""
    return self._kv_view("key")

  @property
  def cached_value(self) -> jax.Array:
    """The cached values in Flax's layout ``[..., C, K, H]`` (a view of :attr:`cache`)."""
    return self._kv_view("value")

  @property
  def cache_index(self) -> jax.Array:
    """Positions decoded so far, as Flax's ``cache_index``."""
    return self._kv_view("index")

  def _decode(self, q: jax.Array, k: jax.Array, v: jax.Array, *,
              mask: jax.Array | None, gates: Mapping[str, jax.Array]) -> jax.Array:
    cache = self._cache_or_raise()
    _check_cache_fits(self, k, type(cache))
    if isinstance(cache, KVCache):
      cache, out = _kv_decode(self._spec, cache, q, k, v, self.attention_options, mask=mask)
    else:
      if mask is not None:
        raise ValueError(f"MultiHeadAttention: attention={self.attention!r} decodes from a "
                         "state and cannot honour a `mask`.")
      cache, out = _state_decode(self._spec, cache, q, k, v, self._options(), gates)
    self.cache.set_value(cache)
    return out


def _gate_projections(spec: AttentionSpec, fn: str) -> tuple[str | None, bool] | None:
  """``(decay projection or None, beta)`` for a variant with per-token inputs (None
  without): what the layer projects, from the names and shapes ``spec`` declares."""
  if not spec.extra_inputs:
    return None
  inputs = dict(spec.extra_inputs)
  if (set(inputs) - {"log_decay", "beta"} or inputs.get("beta", "[B, S, K]") != "[B, S, K]"
      or inputs.get("log_decay", "[B, S, K]") not in _DECAY_PROJECTIONS):
    given = ", ".join(f"{name} {shape}" for name, shape in spec.extra_inputs)
    raise ValueError(f"{fn}: attention={spec.name!r} needs per-token inputs ({given}) that "
                     "this layer has no projection for (it projects log_decay [B, S, K] or "
                     "[B, S, K, H] and beta [B, S, K]); call the function with them instead.")
  return _DECAY_PROJECTIONS.get(inputs.get("log_decay")), "beta" in inputs


def _l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """``x / sqrt(Σ_h x_h² + eps)`` over the last axis H, computed in float32."""
  x32 = x.astype(jnp.float32)
  return (x32 * lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _flat(x: jax.Array, batch: tuple[int, ...]) -> jax.Array:
  """``[*batch, L, heads, dim]`` -> ``[B, L, heads, dim]`` (B = 1 for no batch dims)."""
  return x.reshape((math.prod(batch),) + x.shape[len(batch):])


def _flat_mask(mask: Any, batch: tuple[int, ...]) -> jax.Array | None:
  """A mask broadcastable to ``[*batch, N, T, S]`` as ``[B|1, N|1, T|1, S|1]`` bool."""
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  mask = mask if mask.dtype == jnp.bool_ else mask != 0  # Flax's masks may be float.
  rank = len(batch) + 3
  if mask.ndim > rank:
    raise ValueError(f"MultiHeadAttention: mask of shape {mask.shape} has more dims than "
                     f"[..., N, T, S] for batch dims {batch}.")
  mask = mask.reshape((1,) * (rank - mask.ndim) + mask.shape)
  lead = mask.shape[:len(batch)]
  if all(d == 1 for d in lead):
    return mask.reshape((1,) + mask.shape[len(batch):])
  try:
    mask = jnp.broadcast_to(mask, batch + mask.shape[len(batch):])
  except ValueError:
    raise ValueError(f"MultiHeadAttention: mask of shape {mask.shape} does not broadcast to "
                     f"the batch dims {batch}.") from None
  return mask.reshape((math.prod(batch),) + mask.shape[len(batch):])


def _check_attention_options(spec: AttentionSpec, options: Mapping[str, Any]) -> dict[str, Any]:
  arrays = () if spec.params is None else spec.params.names + ("rng",)
  owned = [o for o in options if o in _LAYER_OWNED or o in arrays]
  if owned:
    raise ValueError(f"MultiHeadAttention: attention_options {sorted(owned)} are managed by the "
                     "layer (its rngs, parameters, cache and call arguments).")
  spec.build(**options)  # Unknown or missing options raise here, naming them.
  return dict(options)


def _check_cache_fits(layer: MultiHeadAttention, k: jax.Array, kind: type) -> None:
  """The cache was made for these shapes: ``[B, T, K, H]`` keys against the cache."""
  cache = layer.cache.get_value()
  leaf = cache.key if kind is KVCache else jax.tree.leaves(cache.state)[0]
  B = leaf.shape[0]
  if k.shape[0] != B:
    raise ValueError(f"MultiHeadAttention: the cache was made for batch dims "
                     f"{layer.cache_batch_shape}; got keys {k.shape} ([B, T, K, H] with the "
                     "batch dims flattened). Call init_cache for these inputs.")


def _kv_decode(spec: AttentionSpec, cache: KVCache, q, k, v, options: Mapping[str, Any], *,
               mask: jax.Array | None) -> tuple[KVCache, jax.Array]:
  """Writes T keys at ``index``; query t reads positions ``<= index + t``.

  The read takes the cached positions ``< index`` from the cache as it was
  and the T new ones from the chunk itself; the write then waits for the
  read (``_after``), so that the updated cache is only carried and XLA
  updates it in place instead of copying it every step. A sparse pattern's
  row ``i = index + t`` reads only the L keys it names (``sparse.decode_rows``),
  gathered from the cache: a step costs O(L), not O(C). ``mask``
  (``[B|1, N|1, T, C]``, over the cache's positions) narrows both.
  """
  B, K, C, H = cache.key.shape
  T = q.shape[1]
  if T > C:
    raise ValueError(f"MultiHeadAttention: {T} positions do not fit a KV cache of capacity {C}.")
  index = cache.index
  jax.debug.callback(_check_capacity, index, T, C)
  write = lambda c, x, at: lax.dynamic_update_slice_in_dim(  # noqa: E731
      c, x.swapaxes(1, 2).astype(c.dtype), at, axis=2)
  chunk_columns = lambda m: lax.dynamic_slice_in_dim(  # noqa: E731  [.., C] -> [.., T]
      jnp.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, T)]), index, T, axis=-1)
  new = jnp.tril(jnp.ones((T, T), bool))[None, None]  # [1, 1, T, T]: causal within the chunk.
  rows = None if spec.dense_mask is None else sparse.decode_rows(spec, C, q.shape[2], options)
  if rows is not None:  # Row i = index + t gathers its L keys: [1, P, T, L] (P = 1 or N).
    i = index + jnp.arange(T, dtype=index.dtype)
    at, old = gather.row_keys(rows, i)  # [P, T, L]
    old = (old & (at < index))[None]  # Cached before this chunk; the chunk's own are in `new`.
    new = new & gather.row_allows(rows, i, i)[None]
    if mask is not None:  # [B|1, N|1, T|1, C|1] at the rows' keys: [B|1, N|P, T, L].
      b, n = mask.shape[0], max(mask.shape[1], at.shape[0])
      mask = jnp.broadcast_to(mask, (b, n, T, C))
      old = old & jnp.take_along_axis(mask, jnp.broadcast_to(at, (b, n) + at.shape[1:]), axis=-1)
      new = new & chunk_columns(mask)
    cached_key, cached_value = (_gathered(c, at) for c in (cache.key, cache.value))
  else:
    old = (jnp.arange(C) < index)[None, None, None]  # [1, 1, 1, C]: cached before this chunk.
    pattern = _pattern_rows(spec, C, index, T, options)  # [1, N|1, T, C] or None
    if mask is not None:
      pattern = mask if pattern is None else pattern & mask
    if pattern is not None:  # The chunk's own columns are its columns index .. index + T - 1.
      old = old & pattern
      new = new & chunk_columns(pattern)
    cached_key, cached_value = cache.key, cache.value
  scale = checks.resolve_scale(options.get("scale"), H)
  read = lambda: _cached_read(q, (cached_key, k), (cached_value, v), (old, new), scale)  # noqa: E731
  if spec.full_softmax and T > 1 and mask is None:
    fresh = lambda: spec.function(q, k, v, is_causal=True, **options)  # noqa: E731
    out = lax.cond(index == 0, fresh, read)  # A prompt from position 0 needs no cache read.
  else:
    out = read()
  at = _after(index, out)
  return KVCache(write(cache.key, k, at), write(cache.value, v, at), index + T), out


def _gathered(cache: jax.Array, at: jax.Array) -> jax.Array:
  """The cache ``[B, K, C, H]`` at positions ``at [P, T, L]``: ``[B, K, 1|G, T, L, H]``.

  ``P = 1``: every query head reads the same positions of its key/value head;
  ``P = N``: query head n reads its own, from key/value head ``n // G``.
  """
  B, K, C, H = cache.shape
  P, T, L = at.shape
  if P == 1:
    return jnp.take(cache, at[0], axis=2, mode="clip")[:, :, None]
  at = at.reshape(K, P // K, T, L) + (jnp.arange(K, dtype=at.dtype) * C)[:, None, None, None]
  return jnp.take(cache.reshape(B, K * C, H), at, axis=1, mode="clip")


def _after(index: jax.Array, out: jax.Array) -> jax.Array:
  """``index`` (``[]`` int32), computed after ``out``: a cache write at it waits for the reads.

  ``index + min(any(isnan(out)), 0)`` is ``index``, but XLA cannot fold the
  term away, so the write into the cache ``[B, K, C, H]`` depends on the
  read that made ``out``. Without that order XLA:CPU's copy insertion cannot
  prove the read of the old cache ends before the in-place update, and
  copies the whole cache twice per step inside a decode loop (a
  ``lax.optimization_barrier`` is expanded away before that pass on CPU).
  """
  return index + jnp.minimum(jnp.isnan(out).any().astype(index.dtype), 0)


def _cached_read(q: jax.Array, keys: tuple[jax.Array, jax.Array],
                 values: tuple[jax.Array, jax.Array], masks: tuple[jax.Array, jax.Array],
                 scale: float) -> jax.Array:
  """``softmax(q kᵀ·scale, mask) v`` over the cache and the new chunk, in float32.

  ``q [B, T, N, H]``; ``keys``/``values``: the head-major cache ``[B, K, C, H]``
  (or the L keys gathered for each row, ``[B, K, 1|G, T, L, H]``) and the
  chunk's own ``[B, T, K, H]``; ``masks``: ``[B|1, N|1, T, C|L]`` and
  ``[B|1, N|1, T, T]``. The cache is read where it lies (a transposed copy
  would dominate a decode step); a row that sees no key gives zeros.
  """
  B, T, N, H = q.shape
  K = keys[0].shape[1]
  G = N // K
  f32 = jnp.float32

  def grouped(mask):  # [B|1, N|1, T, X] -> [B|1, K|1, G|1, T, X]
    b, n = mask.shape[:2]
    return mask.reshape((b, K, G) + mask.shape[2:] if n > 1 else (b, 1, 1) + mask.shape[2:])

  qg = q.reshape(B, T, K, G, H)
  cached_key, cached_value = keys[0], values[0]
  if cached_key.ndim == 4:  # The whole cache [B, K, C, H], shared by the rows.
    cached_scores = jnp.einsum("btkgh,bkch->bkgtc", qg.astype(cached_key.dtype), cached_key,
                               preferred_element_type=f32)

    def cached_sum(p):  # [B, K, G, T, C] -> [B, K, G, T, H]
      # One row (G·T = 1: a single token, no GQA) makes this a vector-matrix product,
      # which XLA:CPU's own dot code runs at a fraction of memory speed (its library,
      # YNNPACK, takes no vectors); a zero second row makes it a matrix product that
      # reads the cache at memory speed (3x faster at C = 65536). The row is dropped.
      pad = [(0, 0)] * 3 + [(0, int(G * T == 1)), (0, 0)]
      out = jnp.einsum("bkgtc,bkch->bkgth", jnp.pad(p.astype(cached_value.dtype), pad),
                       cached_value, preferred_element_type=f32)
      return out[:, :, :, :T]
  else:  # Each row's L gathered keys [B, K, 1|G, T, L, H].
    per_head = cached_key.shape[2] > 1
    kv = "bkgtlh" if per_head else "bktlh"
    cached_key, cached_value = (x if per_head else x[:, :, 0] for x in (cached_key, cached_value))
    cached_scores = jnp.einsum(f"btkgh,{kv}->bkgtl", qg.astype(cached_key.dtype), cached_key,
                               preferred_element_type=f32)
    cached_sum = lambda p: jnp.einsum(  # noqa: E731
        f"bkgtl,{kv}->bkgth", p.astype(cached_value.dtype), cached_value,
        preferred_element_type=f32)
  scores = (
      cached_scores,
      jnp.einsum("btkgh,bskh->bkgts", qg, keys[1].astype(q.dtype), preferred_element_type=f32),
  )
  # Batch dims first in the output: XLA:CPU then multiplies in place (3x faster here).
  weighted_sums = (
      cached_sum,
      lambda p: jnp.einsum("bkgts,bskh->bkgth", p, values[1].astype(f32),
                           preferred_element_type=f32))
  cached, fresh = (softmax_block(jnp.where(grouped(m), x * scale, -jnp.inf), weighted_sum)
                   for x, m, weighted_sum in zip(scores, masks, weighted_sums, strict=True))
  out, _ = online_softmax_finish(merge(cached, fresh))  # [B, K, G, T, H]
  return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)


def _check_capacity(index: Any, T: int, C: int) -> None:
  if int(index) + T > C:
    raise ValueError(f"MultiHeadAttention: decoding positions {int(index)}..{int(index) + T - 1} "
                     f"is past the KV cache's capacity {C}; init_cache with a longer input_shape.")


def _pattern_rows(spec: AttentionSpec, C: int, index: jax.Array, T: int,
                  options: Mapping[str, Any]) -> jax.Array | None:
  """Rows ``index .. index + T - 1`` of a sparse pattern on a sequence of the capacity C:
  ``[1, N|1, T, C]``, or None for a variant without a pattern."""
  if spec.dense_mask is None:
    return None
  if C > MAX_PATTERN_CAPACITY:
    raise ValueError(f"MultiHeadAttention: decoding attention={spec.name!r} builds its [C, C] "
                     f"pattern; C={C} is above MAX_PATTERN_CAPACITY={MAX_PATTERN_CAPACITY}. Use a "
                     "smaller cache, or 'local' (a ring buffer) for long sequences.")
  what = accepted(spec.dense_mask, spec.what_options(options))
  with jax.ensure_compile_time_eval():  # A static pattern, also inside a trace.
    dense_ = jnp.asarray(spec.dense_mask(C, C, is_causal=True, **what))
  dense_ = dense_.reshape((1,) * (4 - dense_.ndim) + dense_.shape)
  return lax.dynamic_slice_in_dim(dense_, index, T, axis=-2)


def _state_decode(spec: AttentionSpec, cache: StateCache, q, k, v, options: Mapping[str, Any],
                  gates: Mapping[str, jax.Array]) -> tuple[StateCache, jax.Array]:
  """Advances a streaming state by T positions: one step, a stateful pass, or a scan.

  ``gates``: a gated variant's per-token inputs ``[B, T, K(, H)]``; a step takes
  each token's ``[B, K(, H)]``.

  A ring buffer holds keys and values in the cache's dtype: the chunk is
  attended in that dtype and the output cast back to the inputs'.
  """
  streaming = spec.streaming
  step_options = accepted(streaming.step, options)
  T = q.shape[1]
  dtype = q.dtype
  if spec.cache_kind is CacheKind.WINDOW:
    q, k, v = (x.astype(jax.tree.leaves(cache.state)[0].dtype) for x in (q, k, v))

  def steps(state):
    def body(state, xs):
      qkv, token_gates = xs
      return streaming.step(state, *qkv, **step_options, **token_gates)

    xs = (tuple(x.swapaxes(0, 1) for x in (q, k, v)),
          {name: x.swapaxes(0, 1) for name, x in gates.items()})
    state, out = lax.scan(body, state, xs)
    return state, out.swapaxes(0, 1)

  def cast_like(state, like):
    return jax.tree.map(lambda x, y: x.astype(y.dtype), state, like)

  if T == 1:
    state, out = steps(cache.state)
  elif spec.cache_kind is CacheKind.RECURRENT:
    out, state = spec.function(q, k, v, is_causal=True, initial_state=cache.state,
                               return_state=True, **options, **gates)
  else:  # A ring buffer: a prompt from position 0 is one blocked pass, later chunks scan.
    def fresh(state):
      out, new = spec.function(q, k, v, is_causal=True, return_state=True, **options)
      return cast_like(new, state), out.astype(q.dtype)

    state, out = lax.cond(cache.index == 0, fresh, steps, cache.state)
  state = cast_like(state, cache.state)
  return StateCache(state, cache.index + T), out.astype(dtype)


def as_flax_attention_fn(fn: Callable[..., Any]) -> Callable[..., jax.Array]:
  """Adapts a linattn_jax function to ``flax.nnx.MultiHeadAttention(attention_fn=...)``.

  Flax calls ``attention_fn(query, key, value, mask=..., dropout_rng=...,
  dropout_rate=..., broadcast_dropout=..., deterministic=..., dtype=...,
  precision=..., module=..., is_causal=...)``. ``mask`` (and ``bias``) reach
  ``fn`` if it takes them; ``dtype`` casts the inputs. What ``fn`` cannot
  honour raises: a mask or bias for a function without one, dropout on
  weights it never forms, a ``precision``, or ``sow_weights`` (``module``).

  Flax passes query ``[B, T, N, H]``, key ``[B, S, N, H]`` and value
  ``[B, S, N, H]`` and expects ``[B, T, N, H]`` back, the layout of every
  linattn_jax function.

  Args:
    fn: e.g. ``linear_attention``, or ``get_attention("local", window_size=64)``.

  Returns:
    A function with Flax's ``attention_fn`` signature.

  Raises:
    ValueError: when the returned function is called with what ``fn`` cannot
      honour (listed above), naming each.

  Examples:
    >>> attention_fn = nn.as_flax_attention_fn(la.linear_attention)
    >>> flax_layer = nnx.MultiHeadAttention(2, 16, attention_fn=attention_fn, decode=False,
    ...                                     rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 16))
    >>> flax_layer(x).shape
    (1, 8, 16)

    Same parameter names and shapes as this package's layer, so with the same
    seed the two agree:

    >>> ours = nn.MultiHeadAttention(2, 16, attention="linear_elu", rngs=nnx.Rngs(0))
    >>> bool(jnp.allclose(ours(x), flax_layer(x), atol=1e-5))
    True
  """
  takes = inspect.signature(fn).parameters

  def attention_fn(query, key, value, bias=None, mask=None, *, dropout_rng=None,
                   dropout_rate=0.0, broadcast_dropout=True, deterministic=True, dtype=None,
                   precision=None, module=None, is_causal=False, **others):
    del dropout_rng, broadcast_dropout  # Only meaningful with dropout, refused below.
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "fn")
    problems = [f"`{k}`" for k in others]
    if dropout_rate and not deterministic:
      problems.append("dropout on attention weights (they are never formed)")
    if precision is not None:
      problems.append("`precision`")
    if module is not None:
      problems.append("sow_weights (attention weights are never formed)")
    for option, value_ in (("mask", mask), ("bias", bias)):
      if value_ is not None and option not in takes:
        problems.append(f"`{option}`")
    if problems:
      raise ValueError(f"as_flax_attention_fn({name}): cannot honour {', '.join(problems)}.")
    if dtype is not None:
      query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    extra = {k: x for k, x in (("mask", mask), ("bias", bias)) if x is not None}
    return fn(query, key, value, is_causal=is_causal, **extra)

  return attention_fn
