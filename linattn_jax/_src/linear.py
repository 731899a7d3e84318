"""Kernel linear attention: reference, parallel, scan, associative scan, chunked.

With a feature map φ (``feature_maps``), query t attends to the keys j it
can see as::

    out_t = φ(q_t)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_t)ᵀ Σ_j φ(k_j) + eps)

Non-causal: every key. Causal: ``j <= t + S - T`` (bottom-right aligned, see
``masks.causal``): for S > T the first S - T keys are a prefix every query
sees; for T > S the first T - S queries see no key (only an initial state).
Padded keys (``key_value_seq_lengths``) count nowhere.

The sums form a recurrent state per key/value head (``LinearState``):
``kv = Σ_j φ(k_j) v_jᵀ`` ``[M, D]`` and ``k_sum = Σ_j φ(k_j)`` ``[M]``.

The engine here is shared with ``performer_attention``, whose features carry
a log-scale (``φ(k) = exp(s_k) φ̃(k)``, the ``log_scaled`` method of the
random-feature maps).
Internally the state is kept in units of ``exp(log_scale)``, where
``log_scale`` is the running maximum of the visible keys' ``s_k``; a key that
raises it rescales the state by ``exp(old - new)``, as in an online softmax.
Every quantity of query t therefore depends only on keys it can see, and
``eps`` is added to the normaliser in those units (and with queries
normalised by their own log-scale). For plain maps ``s_k = 0`` and the units
are 1.

Implementations (``implementation=``):

- ``"reference"``: the masked ``[T, S]`` kernel matrix ``φ(Q) φ(K)ᵀ``; the oracle.
- ``"parallel"``: non-causal only, the summaries ``φ(K)ᵀ V`` and ``φ(K)ᵀ 1``.
- ``"scan"``: token-by-token recurrence (``lax.scan``).
- ``"associative_scan"``: ``lax.associative_scan`` over per-token states.
- ``"chunked"``: chunkwise parallel; within a chunk of C tokens the masked
  ``φ(Q) φ(K)ᵀ`` block, across chunks the carried state.

The causal forms visit chunks of ``chunk_size`` tokens with ``lax.scan`` over
a ``jax.checkpoint``-ed chunk body, so the backward pass keeps one state per
chunk and recomputes the work inside a chunk: O(T·(M + D) + (T/C)·M·D)
memory. Without ``is_causal`` all queries share one summary, so ``"scan"``,
``"associative_scan"`` and ``"chunked"`` compute it like ``"parallel"``.

Internal layout: features ``[B, K, G, T, M]`` (queries) and ``[B, K, S, M]``
(keys), values ``[B, K, S, D]``, so grouped queries share their key/value
head's state.

References:
  Katharopoulos et al., "Transformers are RNNs: Fast Autoregressive
  Transformers with Linear Attention", 2020.
  Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
  Training", 2024 (chunkwise-parallel form).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import typing
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import checks
from linattn_jax._src.blocks import merge_blocks, pad_axis, split_blocks
from linattn_jax._src.feature_maps import FeatureMap, elu_plus_one, relu
from linattn_jax._src.masks import causal, length_predicate
from linattn_jax._src.online_softmax import exponent_shift
from linattn_jax._src.registry import AttentionSpec, StreamingSpec, register_attention

LinearImplementation = Literal["reference", "parallel", "scan", "associative_scan", "chunked"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(LinearImplementation)
DEFAULT_CHUNK_SIZE = 64

# featurizer(params, x [..., H], *, is_query) -> (features [..., M], log_scale [...] or None).
Featurizer = Callable[..., tuple[jax.Array, jax.Array | None]]


class LinearState(NamedTuple):
  """Recurrent state of linear attention, per key/value head (accumulation dtype)."""

  kv: jax.Array  # [B, K, M, D]: Σ_j φ(k_j) v_jᵀ.
  k_sum: jax.Array  # [B, K, M]: Σ_j φ(k_j).


class Carry(NamedTuple):
  """The engine's state: a :class:`LinearState` in units of ``exp(log_scale)``."""

  kv: jax.Array  # [B, K, M, D]: Σ_j exp(s_j - log_scale) φ̃(k_j) v_jᵀ.
  k_sum: jax.Array  # [B, K, M]: Σ_j exp(s_j - log_scale) φ̃(k_j).
  log_scale: jax.Array  # [B, K]: max of the keys' s_j seen so far (-inf: none).


