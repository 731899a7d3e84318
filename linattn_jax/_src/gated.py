"""Gated linear attention: linear attention whose state decays (RetNet, simple GLA, GLA).

Letters: B batch, T queries, S keys, N query heads, K key/value heads (G = N / K
query heads share each), H query/key head dim, D value head dim, C chunk length.
The state of each key/value head is a matrix ``S [H, D]`` (no normaliser); a
query reads ``o_t = scale · q_tᵀ S_t``. RetNet has a fixed decay per head;
Mamba2 and simple GLA a data-dependent decay per head; GLA one per key feature::

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ                       g_t ≤ 0, [K] or [K, H]

Each step decays first, then writes. Inside a chunk the decay from key j to
query i is ``exp(Σ_{j<l≤i} g_l)``, formed from sums of log-decays that are never
positive (a decay of -1e4 is a clean reset, no ``exp`` overflows). GLA's decays
per key feature are not one matrix per chunk: its chunk is halved recursively and
each pair of positions decays through the point where it is split.

This module also holds what every matrix-state recurrence shares (the delta rule,
``delta.py``, builds on it): :class:`GatedState`, the :class:`MatrixFamily` that
runs them on the entry pipeline, and their registration.

Keys past ``key_value_seq_lengths`` are identity steps (no decay, no write); T ≠ S
is bottom-right aligned, like every recurrent variant here.

References:
  Sun et al., "Retentive Network: A Successor to Transformer for Large Language
  Models", 2023. Yang et al., "Gated Linear Attention Transformers with
  Hardware-Efficient Training", 2024. Dao and Gu, "Transformers are SSMs"
  (Mamba2), 2024.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import checks, recurrence
from linattn_jax._src.blocks import pad_axis
from linattn_jax._src.decays import segment_sums, suffix_sums
from linattn_jax._src.registry import Role, TokenInput

GatedImplementation = Literal["reference", "scan", "associative_scan", "chunked"]
GATED_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(GatedImplementation)

class GatedState(NamedTuple):
  """The state of :func:`gated_linear_attention` and :func:`delta_rule_attention`.

  Attributes:
    kv: ``[B, K, H, D]`` (``[K, H, D]`` unbatched): ``S``, float32 (float64 for
      float64 inputs). Reading it: ``o = scale · qᵀ S``.

  Examples:
    >>> x = jnp.ones((1, 4, 2, 8))  # [B, T, N=K, H=D]
    >>> _, state = la.gated_linear_attention(x, x, x, jnp.zeros((1, 4, 2)), is_causal=True,
    ...                                     return_state=True)
    >>> state.kv.shape  # [B, K, H, D]
    (1, 2, 8, 8)
  """

  kv: jax.Array


class GatedSummary(NamedTuple):
  """What a span of keys does to a :class:`GatedState` under :func:`gated_linear_attention`.

  The span maps a state ``S`` to ``diag(exp(a)) S + B``: ``a`` is the sum of its
  log-decays, ``B`` its state from zero. Summaries compose associatively
  (:func:`combine_gated`); one from position 0 continues as a state (``S = B``),
  so ``initial_state`` takes either type.

  Attributes:
    kv: ``[B, K, H, D]``: ``B``, float32 (float64 for float64 inputs).
    log_decay: ``a``, ``[B, K]`` for per-head gates or ``[B, K, H]`` for per-feature ones.

  Examples:
    >>> x = jnp.ones((1, 4, 2, 8))  # [B, S, K, H=D]
    >>> s = la.get_spec("simple_gla").streaming.summarize(x, x, log_decay=jnp.full((1, 4, 2), -0.5))
    >>> s.kv.shape, s.log_decay  # [B, K, H, D]; four steps of -0.5
    ((1, 2, 8, 8), Array([[-2., -2.]], dtype=float32))
  """

  kv: jax.Array
  log_decay: jax.Array



# Gated linear attention: bodies on the chunk driver ---------------------------------------
# chunk.fq [B, K, G, C, H] (scaled queries), fk [B, K, C, H], v [B, K, C, D],
# gates = (g [B, K, C, H|1],); the carry is S [B, K, H, D].


def _gla_absorb(config, S, chunk: recurrence.Chunk) -> jax.Array:
  """``S <- exp(Σ g) S + Σ_j exp(Σ_{l>j} g_l) k_j v_jᵀ``."""
  del config
  (g,) = chunk.gates
  total = jnp.sum(g, axis=2)[..., None]  # [B, K, H|1, 1]
  decayed = chunk.fk * jnp.exp(suffix_sums(g, 2))
  return jnp.exp(total) * S + jnp.einsum("bkjh,bkjd->bkhd", decayed, chunk.v)


def _gla_chunk(config, S, chunk: recurrence.Chunk):
  """C queries against the state and the chunk's C keys: ``(S_C, out [B, K, G, C, D])``."""
  (g,) = chunk.gates
  if g.shape[-1] > 1:
    return _gla_chunk_per_feature(S, chunk)
  q, k = chunk.fq, chunk.fk
  prefix = jnp.cumsum(g, axis=2)  # [B, K, C, 1]: Σ_{l≤i} g_l from the chunk's start.
  decay = jnp.exp(segment_sums(g[..., 0], 2))  # [B, K, C(i), C(j)]; 0 where j > i.
  a = jnp.einsum("bkgih,bkjh->bkgij", q, k) * decay[:, :, None]
  out = (jnp.einsum("bkgij,bkjd->bkgid", a, chunk.v)
         + jnp.einsum("bkgih,bkhd->bkgid", q * jnp.exp(prefix)[:, :, None], S))
  return _gla_absorb(config, S, chunk), out


