"""Kernel linear attention: reference, parallel, scan, associative scan, chunked.

With a feature map φ (``feature_maps``), query t attends to the keys j it
can see as::

    out_t = φ(q_t)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_t)ᵀ Σ_j φ(k_j) + eps)

Non-causal: every key. Causal: ``j <= t + S - T`` (bottom-right aligned, see
``masks.causal``): for S > T the first S - T keys are a prefix every query
sees; for T > S the first T - S queries see no key (only an initial state).
Padded keys (``key_value_seq_lengths``) count nowhere.

The sums form a recurrent state per key/value head (``LinearState``):
``kv = Σ_j φ(k_j) v_jᵀ`` ``[M, D]`` and ``k_sum = Σ_j φ(k_j)`` ``[M]``. The
machinery (chunked scans, alignment, state passing, the one-token step) is
the recurrent core of ``recurrence.py``, shared with Performer, Shen's and
Heinsen's attention; this module supplies the feature map.

Implementations (``implementation=``):

- ``"reference"``: the masked ``[T, S]`` kernel matrix ``φ(Q) φ(K)ᵀ``; the oracle.
- ``"parallel"``: non-causal only, the summaries ``φ(K)ᵀ V`` and ``φ(K)ᵀ 1``.
- ``"scan"``: token-by-token recurrence (``lax.scan``).
- ``"associative_scan"``: ``lax.associative_scan`` over per-token states.
- ``"chunked"``: chunkwise parallel; within a chunk of C tokens the masked
  ``φ(Q) φ(K)ᵀ`` block, across chunks the carried state.

The causal forms visit chunks of ``chunk_size`` tokens with ``lax.scan``
over a ``jax.checkpoint``-ed chunk body, so the backward pass keeps one state
per chunk and recomputes the work inside a chunk: O(T·(M + D) + (T/C)·M·D)
memory. Without ``is_causal`` all queries share one summary, so ``"scan"``,
``"associative_scan"`` and ``"chunked"`` compute it like ``"parallel"``.

References:
  Katharopoulos et al., "Transformers are RNNs: Fast Autoregressive
  Transformers with Linear Attention", 2020.
  Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
  Training", 2024 (chunkwise-parallel form).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from linattn_jax._src import checks, kernel, recurrence
from linattn_jax._src.feature_maps import FeatureMap, elu_plus_one, projected, relu
from linattn_jax._src.kernel import DEFAULT_EPS
from linattn_jax._src.masks import causal
from linattn_jax._src.registry import (
  ParamSpec,
)

LinearImplementation = Literal["reference", "parallel", "scan", "associative_scan", "chunked"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(LinearImplementation)


class LinearState(NamedTuple):
  """Recurrent state of :func:`linear_attention`, per key/value head (accumulation dtype).

  The keys seen so far, folded into two sums that a query reads as
  ``out = φ(q)ᵀ kv / (φ(q)ᵀ k_sum + eps)``::

      kv = Σ_j φ(k_j) v_jᵀ   [B, K, M, D]        k_sum = Σ_j φ(k_j)   [B, K, M]

  M is the feature map's output size. Float32 (float64 for float64 inputs);
  unbatched calls use the same fields without B. Made empty by
  :func:`init_linear_state`, or returned by ``linear_attention(...,
  return_state=True)`` and :func:`linear_attention_step`.

  Attributes:
    kv: ``[B, K, M, D]``: ``Σ_j φ(k_j) v_jᵀ``.
    k_sum: ``[B, K, M]``: ``Σ_j φ(k_j)``.
    reset: None, or ``[B]`` bool in a summary of packed keys (the registry's
      ``summarize`` with ``segment_ids``): True where the keys hold a segment start,
      so that ``combine`` drops the state before them. Ignored as ``initial_state``.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> _, state = la.linear_attention(x, x, x, is_causal=True, return_state=True)
    >>> state.kv.shape, state.k_sum.shape, state.kv.dtype  # elu + 1 keeps M = H.
    ((1, 2, 4, 4), (1, 2, 4), dtype('float32'))
  """

  kv: jax.Array  # [B, K, M, D]: Σ_j φ(k_j) v_jᵀ.
  k_sum: jax.Array  # [B, K, M]: Σ_j φ(k_j).
  reset: Any = None  # None, or [B] bool (summaries of packed keys).


class ImpliedWeights(NamedTuple):
  """The attention weights a kernel variant implies (accumulation dtype).

  ``out[b, t, n] = Σ_j weights[b, n, t, j] value[b, j, n // G] / normalizer[b, n, t]``.
  """

  weights: jax.Array  # [B, N, T, S]: unnormalised; signed for signed feature maps.
  magnitudes: jax.Array  # [B, N, T, S]: Σ_m of the absolute terms forming each weight.
  normalizer: jax.Array  # [B, N, T]: Σ_j weights + eps.


def kernel_weights(query: Any, key: Any, *, featurizer: kernel.Featurizer, params: Any,
                   is_causal: bool, key_value_seq_lengths: Any, eps: float,
                   fn: str) -> ImpliedWeights:
  """The weights the core implies: ``out_t = Σ_j w_tj v_j / normalizer_t``.

  ``w_tj = φ̃(q_t)·φ̃(k_j) exp(s_j - m_t)`` in the units in which ``eps`` is
  added (``m_t``: the max of the ``s_j`` query t sees; 0 for plain maps), and
  ``magnitudes_tj = |φ̃(q_t)|·|φ̃(k_j)| exp(s_j - m_t)``, the sum of the
  absolute values of the M terms forming ``w_tj``. Hidden and padded keys
  have exact zeros. Computed like the ``"reference"`` implementation, in
  the accumulation dtype; no initial state.
  """
  p = checks.prepare_qkv(query, key, key, fn=fn)  # Values play no part in the weights.
  (lengths,) = checks.check_lengths(p, fn=fn, key_value_seq_lengths=key_value_seq_lengths).values()
  dtype = checks.accumulation_dtype(p.query.dtype)
  chunk = kernel.featurize(p, functools.partial(featurizer, params), lengths, dtype, fn=fn)
  B, T, S, N, K = p.dims.B, p.dims.T, p.dims.S, p.dims.N, p.dims.K
  visible = causal(T, S) if is_causal else None
  empty = kernel.empty_carry(B, K, chunk.fk.shape[-1], chunk.lk.shape[-1], 1, dtype)
  config = kernel.ReadConfig("kernel")
  w, _ = kernel.exact_weights(config, empty, chunk, visible)
  magnitudes, _ = kernel.exact_weights(
      config, empty, chunk._replace(fq=jnp.abs(chunk.fq), fk=jnp.abs(chunk.fk)), visible)
  w, magnitudes = (x.reshape(B, N, T, S) for x in (w, magnitudes))  # Head n = k·G + g.
  out = ImpliedWeights(w, magnitudes, jnp.sum(w, axis=-1) + eps)
  return out if p.batched else jax.tree.map(lambda x: x[0], out)


# Public API --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plain:
  """Featurizer of :func:`linear_attention`: ``φ(x)`` as it is (log-scale 0).

  Holds the feature map's static structure; its arrays (the leaves of a
  pytree map such as ``projected(w, b)``) arrive as ``params``, so new
  values of the same shapes reuse the compiled program.
  """

  treedef: Any
  static_leaves: tuple[Any, ...]  # The map's non-array leaves; None where an array goes.

  @classmethod
  def split(cls, feature_map: FeatureMap) -> tuple[_Plain, tuple[jax.Array, ...]]:
    """``(featurizer, arrays)`` for ``feature_map``; a plain function has no arrays."""
    leaves, treedef = jax.tree.flatten(feature_map)
    is_array = [isinstance(x, jax.Array | np.ndarray) for x in leaves]
    arrays = tuple(x for x, a in zip(leaves, is_array, strict=True) if a)
    static = tuple(None if a else x for x, a in zip(leaves, is_array, strict=True))
    return cls(treedef, static), arrays

  def __call__(self, params: tuple[jax.Array, ...], x: jax.Array, *, is_query: bool):
    arrays = iter(params)
    leaves = [next(arrays) if leaf is None else leaf for leaf in self.static_leaves]
    feature_map = jax.tree.unflatten(self.treedef, leaves)
    return feature_map(x, is_query=is_query), None


def linear_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    feature_map: FeatureMap = elu_plus_one,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | None = None,
    eps: float = DEFAULT_EPS,
    initial_state: LinearState | None = None,
    return_state: bool = False,
    implementation: LinearImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, LinearState]:
  """Kernel linear attention in O(T) memory.

  ``out_t = φ(q_t)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_t)ᵀ Σ_j φ(k_j) + eps)`` over the
  keys j that query t sees (and the keys summarised in ``initial_state``).
  Features, sums and the state are float32 (float64 for float64 inputs).

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA / MQA).
    value: ``[B, S, K, D]``.
    feature_map: ``phi(x, *, is_query) -> [..., M]``, see ``feature_maps``;
      a function of each row (position) alone: the causal forms apply it to
      one chunk of positions at a time.
      The arrays of a pytree map (``projected(w, b)``, ``favor_plus(p)``)
      are passed as data: new values of the same shapes do not recompile.
      Random-feature maps are evaluated as they are (unstabilised); use
      :func:`performer_attention` for those.
    is_causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it count
      nowhere and do not advance the state.
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S, ``is_causal=True``): the state is dropped where the id changes, so a
      query sees only its own segment's keys; ``initial_state`` seeds each row's first
      segment and the returned state is its last segment's. Their order is checked
      only where concrete (not under ``jax.jit``).
    eps: added to the normaliser (static float >= 0).
    initial_state: a :class:`LinearState` (``[B, K, M, D]``, ``[B, K, M]``;
      no B for unbatched calls) summarising earlier keys, which every query
      sees, causal or not. Splitting a sequence and carrying the state
      equals one pass.
    return_state: also return the state after the last valid key.
    implementation: ``"reference"``, ``"parallel"`` (non-causal only),
      ``"scan"``, ``"associative_scan"``, ``"chunked"``, or None:
      ``"chunked"`` if causal, else ``"parallel"``.
    chunk_size: C, the chunk length of the causal forms (the unit of
      recomputation in the backward pass; the last chunk may be partial).
      None: the default backend's measured best, 64 on CPU and 256 on GPU
      (docs/benchmarks.md#chunk-size).

  Returns:
    ``[B, T, N, D]`` in the input dtype, or ``(out, LinearState)`` with
    ``return_state``. Queries that see no key (and no state) return zeros.

  Raises:
    ValueError: on bad shapes, dtypes or lengths, an unknown implementation,
      ``"parallel"`` with ``is_causal=True``, a non-positive ``chunk_size``, a
      negative ``eps``, a feature map with inconsistent output shapes, or an
      ``initial_state`` that is not a :class:`LinearState` of float arrays of
      the shapes above.

  Examples:
    >>> q = jnp.ones((2, 100, 8, 16)); kv = jnp.ones((2, 100, 2, 16))
    >>> la.linear_attention(q, kv, kv, is_causal=True, chunk_size=32).shape
    (2, 100, 8, 16)

    Splitting a causal sequence and carrying the state equals one pass:

    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N, H]
    >>> a, b = x[:, :3], x[:, 3:]
    >>> full = la.linear_attention(x, x, x, is_causal=True)
    >>> first, state = la.linear_attention(a, a, a, is_causal=True, return_state=True)
    >>> rest = la.linear_attention(b, b, b, is_causal=True, initial_state=state)
    >>> bool(jnp.allclose(jnp.concatenate([first, rest], axis=1), full, atol=1e-5))
    True

  References:
    Katharopoulos et al., "Transformers are RNNs: Fast Autoregressive
    Transformers with Linear Attention", 2020.
  """
  return _linear_attention(
      query, key, value, feature_map=feature_map, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids, eps=eps,
      implementation=implementation,
      chunk_size=chunk_size, initial_state=initial_state, return_state=return_state,
      fn="linear_attention")


def _family(featurizer: kernel.Featurizer | None) -> kernel.KernelFamily:
  return kernel.KernelFamily(featurizer, "kernel", LinearState, IMPLEMENTATIONS)


def _linear_attention(query, key, value, *, feature_map, is_causal, key_value_seq_lengths,
                      segment_ids, eps, implementation, chunk_size, initial_state, return_state,
                      fn: str):
  """:func:`linear_attention` and its reference, with errors naming ``fn``."""
  featurizer, arrays = _Plain.split(feature_map)
  family = _family(featurizer)
  return recurrence.recurrent_attention(
      family, query, key, value, arrays, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids, eps=eps,
      implementation=implementation,
      chunk_size=chunk_size, initial_state=initial_state,
      return_state=return_state, fn=fn)


def linear_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    feature_map: FeatureMap = elu_plus_one,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    segment_ids: ArrayLike | None = None,
    eps: float = DEFAULT_EPS,
    initial_state: LinearState | None = None,
    return_state: bool = False,
) -> jax.Array | tuple[jax.Array, LinearState]:
  """The oracle of :func:`linear_attention`: the masked ``[T, S]`` kernel matrix, plain einsums.

  ``out_t = Σ_j w_tj v_j / (Σ_j w_tj + eps)`` with the weights
  ``w = φ(Q) φ(K)ᵀ`` formed at once (``[B, N, T, S]``: O(T·S) memory) and
  masked for causality and padding. Same arguments and result as
  :func:`linear_attention` with ``implementation="reference"``; the tests
  judge every fast form against it. Never optimised.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``.
    feature_map: as in :func:`linear_attention`.
    is_causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it count nowhere.
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S, ``is_causal=True``): the state is dropped where the id changes, so a
      query sees only its own segment's keys; ``initial_state`` seeds each row's first
      segment and the returned state is its last segment's. Their order is checked
      only where concrete (not under ``jax.jit``).
    eps: added to the normaliser (static float >= 0).
    initial_state: a :class:`LinearState` ``[B, K, M, D]`` / ``[B, K, M]``
      summarising earlier keys, seen by every query.
    return_state: also return the state after the last valid key.

  Returns:
    ``[B, T, N, D]`` in the input dtype, or ``(out, LinearState)``.

  Raises:
    ValueError: as :func:`linear_attention`: bad shapes, dtypes or lengths,
      a negative ``eps``, a feature map with inconsistent output shapes, or
      an ``initial_state`` that is not a :class:`LinearState` of float arrays
      of the right shapes.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> fast = la.linear_attention(x, x, x, is_causal=True)
    >>> slow = la.linear_attention_reference(x, x, x, is_causal=True)
    >>> bool(jnp.allclose(fast, slow, atol=1e-5))
    True

  References:
    Katharopoulos et al., "Transformers are RNNs", 2020.
  """
  return _linear_attention(
      query, key, value, feature_map=feature_map, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids, eps=eps,
      implementation="reference",
      chunk_size=None, initial_state=initial_state, return_state=return_state,
      fn="linear_attention_reference")


def init_linear_state(
    batch: int, num_kv_heads: int, head_dim: int, value_dim: int, dtype: Any = jnp.float32, *,
    feature_map: FeatureMap = elu_plus_one,
) -> LinearState:
  """The empty :class:`LinearState`: zeros ``kv [B, K, M, D]`` and ``k_sum [B, K, M]``.

  The state of no keys (both sums empty), from which
  :func:`linear_attention_step` decodes. Sized like every ``init_*_state`` by
  the head dim H; M is ``feature_map``'s output size for it: H for
  ``elu_plus_one``, ``relu`` and ``exp``; the projection's M for ``projected``
  (see ``feature_maps``).

  Args:
    batch: B.
    num_kv_heads: K.
    head_dim: H.
    value_dim: D.
    dtype: the state's dtype: float32 for float32, bfloat16 and float16
      inputs (the accumulation dtype), float64 for float64 ones.
    feature_map: φ, as :func:`linear_attention_step` will be given it.

  Returns:
    A :class:`LinearState` of zeros.

  Raises:
    ValueError: if a size is not a positive int.

  Examples:
    >>> state = la.init_linear_state(batch=2, num_kv_heads=1, head_dim=4, value_dim=3)
    >>> state.kv.shape, state.k_sum.shape, bool(jnp.all(state.kv == 0))
    ((2, 1, 4, 3), (2, 1, 4), True)
    >>> w, b = jnp.ones((4, 6)), jnp.zeros(6)  # A learnable map to M = 6 features.
    >>> la.init_linear_state(2, 1, 4, 3, feature_map=feature_maps.projected(w, b)).kv.shape
    (2, 1, 6, 3)
  """
  B, K, H, D = checks.positive_sizes(
      batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, value_dim=value_dim,
      fn="init_linear_state")
  M = feature_dim(feature_map, H, dtype)
  return LinearState(jnp.zeros((B, K, M, D), dtype), jnp.zeros((B, K, M), dtype))


def linear_attention_step(
    state: LinearState,
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    feature_map: FeatureMap = elu_plus_one,
    eps: float = DEFAULT_EPS,
) -> tuple[LinearState, jax.Array]:
  """One causal decoding step: adds one key/value to the state and reads one query.

  ``kv ← kv + φ(k) vᵀ``, ``k_sum ← k_sum + φ(k)``, then
  ``out = φ(q)ᵀ kv / (φ(q)ᵀ k_sum + eps)``: constant time and memory per
  token. Scanned over T tokens from :func:`init_linear_state` it equals
  ``linear_attention(..., is_causal=True)``.

  Args:
    state: :class:`LinearState` ``[B, K, M, D]`` / ``[B, K, M]``.
    query: ``[B, N, H]`` (or unbatched ``[N, H]``, with an unbatched state).
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.
    feature_map: as in :func:`linear_attention`.
    eps: as in :func:`linear_attention`.

  Returns:
    ``(state, out)`` with out ``[B, N, D]`` in the input dtype; the new
    state keeps the dtype of ``state``, so the step is ``lax.scan``-compatible.

  Raises:
    ValueError: if query, key and value are not all rank 3 (or all rank 2),
      on mismatched shapes or dtypes, or for a state whose shapes do not
      match them.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> def step(state, x_t):
    ...   return la.linear_attention_step(state, x_t, x_t, x_t)
    >>> empty = la.init_linear_state(1, 2, 4, 4)
    >>> state, outs = jax.lax.scan(step, empty, x.swapaxes(0, 1))
    >>> full = la.linear_attention(x, x, x, is_causal=True)
    >>> bool(jnp.allclose(outs.swapaxes(0, 1), full, atol=1e-5))
    True

  References:
    Katharopoulos et al., "Transformers are RNNs", 2020.
  """
  return recurrence.one_token_step(linear_attention, state, query, key, value,
                                   feature_map=feature_map, eps=eps)


def feature_dim(feature_map: FeatureMap, head_dim: int, dtype: Any = jnp.float32) -> int:
  """M, the size of ``feature_map``'s output for inputs of head dim H."""
  x = jax.ShapeDtypeStruct((head_dim,), dtype)
  return jax.eval_shape(lambda x: feature_map(x, is_query=False), x).shape[-1]


