"""A diagonal-plus-low-rank transition: the generalised delta rule of RWKV-7.

Letters as in ``gated.py``; each key/value head keeps a matrix state ``S [H, D]``,
and per token a decay ``g_t [H]`` (≤ 0) and two vectors ``a_t``, ``b_t`` ``[H]``::

    S_t = (diag(exp(g_t)) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ        o_t = scale · q_tᵀ S_t

The delta rule is the case ``a = -β k``, ``b = k`` (with the decay applied first);
RWKV-7 uses ``a = -κ̂`` and ``b = κ̂ ⊙ iclr`` for its unit removal key κ̂ and
in-context learning rate.

The chunk form (the WY representation of the transition): with ``w_t = S_{t-1}ᵀ a_t``
the read of the low-rank part, ``S_t = diag(exp(g_t)) S_{t-1} + b_t w_tᵀ + k_t v_tᵀ``,
so inside a chunk, with ``Γ_i = exp(Σ_{l≤i} g_l)`` per feature and the pair weights
``P(x, y)_ij = Σ_h x_ih y_jh Γ_ih / Γ_jh`` (``decays.pair_weights``)::

    w_i = (a_i ⊙ Γ_{i-1})ᵀ S_0 + Σ_{j<i} [A_ab]_ij w_j + [A_ak]_ij v_j
    o_i = (q_i ⊙ Γ_i)ᵀ S_0 + Σ_{j≤i} P(q, b)_ij w_j + P(q, k)_ij v_j
    S_C = diag(Γ_C) S_0 + Σ_j (Γ_C / Γ_j) ⊙ (b_j w_jᵀ + k_j v_jᵀ)

where ``A_ab``, ``A_ak`` weigh pairs j < i decayed over ``j < l < i`` (the step i reads
``S_{i-1}``). ``W = (I - A_ab)⁻¹ (...)`` is one unit triangular inverse per chunk.

References:
  Peng et al., "RWKV-7 "Goose" with Expressive Dynamic State Evolution", 2025.
  Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
  Sequence Length", 2024 (the WY form).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import recurrence
from linattn_jax._src.decays import pair_weights, suffix_sums
from linattn_jax._src.delta import (
    DeltaFamily,
    DeltaSummary,
    affine_identity,
    combine_delta,
    exact_matmul,
    solve_unit_lower,
)
from linattn_jax._src.gated import (
    GatedState,
    aligned,
    by_token,
    matrix_attention,
    one_token,
    register_matrix,
)
from linattn_jax._src.registry import Role, TokenInput

DPLRImplementation = Literal["reference", "scan", "chunked"]
DPLR_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(DPLRImplementation)

# The chunk: fq [B, K, G, C, H] (scaled queries), fk [B, K, C, H], v [B, K, C, D],
# gates = (g [B, K, C, H|1], a [B, K, C, H], b [B, K, C, H]); the carry is S [B, K, H, D].


def _dplr_writes(S, chunk: recurrence.Chunk):
  """The low-rank reads ``w [B, K, C, D]`` of a chunk by one unit triangular inverse, with
  ``log Γ_i`` ``[B, K, C, H|1]`` and the state after the chunk."""
  g, a, b = chunk.gates
  k, v = chunk.fk, chunk.v
  prefix = jnp.cumsum(g, axis=2)  # log Γ_i
  # log Γ_{i-1}, summed from the start (not prefix - g: a reset at i must not cancel).
  before = jnp.cumsum(jnp.concatenate([jnp.zeros_like(g[:, :, :1]), g[:, :, :-1]], 2), axis=2)
  # Row m of P(a_{m+1}, ·) weighs pairs j ≤ m over j < l ≤ m: shifted down one row, that is
  # row i = m + 1 over j < l < i, the pairs j < i of A_ab and A_ak.
  a_next = jnp.concatenate([a[:, :, 1:], jnp.zeros_like(a[:, :, :1])], axis=2)
  shifted = pair_weights(a_next[None], jnp.stack([b, k]), g[None])  # [2, B, K, C, C]
  A_ab, A_ak = jnp.concatenate([jnp.zeros_like(shifted[..., :1, :]), shifted[..., :-1, :]], -2)
  read = jnp.einsum("bkih,bkhd->bkid", a * jnp.exp(before), S)  # (S_0ᵀ diag(Γ_{i-1}) a_i)ᵀ
  C = k.shape[2]
  w = solve_unit_lower(jnp.eye(C, dtype=A_ab.dtype)[None, None] - A_ab,
                       read + exact_matmul(A_ak, v))
  to_end = jnp.exp(suffix_sums(g, 2))  # Γ_C / Γ_j
  S_end = (jnp.exp(prefix[:, :, -1])[..., None] * S
           + jnp.einsum("bkjh,bkjd->bkhd", b * to_end, w)
           + jnp.einsum("bkjh,bkjd->bkhd", k * to_end, v))
  return w, prefix, S_end


def _dplr_chunk(config, S, chunk: recurrence.Chunk):
  """C queries against the state and the chunk: ``(S_C, out [B, K, G, C, D])``."""
  del config
  w, prefix, S_end = _dplr_writes(S, chunk)
  g, _, b = chunk.gates
  q = chunk.fq
  qb, qk = pair_weights(q[None], jnp.stack([b, chunk.fk])[:, :, :, None], g[None, :, :, None])
  out = (jnp.einsum("bkgij,bkjd->bkgid", qb, w) + jnp.einsum("bkgij,bkjd->bkgid", qk, chunk.v)
         + jnp.einsum("bkgih,bkhd->bkgid", q * jnp.exp(prefix)[:, :, None], S))
  return S_end, out


def _dplr_token(S, x):
  q, k, v, g, a, b = x  # [B, K, G, H], [B, K, H], [B, K, D], [B, K, H|1], [B, K, H], [B, K, H]
  w = jnp.einsum("bkh,bkhd->bkd", a, S)
  S = jnp.exp(g)[..., None] * S + b[..., None] * w[..., None, :] + k[..., None] * v[..., None, :]
  return S, jnp.einsum("bkgh,bkhd->bkgd", q, S)


def _dplr_scan(config, S, chunk):
  del config
  return by_token(_dplr_token, S, chunk)


def _dplr_reference(S0, chunk: recurrence.Chunk):
  """The recurrence token by token, written out: one ``lax.scan`` step per key keeping every
  state (``[S, B, K, H, D]``: small S only); a segment start drops the state."""
  chunk = aligned(chunk)
  T, S = chunk.num_queries, chunk.num_keys

  def token(state, x):
    k, v, g, a, b, *reset = x
    if reset:
      state = jnp.where(reset[0][..., None], 0, state)
    state = (jnp.exp(g)[..., None] * state
             + jnp.einsum("bkh,bki,bkid->bkhd", b, a, state)
             + jnp.einsum("bkh,bkd->bkhd", k, v))
    return state, state

  resets = () if chunk.reset is None else (chunk.reset,)
  keys = tuple(jnp.moveaxis(x, 2, 0) for x in (chunk.fk, chunk.v, *chunk.gates, *resets))
  state, states = lax.scan(token, S0, keys)
  return jnp.einsum("bkgth,tbkhd->bkgtd", chunk.fq, states[S - T:]), state


@dataclasses.dataclass(frozen=True)
class DPLRFamily(DeltaFamily):
  """:func:`dplr_attention` on the entry pipeline; ``gates = (g, a, b)`` (g = 0 without a
  decay). Its spans are affine maps of the state, summarised as the delta rule's are
  (:class:`DeltaSummary`)."""

  implementations: ClassVar[tuple[str, ...]] = DPLR_IMPLEMENTATIONS
  bodies: ClassVar[Mapping[str, recurrence.Body]] = {"scan": _dplr_scan, "chunked": _dplr_chunk}
  input_names: ClassVar[tuple[str, ...]] = ("a", "b", "log_decay")

  def token_inputs(self, inputs, key):
    low_rank = (TokenInput("a", Role.TRANSITION_READ, per_feature=True),
                TokenInput("b", Role.TRANSITION_WRITE, per_feature=True))
    g = inputs.get("log_decay")
    if g is None:
      return low_rank
    per_feature = key is not None and jnp.ndim(g) == jnp.ndim(key)
    return (*low_rank, TokenInput("log_decay", Role.DECAY, per_feature=per_feature))

  def chunk_form(self, token_inputs):
    del token_inputs
    return "dplr"

  def gates(self, inputs, chunk):
    a = inputs["a"]
    if chunk.reset is not None:  # A segment start reads nothing of the dropped state.
      a = jnp.where(chunk.reset, 0, a)
    return (inputs.get("log_decay", jnp.zeros_like(a[..., :1])), a, inputs["b"])

  def absorb(self, config, S, chunk):
    del config
    return _dplr_writes(S, chunk)[-1]

  def reference(self, S0, chunk):
    return _dplr_reference(S0, chunk)


# The public functions ---------------------------------------------------------------------


def dplr_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    a: ArrayLike,
    b: ArrayLike,
    *,
    log_decay: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
    initial_state: GatedState | DeltaSummary | None = None,
    return_state: bool = False,
    implementation: DPLRImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """A diagonal-plus-low-rank recurrence (the generalised delta rule; RWKV-7).

  ``S_t = (diag(exp(g_t)) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ`` from ``S_0 = 0`` (or
  ``initial_state``), ``o_t = scale · q_tᵀ S_t``. The delta rule is ``a = -β k``,
  ``b = k``; RWKV-7 is ``a = -κ̂``, ``b = κ̂ ⊙ iclr``.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``, or ``[B, S, V, D]`` with V a multiple of K (grouped value
      heads; then N = K and ``a``, ``b``, ``log_decay`` are per value head).
    a: ``[B, S, K, H]``: what the low-rank part reads from the state (``a_tᵀ S``).
    b: ``[B, S, K, H]``: where it writes that back.
    log_decay: optional ``g``, ``[B, S, K, H]`` (one per key feature) or ``[B, S, K]``,
      ≤ 0 (None: no decay); checked where concrete (not under ``jax.jit``).
    scale: multiplies the query (a static float); default ``1 / sqrt(H)``.
    is_causal: must be True (a recurrence); the default False raises, as for every
      causal-only variant.
    key_value_seq_lengths: optional ``[B]``: keys at or past it are identity steps.
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S): the state is dropped where the id changes (the start's own ``a`` then
      reads nothing), so a query sees only its own segment's keys; ``initial_state``
      seeds each row's first segment and the returned state is its last segment's.
    initial_state: a :class:`GatedState` to continue from, or a :class:`DeltaSummary`
      (continued from its ``kv``).
    return_state: also return the final state: a :class:`GatedState`, or for a summary
      ``initial_state`` that summary followed by these keys.
    implementation: ``"reference"`` (token by token, every state kept), ``"scan"``
      (token by token on ``lax.scan``) or ``"chunked"`` (the default: the WY form, one
      unit triangular inverse per chunk).
    chunk_size: positions per chunk of ``"scan"`` and ``"chunked"``; None: the default
      backend's measured best (docs/benchmarks.md#chunk-size).

  Returns:
    ``[B, T, N, D]`` in the input dtype; with ``return_state`` the pair ``(out, state)``.
    T ≠ S is bottom-right aligned.

  Raises:
    ValueError: for ``is_causal=False``, bad shapes or dtypes of the arrays, ``a``, ``b``
      or ``log_decay``, a positive ``log_decay`` (where concrete), a traced ``scale``, an
      unknown implementation, a bad ``chunk_size`` or a state that does not match.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))  # [B, T, N=K, H=D]
    >>> kappa = x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # RWKV-7's removal key
    >>> g = jnp.full(x.shape, -0.1)
    >>> la.dplr_attention(x, x, x, -kappa, 0.5 * kappa, log_decay=g, is_causal=True).shape
    (1, 16, 2, 8)

  References:
    Peng et al., "RWKV-7 "Goose" with Expressive Dynamic State Evolution", 2025.
    Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence
    Length", 2024.
  """
  return _dplr(query, key, value, a, b, log_decay=log_decay, scale=scale, is_causal=is_causal,
               key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
               initial_state=initial_state, return_state=return_state,
               implementation=implementation, chunk_size=chunk_size, fn="dplr_attention")


def _dplr(query, key, value, a, b, *, log_decay=None, fn: str, **options):
  return matrix_attention(DPLRFamily(), query, key, value,
                          inputs={"a": a, "b": b, "log_decay": log_decay}, fn=fn, **options)


def dplr_attention_reference(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, a: ArrayLike, b: ArrayLike, *,
    log_decay: ArrayLike | None = None, scale: float | None = None, is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None, segment_ids: ArrayLike | None = None,
    initial_state: GatedState | DeltaSummary | None = None, return_state: bool = False,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """The oracle of :func:`dplr_attention`: the token recurrence written out, float32.

  One step per key, keeping every state (small S only). Takes the arrays ``[B, T, N, H]``,
  ``[B, S, K, H]``, ``[B, S, K, D]``, ``a``, ``b`` ``[B, S, K, H]`` and the options of
  :func:`dplr_attention` but ``implementation``.

  Raises:
    ValueError: as :func:`dplr_attention`, under this name.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4)) / 2
    >>> fast = la.dplr_attention(x, x, x, -x, x, is_causal=True)
    >>> ref = la.dplr_attention_reference(x, x, x, -x, x, is_causal=True)
    >>> bool(jnp.allclose(fast, ref, atol=1e-5))
    True

  References:
    Peng et al., "RWKV-7 "Goose" with Expressive Dynamic State Evolution", 2025.
  """
  return _dplr(query, key, value, a, b, log_decay=log_decay, scale=scale, is_causal=is_causal,
               key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
               initial_state=initial_state, return_state=return_state, chunk_size=chunk_size,
               implementation="reference", fn="dplr_attention_reference")


def dplr_attention_step(state: GatedState, query: ArrayLike, key: ArrayLike, value: ArrayLike,
                        a: ArrayLike, b: ArrayLike, *, log_decay: ArrayLike | None = None,
                        scale: float | None = None) -> tuple[GatedState, jax.Array]:
  """One decoding step of :func:`dplr_attention`: ``S <- (diag(exp(g)) + b aᵀ) S + k vᵀ``.

  Then ``o = scale · qᵀ S``.

  Args:
    state: the :class:`GatedState` so far (``kv [B, K, H, D]``).
    query: ``[B, N, H]`` (no B when unbatched, like the state).
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.
    a: ``[B, K, H]``.
    b: ``[B, K, H]``.
    log_decay: optional ``[B, K, H]`` or ``[B, K]``, ≤ 0.
    scale: multiplies the query; default ``1 / sqrt(H)``.

  Returns:
    ``(state, out [B, N, D])``, the state in the dtype it came in.

  Raises:
    ValueError: on ranks or shapes that do not match each other or the state, or a
      positive ``log_decay`` (where concrete).

  Examples:
    >>> state = la.init_gated_state(batch=1, num_kv_heads=1, head_dim=2, value_dim=2)
    >>> e0 = jnp.array([[[1.0, 0.0]]])  # [B, K=N, H]
    >>> state, _ = la.dplr_attention_step(state, e0, e0, e0, -e0, e0)  # writes e0 e0ᵀ
    >>> state, _ = la.dplr_attention_step(state, e0, 0 * e0, e0, -e0, e0)  # (I - e0 e0ᵀ) S
    >>> state.kv[0, 0]
    Array([[0., 0.],
           [0., 0.]], dtype=float32)

  References:
    Peng et al., "RWKV-7 "Goose" with Expressive Dynamic State Evolution", 2025.
  """
  return one_token(dplr_attention, state, query, key, value,
                   {"a": a, "b": b, "log_decay": log_decay}, scale=scale)


def _summarize(key: Any, value: Any, a: Any, b: Any, *, log_decay: Any = None,
               key_value_seq_lengths: Any = None, chunk_size: int | None = None,
               segment_ids: Any = None) -> DeltaSummary:
  """The :class:`DeltaSummary` (``S ↦ A S + B``) of ``key [B, S, K, H]`` / ``value``."""
  return recurrence.summarize_keys(dplr_attention, key, value, a=a, b=b, log_decay=log_decay,
                                   chunk_size=chunk_size,
                                   initial_state=affine_identity(key, value),
                                   segment_ids=segment_ids,
                                   key_value_seq_lengths=key_value_seq_lengths)


def _register(name: str) -> None:
  register_matrix(name, family=DPLRFamily(), function=dplr_attention,
                  reference=dplr_attention_reference, step=dplr_attention_step,
                  summarize=_summarize, identity=affine_identity, combine=combine_delta,
                  token_inputs=(TokenInput("a", Role.TRANSITION_READ, per_feature=True),
                                TokenInput("b", Role.TRANSITION_WRITE, per_feature=True),
                                TokenInput("log_decay", Role.DECAY, per_feature=True)))


# The general form, and RWKV-7's (the same function; its layer makes a = -κ̂, b = κ̂ ⊙ iclr
# and a decay per key feature).
_register("dplr")
_register("rwkv7")
