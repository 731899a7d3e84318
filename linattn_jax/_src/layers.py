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
  efficient, heinsen): the variant's fixed-size state (``[B, K, M, D]`` and
  its normaliser), whatever the position.

A decode call takes a chunk of any length (a prompt) or one token; a prefill
followed by single steps equals one causal call on the whole sequence.
Letters: B batch, T query length, S key length, N query heads, K key/value
heads, H head dim (keys and values), C a KV cache's capacity.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from jax import lax

from linattn_jax._src import checks
from linattn_jax._src.online_softmax import safe_divide
from linattn_jax._src.parallel import ContextParallel
from linattn_jax._src.registry import AttentionSpec, accepted, get_spec

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()

# Options the layer owns: it passes them itself (state, call arguments); so too a
# variant's own arrays and the seed `rng` they would otherwise be drawn from.
_LAYER_OWNED = ("initial_state", "return_state", "is_causal", "key_value_seq_lengths")
_POSITION_INVARIANT = ("softmax", "flash")  # A prefill from position 0 is the plain causal call.
# Sparse patterns decode through their dense [C, C] pattern on a sequence of the
# cache's capacity C (a compile-time constant of C² bytes): capped here.
MAX_PATTERN_CAPACITY = 8192


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


def cache_kind(attention: str) -> str:
  """``"recurrent"``, ``"window"`` or ``"kv"``: what ``attention``'s decode cache holds.

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
    >>> [nn.cache_kind(name) for name in ("softmax", "local", "linear_elu")]
    ['kv', 'window', 'recurrent']
  """
  streaming = get_spec(attention).streaming
  if streaming is None:
    return "kv"
  return "recurrent" if streaming.state_passing else "window"


