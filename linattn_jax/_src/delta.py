"""The delta rule: DeltaNet, and Gated DeltaNet with a decay per head.

Letters as in ``gated.py``: the state of each key/value head is a matrix
``S [H, D]`` (no normaliser); a query reads ``o_t = scale · q_tᵀ S_t``::

    S' = exp(g_t) S_{t-1}     u_t = β_t (v_t - S'ᵀ k_t)     S_t = S' + k_t u_tᵀ

Each write replaces part of what the key already stores. Inside a chunk the
decay from key j to query i is ``exp(Σ_{j<l≤i} g_l)`` (never a positive
exponent; a decay of -1e4 is a clean reset). The chunk form is the WY/UT
representation (Yang et al., 2024): with ``Γ_i = exp(Σ_{l≤i} g_l)`` inside the
chunk, ``U = (I + L)⁻¹ diag(β) (V - diag(Γ) K S_0)`` where
``L_ij = β_i (Γ_i / Γ_j) k_iᵀ k_j`` for ``j < i`` (one unit triangular inverse per
chunk, by halves), then ``S_C = Γ_C S_0 + Σ_j (Γ_C / Γ_j) k_j u_jᵀ``.

References:
  Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
  Sequence Length", 2024. Yang, Kautz and Hatamizadeh, "Gated Delta Networks:
  Improving Mamba2 with Delta Rule", 2025.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import recurrence
from linattn_jax._src.decays import pair_weights, segment_sums, suffix_sums
from linattn_jax._src.gated import (
    GatedState,
    MatrixFamily,
    aligned,
    by_token,
    check_summaries,
    empty_kv,
    matrix_attention,
    one_token,
    register_matrix,
)
from linattn_jax._src.registry import Role, TokenInput

DeltaImplementation = Literal["reference", "scan", "chunked"]
DELTA_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(DeltaImplementation)


class DeltaSummary(NamedTuple):
  """What a span of keys does to a :class:`GatedState` under :func:`delta_rule_attention`.

  The span maps ``S`` to ``A S + B`` with ``A = Π_t exp(g_t) (I - β_t k_t k_tᵀ)``
  (the latest token on the left) and ``B`` its state from zero; summaries compose
  by ``(A_l A_e, A_l B_e + B_l)`` (:func:`combine_delta`). Being affine in ``S``, the
  recurrence run from the state ``[B_e | A_e]`` ``[H, D + H]`` with values ``[v | 0]``
  leaves ``[A B_e + B | A A_e]``: that is how a summary continues over more keys.

  Attributes:
    kv: ``[B, K, H, D]``: ``B``, float32 (float64 for float64 inputs).
    transition: ``A``, ``[B, K, H, H]``.

  Examples:
    >>> k = jnp.zeros((1, 3, 1, 2)).at[..., 0].set(1.0)  # [B, S, K, H]: unit keys e_0
    >>> s = la.get_spec("delta_net").streaming.summarize(k, k, beta=jnp.ones((1, 3, 1)))
    >>> s.transition[0, 0]  # β = 1 erases what e_0 stored: I - e_0 e_0ᵀ
    Array([[0., 0.],
           [0., 1.]], dtype=float32)
  """

  kv: jax.Array
  transition: jax.Array


# The delta rule --------------------------------------------------------------------------
# gates = (g [B, K, C, 1], beta [B, K, C, 1]).


# The delta rule's inverse and its applications multiply in full float32 (no TF32 on GPUs):
# an inverse compounds rounding level by level.
exact_matmul = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)


def unit_lower_inverse(M: jax.Array) -> jax.Array:
  """``M⁻¹`` for unit lower triangular ``M [..., C, C]``, by halves::

      [[A, 0], [L, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ L A⁻¹, D⁻¹]]

  with the two diagonal halves inverted together, one level per halving: matrix
  products only (a triangular solve is a sequential loop on some backends), in full
  float32 precision. A size that is not a power of two gets identity rows and
  columns up to the next one, dropped at the end.
  """
  C = M.shape[-1]
  padded = 1 << (C - 1).bit_length()
  if padded != C:
    pad = [(0, 0)] * (M.ndim - 2) + [(0, padded - C)] * 2
    ones = jnp.diag(jnp.arange(padded) >= C).astype(M.dtype)  # On the added diagonal.
    M = jnp.pad(M, pad) + ones.reshape((1,) * (M.ndim - 2) + ones.shape)
  return _inverse_by_halves(M)[..., :C, :C]


def _inverse_by_halves(M: jax.Array) -> jax.Array:
  """:func:`unit_lower_inverse` for a power-of-two size."""
  C = M.shape[-1]
  if C == 1:
    return jnp.ones_like(M)
  h = C // 2
  halves = _inverse_by_halves(jnp.stack([M[..., :h, :h], M[..., h:, h:]], axis=-3))
  A_inv, D_inv = halves[..., 0, :, :], halves[..., 1, :, :]
  below = -exact_matmul(exact_matmul(D_inv, M[..., h:, :h]), A_inv)
  return jnp.concatenate([jnp.concatenate([A_inv, jnp.zeros_like(below)], axis=-1),
                          jnp.concatenate([below, D_inv], axis=-1)], axis=-2)


@jax.custom_jvp
def solve_unit_lower(M: jax.Array, b: jax.Array) -> jax.Array:
  """``u = M⁻¹ b`` for unit lower triangular ``M [..., C, C]`` (only its strictly lower
  part is read) and ``b [..., C, D]``, by :func:`unit_lower_inverse`. Differentiated
  through the inverse it formed, ``du = M⁻¹ (db - tril(dM) u)``, whose transpose is the
  backward pass's two products::

      ∂b = M⁻ᵀ ∂u     ∂M = -tril(∂b uᵀ)

  (rather than the transposed levels of the inverse; with tril the strictly lower part);
  forward mode works too.
  """
  return exact_matmul(unit_lower_inverse(M), b)


@solve_unit_lower.defjvp
def _solve_unit_lower_jvp(primals, tangents):
  (M, b), (dM, db) = primals, tangents
  inverse = unit_lower_inverse(M)
  u = exact_matmul(inverse, b)
  return u, exact_matmul(inverse, db - exact_matmul(jnp.tril(dM, -1), u))


def _delta_writes(S, chunk: recurrence.Chunk, kk: jax.Array | None = None):
  """The chunk's writes ``u [B, K, C, D]`` by one unit triangular inverse (the WY/UT form),
  ``U = (I + L)⁻¹ diag(β) (V - (K ⊙ Γ) S_0)`` with ``L_ij = β_i Σ_h k_ih k_jh Γ_ih / Γ_jh``
  (j < i; :func:`pair_weights`, or ``kk`` where the caller formed them); also ``log Γ_i``
  ``[B, K, C, H|1]`` and the state after the chunk."""
  g, beta = chunk.gates  # [B, K, C, H|1] (a decay per head or per key feature), [B, K, C, 1]
  k = chunk.fk
  C = k.shape[2]
  prefix = jnp.cumsum(g, axis=2)  # log Γ_i
  strictly_lower = jnp.tril(jnp.ones((C, C), bool), -1)
  kk = pair_weights(k, k, g) if kk is None else kk
  L = jnp.where(strictly_lower, beta * kk, 0)
  system = L + jnp.eye(C, dtype=L.dtype)[None, None]
  read = jnp.einsum("bkih,bkhd->bkid", k * jnp.exp(prefix), S)  # (S_0ᵀ diag(Γ_i) k_i)ᵀ
  u = solve_unit_lower(system, beta * (chunk.v - read))
  to_end = jnp.exp(suffix_sums(g, 2))  # [B, K, C, H|1]: Γ_C / Γ_j
  S_end = (jnp.exp(prefix[:, :, -1])[..., None] * S
           + jnp.einsum("bkjh,bkjd->bkhd", k * to_end, u))
  return u, prefix, S_end


def _delta_chunk(config, S, chunk: recurrence.Chunk):
  """C queries against the state and the chunk's writes: ``(S_C, out [B, K, G, C, D])``.

  With a query stride n (``config.query_stride``; DeltaProduct, whose token reads after
  its last step) and a decay per head, only the rows ``n - 1, 2n - 1, ...`` are read
  (C a multiple of n); the others are 0.
  """
  stride = config.query_stride
  q = chunk.fq  # [B, K, G, C, H]
  g = chunk.gates[0][:, :, None]  # [B, K, 1, C, H|1]
  k = chunk.fk[:, :, None]  # [B, K, 1, C, H]
  C = q.shape[3]
  if stride > 1 and C % stride == 0 and g.shape[-1] == 1:
    rows = slice(stride - 1, None, stride)
    decay = jnp.exp(segment_sums(g[..., 0], -1))  # [B, K, 1, C(i), C(j)]: 0 where j > i.
    kk = jnp.einsum("bkih,bkjh->bkij", chunk.fk, chunk.fk) * decay[:, :, 0]
    q = q[:, :, :, rows]
    a = jnp.einsum("bkgih,bkjh->bkgij", q, chunk.fk) * decay[:, :, :, rows]
    u, prefix, S_end = _delta_writes(S, chunk, kk=kk)
    prefix = prefix[:, :, rows]
  else:
    # The keys' and the queries' pair weights against the keys in one call: their decays
    # (with one per key feature, most of the work) are formed once.
    weights = pair_weights(jnp.concatenate([k, q], axis=2), k, g)  # [B, K, 1 + G, C, C]
    u, prefix, S_end = _delta_writes(S, chunk, kk=weights[:, :, 0])
    a = weights[:, :, 1:]  # [B, K, G, C, C]
  out = (jnp.einsum("bkgij,bkjd->bkgid", a, u)
         + jnp.einsum("bkgih,bkhd->bkgid", q * jnp.exp(prefix)[:, :, None], S))
  if out.shape[3] != C:  # The rows read, each after stride - 1 zero rows.
    skipped = jnp.zeros_like(out, shape=out.shape[:4] + (stride - 1, out.shape[-1]))
    out = jnp.concatenate([skipped, out[..., None, :]], axis=-2)
    out = out.reshape(out.shape[:3] + (C, out.shape[-1]))
  return S_end, out


def _delta_token(S, x):
  q, k, v, g, beta = x  # [B, K, G, H], [B, K, H], [B, K, D], [B, K, H|1], [B, K, 1]
  S = jnp.exp(g)[..., None] * S
  u = beta * (v - jnp.einsum("bkh,bkhd->bkd", k, S))
  S = S + k[..., None] * u[..., None, :]
  return S, jnp.einsum("bkgh,bkhd->bkgd", q, S)


def _delta_scan(config, S, chunk):
  del config
  return by_token(_delta_token, S, chunk)


def _delta_absorb(config, S, chunk):
  del config
  return _delta_writes(S, chunk)[-1]


_DELTA_BODIES = {"scan": _delta_scan, "chunked": _delta_chunk}



@dataclasses.dataclass(frozen=True)
class DeltaFamily(MatrixFamily):
  """:func:`delta_rule_attention` on the entry pipeline; ``gates = (g, β)`` (g = 0 without
  a decay)."""

  implementations: ClassVar[tuple[str, ...]] = DELTA_IMPLEMENTATIONS
  bodies: ClassVar[Mapping[str, recurrence.Body]] = _DELTA_BODIES
  # Queries only at positions ≡ -1 mod this (the others are zeros whose outputs are
  # dropped: DeltaProduct's steps); the chunked form then skips the other rows.
  query_stride: int = 1
  summary_cls: ClassVar[type] = DeltaSummary
  input_names: ClassVar[tuple[str, ...]] = ("beta", "log_decay")
  static_return_state: ClassVar[bool] = True

  def token_inputs(self, inputs, key):
    beta = TokenInput("beta", Role.WRITE_STRENGTH)
    g = inputs.get("log_decay")
    if g is None:
      return (beta,)
    per_feature = key is not None and jnp.ndim(g) == jnp.ndim(key)
    return (beta, TokenInput("log_decay", Role.DECAY, per_feature=per_feature))

  def chunk_form(self, token_inputs):
    return "kda" if any(x.per_feature for x in token_inputs) else "delta"

  def gates(self, inputs, chunk):
    beta = inputs["beta"]
    return (inputs.get("log_decay", jnp.zeros_like(beta)), beta)

  def absorb(self, config, S, chunk):
    return _delta_absorb(config, S, chunk)

  def reference(self, S0, chunk):
    return _delta_reference(S0, chunk)

  def summary_fields(self, lead, K, H, gates):
    return {"transition": lead + (K, H, H)}

  def continue_from(self, chunk, state, options):
    if not (isinstance(state, DeltaSummary) and options.return_state):
      return chunk, state.kv
    # The keys act on a state as S ↦ A S + B, so the same recurrence run from [S_0 | A_0]
    # with values [v | 0] leaves [A S_0 + B | A A_0]: the summary composed with the keys'.
    H = state.transition.shape[-1]
    v = jnp.concatenate([chunk.v, jnp.zeros_like(chunk.v, shape=chunk.v.shape[:-1] + (H,))], -1)
    return chunk._replace(v=v), jnp.concatenate([state.kv, state.transition], axis=-1)

  def finish(self, out, carry, state, chunk, options):
    if isinstance(state, DeltaSummary) and options.return_state:
      D = state.kv.shape[-1]
      return out[..., :D], DeltaSummary(carry[..., :D], carry[..., D:])
    return out, GatedState(carry)


# The public function --------------------------------------------------------------------


def delta_rule_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    beta: ArrayLike,
    *,
    log_decay: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
    initial_state: GatedState | None = None,
    return_state: bool = False,
    implementation: DeltaImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """The delta rule (DeltaNet; Gated DeltaNet, or KDA with a decay per key feature).

  ``S' = diag(exp(g_t)) S_{t-1}``, ``u_t = β_t (v_t - S'ᵀ k_t)``,
  ``S_t = S' + k_t u_tᵀ``, ``o_t = scale · q_tᵀ S_t``: each write replaces
  part of what the key already stores. The keys are used as given (the
  papers' layers L2-normalise them first).

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``, or ``[B, S, V, D]`` with V a multiple of K (grouped value
      heads: then N = K, and ``beta`` and ``log_decay`` are per value head).
    beta: ``[B, S, K]`` write strengths in [0, 2] (above 1: negative eigenvalues; checked
      where concrete: not under ``jax.jit``).
    log_decay: optional ``g`` ``[B, S, K]`` (Gated DeltaNet) or ``[B, S, K, H]`` (one per
      key feature: KDA), ≤ 0 (None: no decay, DeltaNet); checked where concrete.
    scale: multiplies the query (a static float); default ``1 / sqrt(H)``.
    is_causal: must be True (a recurrence); the default False raises, as for every
      causal-only variant.
    key_value_seq_lengths: optional ``[B]``: keys at or past it are identity steps.
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease along T
      (T == S, ``is_causal=True``): the state is dropped where the id changes, so a
      query sees only its own segment's keys; ``initial_state`` seeds each row's first
      segment and the returned state is its last segment's. Their order is checked
      only where concrete (not under ``jax.jit``).
    initial_state: a :class:`GatedState` to continue from, or a
      :class:`DeltaSummary` (continued from its ``kv``).
    return_state: also return the final state: a :class:`GatedState`, or for a
      summary ``initial_state`` that summary followed by these keys.
    implementation: ``"reference"`` (token by token, every state kept), ``"scan"``
      (token by token on ``lax.scan``) or ``"chunked"`` (the default: the
      WY/UT chunk form, one unit triangular inverse per chunk).
    chunk_size: positions per chunk of ``"scan"`` and ``"chunked"``.
      None: the default backend's measured best, 32 on CPU and 256 on GPU; with a decay
      per key feature (KDA) 16 (docs/benchmarks.md#chunk-size).

  Returns:
    ``[B, T, N, D]`` in the input dtype; with ``return_state`` the pair
    ``(out, state)``. T ≠ S is bottom-right aligned.

  Raises:
    ValueError: for ``is_causal=False``, bad shapes or dtypes of the arrays,
      ``beta`` or ``log_decay``, values out of their ranges (where concrete), a traced
      ``scale``, an unknown implementation, a bad ``chunk_size`` or a state that does
      not match.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))  # [B, T, N=K, H=D]
    >>> k = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    >>> la.delta_rule_attention(x, k, x, jnp.full((1, 16, 2), 0.5), is_causal=True).shape
    (1, 16, 2, 8)

  References:
    Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length", 2024. Yang, Kautz and Hatamizadeh, "Gated Delta
    Networks: Improving Mamba2 with Delta Rule", 2025.
  """
  return run_delta_rule(query, key, value, beta, log_decay=log_decay, scale=scale,
                        is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                        segment_ids=segment_ids, initial_state=initial_state,
                        return_state=return_state, implementation=implementation,
                        chunk_size=chunk_size, fn="delta_rule_attention")


def run_delta_rule(query, key, value, beta, *, log_decay=None, query_stride: int = 1, fn: str,
                   **options):
  """:func:`delta_rule_attention` with any option, its errors under the name ``fn``;
  ``query_stride``: as :attr:`DeltaFamily.query_stride`."""
  return matrix_attention(DeltaFamily(query_stride=query_stride), query, key, value,
                          inputs={"beta": beta, "log_decay": log_decay}, fn=fn, **options)


def delta_rule_attention_step(state: GatedState, query: ArrayLike, key: ArrayLike,
                              value: ArrayLike, beta: ArrayLike, *,
                              log_decay: ArrayLike | None = None,
                              scale: float | None = None) -> tuple[GatedState, jax.Array]:
  """One decoding step of :func:`delta_rule_attention`.

  ``S' = exp(g) S``, ``u = β (v - S'ᵀ k)``, ``S <- S' + k uᵀ``, ``o = scale · qᵀ S``.

  Args:
    state: the :class:`GatedState` so far (``kv [B, K, H, D]``).
    query: ``[B, N, H]`` (no B when unbatched, like the state).
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.
    beta: ``[B, K]`` in [0, 2].
    log_decay: optional ``[B, K]`` (or ``[B, K, H]``: KDA), ≤ 0.
    scale: multiplies the query; default ``1 / sqrt(H)``.

  Returns:
    ``(state, out [B, N, D])``, the state in the dtype it came in.

  Raises:
    ValueError: on ranks or shapes that do not match each other or the state, or
      per-token inputs outside their ranges (where concrete).

  Examples:
    >>> state = la.init_gated_state(batch=1, num_kv_heads=2, head_dim=4, value_dim=4)
    >>> x = jnp.ones((1, 2, 4)) / 2  # [B, N=K, H=D]; a unit key
    >>> state, out = la.delta_rule_attention_step(state, x, x, x, jnp.ones((1, 2)))
    >>> bool(jnp.allclose(state.kv[0, 0].T @ x[0, 0], x[0, 0]))  # β = 1 stores v at k
    True

  References:
    Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length", 2024.
  """
  return one_token(delta_rule_attention, state, query, key, value,
                    {"beta": beta, "log_decay": log_decay}, scale=scale)



# The oracle --------------------------------------------------------------------------------


def _delta_reference(S0, chunk: recurrence.Chunk):
  """The delta rule token by token, written out: one ``lax.scan`` step per key (every
  key's state kept, ``[S, B, K, H, D]``: small S only), then each query reads its own."""
  chunk = aligned(chunk)
  T, S = chunk.num_queries, chunk.num_keys

  def token(state, x):
    k, v, g, beta, *reset = x  # [B, K, H], [B, K, D], [B, K, 1], [B, K, 1] (, [B, 1, 1])
    if reset:  # Packed: a segment start drops the state.
      state = jnp.where(reset[0][..., None], 0, state)
    state = jnp.exp(g)[..., None] * state
    u = beta * (v - jnp.einsum("bkh,bkhd->bkd", k, state))
    state = state + jnp.einsum("bkh,bkd->bkhd", k, u)
    return state, state

  resets = () if chunk.reset is None else (chunk.reset,)
  keys = tuple(jnp.moveaxis(x, 2, 0) for x in (chunk.fk, chunk.v, *chunk.gates, *resets))
  state, states = lax.scan(token, S0, keys)
  return jnp.einsum("bkgth,tbkhd->bkgtd", chunk.fq, states[S - T:]), state



def delta_rule_attention_reference(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, beta: ArrayLike, *,
    log_decay: ArrayLike | None = None, scale: float | None = None, is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None, segment_ids: ArrayLike | None = None,
    initial_state: GatedState | None = None,
    return_state: bool = False, chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """The oracle of :func:`delta_rule_attention`: the token recurrence written out.

  One step per key, keeping every state (small S only), float32. Takes the arrays
  ``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, D]``, ``[B, S, K]`` and the
  options of :func:`delta_rule_attention` but ``implementation``.

  Raises:
    ValueError: as :func:`delta_rule_attention`, under this name.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> beta = jnp.full((1, 8, 2), 0.5)
    >>> fast = la.delta_rule_attention(x, x, x, beta, is_causal=True)
    >>> bool(jnp.allclose(fast, la.delta_rule_attention_reference(
    ...     x, x, x, beta, is_causal=True), atol=1e-5))
    True

  References:
    Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length", 2024.
  """
  return run_delta_rule(query, key, value, beta, log_decay=log_decay, scale=scale,
                        is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                        segment_ids=segment_ids, initial_state=initial_state,
                        return_state=return_state, chunk_size=chunk_size,
                        implementation="reference", fn="delta_rule_attention_reference")


# Summaries, their combine and the registry entries ----------------------------------------


def combine_delta(earlier: Any, later: Any) -> Any:
  """The summary of ``earlier``'s keys followed by ``later``'s (``delta_net``'s and
  ``gated_delta_net``'s ``combine``): ``(B_e, A_e) ∘ (B_l, A_l) = (A_l B_e + B_l, A_l A_e)``.

  Associative, so summaries of consecutive spans combine into the summary of all.
  ``earlier`` may also be a :class:`GatedState` (the state of the keys so far): the
  result is then the state after ``later``'s keys.

  Raises:
    ValueError: for other or mixed types, or fields whose shapes differ.
  """
  kv = check_summaries(earlier, later, DeltaSummary)
  kv = jnp.einsum("...hi,...id->...hd", later.transition, kv) + later.kv
  if type(earlier) is GatedState:
    return GatedState(kv)
  return DeltaSummary(kv, jnp.einsum("...hi,...ij->...hj", later.transition, earlier.transition))


def affine_identity(key: Any, value: Any) -> DeltaSummary | None:
  """The :class:`DeltaSummary` of no keys (zero ``kv``, identity transition)."""
  empty = empty_kv(key, value)
  if empty is None:
    return None
  kv, lead, dtype = empty
  H = kv.shape[-2]
  eye = jnp.eye(H, dtype=dtype).reshape((1,) * (len(lead) + 1) + (H, H))
  return DeltaSummary(kv, jnp.zeros_like(kv, shape=kv.shape[:-1] + (H,)) + eye)


def _summarize(key: Any, value: Any, beta: Any, *, log_decay: Any = None,
               key_value_seq_lengths: Any = None, chunk_size: int | None = None,
               segment_ids: Any = None) -> DeltaSummary:
  """The :class:`DeltaSummary` of ``key [B, S, K, H]`` / ``value [B, S, K, D]`` (the
  recurrence run from the identity summary, as :class:`DeltaSummary` says)."""
  return recurrence.summarize_keys(delta_rule_attention, key, value, beta=beta,
                                   log_decay=log_decay, chunk_size=chunk_size,
                                   initial_state=affine_identity(key, value),
                                   segment_ids=segment_ids,
                                   key_value_seq_lengths=key_value_seq_lengths)


def _register(name: str, token_inputs: tuple[TokenInput, ...]) -> None:
  register_matrix(name, family=DeltaFamily(), function=delta_rule_attention,
                  reference=delta_rule_attention_reference, step=delta_rule_attention_step,
                  summarize=_summarize, identity=affine_identity, combine=combine_delta,
                  token_inputs=token_inputs)


_register("delta_net", (TokenInput("beta", Role.WRITE_STRENGTH),))
_register("gated_delta_net", (TokenInput("beta", Role.WRITE_STRENGTH),
                              TokenInput("log_decay", Role.DECAY)))
# Kimi Delta Attention: the gated delta rule with a decay per key feature.
_register("kda", (TokenInput("beta", Role.WRITE_STRENGTH),
                  TokenInput("log_decay", Role.DECAY, per_feature=True)))