class ImpliedWeights(NamedTuple):
  """The attention weights a kernel variant implies (accumulation dtype).

  ``out[b, t, n] = Σ_j weights[b, n, t, j] value[b, j, n // G] / normalizer[b, n, t]``.
  """

  weights: jax.Array  # [B, N, T, S]: unnormalised; signed for signed feature maps.
  magnitudes: jax.Array  # [B, N, T, S]: Σ_m of the absolute terms forming each weight.
  normalizer: jax.Array  # [B, N, T]: Σ_j weights + eps.


# Building blocks ---------------------------------------------------------------


def _normalize(num: jax.Array, den: jax.Array, eps: float) -> jax.Array:
  """``num / (den + eps)``; rows with a zero normaliser (no key) return ``num`` (zeros)."""
  den = den + eps
  return num / jnp.where(den == 0, 1, den)[..., None]


def summarize(fk: jax.Array, lk: jax.Array, v: jax.Array) -> Carry:
  """The state of S keys: ``fk [..., S, M]``, ``lk [..., S]``, ``v [..., S, D]`` -> ``[...]``."""
  m = jnp.max(lax.stop_gradient(lk), axis=-1)
  fk = fk * jnp.exp(lk - exponent_shift(m)[..., None])[..., None]
  return Carry(jnp.einsum("...sm,...sd->...md", fk, v), jnp.sum(fk, axis=-2), m)


def combine(a: Carry, b: Carry) -> Carry:
  """The state of a's keys followed by b's (associative; shapes broadcast)."""
  m = lax.stop_gradient(jnp.maximum(a.log_scale, b.log_scale))
  shift = exponent_shift(m)
  wa, wb = jnp.exp(a.log_scale - shift), jnp.exp(b.log_scale - shift)
  return Carry(
      wa[..., None, None] * a.kv + wb[..., None, None] * b.kv,
      wa[..., None] * a.k_sum + wb[..., None] * b.k_sum,
      m,
  )


def _readout(carry: Carry, fq: jax.Array, eps: float) -> jax.Array:
  """Queries ``fq [B, K, G, ..., M]`` against states ``[B, K, ...]`` -> ``[B, K, G, ..., D]``.

  The ``...`` axes broadcast: one state for all queries, or one per query.
  """
  num = jnp.einsum("bkg...m,bk...md->bkg...d", fq, carry.kv)
  den = jnp.einsum("bkg...m,bk...m->bkg...", fq, carry.k_sum)
  return _normalize(num, den, eps)


def _scaled_kernel(fq, fk, lk, log_scale, visible: jax.Array | None):
  """The masked kernel matrix in the units of each query's running max.

  ``fq [B, K, G, T, M]``, ``fk [B, K, S, M]``, ``lk [B, K, S]`` and the
  state's ``log_scale [B, K]``; ``visible [T, S]`` (None: all). Returns
  ``kernel [B, K, G, T, S] = φ̃(q_t)·φ̃(k_j) exp(s_j - m_t)`` (exact zeros for
  hidden keys) and the state's weight ``exp(log_scale - m_t)`` ``[B, K, 1, T|1]``,
  where ``m_t`` is the max of ``log_scale`` and the ``s_j`` query t sees.
  """
  lk = lk[..., None, :]  # [B, K, 1, S]
  if visible is not None:
    lk = jnp.where(visible, lk, -jnp.inf)  # [B, K, T, S]
  m = jnp.maximum(log_scale[..., None], jnp.max(lax.stop_gradient(lk), axis=-1))
  shift = lax.stop_gradient(exponent_shift(m))  # [B, K, T|1]
  weights = jnp.exp(lk - shift[..., None])[:, :, None]  # [B, K, 1, T|1, S]
  kernel = jnp.einsum("bkgtm,bksm->bkgts", fq, fk)
  kernel = jnp.where(weights > 0, kernel * weights, 0)  # Hidden keys: exact zeros.
  return kernel, jnp.exp(log_scale[..., None] - shift)[:, :, None]


