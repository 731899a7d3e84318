"""Flax NNX attention layer over the registry: ``MultiHeadAttention``.

``MultiHeadAttention`` follows ``flax.nnx.MultiHeadAttention``: the same
``query``/``key``/``value`` projections ``[in, N|K, H]`` and output projection
``[N, H, out]``, GQA through ``num_kv_heads``, and any registered variant
(``attention=`` a name from ``available_attentions()``) in place of the dense
softmax. The layer's parts live beside it: decode caches and their kernels in
``cache``, gate projections in ``gates``, the weights path (mask, dropout,
sowing) in ``weights``, Flax's calling conventions and ``attention_fn`` in
``flax_compat``.

Letters: B batch, T query length, S key length, N query heads, K key/value
heads, H head dim (keys and values), C a KV cache's capacity.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as flax_dtypes
from flax.nnx.nn import initializers
from flax.typing import DotGeneralT, Dtype, Initializer, PrecisionLike, PromoteDtypeFn, Shape

from linattn_jax._src import checks
from linattn_jax._src.nn import cache as cache_lib
from linattn_jax._src.nn import packing, weights
from linattn_jax._src.nn.cache import KVCache
from linattn_jax._src.nn.compiled import compiled_call
from linattn_jax._src.nn.flax_compat import call_attention_fn, flat, flat_mask, flax_cache_view
from linattn_jax._src.nn.gates import GateProjections, l2_normalize
from linattn_jax._src.parallel import ContextParallel
from linattn_jax._src.registry import AttentionSpec, CacheKind, accepted, get_spec

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()

# Options the layer owns: it passes them itself (state, call arguments); so too a
# variant's own arrays and the seed `rng` they would otherwise be drawn from.
_LAYER_OWNED = ("initial_state", "return_state", "is_causal", "key_value_seq_lengths")


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
      variant with per-token inputs (``AttentionSpec.token_inputs``) the
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

    Packed rows: documents laid end to end, told apart by ``segment_ids``; the
    second document of row 0 equals it run alone:

    >>> exact = nn.MultiHeadAttention(4, 32, rngs=nnx.Rngs(0))  # softmax
    >>> ids = jnp.array([[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1]])  # [B, T]
    >>> packed = exact(x, is_causal=True, segment_ids=ids)
    >>> bool(jnp.allclose(packed[:1, 4:], exact(x[:1, 4:], is_causal=True), atol=1e-5))
    True

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
    features = in_features if qkv_features is None else qkv_features
    N, K = _check_sizes(num_heads, num_kv_heads, features=features, dropout_rate=dropout_rate)
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
    self._gates = GateProjections.for_spec(spec, fn)
    self.attention_options = _check_attention_options(spec, attention_options or {})
    _check_alternatives(spec, self.attention_options, attention=attention,
                        attention_fn=attention_fn, dropout_rate=dropout_rate,
                        context_parallel=context_parallel)
    self.attention_fn, self.context_parallel = attention_fn, context_parallel

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
    if self._gates is not None:
      drawn = self._gates.init(rngs, kernel_init, bias_init, in_features=self.in_kv_features,
                               num_kv_heads=K, head_dim=H, dtype=param_dtype)
      for name, array in drawn.items():
        setattr(self, name, nnx.Param(array))
    self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None
    self.cache = nnx.data(None)
    self.cache_batch_shape: tuple[int, ...] = ()

  # -- variant-owned arrays ---------------------------------------------------

  def _draw(self, rng: jax.Array) -> dict[str, jax.Array]:
    spec = self._spec
    return dict(spec.params.init(rng, self.head_dim,
                                 **accepted(spec.params.init, self.attention_options)))

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

  def _arrays(self, names: tuple[str, ...]) -> dict[str, jax.Array]:
    return {name: getattr(self, name).get_value() for name in names}

  def _options(self) -> dict[str, Any]:
    """The variant's options plus its arrays (as data)."""
    params = self._spec.params
    return {**self.attention_options, **self._arrays(() if params is None else params.names)}

  # -- calls ------------------------------------------------------------------

  @compiled_call
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
      segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
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

    ``segment_ids`` (packed sequences, not in Flax): int ids ``[..., T]``,
    non-decreasing along the sequence, one per document laid end to end in a
    row; query t sees key j only where their ids are equal, together with
    ``is_causal``, the lengths, ``mask`` and a sparse pattern (which keeps the
    row's positions), so one call equals each document run alone (for a
    pattern: the row's pattern cut to each document). Cross-attention with ids
    on both sides takes the pair ``(query_segment_ids [..., T], kv_segment_ids
    [..., S])``. A gated variant's gates reset at each boundary inside its
    function. The variant's function must take ``segment_ids``. Decoding takes
    the ids of the call's positions, ``[..., T]`` for a prompt and ``[..., 1]``
    for a step (omitted: they continue the last decoded position's document). A
    position whose id differs from the one before it starts a new document: the
    KV cache masks the keys of other ids and a recurrent state restarts from the
    empty state, so decoding equals the packed call (and a document decodes as
    from a fresh cache, but for a pattern's positions); ``local``'s ring buffer
    holds no ids and refuses them.

    Returns:
      ``[..., T, out_features]``.

    Raises:
      ValueError: for inputs whose last axis is not ``in_features`` /
        ``in_kv_features`` or whose batch dims differ, ``inputs_v`` without
        ``inputs_k``, a mask, dropout or ``sow_weights`` the variant cannot
        honour, dropout without ``rngs``, or a decode call without a cache,
        with cross-attention inputs, lengths, ``is_causal=False`` on several
        positions, or inputs that do not match the cache; for ``segment_ids`` that
        are not integers or not ``[..., T]`` (the pair ``[..., T]``, ``[..., S]``
        for cross-attention), or that the variant cannot honour: a function without
        ``segment_ids``, ``attention_fn``, a ``context_parallel`` without them,
        decoding ``local``'s ring buffer, a kernel variant's sown weights. A KV
        cache's capacity is checked when the program runs: going past it raises
        a runtime error that names it.
    """
    self_attention = inputs_k is None
    inputs_k, inputs_v, batch = _inputs(inputs_q, inputs_k, inputs_v, in_q=self.in_features,
                                        in_kv=self.in_kv_features)
    q = self.query(inputs_q, out_sharding=qkv_sharding)
    k = self.key(inputs_k, out_sharding=qkv_sharding)
    v = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      q, k = self.query_ln(q), self.key_ln(k)
    q, k, gates = _gated(self, q, k, inputs_k, batch)
    decode = bool(self.decode) if decode is None else decode
    dropout_rng = _dropout_rng(self, deterministic, rngs)
    segments = packing.flatten(segment_ids, batch=batch, q_len=q.shape[-3], kv_len=k.shape[-3],
                               decode=decode)
    if self.attention_fn is not None:
      if segments is not None:
        raise ValueError("MultiHeadAttention: segment_ids reach registered attentions only; "
                         "with attention_fn pass a mask.")
      out = call_attention_fn(self, q, k, v, mask=mask, is_causal=is_causal, decode=decode,
                              dropout_rng=dropout_rng, sow_weights=sow_weights,
                              lengths=key_value_seq_lengths, batch=batch)
      return self.out(out, out_sharding=out_sharding)
    if decode:
      _check_decode_call(q, self_attention=self_attention, lengths=key_value_seq_lengths,
                         is_causal=is_causal, forms_weights=dropout_rng is not None or sow_weights)
      out = _decode(self, *(flat(x, batch) for x in (q, k, v)), mask=flat_mask(mask, batch),
                    gates=gates, segment_ids=segments)
    else:
      lengths = key_value_seq_lengths
      out = _attend(self, *(flat(x, batch) for x in (q, k, v)), mask=flat_mask(mask, batch),
                    is_causal=bool(is_causal), dropout_rng=dropout_rng,
                    lengths=None if lengths is None else jnp.reshape(jnp.asarray(lengths), (-1,)),
                    sow_as=batch if sow_weights else None, gates=gates, segment_ids=segments)
    return self.out(out.reshape(batch + out.shape[1:]), out_sharding=out_sharding)

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
      ValueError: for an ``input_shape`` of fewer than two dims, or a variant that is
        non-causal only (it cannot decode).

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
    if self.attention_fn is None and not self._spec.supports_causal:
      raise ValueError(f"MultiHeadAttention.init_cache: attention={self.attention!r} is "
                       "non-causal only, so it cannot decode one token after another.")
    batch = tuple(input_shape[:-2])
    self.cache = nnx.Cache(cache_lib.empty(
        None if self.attention_fn is not None else self._spec, batch=math.prod(batch),
        capacity=input_shape[-2], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, dtype=jnp.dtype(dtype), options=self._options()))
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

  cached_key = flax_cache_view(
      "key", "The cached keys in Flax's layout ``[..., C, K, H]`` (a view of :attr:`cache`).")
  cached_value = flax_cache_view(
      "value", "The cached values in Flax's layout ``[..., C, K, H]`` (a view of :attr:`cache`).")
  cache_index = flax_cache_view("index", "Positions decoded so far, as Flax's ``cache_index``.")


def _check_sizes(num_heads: int, num_kv_heads: int | None, *, features: int,
                 dropout_rate: float) -> tuple[int, int]:
  """``(N, K)``, checked with the projections' size N·H and the dropout rate."""
  fn = "MultiHeadAttention"
  N = checks.check_positive_int(num_heads, name="num_heads", fn=fn)
  K = N if num_kv_heads is None else checks.check_positive_int(
      num_kv_heads, name="num_kv_heads", fn=fn)
  if N % K:
    raise ValueError(f"{fn}: num_heads={N} must be divisible by num_kv_heads={K}.")
  if features % N:
    raise ValueError(f"{fn}: qkv_features={features} must be divisible by num_heads={N}.")
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"{fn}: dropout_rate must be in [0, 1); got {dropout_rate}.")
  return N, K


def _dropout_rng(layer: MultiHeadAttention, deterministic: bool | None,
                 rngs: nnx.Rngs | nnx.RngStream | None) -> jax.Array | None:
  """A key for this call's dropout, or None when no dropout applies (Flax's rules)."""
  if layer.dropout_rate == 0.0:
    return None
  deterministic = layer.deterministic if deterministic is None else deterministic
  if deterministic is None:
    raise ValueError("MultiHeadAttention: dropout_rate > 0 needs `deterministic`, in the "
                     "constructor, the call or through nnx.view.")
  if deterministic:
    return None
  stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
  stream = layer.rngs if stream is None else stream
  if stream is None:
    raise ValueError("MultiHeadAttention: dropout needs `rngs` in the call when the layer "
                     "keeps none (keep_rngs=False).")
  return stream()


def _attend(layer: MultiHeadAttention, q: jax.Array, k: jax.Array, v: jax.Array, *,
            mask: jax.Array | None, is_causal: bool, dropout_rng: jax.Array | None,
            lengths: jax.Array | None, sow_as: tuple[int, ...] | None,
            gates: Mapping[str, jax.Array], segment_ids: Any = None) -> jax.Array:
  """One call on ``[B, T, N, H]`` arrays: the variant, or the weights when needed; ``gates``
  (a gated variant's ``[B, S, K(, H)]`` inputs) go to the function by name, and so do
  ``segment_ids`` (``[B, T]`` or the pair ``([B, T], [B, S])``) when given."""
  spec, options, fn = layer._spec, layer._options(), "MultiHeadAttention"
  general = mask is not None or dropout_rng is not None or sow_as is not None
  packed = {} if segment_ids is None else {"segment_ids": segment_ids}
  if packed:
    packing.require(spec)
    if layer.context_parallel is not None and not packing.takes_segment_ids(
        layer.context_parallel.attend):
      raise ValueError(f"{fn}: context_parallel takes no segment_ids here (its "
                       "ContextParallel.attend has no packed-sequence support).")
  if general and layer.context_parallel is not None:
    raise ValueError(f"{fn}: context_parallel takes no mask, dropout or sow_weights.")
  sow = None if sow_as is None else lambda w: layer.sow(  # [B, N, T, S] -> [*batch, N, T, S]
      nnx.Intermediate, "attention_weights", w.astype(q.dtype).reshape(sow_as + w.shape[1:]))
  if spec.forms_weights and general:
    dropout = None if dropout_rng is None else weights.Dropout(
        dropout_rng, layer.dropout_rate, layer.broadcast_dropout)
    return weights.softmax(spec, q, k, v, options=layer.attention_options, mask=mask,
                           is_causal=is_causal, lengths=lengths, dropout=dropout, sow=sow,
                           segment_ids=segment_ids)
  if mask is not None:
    raise ValueError(f"{fn}: attention={layer.attention!r} cannot honour a general `mask`; "
                     "pass causal and padding masks as is_causal and key_value_seq_lengths.")
  if sow is not None:
    if spec.weights is None:
      raise ValueError(f"{fn}: sow_weights: attention={layer.attention!r} forms no "
                       "attention weights to sow.")
    if packed and not packing.takes_segment_ids(spec.weights):
      raise ValueError(f"{fn}: sow_weights: the weights attention={layer.attention!r} "
                       "implies take no segment_ids.")
    sow(weights.implied(spec, q, k, options=options, is_causal=is_causal, lengths=lengths,
                        **packed))
  if layer.context_parallel is not None:
    return layer.context_parallel.attend(layer.attention, q, k, v, is_causal=is_causal,
                                         key_value_seq_lengths=lengths, **packed, **options,
                                         **gates)
  return spec.function(q, k, v, is_causal=is_causal, key_value_seq_lengths=lengths,
                       **packed, **options, **gates)


def _gated(layer: MultiHeadAttention, q: jax.Array, k: jax.Array, inputs_k: jax.Array,
           batch: tuple[int, ...]) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """``(q, k, gates)``: a gated variant's per-token inputs ``[B, S, K(, H)]`` projected from
  ``inputs_k``, with a delta rule's queries and keys ``[*batch, L, N|K, H]`` made unit."""
  projections = layer._gates
  if projections is None:
    return q, k, {}
  if layer._spec.unit_keys:  # A delta rule's write strength wants unit queries and keys.
    q, k = l2_normalize(q), l2_normalize(k)
  gates = projections(layer._arrays(projections.names), inputs_k,
                      num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
                      precision=layer.precision)
  return q, k, {name: flat(x, batch) for name, x in gates.items()}


def _check_decode_call(q: jax.Array, *, self_attention: bool, lengths: Any,
                       is_causal: bool | None, forms_weights: bool) -> None:
  """A decode call continues one causal self-attention sequence and forms no weights."""
  fn = "MultiHeadAttention"
  if not self_attention or lengths is not None:
    raise ValueError(f"{fn}: decode continues one causal self-attention sequence: pass no "
                     "inputs_k/inputs_v and no key_value_seq_lengths.")
  if is_causal is False and q.shape[-3] > 1:
    raise ValueError(f"{fn}: decoding is causal; is_causal=False with {q.shape[-3]} "
                     "positions at once cannot be honoured.")
  if forms_weights:
    raise ValueError(f"{fn}: decoding forms no weights to drop or sow; call it with "
                     "deterministic=True and sow_weights=False.")


def _decode(layer: MultiHeadAttention, q: jax.Array, k: jax.Array, v: jax.Array, *,
            mask: jax.Array | None, gates: Mapping[str, jax.Array],
            segment_ids: jax.Array | None = None) -> jax.Array:
  """The next T positions ``[B, T, N|K, H]`` through the layer's cache, which advances;
  ``segment_ids [B, T]``: their documents (None: the last decoded position's)."""
  spec = layer._spec
  cache = cache_lib.current(layer.cache)
  cache_lib.check_fits(cache, k, layer.cache_batch_shape)
  if segment_ids is not None:
    packing.require(spec, " while decoding")
    if spec.cache_kind is CacheKind.WINDOW:
      raise ValueError(f"MultiHeadAttention: decoding attention={layer.attention!r} cannot "
                       "honour segment_ids: its ring buffer holds no ids; decode each "
                       "document from a fresh cache (init_cache).")
  if isinstance(cache, KVCache):
    cache, out = cache_lib.kv_decode(spec, cache, q, k, v, options=layer.attention_options,
                                     mask=mask, segment_ids=segment_ids)
  else:
    if mask is not None:
      raise ValueError(f"MultiHeadAttention: attention={layer.attention!r} decodes from a "
                       "state and cannot honour a `mask`.")
    cache, out = cache_lib.state_decode(spec, cache, q, k, v, options=layer._options(),
                                        gates=gates, segment_ids=segment_ids)
  layer.cache.set_value(cache)
  return out


def _inputs(inputs_q: jax.Array, inputs_k: jax.Array | None, inputs_v: jax.Array | None, *,
            in_q: int, in_kv: int) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
  """``(inputs_k, inputs_v, batch dims)`` with Flax's defaults (self-attention; ``inputs_v``
  is ``inputs_k``), after checking the feature sizes and the shared batch dims."""
  fn = "MultiHeadAttention"
  if inputs_k is None and inputs_v is not None:
    raise ValueError(f"{fn}: inputs_v given without inputs_k; pass inputs_k (inputs_v "
                     "defaults to it).")
  inputs_k = inputs_q if inputs_k is None else inputs_k
  inputs_v = inputs_k if inputs_v is None else inputs_v
  for name, x, size in (("inputs_q", inputs_q, in_q), ("inputs_k", inputs_k, in_kv),
                        ("inputs_v", inputs_v, in_kv)):
    if jnp.ndim(x) < 2 or jnp.shape(x)[-1] != size:
      raise ValueError(f"{fn}: {name} must be [..., length, {size}]; got shape "
                       f"{jnp.shape(x)}.")
  batch = jnp.shape(inputs_q)[:-2]
  if jnp.shape(inputs_k)[:-2] != batch or jnp.shape(inputs_v)[:-2] != batch:
    raise ValueError(f"{fn}: inputs_q, inputs_k and inputs_v must share their batch dims; "
                     f"got {jnp.shape(inputs_q)}, {jnp.shape(inputs_k)}, {jnp.shape(inputs_v)}.")
  return inputs_k, inputs_v, batch


def _check_attention_options(spec: AttentionSpec, options: Mapping[str, Any]) -> dict[str, Any]:
  arrays = () if spec.params is None else spec.params.names + ("rng",)
  owned = [o for o in options if o in _LAYER_OWNED or o in arrays]
  if owned:
    raise ValueError(f"MultiHeadAttention: attention_options {sorted(owned)} are managed by the "
                     "layer (its rngs, parameters, cache and call arguments).")
  spec.build(**options)  # Unknown or missing options raise here, naming them.
  return dict(options)


def _check_alternatives(spec: AttentionSpec, options: Mapping[str, Any], *, attention: str,
                        attention_fn: Callable[..., jax.Array] | None, dropout_rate: float,
                        context_parallel: ContextParallel | None) -> None:
  """The variant against what would replace or wrap it: an ``attention_fn``, dropout on its
  weights, context parallelism."""
  fn = "MultiHeadAttention"
  if attention_fn is not None and (attention != "softmax" or options):
    raise ValueError(f"{fn}: attention_fn replaces the registered attention; it cannot be "
                     f"combined with attention={attention!r} or attention_options.")
  if dropout_rate > 0 and attention_fn is None and not spec.forms_weights:
    raise ValueError(f"{fn}: dropout_rate={dropout_rate} drops attention weights, which "
                     f"attention={attention!r} never forms; use 0.0 (or dropout elsewhere).")
  if context_parallel is not None:
    if not isinstance(context_parallel, ContextParallel):
      raise ValueError(f"{fn}: context_parallel must be a linattn_jax.parallel."
                       f"ContextParallel; got {type(context_parallel).__name__}.")
    if attention_fn is not None:
      raise ValueError(f"{fn}: context_parallel runs a registered attention, not attention_fn.")
    context_parallel.check(attention, options)