class MultiHeadAttention(nnx.Module):
  """Multi-head attention with any registered variant and a decode cache.

  ``out = W_o · attention(x_q W_q, x_k W_k, x_v W_v)`` with ``W_q [in, N, H]``,
  ``W_k``, ``W_v [in, K, H]`` and ``W_o [N, H, out]``, as in
  ``flax.nnx.MultiHeadAttention`` (same parameter names and shapes, so
  weights move between the two). ``attention`` names a registered variant;
  its options go in ``attention_options``. Arrays a variant owns live in the
  layer: a random projection (performer, random_fourier) as a
  :class:`FeatureProjection` drawn from ``rngs`` (see :meth:`redraw`), a
  learnable feature map (linear_learned) as ``nnx.Param``; both reach the
  attention function as data, so new values never recompile.

  Args:
    num_heads: N.
    in_features: size of the inputs' last axis.
    qkv_features: N·H (default ``in_features``); must divide by N.
    out_features: output size (default ``in_features``).
    num_kv_heads: K (default N); must divide N (GQA; 1 is MQA).
    attention: a name from ``available_attentions()``.
    attention_options: that variant's options, e.g. ``{"window_size": (64, 0)}``
      or ``{"num_features": 128}``; not ``rng``, ``initial_state`` or the
      variant's arrays, which the layer owns.
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as in
      ``flax.nnx.MultiHeadAttention`` (``dtype`` is the computation dtype).
    context_parallel: a ``linattn_jax.parallel.ContextParallel`` (a mesh and
      the axis that splits the sequence): self-attention calls then run
      with context parallelism, ring attention for softmax and flash, the
      state-passing form for recurrent variants. Decoding is unaffected.
    rngs: ``nnx.Rngs``; ``rngs.params()`` draws the weights and projections.

  Raises:
    ValueError: for an unknown variant or option, an option the layer owns,
      a required option left out, ``num_heads`` or ``num_kv_heads`` that is
      not a positive int, ``qkv_features`` not divisible by N, N not
      divisible by K, a ``context_parallel`` that is not a
      ``ContextParallel``, or a variant ``context_parallel`` cannot run.

  Examples:
    >>> layer = nn.MultiHeadAttention(4, 32, attention="linear_elu", rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 10, 32)), is_causal=True).shape
    (2, 10, 32)

    Decoding a prompt and then single tokens equals one causal call:

    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 32))  # [B, T, in]
    >>> full = layer(x, is_causal=True)
    >>> layer.init_cache(x.shape)
    >>> prompt = layer(x[:, :4], is_causal=True, decode=True)
    >>> steps = [layer(x[:, t:t + 1], is_causal=True, decode=True) for t in (4, 5)]
    >>> bool(jnp.allclose(jnp.concatenate([prompt, *steps], axis=1), full, atol=1e-5))
    True

  References:
    Vaswani et al., "Attention Is All You Need", 2017. Ainslie et al., "GQA:
    Training Generalized Multi-Query Transformer Models from Multi-Head
    Checkpoints", 2023.
  """

  def __init__(self, num_heads: int, in_features: int, *, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               attention: str = "softmax", attention_options: Mapping[str, Any] | None = None,
               use_bias: bool = True, dtype: Any = None, param_dtype: Any = jnp.float32,
               precision: Any = None, kernel_init: Any = default_kernel_init,
               bias_init: Any = default_bias_init, context_parallel: Any = None,
               rngs: nnx.Rngs):
    fn = "MultiHeadAttention"
    N = checks.check_positive_int(num_heads, name="num_heads", fn=fn)
    K = N if num_kv_heads is None else checks.check_positive_int(
        num_kv_heads, name="num_kv_heads", fn=fn)
    features = in_features if qkv_features is None else qkv_features
    if N % K:
      raise ValueError(f"{fn}: num_heads={N} must be divisible by num_kv_heads={K}.")
    if features % N:
      raise ValueError(f"{fn}: qkv_features={features} must be divisible by num_heads={N}.")
    self.num_heads, self.num_kv_heads, self.head_dim = N, K, features // N
    self.in_features = in_features
    self.out_features = in_features if out_features is None else out_features
    self.dtype, self.param_dtype = dtype, param_dtype
    self.attention = attention
    self.attention_options = _check_attention_options(attention, attention_options or {})
    self.cache_kind = cache_kind(attention)
    if context_parallel is not None:
      if not isinstance(context_parallel, ContextParallel):
        raise ValueError(f"{fn}: context_parallel must be a linattn_jax.parallel."
                         f"ContextParallel; got {type(context_parallel).__name__}.")
      context_parallel.check(attention, self.attention_options)
    self.context_parallel = context_parallel

    def proj(heads: int) -> nnx.LinearGeneral:
      return nnx.LinearGeneral(in_features, (heads, self.head_dim), use_bias=use_bias,
                               dtype=dtype, param_dtype=param_dtype, precision=precision,
                               kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)

    self.query, self.key, self.value = proj(N), proj(K), proj(K)
    self.out = nnx.LinearGeneral((N, self.head_dim), self.out_features, axis=(-2, -1),
                                 use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                                 precision=precision, kernel_init=kernel_init,
                                 bias_init=bias_init, rngs=rngs)
    spec = get_spec(attention)
    if spec.params is not None:
      kind = nnx.Param if spec.params.trainable else FeatureProjection
      for name, array in self._draw(rngs.params()).items():
        setattr(self, name, kind(array.astype(param_dtype)))
    self.cache = nnx.data(None)

  # -- variant-owned arrays ---------------------------------------------------

  def _draw(self, rng: jax.Array) -> dict[str, jax.Array]:
    spec = get_spec(self.attention)
    return dict(spec.params.init(rng, self.head_dim,
                                 **accepted(spec.params.init, self.attention_options)))

  def redraw(self, rng: jax.Array) -> None:
    """Draws the random projection anew from ``rng`` (same rng, same projection).

    Raises:
      ValueError: if the variant has no random projection (learned feature
        maps are trained, not redrawn).
    """
    spec = get_spec(self.attention)
    if spec.params is None or spec.params.trainable:
      raise ValueError(f"MultiHeadAttention.redraw: attention={self.attention!r} has no "
                       "random projection to redraw.")
    for name, array in self._draw(rng).items():
      getattr(self, name).set_value(array.astype(self.param_dtype))

  def _options(self) -> dict[str, Any]:
    """The variant's options plus its arrays (as data)."""
    params = get_spec(self.attention).params
    names = () if params is None else params.names
    arrays = {name: getattr(self, name).get_value() for name in names}
    return {**self.attention_options, **arrays}

  # -- calls ------------------------------------------------------------------

  def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
               inputs_v: jax.Array | None = None, *, is_causal: bool = False,
               key_value_seq_lengths: Any = None, decode: bool = False) -> jax.Array:
    """Attends ``inputs_q [B, T, in]`` to ``inputs_k``/``inputs_v [B, S, in]``.

    Self-attention when ``inputs_k`` and ``inputs_v`` are omitted
    (``inputs_v`` defaults to ``inputs_k``). ``is_causal`` and
    ``key_value_seq_lengths`` ``[B]`` are as in the functions (query t sees
    keys ``j <= t + S - T``). With ``decode=True`` (self-attention, causal,
    after :meth:`init_cache`) the inputs are the next T positions of one
    sequence: a prompt or one token; the cache advances by T.

    Returns:
      ``[B, T, out_features]``.

    Raises:
      ValueError: for inputs whose last axis is not ``in_features``,
        ``inputs_v`` without ``inputs_k``, or a decode call without a cache,
        with cross-attention inputs, lengths or ``is_causal=False``, or with
        inputs that do not match the cache. A KV cache's capacity is checked
        when the program runs: going past it raises a runtime error that
        names it.
    """
    fn = "MultiHeadAttention"
    if inputs_k is None and inputs_v is not None:
      raise ValueError(f"{fn}: inputs_v given without inputs_k; pass inputs_k (inputs_v "
                       "defaults to it).")
    self_attention = inputs_k is None
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    for name, x in (("inputs_q", inputs_q), ("inputs_k", inputs_k), ("inputs_v", inputs_v)):
      if jnp.ndim(x) < 2 or jnp.shape(x)[-1] != self.in_features:
        raise ValueError(f"{fn}: {name} must be [..., T, in_features={self.in_features}]; got "
                         f"shape {jnp.shape(x)}.")
    q, k, v = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    if decode:
      if self.cache is None:
        raise ValueError(f"{fn}: decode=True needs a cache; call init_cache(input_shape) first.")
      if not self_attention or not is_causal or key_value_seq_lengths is not None:
        raise ValueError(f"{fn}: decode=True continues one causal self-attention sequence: "
                         "pass is_causal=True, no inputs_k/inputs_v and no "
                         "key_value_seq_lengths.")
      out = self._decode(q, k, v)
    elif self.context_parallel is not None:
      out = self.context_parallel.attend(self.attention, q, k, v, is_causal=is_causal,
                                         key_value_seq_lengths=key_value_seq_lengths,
                                         **self._options())
    else:
      attend = get_spec(self.attention).function
      out = attend(q, k, v, is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                   **self._options())
    return self.out(out)

  # -- decoding -----------------------------------------------------------------

  def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None) -> None:
    """Allocates an empty decode cache for inputs of ``input_shape = (B, C, in)``.

    A KV cache holds ``C`` positions (its capacity); a ring buffer the
    window; a recurrent state has no capacity. ``dtype`` (default: the
    layer's ``dtype``, else float32) is that of cached keys and values;
    recurrent states accumulate in float32.
    """
    if len(input_shape) != 3:
      raise ValueError(f"MultiHeadAttention.init_cache: input_shape must be (B, C, in); got "
                       f"{input_shape}.")
    B, C, _ = input_shape
    if dtype is None:
      dtype = jnp.float32 if self.dtype is None else self.dtype
    dtype = jnp.dtype(dtype)
    N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
    zero = jnp.zeros((), jnp.int32)
    if self.cache_kind == "kv":
      cache = KVCache(jnp.zeros((B, K, C, H), dtype), jnp.zeros((B, K, C, H), dtype), zero)
    else:
      streaming = get_spec(self.attention).streaming
      q, kv = jnp.zeros((B, 1, N, H), dtype), jnp.zeros((B, 1, K, H), dtype)
      cache = StateCache(streaming.init(q, kv, kv, **accepted(streaming.init, self._options())),
                         zero)
    self.cache = nnx.Cache(cache)

  def _decode(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    cache = self.cache.get_value()
    _check_cache_fits(cache, k, self.cache_kind)
    if self.cache_kind == "kv":
      cache, out = _kv_decode(get_spec(self.attention), cache, q, k, v, self.attention_options)
    else:
      cache, out = _state_decode(get_spec(self.attention), self.cache_kind, cache, q, k, v,
                                 self._options())
    self.cache.set_value(cache)
    return out


def _check_attention_options(attention: str, options: Mapping[str, Any]) -> dict[str, Any]:
  spec = get_spec(attention)
  arrays = () if spec.params is None else spec.params.names + ("rng",)
  owned = [o for o in options if o in _LAYER_OWNED or o in arrays]
  if owned:
    raise ValueError(f"MultiHeadAttention: attention_options {sorted(owned)} are managed by the "
                     "layer (its rngs, parameters, cache and call arguments).")
  spec.build(**options)  # Unknown or missing options raise here, naming them.
  return dict(options)


def _check_cache_fits(cache: Any, k: jax.Array, kind: str) -> None:
  """The cache was made for these shapes: ``[B, T, K, H]`` keys against the cache."""
  leaves = cache.key if kind == "kv" else jax.tree.leaves(cache.state)[0]
  B, K = leaves.shape[0], (leaves.shape[2] if kind == "window" else leaves.shape[1])
  if k.shape[0] != B or k.shape[2] != K:
    raise ValueError(f"MultiHeadAttention: the cache was made for batch {B} and {K} kv heads; "
                     f"got keys {k.shape} ([B, T, K, H]). Call init_cache for these inputs.")


def _kv_decode(spec: AttentionSpec, cache: KVCache, q, k, v,
               options: Mapping[str, Any]) -> tuple[KVCache, jax.Array]:
  """Writes T keys at ``index``; query t reads positions ``<= index + t``.

  The read takes the cached positions ``< index`` from the cache as it was
  and the T new ones from the chunk itself: the updated cache is then only
  carried, so XLA updates it in place instead of copying it every step.
  """
  B, K, C, H = cache.key.shape
  T = q.shape[1]
  if T > C:
    raise ValueError(f"MultiHeadAttention: {T} positions do not fit a KV cache of capacity {C}.")
  index = cache.index
  jax.debug.callback(_check_capacity, index, T, C)
  write = lambda c, x: lax.dynamic_update_slice_in_dim(  # noqa: E731
      c, x.swapaxes(1, 2).astype(c.dtype), index, axis=2)
  old = jnp.arange(C)[None, :] < index  # [1, C]: positions cached before this chunk.
  new = jnp.tril(jnp.ones((T, T), bool))  # [T, T]: causal within the chunk.
  pattern = _pattern_rows(spec, C, index, T, options)
  if pattern is not None:  # [.., T, C] rows of the pattern; the chunk's own columns too.
    old = old & pattern
    new = new & lax.dynamic_slice_in_dim(jnp.pad(pattern, [(0, 0)] * (pattern.ndim - 1) + [
        (0, T)]), index, T, axis=-1)
  scale = checks.resolve_scale(options.get("scale"), H)
  read = lambda: _cached_read(q, (cache.key, k), (cache.value, v), (old, new), scale)  # noqa: E731
  if spec.name in _POSITION_INVARIANT and T > 1:  # A prompt from position 0 needs no cache read.
    fresh = lambda: spec.function(q, k, v, is_causal=True, **options)  # noqa: E731
    out = lax.cond(index == 0, fresh, read)
  else:
    out = read()
  return KVCache(write(cache.key, k), write(cache.value, v), index + T), out


def _cached_read(q: jax.Array, keys: tuple[jax.Array, jax.Array],
                 values: tuple[jax.Array, jax.Array], masks: tuple[jax.Array, jax.Array],
                 scale: float) -> jax.Array:
  """``softmax(q kᵀ·scale, mask) v`` over the cache and the new chunk, in float32.

  ``q [B, T, N, H]``; ``keys``/``values``: the head-major cache ``[B, K, C, H]``
  and the chunk's own ``[B, T, K, H]``; ``masks``: ``[.., T, C]`` and
  ``[.., T, T]`` (a leading N for per-head patterns). The cache is read where
  it lies (a transposed copy would dominate a decode step); a row that sees
  no key gives zeros.
  """
  B, T, N, H = q.shape
  K = keys[0].shape[1]
  G = N // K
  qg = q.reshape(B, T, K, G, H)
  f32 = jnp.float32

  def visible(mask):
    return mask.reshape((K, G) + mask.shape[1:]) if mask.ndim == 3 else mask

  scores = (
      jnp.einsum("btkgh,bkch->bkgtc", qg, keys[0], preferred_element_type=f32),
      jnp.einsum("btkgh,bskh->bkgts", qg, keys[1], preferred_element_type=f32),
  )
  scores = [jnp.where(visible(m), s * scale, -jnp.inf) for s, m in zip(scores, masks,
                                                                      strict=True)]
  m = jnp.maximum(*(jnp.max(s, axis=-1, keepdims=True) for s in scores))
  p = [jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)) for s in scores]
  # Batch dims first in the output: XLA:CPU then multiplies in place (3x faster here).
  out = (jnp.einsum("bkgtc,bkch->bkgth", p[0], values[0], preferred_element_type=f32)
         + jnp.einsum("bkgts,bskh->bkgth", p[1], values[1], preferred_element_type=f32))
  out = safe_divide(out, sum(jnp.sum(x, axis=-1, keepdims=True) for x in p))  # [B, K, G, T, H]
  return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)