# GLA's chunk form weighs the pairs inside blocks of this many positions directly (C·4·H
# exponentials), and halves above them: the direct blocks grow as C·span·H, the levels
# below them are products too small to run fast; 4 was the fastest span on CPU
# (docs/benchmarks.md#chunk-size).
_GLA_DIRECT_SPAN = 4


def _add_to_half(x: jax.Array, half: int, y: jax.Array) -> jax.Array:
  """``x [..., 2, span, ·]`` with ``y`` added to its first (``half=0``) or second half."""
  parts = [x[..., :1, :, :], x[..., 1:, :, :]]
  parts[half] = parts[half] + y
  return jnp.concatenate(parts, axis=-3)


def _gla_chunk_per_feature(S, chunk: recurrence.Chunk):
  """The chunk form of GLA (a decay per key feature) by recursive halving.

  With ``b_t = Σ_{l≤t} g_l`` inside the chunk, the weight of key s ≤ t for query t
  is ``A_ts = Σ_h q_th k_sh exp(b_th - b_sh)``. Inside blocks of 4 positions
  (``_GLA_DIRECT_SPAN``) it is formed directly, ``exp(Σ_{s<l≤t} g_l)`` from running
  sums. Above them, cut the chunk into halves, each half into halves, and so on down
  to the blocks (Yang et al.'s secondary chunking, applied at every scale): a pair
  s < t in different blocks is split at exactly one level, in a span whose first
  half F holds s and second half L holds t. With m the last position of F::

      b_t - b_s = (b_t - b_m) + (b_m - b_s) = Σ_{m<l≤t} g_l + Σ_{s<l≤m} g_l

  both sums of log-decays over a span inside one half, never a difference, so no
  exponent is positive and a reset cancels nothing. Each level is then a matrix
  product of ``q_t exp(b_t - b_m)`` (L) with ``k_s exp(b_m - b_s)`` (F). No
  ``[C, C, H]`` tensor is formed: the blocks cost ``4 C H`` exponentials, each
  level ``O(C H)``. The span sums of a level come from the level below (a half's
  prefix is its first half's, then that half's total plus the second's), and the
  last level's are the whole chunk's: they read and write the state.

  References:
    Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
    Training", 2024 (secondary-level chunking, section 4.2).
  """
  (g,) = chunk.gates  # [B, K, C, H]
  q, k, v = chunk.fq, chunk.fk, chunk.v
  C = q.shape[-2]
  padded = 1 << (C - 1).bit_length()  # Padded positions: identity steps (g = 0, k = v = 0).
  # [..., P, ·] as [..., P / (Π sizes), *sizes, ·]: blocks of `span`, pairs of halves.
  split = lambda x, *sizes: x.reshape(x.shape[:-2] + (-1, *sizes, x.shape[-1]))  # noqa: E731
  q, k, v, g = (pad_axis(x, x.ndim - 2, padded) for x in (q, k, v, g))
  # Blocks of `span` positions weigh their own pairs directly: [.., blocks, span(t), span(s), H]
  # holds Σ_{s<l≤t} g_l, a running sum down t of g_t where t > s (no difference is formed).
  span = min(_GLA_DIRECT_SPAN, padded)
  g_blocks = split(g, span)  # [B, K, blocks, span, H]
  weights = jnp.exp(segment_sums(g_blocks, 3))  # [.., t, s, H]: exp(b_t - b_s) for s ≤ t, else 0
  a = jnp.einsum("bkgnth,bknsh,bkntsh->bkgnts", split(q, span), split(k, span), weights)
  out = jnp.einsum("bkgnts,bknsd->bkgntd", a, split(v, span))
  out = out.reshape(q.shape[:-1] + v.shape[-1:])
  # Σ_{l≤t} g_l and Σ_{l>s} g_l within t's and s's span of `span` positions.
  prefix = jnp.cumsum(g_blocks, axis=-2).reshape(g.shape)
  suffix = suffix_sums(g_blocks, 3).reshape(g.shape)
  while span < padded:
    halves = lambda x, span=span: split(x, 2, span)  # noqa: E731  [.., 2, span, ·]
    pre, suf = halves(prefix), halves(suffix)  # [B, K, padded / 2span, 2, span, H]
    total = pre[..., -1:, :]  # [.., 2, 1, H]: each half's Σ g, its prefix at its end.
    q_late = halves(q)[..., 1, :, :] * jnp.exp(pre[:, :, None, :, 1])  # exp(b_t - b_m)
    k_early = halves(k)[..., 0, :, :] * jnp.exp(suf[..., 0, :, :])  # exp(b_m - b_s)
    late = jnp.einsum("bkgnts,bknsd->bkgntd", jnp.einsum("bkgnth,bknsh->bkgnts", q_late, k_early),
                      halves(v)[..., 0, :, :])
    out = _add_to_half(halves(out), 1, late[..., None, :, :]).reshape(out.shape)
    prefix = _add_to_half(pre, 1, total[..., :1, :, :]).reshape(g.shape)
    suffix = _add_to_half(suf, 0, total[..., 1:, :, :]).reshape(g.shape)
    span *= 2
  # Now over the whole chunk: exp(b_t) reads the state, exp(b_C - b_s) writes to it.
  out = out + jnp.einsum("bkgth,bkhd->bkgtd", q * jnp.exp(prefix)[:, :, None], S)
  S = (jnp.exp(prefix[..., -1, :])[..., None] * S
       + jnp.einsum("bksh,bksd->bkhd", k * jnp.exp(suffix), v))
  return S, out[..., :C, :]