def _init_like(query, key, value, *, feature_map: FeatureMap = elu_plus_one) -> LinearState:
  """The empty state for arrays shaped like ``query``, ``key``, ``value`` (streaming init)."""
  p = checks.prepare_qkv(query, key, value, fn="init_linear_state")
  d = p.dims
  return init_linear_state(d.B, d.K, d.H, d.D, checks.accumulation_dtype(p.query.dtype),
                           feature_map=feature_map)


def _weights(query, key, *, feature_map: FeatureMap = elu_plus_one, is_causal: bool = False,
             key_value_seq_lengths: Any = None, eps: float = DEFAULT_EPS) -> ImpliedWeights:
  """:func:`kernel_weights` of :func:`linear_attention` (the registry's ``weights``)."""
  featurizer, arrays = _Plain.split(feature_map)
  return kernel_weights(query, key, featurizer=featurizer, params=arrays,
                        is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                        eps=eps, fn="linear_attention")


def _summarize(key, value, *, feature_map: FeatureMap = elu_plus_one,
               key_value_seq_lengths: Any = None, segment_ids: Any = None) -> LinearState:
  """The :class:`LinearState` of ``key`` / ``value`` (the registry's ``summarize``)."""
  return recurrence.summarize_keys(linear_attention, key, value, feature_map=feature_map,
                                   segment_ids=segment_ids,
                                   key_value_seq_lengths=key_value_seq_lengths)