def _masked_block(
    carry: Carry, fq, fk, lk, v, visible: jax.Array | None, eps: float
) -> jax.Array:
  """Queries ``[B, K, G, T, M]`` against the state plus keys ``[B, K, S, ...]``.

  ``visible [T, S]`` (None: all) masks the kernel matrix ``φ̃(Q) φ̃(K)ᵀ``.
  Each query uses the running max over the keys it sees as its units.
  """
  kernel, state_weight = _scaled_kernel(fq, fk, lk, carry.log_scale, visible)
  num = (jnp.einsum("bkgts,bksd->bkgtd", kernel, v)
         + state_weight[..., None] * jnp.einsum("bkgtm,bkmd->bkgtd", fq, carry.kv))
  den = jnp.sum(kernel, axis=-1) + state_weight * jnp.einsum("bkgtm,bkm->bkgt", fq, carry.k_sum)
  return _normalize(num, den, eps)


# Causal chunk bodies: (carry, fq [B,K,G,C,M], fk [B,K,C,M], lk [B,K,C], v [B,K,C,D]) ------


def _chunk_masked(carry: Carry, fq, fk, lk, v, *, eps: float):
  C = lk.shape[-1]
  out = _masked_block(carry, fq, fk, lk, v, causal(C), eps)
  return combine(carry, summarize(fk, lk, v)), out


def _per_token(fk, lk, v) -> Carry:
  """One state per token: fields ``[B, K, C, ...]``."""
  return summarize(fk[..., None, :], lk[..., None], v[..., None, :])


def _chunk_scan(carry: Carry, fq, fk, lk, v, *, eps: float):
  def token(carry, xs):
    fq_t, fk_t, lk_t, v_t = xs
    carry = combine(carry, _per_token(fk_t, lk_t, v_t))
    return carry, _readout(carry, fq_t, eps)

  xs = (jnp.moveaxis(fq, 3, 0), *(jnp.moveaxis(x, 2, 0) for x in (fk, lk, v)))
  carry, out = lax.scan(token, carry, xs)
  return carry, jnp.moveaxis(out, 0, 3)


def _chunk_associative_scan(carry: Carry, fq, fk, lk, v, *, eps: float):
  prefix = lax.associative_scan(combine, _per_token(fk, lk, v), axis=2)
  states = combine(jax.tree.map(lambda x: x[:, :, None], carry), prefix)  # [B, K, C, ...]
  return jax.tree.map(lambda x: x[:, :, -1], states), _readout(states, fq, eps)


CHUNK_BODIES = {
    "scan": _chunk_scan,
    "associative_scan": _chunk_associative_scan,
    "chunked": _chunk_masked,
}


def _pad_front(x: jax.Array, axis: int, count: int, value: float) -> jax.Array:
  widths = [(0, 0)] * x.ndim
  widths[axis] = (count, 0)
  return jnp.pad(x, widths, constant_values=value)