def _check_capacity(index: Any, T: int, C: int) -> None:
  if int(index) + T > C:
    raise ValueError(f"MultiHeadAttention: decoding positions {int(index)}..{int(index) + T - 1} "
                     f"is past the KV cache's capacity {C}; init_cache with a longer input_shape.")


def _pattern_rows(spec: AttentionSpec, C: int, index: jax.Array, T: int,
                  options: Mapping[str, Any]) -> jax.Array | None:
  """Rows ``index .. index + T - 1`` of a sparse pattern on a sequence of the capacity C."""
  if spec.dense_mask is None:
    return None
  if C > MAX_PATTERN_CAPACITY:
    raise ValueError(f"MultiHeadAttention: decoding attention={spec.name!r} builds its [C, C] "
                     f"pattern; C={C} is above MAX_PATTERN_CAPACITY={MAX_PATTERN_CAPACITY}. Use a "
                     "smaller cache, or 'local' (a ring buffer) for long sequences.")
  what = accepted(spec.dense_mask, spec.what_options(options))
  with jax.ensure_compile_time_eval():  # A static pattern, also inside a trace.
    dense = jnp.asarray(spec.dense_mask(C, C, is_causal=True, **what))
  return lax.dynamic_slice_in_dim(dense, index, T, axis=-2)