def _init_learned(rng: jax.Array, head_dim: int, *,
                  num_features: int | None = None) -> dict[str, jax.Array]:
  """``linear_learned``'s arrays: ``feature_weight [H, M] ~ N(0, 1/H)``, ``feature_bias [M] = 0``.

  M defaults to H; with this scale ``x W`` has the variance of one entry of x.
  """
  M = head_dim if num_features is None else checks.check_positive_int(
      num_features, name="num_features", fn="linear_learned")
  weight = jax.random.normal(rng, (head_dim, M), jnp.float32) / float(np.sqrt(head_dim))
  return {"feature_weight": weight, "feature_bias": jnp.zeros((M,), jnp.float32)}


def _register(name: str, feature_map: FeatureMap | None = None,
              params: ParamSpec | None = None) -> None:
  """One entry: a fixed ``feature_map``, or one built from ``params``' arrays."""
  def bind(fn, head_dim_at=0):
    if params is not None:
      return params.bind(fn, head_dim_at=head_dim_at)
    return functools.partial(fn, feature_map=feature_map)

  recurrence.register_recurrent(
      name, function=linear_attention, reference=linear_attention_reference, init=_init_like,
      step=linear_attention_step, summarize=_summarize, family=_family(None),
      combine=kernel.combine_states, weights=_weights, params=params, bind=bind)


_register("linear_elu", elu_plus_one)
_register("linear_relu", relu)
# The learnable map elu(x W + b) + 1, its weights as array options.
_register("linear_learned", params=ParamSpec(
    init=_init_learned, names=("feature_weight", "feature_bias"), trainable=True,
    option="feature_map", build=lambda a: projected(a["feature_weight"], a["feature_bias"])))