def _gla_token(S, x):
  q, k, v, g = x  # [B, K, G, H], [B, K, H], [B, K, D], [B, K, H|1]
  S = jnp.exp(g)[..., None] * S + k[..., None] * v[..., None, :]
  return S, jnp.einsum("bkgh,bkhd->bkgd", q, S)


def _gla_scan(config, S, chunk):
  del config
  return by_token(_gla_token, S, chunk)


def _gla_associative_scan(config, S, chunk):
  """Prefix states by the associative ``(a1, S1) ∘ (a2, S2) = (a1 a2, a2 S1 + S2)``
  (``a`` as a log-decay)."""
  del config
  (g,) = chunk.gates

  def compose(earlier, later):
    return earlier[0] + later[0], jnp.exp(later[0])[..., None] * earlier[1] + later[1]

  writes = chunk.fk[..., None] * chunk.v[..., None, :]  # [B, K, C, H, D]
  log_a, states = lax.associative_scan(compose, (g, writes), axis=2)
  states = jnp.exp(log_a)[..., None] * S[:, :, None] + states  # [B, K, C, H, D]
  return states[:, :, -1], jnp.einsum("bkgih,bkihd->bkgid", chunk.fq, states)


_GLA_BODIES = {
    "scan": _gla_scan,
    "associative_scan": _gla_associative_scan,
    "chunked": _gla_chunk,
}


# What every matrix-state recurrence shares -----------------------------------------------


def aligned(chunk: recurrence.Chunk) -> recurrence.Chunk:
  """Keys aligned with the queries (bottom-right): T - S hidden keys in front for T > S."""
  T, S = chunk.num_queries, chunk.num_keys
  return chunk.pad_keys(front=max(T - S, 0))


def by_token(token: Callable[[Any, tuple], tuple[Any, jax.Array]], S, chunk):
  """``token(S, (q, k, v, *gates)) -> (S, out)`` over the chunk's positions
  (:func:`recurrence.scan_tokens`)."""
  return recurrence.scan_tokens(lambda S, one: token(S, (one.fq, one.fk, one.v, *one.gates)),
                                S, chunk._replace(lk=None))