def _causal(body, carry: Carry, fq, fk, lk, v, *, chunk_size: int, eps: float):
  """Causal attention of T queries on S keys via chunk bodies; returns (out, carry)."""
  T, S = fq.shape[3], fk.shape[2]
  if S > T:  # A prefix of S - T keys that every query sees.
    carry = combine(carry, summarize(fk[:, :, :S - T], lk[:, :, :S - T], v[:, :, :S - T]))
    fk, lk, v = fk[:, :, S - T:], lk[:, :, S - T:], v[:, :, S - T:]
  elif T > S:  # The first T - S queries see no key: align with T - S hidden keys.
    fk, lk, v = (_pad_front(x, 2, T - S, value) for x, value in ((fk, 0), (lk, -jnp.inf), (v, 0)))
  C = min(chunk_size, T)
  lk = pad_axis(lk, 2, C, -jnp.inf)  # Padding keys are hidden and keep the running max.
  xs = (split_blocks(fq, 3, C), *(split_blocks(x, 2, C) for x in (fk, lk, v)))
  body = functools.partial(body, eps=eps)
  if xs[0].shape[0] == 1:
    carry, out = body(carry, *(x[0] for x in xs))
    return out, carry
  step = jax.checkpoint(lambda c, x: body(c, *x), prevent_cse=False)
  carry, out = lax.scan(step, carry, xs)
  return merge_blocks(out, 3, T), carry


def _empty_carry(B: int, K: int, M: int, D: int, dtype: Any) -> Carry:
  return Carry(jnp.zeros((B, K, M, D), dtype), jnp.zeros((B, K, M), dtype),
               jnp.full((B, K), -jnp.inf, dtype))


def _check_carry(carry: Carry | None, p: checks.Prepared, M: int, dtype, fn: str) -> Carry:
  B, _, _, _, K, _, D = p.dims
  if carry is None:
    return _empty_carry(B, K, M, D, dtype)
  carry = Carry(*(jnp.asarray(x, dtype) for x in carry))
  if not p.batched:
    carry = jax.tree.map(lambda x: x[None], carry)
  want = Carry((B, K, M, D), (B, K, M), (B, K))
  got = Carry(*(x.shape for x in carry))
  if got != want:
    raise ValueError(
        f"{fn}: initial_state fields (kv, k_sum, log_scale) have shapes "
        f"({got.kv}, {got.k_sum}, {got.log_scale}); expected ({want.kv}, {want.k_sum}, "
        f"{want.log_scale}) for B={B}, K={K}, M={M}, D={D} (without B for unbatched inputs)."
    )
  return carry


def _featurize(p: checks.Prepared, featurizer: Featurizer, lengths, dtype, fn: str):
  """Features in the internal layout, with padded keys hidden (lk = -inf, fk = v = 0)."""
  B, T, S, N, K, H, D = p.dims
  q = p.query.astype(dtype).reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
  k = p.key.astype(dtype).transpose(0, 2, 1, 3)  # [B, K, S, H]
  v = p.value.astype(dtype).transpose(0, 2, 1, 3)  # [B, K, S, D]
  fq, _ = featurizer(q, is_query=True)
  fk, lk = featurizer(k, is_query=False)
  if fq.shape[:-1] != q.shape[:-1] or fk.shape[:-1] != k.shape[:-1] or (
      fq.shape[-1] != fk.shape[-1]):
    raise ValueError(
        f"{fn}: the feature map must map [..., H] to [..., M] with one M for queries and "
        f"keys; got {q.shape} -> {fq.shape} and {k.shape} -> {fk.shape}."
    )
  lk = jnp.zeros(k.shape[:-1], dtype) if lk is None else lk.astype(dtype)
  valid = length_predicate(jnp.arange(S), lengths)[:, None, :]  # [B|1, 1, S]
  fk = jnp.where(valid[..., None], fk.astype(dtype), 0)
  v = jnp.where(valid[..., None], v, 0)
  return fq.astype(dtype), fk, jnp.where(valid, lk, -jnp.inf), v


def _attend(fq, fk, lk, v, carry: Carry, *, is_causal: bool, eps: float, implementation: str,
            chunk_size: int) -> tuple[jax.Array, Carry]:
  """Output ``[B, K, G, T, D]`` and final carry from internal-layout features."""
  if implementation == "reference":
    visible = causal(fq.shape[3], fk.shape[2]) if is_causal else None
    out = _masked_block(carry, fq, fk, lk, v, visible, eps)
    return out, combine(carry, summarize(fk, lk, v))
  if not is_causal:
    carry = combine(carry, summarize(fk, lk, v))
    return _readout(carry, fq, eps), carry
  return _causal(CHUNK_BODIES[implementation], carry, fq, fk, lk, v,
                 chunk_size=chunk_size, eps=eps)