def _state_decode(spec: AttentionSpec, kind: str, cache: StateCache, q, k, v,
                  options: Mapping[str, Any]) -> tuple[StateCache, jax.Array]:
  """Advances a streaming state by T positions: one step, a stateful pass, or a scan."""
  streaming = spec.streaming
  step_options = accepted(streaming.step, options)
  T = q.shape[1]

  def steps(state):
    def body(state, qkv):
      return streaming.step(state, *qkv, **step_options)

    state, out = lax.scan(body, state, tuple(x.swapaxes(0, 1) for x in (q, k, v)))
    return state, out.swapaxes(0, 1)

  def cast_like(state, like):
    return jax.tree.map(lambda x, y: x.astype(y.dtype), state, like)

  if T == 1:
    state, out = steps(cache.state)
  elif kind == "recurrent":
    out, state = spec.function(q, k, v, is_causal=True, initial_state=cache.state,
                               return_state=True, **options)
  else:  # A ring buffer: a prompt from position 0 is one blocked pass, later chunks scan.
    def fresh(state):
      out, new = spec.function(q, k, v, is_causal=True, return_state=True, **options)
      return cast_like(new, state), out.astype(q.dtype)

    state, out = lax.cond(cache.index == 0, fresh, steps, cache.state)
  state = cast_like(state, cache.state)
  return StateCache(state, cache.index + T), out


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