@dataclasses.dataclass(frozen=True)
class MatrixFamily(recurrence.Family):
  """A recurrence whose state per key/value head is a matrix ``S [H, D]`` (no normaliser),
  read as ``o_t = scale · q_tᵀ S_t``: the gated family here, the delta rule in ``delta.py``.

  A subclass names its implementations, its bodies on the chunk driver, its oracle
  (``reference(S_0, chunk) -> (out, S_end)``), its per-token inputs and its span
  summary. The chunk it runs carries the scaled queries in ``fq``, the keys in ``fk``
  and its inputs' arrays in ``gates`` (in the order of :meth:`token_inputs`, each
  ``[B, K, S, H|1]``, 0 at padded keys), the first of them its log-decay. Packed
  sequences reach the bodies as that decay: ``RESET_LOG_DECAY`` where a segment
  starts (the state is dropped, exactly); ``chunk.reset`` stays for the oracle.
  """

  supports_noncausal: ClassVar[bool] = False
  bodies: ClassVar[Mapping[str, recurrence.Body]] = {}
  summary_cls: ClassVar[type] = tuple
  # The per-token inputs its public function takes by name (an entry takes some of them).
  input_names: ClassVar[tuple[str, ...]] = ()

  def default_implementation(self, is_causal):
    del is_causal
    return "chunked"

  def absorb(self, config, S, chunk):
    """Keys every query sees: ``S`` after them."""
    raise NotImplementedError

  def reference(self, S0, chunk):
    """The oracle's ``(out, S_end)``."""
    raise NotImplementedError

  def summary_fields(self, lead: tuple[int, ...], K: int, H: int, gates) -> dict[str, tuple]:
    """The shapes of :attr:`summary_cls`' fields besides ``kv``."""
    raise NotImplementedError

  def gates(self, inputs, chunk):
    """The chunk's ``gates`` from the per-token inputs."""
    return tuple(inputs[x.name] for x in self.token_inputs(inputs, None))

  def start(self, chunk, state, params, inputs, p, options, *, fn):
    del params
    d = p.dims
    scale = checks.resolve_scale(options.scale, d.H)
    chunk = chunk._replace(fq=chunk.fq * scale, lk=None, gates=self.gates(inputs, chunk))
    if chunk.reset is not None:  # A segment start drops the state: its decay becomes exp(-1e4).
      g, *rest = chunk.gates
      chunk = chunk._replace(gates=(jnp.where(chunk.reset, recurrence.RESET_LOG_DECAY, g), *rest))
    if state is None:
      return recurrence.Start(chunk, None, jnp.zeros_like(chunk.v, shape=(d.B, d.K, d.H, d.D)))
    lead = (d.B,) if p.batched else ()
    want = {"kv": lead + (d.K, d.H, d.D)}
    if isinstance(state, self.summary_cls):
      cls = self.summary_cls
      want.update(self.summary_fields(lead, d.K, d.H, chunk.gates))
    elif isinstance(state, GatedState):
      cls = GatedState
    else:
      raise ValueError(
          f"{fn}: initial_state must be a {self.summary_cls.__name__} (fields "
          f"{', '.join(self.summary_cls._fields)}) or a GatedState (field kv); got "
          f"{type(state).__name__}.")
    state = recurrence.check_state(state, cls, want, what="initial_state", fn=fn,
                                   dims=f"B={d.B}, K={d.K}, H={d.H}, D={d.D}"
                                   + ("" if p.batched else " (no B)"))
    state = jax.tree.map(lambda x: (x if p.batched else x[None]).astype(chunk.v.dtype), state)
    chunk, carry = self.continue_from(chunk, state, options)
    return recurrence.Start(chunk, None, carry, state)

  def continue_from(self, chunk, state, options):
    """The chunk and the carry that continue from ``state`` (checked and batched)."""
    del options
    return chunk, state.kv

  def attend(self, carry, chunk, prepare, options):
    del prepare
    if options.implementation == "reference":
      return self.reference(carry, chunk)
    bodies = recurrence.Bodies(self.bodies[options.implementation], self.absorb, None)
    return recurrence.run_chunks(bodies, self, carry, chunk, is_causal=True,
                                 chunk_size=options.chunk_size)

  def finish(self, out, carry, state, chunk, options):
    del chunk, options
    return out, GatedState(carry)