def kernel_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    featurizer: Featurizer,
    params: Any,
    is_causal: bool,
    key_value_seq_lengths: Any,
    eps: float,
    implementation: str | None,
    chunk_size: int,
    initial_carry: Carry | None,
    fn: str,
) -> tuple[jax.Array, Carry]:
  """The shared engine of linear and Performer attention: ``(out, final carry)``.

  ``featurizer(params, x, *, is_query) -> (features, log_scale or None)`` is
  a static (hashable) option; ``params`` (e.g. a projection) are arrays.
  Checks the static options here, then runs one jitted function (inlined
  under an outer jit; eager calls reuse its compiled scans) that validates the
  arrays, featurises, dispatches on ``implementation`` and restores the
  public layout (and the missing batch axis of unbatched calls, for the
  carry too).
  """
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  implementation = checks.check_implementation(
      implementation, choices=IMPLEMENTATIONS, is_causal=is_causal, fn=fn)
  implementation = implementation or ("chunked" if is_causal else "parallel")
  chunk_size = checks.check_positive_int(chunk_size, name="chunk_size", fn=fn)
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or eps < 0:
    raise ValueError(f"{fn}: eps must be a non-negative float; got {eps!r}.")
  return _kernel_attention(
      query, key, value, key_value_seq_lengths, initial_carry, params, featurizer=featurizer,
      is_causal=is_causal, eps=float(eps), implementation=implementation,
      chunk_size=chunk_size, fn=fn,
  )


@functools.partial(jax.jit, static_argnames=(
    "featurizer", "is_causal", "eps", "implementation", "chunk_size", "fn"))
def _kernel_attention(query, key, value, lengths, carry, params, *, featurizer, is_causal, eps,
                      implementation, chunk_size, fn):
  p = checks.prepare_qkv(query, key, value, fn=fn)
  (lengths,) = checks.check_lengths(p, fn=fn, key_value_seq_lengths=lengths).values()
  dtype = checks.accumulation_dtype(p.query.dtype)
  fq, fk, lk, v = _featurize(p, functools.partial(featurizer, params), lengths, dtype, fn)
  carry = _check_carry(carry, p, fq.shape[-1], dtype, fn)
  out, carry = _attend(fq, fk, lk, v, carry, is_causal=is_causal, eps=eps,
                       implementation=implementation, chunk_size=chunk_size)
  B, T, N, D = p.dims.B, p.dims.T, p.dims.N, p.dims.D
  out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, D).astype(p.query.dtype)
  if not p.batched:
    carry = jax.tree.map(lambda x: x[0], carry)
  return p.restore(out), carry