def grouped_value_heads(query: Any, key: Any, value: Any, *, fn: str) -> tuple[Any, Any]:
  """``(query, key)`` with each head repeated for its value heads (grouped value heads).

  A matrix-state recurrence may have ``V = r·K`` value heads (``value [B, S, V, D]``)
  for K query and key heads: value head j reads query and key head ``j // r``, and
  the state, the per-token inputs and the output are per value head (Qwen3-Next's
  Gated DeltaNet; ``HV`` in flash-linear-attention). Repeating the r-fold shared
  heads makes that the ordinary one-head-per-state call. Arrays of other ranks pass
  unchanged (the call names them).

  Raises:
    ValueError: if V is not a multiple of K, or V ≠ K and the query does not have K heads.
  """
  q, k, v = (jnp.asarray(x) for x in (query, key, value))
  if not (q.ndim == k.ndim == v.ndim and q.ndim in (3, 4)) or k.shape[-2] in (0, v.shape[-2]):
    return query, key
  K, V, N = k.shape[-2], v.shape[-2], q.shape[-2]
  if V % K:
    raise ValueError(f"{fn}: key and value head counts differ (K={K} vs V={V}), and V is not "
                     "a multiple of K (grouped value heads: value head j reads key head "
                     f"j // (V / K)); got key {k.shape}, value {v.shape}.")
  if N != K:
    raise ValueError(f"{fn}: with grouped value heads (V={V} value heads for K={K} key "
                     f"heads) the query has one head per key head, N = K = {K}; got query "
                     f"{q.shape}.")
  return jnp.repeat(q, V // K, axis=-2), jnp.repeat(k, V // K, axis=-2)


def matrix_attention(family: MatrixFamily, query: Any, key: Any, value: Any, *, fn: str,
                     **options) -> Any:
  """:func:`recurrence.recurrent_attention` of a matrix-state family, value heads grouped
  (:func:`grouped_value_heads`)."""
  query, key = grouped_value_heads(query, key, value, fn=fn)
  return recurrence.recurrent_attention(family, query, key, value, fn=fn, **options)


def one_token(fn, state, query, key, value, inputs, **options):
  """:func:`recurrence.one_token_step` with per-token inputs ``[B, K(, H)]`` (no B
  unbatched) given a position axis like the arrays."""
  at = jnp.ndim(query) - 2  # The position axis: after B (if any); bad ranks are named there.
  inputs = {name: None if x is None else jnp.expand_dims(jnp.asarray(x), at)
            for name, x in inputs.items()}
  return recurrence.one_token_step(fn, state, query, key, value, **inputs, **options)


# Gated linear attention -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GLAFamily(MatrixFamily):
  """:func:`gated_linear_attention` on the entry pipeline; ``gates = (g,)``."""

  implementations: ClassVar[tuple[str, ...]] = GATED_IMPLEMENTATIONS
  bodies: ClassVar[Mapping[str, recurrence.Body]] = _GLA_BODIES
  summary_cls: ClassVar[type] = GatedSummary
  input_names: ClassVar[tuple[str, ...]] = ("log_decay",)

  def token_inputs(self, inputs, key):
    g = inputs.get("log_decay")
    per_feature = key is not None and g is not None and jnp.ndim(g) == jnp.ndim(key)
    return (TokenInput("log_decay", Role.DECAY, per_feature=per_feature),)

  def gates(self, inputs, chunk):
    return (inputs["log_decay"],)

  def chunk_form(self, token_inputs):
    return "gla" if token_inputs[0].per_feature else "kernel"

  def absorb(self, config, S, chunk):
    return _gla_absorb(config, S, chunk)

  def reference(self, S0, chunk):
    return _gla_reference(S0, chunk)

  def summary_fields(self, lead, K, H, gates):
    return {"log_decay": lead + (K,) + ((H,) if gates[0].shape[-1] > 1 else ())}

  def finish(self, out, carry, state, chunk, options):
    if isinstance(state, GatedSummary):  # Given a summary, return one: it composes with the span.
      total = jnp.sum(chunk.gates[0], axis=2)  # [B, K, H|1]: the span's log-decay.
      per_feature = chunk.gates[0].shape[-1] > 1
      return out, GatedSummary(carry, state.log_decay + (total if per_feature else total[..., 0]))
    return out, GatedState(carry)


# The public function --------------------------------------------------------------------


def gated_linear_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    log_decay: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
    initial_state: GatedState | None = None,
    return_state: bool = False,
    implementation: GatedImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """Linear attention with a decaying state (RetNet, simple GLA, Mamba2, GLA).

  ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ`` from ``S_0 = 0`` (or
  ``initial_state``) and ``o_t = scale · q_tᵀ S_t``: step t decays before it
  writes. No normaliser.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``, or ``[B, S, V, D]`` with V a multiple of K (grouped value
      heads: then N = K, and ``log_decay`` is per value head).
    log_decay: ``g``, ``[B, S, K]`` (one decay per head: constant for RetNet,
      data-dependent for simple GLA / Mamba2) or ``[B, S, K, H]`` (one per key
      feature: GLA); every entry ≤ 0 (``-inf`` or a large negative value resets),
      checked where it is concrete (not under ``jax.jit``).
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
      :class:`GatedSummary` (continued from its ``kv``).
    return_state: also return the final state: a :class:`GatedState`, or for a
      summary ``initial_state`` that summary followed by these keys.
    implementation: ``"reference"`` (the quadratic ``(Q Kᵀ ⊙ Γ) V`` with the
      decay matrix Γ), ``"scan"`` (token by token), ``"associative_scan"``, or
      ``"chunked"`` (the default: chunkwise parallel, O(T) memory).
    chunk_size: positions per chunk of ``"scan"``, ``"associative_scan"`` and ``"chunked"``.
      None: the default backend's measured best, 64 on CPU and 256 on GPU; with a decay
      per key feature (GLA's recursive halving) 128 on CPU.

  Returns:
    ``[B, T, N, D]`` in the input dtype; with ``return_state`` the pair
    ``(out, state)``. T ≠ S is bottom-right aligned.

  Raises:
    ValueError: for ``is_causal=False``, bad shapes or dtypes of the arrays or
      ``log_decay``, a positive ``log_decay`` (where concrete), a traced ``scale``,
      an unknown implementation, a bad ``chunk_size`` or a state that does not match.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))  # [B, T, N=K, H=D]
    >>> g = jnp.full((1, 16, 2), jnp.log(0.9))  # RetNet: a fixed decay per head
    >>> la.gated_linear_attention(x, x, x, g, is_causal=True).shape
    (1, 16, 2, 8)

  References:
    Sun et al., "Retentive Network: A Successor to Transformer for Large
    Language Models", 2023. Yang et al., "Gated Linear Attention Transformers
    with Hardware-Efficient Training", 2024. Dao and Gu, "Transformers are
    SSMs: Generalized Models and Efficient Algorithms Through Structured State
    Space Duality", 2024.
  """
  return _gated(query, key, value, log_decay, scale=scale, is_causal=is_causal,
                key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                initial_state=initial_state,
                return_state=return_state, implementation=implementation,
                chunk_size=chunk_size, fn="gated_linear_attention")


def _gated(query, key, value, log_decay, *, fn: str, **options):
  return matrix_attention(GLAFamily(), query, key, value, inputs={"log_decay": log_decay},
                          fn=fn, **options)


# Decoding --------------------------------------------------------------------------------


def init_gated_state(batch: int, num_kv_heads: int, head_dim: int, value_dim: int,
                     dtype: Any = jnp.float32) -> GatedState:
  """The empty :class:`GatedState`: zeros ``kv [B, K, H, D]``.

  Args:
    batch: B.
    num_kv_heads: K.
    head_dim: H.
    value_dim: D.
    dtype: the state's dtype (float32 for float32, bfloat16 and float16 inputs).

  Returns:
    A :class:`GatedState` of zeros.

  Raises:
    ValueError: if a size is not a positive int.

  Examples:
    >>> la.init_gated_state(batch=2, num_kv_heads=1, head_dim=4, value_dim=3).kv.shape
    (2, 1, 4, 3)
  """
  sizes = checks.positive_sizes(batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                value_dim=value_dim, fn="init_gated_state")
  return GatedState(jnp.zeros(sizes, dtype))




def gated_linear_attention_step(state: GatedState, query: ArrayLike, key: ArrayLike,
                                value: ArrayLike, log_decay: ArrayLike, *,
                                scale: float | None = None) -> tuple[GatedState, jax.Array]:
  """One decoding step of :func:`gated_linear_attention`: ``S <- diag(exp(g)) S + k vᵀ``.

  Args:
    state: the :class:`GatedState` so far (``kv [B, K, H, D]``).
    query: ``[B, N, H]`` (no B when unbatched, like the state).
    key: ``[B, K, H]``.
    value: ``[B, K, D]``.
    log_decay: ``[B, K]`` or ``[B, K, H]``, ≤ 0.
    scale: multiplies the query; default ``1 / sqrt(H)``.

  Returns:
    ``(state, out [B, N, D])``, the state in the dtype it came in.

  Raises:
    ValueError: on ranks or shapes that do not match each other or the state, or
      per-token inputs outside their ranges (where concrete).

  Examples:
    >>> state = la.init_gated_state(batch=1, num_kv_heads=2, head_dim=4, value_dim=4)
    >>> x = jnp.ones((1, 2, 4))  # [B, N=K, H=D]
    >>> state, out = la.gated_linear_attention_step(state, x, x, x, jnp.full((1, 2), -0.1))
    >>> out.shape
    (1, 2, 4)

  References:
    Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
    Training", 2024.
  """
  return one_token(gated_linear_attention, state, query, key, value,
                    {"log_decay": log_decay}, scale=scale)



# The oracle --------------------------------------------------------------------------------


def _gla_reference(S0, chunk: recurrence.Chunk):
  """``(Q Kᵀ ⊙ Γ) V + (Q ⊙ exp(G)) S_0`` with ``Γ_ij = exp(G_i - G_j)``, ``G`` the prefix
  sums of the log-decays, all positions at once (float32; moderate decays only)."""
  chunk = aligned(chunk)
  (g,) = chunk.gates
  T, S = chunk.num_queries, chunk.num_keys
  visible = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + S - T  # [T, S]
  first = last = keeps_S0 = True  # Packed (T == S): S_0 reaches the first segment only.
  if chunk.reset is not None:
    g = jnp.where(chunk.reset, 0, g)  # A start's own decay acts on the dropped state.
    c = recurrence.segment_index(chunk.reset)  # [B, 1, S]
    visible = visible[None, None] & (c[..., :, None] == c[..., None, :])  # [B, 1, T, S]
    first, last = (c == 0)[:, :, None, :, None], (c == c[..., -1:])[..., None]
    keeps_S0 = ~recurrence.any_reset(chunk.reset)[..., None, None]  # [B, 1, 1, 1]
  G = jnp.cumsum(g, axis=2)  # [B, K, S, H|1]
  Gq = G[:, :, S - T:]  # query i sits at key position i + S - T.
  gamma = jnp.exp(jnp.where(visible[..., None], Gq[:, :, :, None] - G[:, :, None], -jnp.inf))
  a = jnp.einsum("bkgih,bkjh,bkijh->bkgij", chunk.fq, chunk.fk,
                 jnp.broadcast_to(gamma, gamma.shape[:-1] + (chunk.fk.shape[-1],)))
  read = jnp.where(first, chunk.fq * jnp.exp(Gq)[:, :, None], 0)
  out = jnp.einsum("bkgij,bkjd->bkgid", a, chunk.v) + jnp.einsum("bkgih,bkhd->bkgid", read, S0)
  to_end = jnp.where(last, jnp.exp(G[:, :, -1:] - G), 0)  # [B, K, S, H|1]
  S_end = (jnp.where(keeps_S0, jnp.exp(G[:, :, -1])[..., None] * S0, 0)
           + jnp.einsum("bkjh,bkjd->bkhd", chunk.fk * to_end, chunk.v))
  return out, S_end



def gated_linear_attention_reference(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, log_decay: ArrayLike, *,
    scale: float | None = None, is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None, segment_ids: ArrayLike | None = None,
    initial_state: GatedState | None = None,
    return_state: bool = False, chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """The oracle of :func:`gated_linear_attention`: ``(Q Kᵀ ⊙ Γ) V`` at once, float32.

  ``Γ_ij = exp(G_i - G_j)`` for the prefix sums ``G`` of ``log_decay`` (moderate
  decays: a reset's large sums cancel here, not in the fast forms). Takes the
  arrays ``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, D]``, ``[B, S, K(, H)]``
  and the options of :func:`gated_linear_attention` but ``implementation``.

  Raises:
    ValueError: as :func:`gated_linear_attention`, under this name.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> g = jnp.full((1, 8, 2), -0.1)
    >>> fast = la.gated_linear_attention(x, x, x, g, is_causal=True)
    >>> bool(jnp.allclose(fast, la.gated_linear_attention_reference(
    ...     x, x, x, g, is_causal=True), atol=1e-5))
    True

  References:
    Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
    Training", 2024.
  """
  return _gated(query, key, value, log_decay, scale=scale, is_causal=is_causal,
                key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                initial_state=initial_state,
                return_state=return_state, chunk_size=chunk_size, implementation="reference",
                fn="gated_linear_attention_reference")


# Summaries, their combine and the registry entries ----------------------------------------


def combine_gated(earlier: Any, later: Any) -> Any:
  """The summary of ``earlier``'s keys followed by ``later``'s (``gla``'s and its siblings'
  ``combine``): ``(B_e, a_e) ∘ (B_l, a_l) = (diag(exp(a_l)) B_e + B_l, a_e + a_l)``.

  Associative, so summaries of consecutive spans combine into the summary of all.
  ``earlier`` may also be a :class:`GatedState` (the state of the keys so far): the
  result is then the state after ``later``'s keys.

  Raises:
    ValueError: for other or mixed types, or fields whose shapes differ.
  """
  kv = check_summaries(earlier, later, GatedSummary)
  decay = jnp.exp(later.log_decay)
  rank = jnp.ndim(kv) - decay.ndim
  if rank not in (1, 2):
    raise ValueError(f"combine: GatedSummary.log_decay {decay.shape} must be [B, K] or "
                     f"[B, K, H] for kv {jnp.shape(kv)}.")
  kv = (decay[..., None, None] if rank == 2 else decay[..., None]) * kv + later.kv
  if type(earlier) is GatedState:
    return GatedState(kv)
  return GatedSummary(kv, earlier.log_decay + later.log_decay)


def check_summaries(earlier: Any, later: Any, cls: type) -> jax.Array:
  """``earlier.kv`` once ``later`` is a ``cls`` and ``earlier`` one too or a
  :class:`GatedState`, with fields of the same shapes; a ValueError otherwise."""
  if type(later) is not cls or type(earlier) not in (cls, GatedState):
    raise ValueError(
        f"combine: later must be a {cls.__name__} and earlier one too or a GatedState; got "
        f"{type(earlier).__name__} and {type(later).__name__}.")
  for field in type(earlier)._fields:
    a, b = jnp.shape(getattr(earlier, field)), jnp.shape(getattr(later, field))
    if a != b:
      raise ValueError(f"combine: {cls.__name__}.{field} has shapes {a} and {b}.")
  return earlier.kv


def empty_kv(key: Any, value: Any) -> tuple[jax.Array, tuple[int, ...], Any] | None:
  """Zeros ``kv [B, K, H, D]`` for ``key [B, S, K, H]`` / ``value [B, S, K, D]`` (no B
  unbatched; K of the value, for grouped value heads), with the lead shape and dtype;
  None for bad ranks (the call names them). Built ``zeros_like`` the key: inside
  shard_map it varies over the devices as they do."""
  key, value = jnp.asarray(key), jnp.asarray(value)
  if key.ndim not in (3, 4) or value.ndim != key.ndim:
    return None
  lead, H, (K, D) = key.shape[:-3], key.shape[-1], value.shape[-2:]  # K: value heads.
  dtype = checks.accumulation_dtype(key.dtype)
  return jnp.zeros_like(key, dtype, shape=lead + (K, H, D)), lead, dtype


def _identity(key: Any, value: Any, *, per_feature: bool) -> GatedSummary | None:
  """The :class:`GatedSummary` of no keys (zero ``kv`` and log-decay)."""
  empty = empty_kv(key, value)
  if empty is None:
    return None
  kv, lead, dtype = empty
  K, H = kv.shape[-3:-1]
  return GatedSummary(kv, jnp.zeros_like(kv, shape=lead + (K,) + ((H,) if per_feature else ())))


def init_like(query: Any, key: Any, value: Any) -> GatedState:
  """The empty :class:`GatedState` ``[B, K, H, D]`` for arrays shaped like ``query``, ``key``,
  ``value`` (the registry's ``init``): what decoding carries, without a summary's decays or
  transitions."""
  query, key = grouped_value_heads(query, key, value, fn="init_gated_state")
  p = checks.prepare_qkv(query, key, value, fn="init_gated_state")
  return GatedState(empty_kv(p.key, p.value)[0])


def _gated_summarize(key: Any, value: Any, log_decay: Any, *, key_value_seq_lengths: Any = None,
                     chunk_size: int | None = None, segment_ids: Any = None) -> GatedSummary:
  """The :class:`GatedSummary` of ``key [B, S, K, H]`` / ``value [B, S, K, D]``."""
  identity = _identity(key, value, per_feature=jnp.ndim(log_decay) == jnp.ndim(key))
  return recurrence.summarize_keys(gated_linear_attention, key, value, log_decay=log_decay,
                                   initial_state=identity, chunk_size=chunk_size,
                                   segment_ids=segment_ids,
                                   key_value_seq_lengths=key_value_seq_lengths)


def _fixed_log_decays(shape: tuple[int, ...], dtype: Any) -> jax.Array:
  """RetNet's ``log γ_i`` with ``γ_i = 1 - 2^(-5-i)`` for (value) head i, broadcast to a
  key's ``shape`` without H (``[B, S, K]``, or ``[B, K]`` for one token)."""
  dtype = checks.accumulation_dtype(dtype)
  if len(shape) < 2:
    return jnp.zeros(shape[:-1], dtype)  # The attention call names the ranks.
  log_gamma = np.log1p(-np.exp2(-5.0 - np.arange(shape[-2])))
  return jnp.broadcast_to(jnp.asarray(log_gamma, dtype), shape[:-1])


def _entry(fn: Any, *, name: str, key_at: int, token_inputs: tuple[TokenInput, ...],
           gates: Any = None, all_inputs: tuple[str, ...]) -> Any:
  """``fn`` as registered under ``name``: its per-token inputs are the keyword-only
  ``token_inputs``, checked against the key (the positional argument at ``key_at``, with
  the value's heads: grouped value heads have inputs per value head) and passed on by
  name; a variant without inputs computes them as ``gates(shape, dtype)`` of that key.
  Inputs of ``fn`` (``all_inputs``) outside ``token_inputs`` are refused."""
  names = tuple(x.name for x in token_inputs)
  signature = inspect.signature(fn)
  params = [p for p in signature.parameters.values() if p.name not in all_inputs]
  positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
  rest = [p for p in params if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD]
  extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]

  @functools.wraps(fn)
  def entry(*args: Any, **kwargs: Any) -> Any:
    given = {n: kwargs.pop(n) for n in names if n in kwargs}
    missing = [n for n in names if n not in given]
    refused = [n for n in all_inputs if n in kwargs]
    if missing or refused:
      raise ValueError(f"{name}: takes the per-token input(s) {list(names)} as keyword "
                       f"arguments; missing {missing}, not taken {refused}.")
    key = args[key_at] if len(args) > key_at else kwargs.get("key")
    value = args[key_at + 1] if len(args) > key_at + 1 else kwargs.get("value")
    shape = jnp.shape(key)
    heads = jnp.shape(value)[-2] if jnp.ndim(value) == len(shape) >= 2 else 0
    if heads and shape[-2] and heads % shape[-2] == 0:  # Grouped value heads: per value head.
      shape = shape[:-2] + (heads, shape[-1])
    if gates is not None:
      return fn(*args, **gates(shape, jnp.result_type(key)), **kwargs)
    if len(shape) >= 2:  # Else the function names the ranks it needs.
      given = {x.name: x.check(given[x.name], shape, fn=name) for x in token_inputs}
    return fn(*args, **given, **kwargs)

  entry.__signature__ = signature.replace(parameters=positional + extra + rest)
  return entry


def register_matrix(name: str, *, family: MatrixFamily, function: Callable[..., Any],
                    reference: Callable[..., Any], step: Callable[..., Any],
                    summarize: Callable[..., Any], identity: Callable[..., Any],
                    combine: Callable[..., Any], token_inputs: tuple[TokenInput, ...],
                    gates: Any = None) -> None:
  """Registers a matrix-state recurrence: each entry point takes ``token_inputs`` by
  keyword (or computes its inputs as ``gates(shape, dtype)`` of the key), decodes from a
  :class:`GatedState`,
  and summarises spans with ``summarize`` / ``identity`` / ``combine``."""
  all_inputs = tuple(dict.fromkeys((*family.input_names, *(x.name for x in token_inputs))))
  entry = functools.partial(_entry, name=name, token_inputs=token_inputs, gates=gates,
                            all_inputs=all_inputs)

  def identity_like(query, key, value):
    query, key = grouped_value_heads(query, key, value, fn="init_gated_state")
    p = checks.prepare_qkv(query, key, value, fn="init_gated_state")
    return identity(p.key, p.value)

  recurrence.register_recurrent(
      name, family=family, function=entry(function, key_at=1),
      reference=entry(reference, key_at=1), init=init_like, identity=identity_like,
      step=entry(step, key_at=2), summarize=entry(summarize, key_at=0),
      token_inputs=token_inputs, combine=combine)


def _register_gla(name: str, token_inputs: tuple[TokenInput, ...], gates: Any = None) -> None:
  per_feature = any(x.per_feature for x in token_inputs)
  register_matrix(name, family=GLAFamily(), function=gated_linear_attention,
                  reference=gated_linear_attention_reference, step=gated_linear_attention_step,
                  summarize=_gated_summarize,
                  identity=functools.partial(_identity, per_feature=per_feature),
                  combine=combine_gated, token_inputs=token_inputs, gates=gates)


# RetNet: a fixed decay per head, no gate inputs.
_register_gla("retention", (),
              gates=lambda shape, dtype: {"log_decay": _fixed_log_decays(shape, dtype)})
_register_gla("simple_gla", (TokenInput("log_decay", Role.DECAY),))
_register_gla("gla", (TokenInput("log_decay", Role.DECAY, per_feature=True),))