def kernel_weights(query: Any, key: Any, *, featurizer: Featurizer, params: Any, is_causal: bool,
                   key_value_seq_lengths: Any, eps: float, fn: str) -> ImpliedWeights:
  """The weights the engine implies: ``out_t = Σ_j w_tj v_j / normalizer_t``.

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
  fq, fk, lk, _ = _featurize(p, functools.partial(featurizer, params), lengths, dtype, fn)
  visible = causal(fq.shape[3], fk.shape[2]) if is_causal else None
  no_state = jnp.full(lk.shape[:2], -jnp.inf, dtype)
  w, _ = _scaled_kernel(fq, fk, lk, no_state, visible)
  magnitudes, _ = _scaled_kernel(jnp.abs(fq), jnp.abs(fk), lk, no_state, visible)
  B, T, N, S = p.dims.B, p.dims.T, p.dims.N, p.dims.S
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


def _to_carry(state: LinearState | None) -> Carry | None:
  if state is None:
    return None
  return Carry(state.kv, state.k_sum, jnp.zeros(jnp.shape(state.k_sum)[:-1]))


def linear_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    feature_map: FeatureMap = elu_plus_one,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    eps: float = 1e-6,
    implementation: LinearImplementation | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: LinearState | None = None,
    return_state: bool = False,
) -> jax.Array | tuple[jax.Array, LinearState]:
  """Kernel linear attention in O(T) memory.

  ``out_t = φ(q_t)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_t)ᵀ Σ_j φ(k_j) + eps)`` over the
  keys j that query t sees (and the keys summarised in ``initial_state``).
  Features, sums and the state are float32 (float64 for float64 inputs).

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA / MQA).
    value: ``[B, S, K, D]``.
    feature_map: ``phi(x, *, is_query) -> [..., M]``, see ``feature_maps``.
      The arrays of a pytree map (``projected(w, b)``, ``favor_plus(p)``)
      are passed as data: new values of the same shapes do not recompile.
      Random-feature maps are evaluated as they are (unstabilised); use
      :func:`performer_attention` for those.
    is_causal: query t sees keys ``j <= t + S - T`` (bottom-right aligned).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it count
      nowhere and do not advance the state.
    eps: added to the normaliser (static float >= 0).
    implementation: ``"reference"``, ``"parallel"`` (non-causal only),
      ``"scan"``, ``"associative_scan"``, ``"chunked"``, or None:
      ``"chunked"`` if causal, else ``"parallel"``.
    chunk_size: C, the chunk length of the causal forms (the unit of
      recomputation in the backward pass; the last chunk may be partial).
    initial_state: a :class:`LinearState` (``[B, K, M, D]``, ``[B, K, M]``;
      no B for unbatched calls) summarising earlier keys, which every query
      sees, causal or not. Splitting a sequence and carrying the state
      equals one pass.
    return_state: also return the state after the last valid key.

  Returns:
    ``[B, T, N, D]`` in the input dtype, or ``(out, LinearState)`` with
    ``return_state``. Queries that see no key (and no state) return zeros.

  Raises:
    ValueError: on bad shapes, dtypes or lengths, an unknown implementation,
      ``"parallel"`` with ``is_causal=True``, a non-positive ``chunk_size``, a
      negative ``eps``, a feature map with inconsistent output shapes, or an
      ``initial_state`` of the wrong shape.

  Examples:
    >>> q = jnp.ones((2, 100, 8, 16)); kv = jnp.ones((2, 100, 2, 16))
    >>> linear_attention(q, kv, kv, is_causal=True, chunk_size=32).shape
    (2, 100, 8, 16)

  References:
    Katharopoulos et al., "Transformers are RNNs", 2020.
  """
  featurizer, arrays = _Plain.split(feature_map)
  out, carry = kernel_attention(
      query, key, value, featurizer=featurizer, params=arrays, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, eps=eps, implementation=implementation,
      chunk_size=chunk_size, initial_carry=_to_carry(initial_state), fn="linear_attention",
  )
  return (out, LinearState(carry.kv, carry.k_sum)) if return_state else out


def linear_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    feature_map: FeatureMap = elu_plus_one,
    is_causal: bool = False,
    key_value_seq_lengths: Any = None,
    eps: float = 1e-6,
    initial_state: LinearState | None = None,
    return_state: bool = False,
) -> jax.Array | tuple[jax.Array, LinearState]:
  """The oracle: the masked ``[T, S]`` kernel matrix ``φ(Q) φ(K)ᵀ``, plain einsums.

  Same arguments and result as :func:`linear_attention`
  (``implementation="reference"``). Never optimised.
  """
  return linear_attention(
      query, key, value, feature_map=feature_map, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, eps=eps, implementation="reference",
      initial_state=initial_state, return_state=return_state,
  )


def init_linear_state(
    batch: int, num_kv_heads: int, feature_dim: int, value_dim: int, dtype: Any = jnp.float32
) -> LinearState:
  """The empty :class:`LinearState`: zeros ``[B, K, M, D]`` and ``[B, K, M]``."""
  return LinearState(jnp.zeros((batch, num_kv_heads, feature_dim, value_dim), dtype),
                     jnp.zeros((batch, num_kv_heads, feature_dim), dtype))


def linear_attention_step(
    state: LinearState,
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    feature_map: FeatureMap = elu_plus_one,
    eps: float = 1e-6,
) -> tuple[LinearState, jax.Array]:
  """One decoding step: adds one key/value to the state and reads one query.

  Args:
    state: :class:`LinearState` ``[B, K, M, D]`` / ``[B, K, M]``.
    query: ``[B, N, H]``.
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.
    feature_map: as in :func:`linear_attention`.
    eps: as in :func:`linear_attention`.

  Returns:
    ``(state, out)`` with out ``[B, N, D]``; ``lax.scan``-compatible.
  """
  return one_token_step(linear_attention, state, query, key, value,
                        feature_map=feature_map, eps=eps)


def one_token_step(attention: Callable[..., Any], state, query, key, value, **options):
  """A causal pass of ``attention`` over one token (T = S = 1) from ``state``.

  ``query [B, N, H]``, ``key [B, K, H]``, ``value [B, K, D]`` (no B when
  unbatched) -> ``(state, out [B, N, D])``; uses the ``"scan"`` recurrence.
  """
  out, state = attention(
      *(jnp.expand_dims(x, -3) for x in (query, key, value)), is_causal=True,
      implementation="scan", initial_state=state, return_state=True, **options,
  )
  return state, jnp.squeeze(out, -3)


def feature_dim(feature_map: FeatureMap, head_dim: int, dtype: Any = jnp.float32) -> int:
  """M, the size of ``feature_map``'s output for inputs of head dim H."""
  x = jax.ShapeDtypeStruct((head_dim,), dtype)
  return jax.eval_shape(lambda x: feature_map(x, is_query=False), x).shape[-1]


def _init_like(query, key, value, *, feature_map: FeatureMap = elu_plus_one) -> LinearState:
  """The empty state for arrays shaped like ``query``, ``key``, ``value`` (streaming init)."""
  p = checks.prepare_qkv(query, key, value, fn="init_linear_state")
  B, _, _, _, K, H, D = p.dims
  dtype = checks.accumulation_dtype(p.query.dtype)
  return init_linear_state(B, K, feature_dim(feature_map, H, dtype), D, dtype)


def _weights(query, key, *, feature_map: FeatureMap = elu_plus_one, is_causal: bool = False,
             key_value_seq_lengths: Any = None, eps: float = 1e-6) -> ImpliedWeights:
  """:func:`kernel_weights` of :func:`linear_attention` (the registry's ``weights``)."""
  featurizer, arrays = _Plain.split(feature_map)
  return kernel_weights(query, key, featurizer=featurizer, params=arrays,
                        is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                        eps=eps, fn="linear_attention")


def _register(name: str, feature_map: FeatureMap,
              suite_implementations: tuple[str, ...] | None = None) -> None:
  bind = functools.partial
  register_attention(AttentionSpec(
      name=name,
      function=bind(linear_attention, feature_map=feature_map),
      reference=bind(linear_attention_reference, feature_map=feature_map),
      how_options=frozenset({"implementation", "chunk_size"}),
      implementations=IMPLEMENTATIONS,
      suite_implementations=suite_implementations,
      noncausal_only=frozenset({"parallel"}),
      test_options={"chunk_size": 4},
      streaming=StreamingSpec(init=bind(_init_like, feature_map=feature_map),
                              step=bind(linear_attention_step, feature_map=feature_map)),
      weights=bind(_weights, feature_map=feature_map),
  ))


# The engine's every form runs in the shared suite through "performer", whose
# running-max stabiliser is the general case (here the log-scales are 0);
# these entries run its non-causal and default causal forms with their maps
# (ReLU: zero features, eps-only denominators).
_register("linear_elu", elu_plus_one, suite_implementations=("parallel", "chunked"))
_register("linear_relu", relu, suite_implementations=("parallel", "chunked"))
