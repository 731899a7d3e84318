"""The kernel families: linear, Performer, Shen's efficient and Heinsen's attention.

These families are one computation. Per key/value head, the keys j a query
sees fold into a fixed-size state::

    kv = Σ_j exp(ℓ_j - μ) φ(k_j) v_jᵀ   [M, D]       k_sum = Σ_j exp(ℓ_j - μ) φ(k_j)   [M]

where ``φ(k_j) [M]`` are the key's features, ``ℓ_j`` its log-scale (a
stabiliser: the sums stand for ``Σ_j exp(ℓ_j) φ(k_j) v_jᵀ``) and
``μ = max_j ℓ_j`` the **running max**, the unit in which the state is kept.
The log-scale has one of two shapes, M' below:

- M' = 1, a scalar per key: 0 for plain maps (elu + 1, ReLU), the row
  maximum of FAVOR+'s exponents;
- M' = M, one per feature: Heinsen's ``exp(k_h)`` is ``φ = 1, ℓ = k``, and
  Shen's key softmax over positions is one online softmax per feature.

A key that raises the running max rescales the state by ``exp(μ_old - μ_new)``
(as in an online softmax), so nothing overflows, and since ``μ`` is a max over
the keys a query sees, no output depends on a later key, not even through the
stabiliser. Two states of consecutive spans combine associatively
(:func:`combine`: rescale both to the larger running max and add), which is
what chunked scans, state passing and context parallelism rely on.

A query reads a state in one of two ways (``read``):

- ``"kernel"`` (linear, Performer, Heinsen): with the query's features
  ``φ(q)`` and log-scale ``ℓ_q``,
  ``out = Σ_h c_h kv_h / (Σ_h c_h k_sum_h + eps)`` where
  ``c_h = φ(q)_h exp(ℓ_q,h + μ_h - max_h'(ℓ_q,h' + μ_h'))``. The per-query
  shift cancels in the ratio; ``eps`` is added in its units.
- ``"per_feature"`` (Shen): ``out = Σ_h φ(q)_h kv_h / k_sum_h``, a softmax
  over keys per feature h, mixed by the query's weights.

Causal attention runs on the one chunk driver (``recurrence.run_chunks``).
The feature map runs inside its checkpointed body, on one chunk at a time
(``prepare``): the ``[T, M]`` features of a whole sequence, and their
cotangents, never exist, and the backward pass recomputes a chunk's features
where it needs them (for Performer this more than halves forward + backward
time and memory: docs/benchmarks.md#chunk-size).

Within a chunk, the ``"chunked"`` body forms the masked ``[C, C]``
matrix of query-key weights. With a per-feature log-scale each query has its
own running max per feature; the chunk's keys are measured against the
running max at its first position instead (one ``exp`` per key and feature,
then matrix products), which is exact for every row whose running max stays
within ``MAX_RISE`` of it; only rows that climb further (keys of wildly
different sizes) are recomputed per query (``[C, C, M]`` exponentials). Each
row's value depends on its own past only, bit for bit. These per-feature
forms run every chunk at once (:func:`_blocks_at_once`): only the states
are scanned, from the chunks' summaries, and every chunk then reads its own
in batched products (faster on CPU, for more memory: docs/benchmarks.md#recurrent-core-timings).

Internal layout: query features ``[B, K, G, T, M|1]`` and log-scales
``[B, K, G, T, M'|1]``; key features ``[B, K, S, M|1]`` and log-scales
``[B, K, S, M']``; values ``[B, K, S, D]``: grouped queries share their
key/value head's state. A size-1 feature axis broadcasts (Heinsen's φ = 1).

Packed sequences (``chunk.reset``): a query's weights keep only its own
segment's keys (``same_segment``) and the state only if no segment starts
before it in the chunk (``carried``); a chunk's state is that of its last
segment, and :func:`combine` takes a ``reset`` that drops the earlier state.
The per-feature chunked form then reads every block through the exact path
(rows of a later segment have maxima of their own).

References:
  Katharopoulos et al., "Transformers are RNNs", 2020 (the recurrent form).
  Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
  Training", 2024 (chunkwise-parallel form).
  Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax._src import checks
from linattn_jax._src.blocks import prefix_sums
from linattn_jax._src.masks import causal
from linattn_jax._src.online_softmax import divide_rows, exponent_shift, safe_divide
from linattn_jax._src.recurrence import (
  Bodies,
  Body,
  Chunk,
  ChunkForm,
  Family,
  Start,
  any_reset,
  carried,
  check_state,
  in_last_segment,
  layout,
  run_chunks,
  same_segment,
  scan_tokens,
)

Read = Literal["kernel", "per_feature"]
DEFAULT_EPS = 1e-6
# A row whose per-feature running max climbs more than this above the chunk's
# first is computed per query: measured against the first, its keys' terms
# would reach exp(MAX_RISE) (and exp(88) overflows float32).
MAX_RISE = 40.0


class Carry(NamedTuple):
  """The core's state per key/value head (accumulation dtype)."""

  kv: jax.Array  # [B, K, M, D]: Σ_j exp(ℓ_j - running_max) φ(k_j) v_jᵀ.
  k_sum: jax.Array  # [B, K, M]: Σ_j exp(ℓ_j - running_max) φ(k_j).
  running_max: jax.Array  # [B, K, M']: max of the keys' ℓ_j seen so far (-inf: none).


def empty_carry(B: int, K: int, M: int, M_log: int, D: int, dtype: Any, *,
                like: jax.Array | None = None) -> Carry:
  """The state of no keys: zero sums, running max ``-inf``.

  ``like``: an input it is built from (``*_like``), so that inside ``shard_map`` it
  varies over the same devices as the inputs and a scan carrying it keeps one type.
  """
  like = jnp.zeros((), dtype) if like is None else like
  return Carry(jnp.zeros_like(like, dtype, shape=(B, K, M, D)),
               jnp.zeros_like(like, dtype, shape=(B, K, M)),
               jnp.full_like(like, -jnp.inf, dtype, shape=(B, K, M_log)))


@dataclasses.dataclass(frozen=True)
class ReadConfig:
  """How queries read the state (see the module docstring); static."""

  read: Read = "kernel"
  eps: float = 0.0


# State algebra ------------------------------------------------------------------


def summarize(chunk: Chunk) -> Carry:
  """The state of a chunk's S keys (all of them: see :func:`summarize_span` for segments)."""
  m = jnp.max(lax.stop_gradient(chunk.lk), axis=-2)
  scale = jnp.exp(chunk.lk - exponent_shift(m)[..., None, :])  # [..., S, M']
  # One log-scale per key: an einsum, so that the gradient for the scale is a batched
  # product, not a reduction over M (XLA:CPU's slow path; see divide_rows).
  if scale.shape[-1] == 1:
    e = jnp.einsum("...sm,...s->...sm", chunk.fk, scale[..., 0])
  else:
    e = chunk.fk * scale  # [..., S, M]
  return Carry(jnp.einsum("...sm,...sd->...md", e, chunk.v), jnp.sum(e, axis=-2), m)


def summarize_span(chunk: Chunk) -> tuple[Carry, jax.Array | None]:
  """``(state, reset)`` of a span of keys: with segment starts in it (``chunk.reset``), the
  state of its last segment's keys and ``reset [B, 1]`` True ("drop the state before,
  then this"); else the state of all of them and None."""
  if chunk.reset is None:
    return summarize(chunk), None
  last = in_last_segment(chunk.reset)[..., None]  # [B, 1, S, 1]
  return (summarize(chunk._replace(lk=jnp.where(last, chunk.lk, -jnp.inf))),
          any_reset(chunk.reset))


def combine(earlier: Carry, later: Carry, reset: jax.Array | None = None) -> Carry:
  """The state of ``earlier``'s keys followed by ``later``'s (associative; shapes broadcast).

  ``reset`` (the shape of ``running_max`` without its last axis, broadcasting): where True,
  ``later`` starts a new segment and ``earlier`` is dropped. With it, pairs ``(state,
  reset)`` compose associatively as ``(combine(a, b, r_b), r_a | r_b)``.
  """
  earlier_max = earlier.running_max
  if reset is not None:
    earlier_max = jnp.where(reset[..., None], -jnp.inf, earlier_max)
  m = lax.stop_gradient(jnp.maximum(earlier_max, later.running_max))
  shift = exponent_shift(m)
  wa, wb = jnp.exp(earlier_max - shift), jnp.exp(later.running_max - shift)
  return Carry(wa[..., None] * earlier.kv + wb[..., None] * later.kv,
               wa * earlier.k_sum + wb * later.k_sum, m)


def _absorb(config: ReadConfig, carry: Carry, chunk: Chunk) -> Carry:
  del config
  return combine(carry, *summarize_span(chunk))


# Reading states -----------------------------------------------------------------


def _coefficients(read: Read, fq, lq, units, running_max, den):
  """Query t's weight on feature h of a state kept in units ``exp(units)``.

  ``"kernel"``: ``φ(q)_h exp(ℓ_q,h + units_h - c_t)`` with the per-query shift
  ``c_t = max_h(ℓ_q,h + running_max_h)`` (it cancels; features not yet seen,
  ``units = -inf``, get 0). ``"per_feature"``: ``φ(q)_h / den_h`` (0 where
  ``den = 0``). Arguments broadcast against ``fq [..., T, M|1]``.
  """
  if read == "per_feature":
    return safe_divide(fq, den)
  if lq.shape[-1] == 1 and running_max.shape[-1] == 1:
    return fq  # Scalar log-scales: the shift is exactly ℓ_q + running_max, exp(0) = 1.
  c = lax.stop_gradient(exponent_shift(jnp.max(lq + running_max, axis=-1, keepdims=True)))
  return fq * jnp.exp(lq + units - c)


def _finish(config: ReadConfig, num, den):
  """``num / (den + eps)`` for a kernel read (0 where that is 0); a per-feature read is done."""
  if config.read == "per_feature":
    return num
  return divide_rows(num, den + config.eps)


def readout(config: ReadConfig, carry: Carry, chunk: Chunk) -> jax.Array:
  """The chunk's queries ``[B, K, G, T, ·]`` read one state ``[B, K, ...]`` or one per
  query ``[B, K, T, ...]``."""
  per_query = carry.kv.ndim == 5
  lift = (lambda x: x[:, :, None]) if per_query else (lambda x: x[:, :, None, None])
  m, k_sum = lift(carry.running_max), lift(carry.k_sum)
  coef = _coefficients(config.read, chunk.fq, chunk.lq, m, m, k_sum)
  num = jnp.einsum("bkgtm,bktmd->bkgtd" if per_query else "bkgtm,bkmd->bkgtd", coef, carry.kv)
  return _finish(config, num, jnp.sum(coef * k_sum, axis=-1))


def exact_weights(config: ReadConfig, carry: Carry, chunk: Chunk, visible: jax.Array | None):
  """Each query's weights in the units of its own running max: ``(a, cw)``.

  ``a [B, K, G, T, S]`` weighs the keys (exact zeros where ``visible [T, S]``
  hides them; None: all visible) and ``cw [B, K, G, T, M]`` the state's
  features, so that ``num = a v + cw kv`` and, for a kernel read,
  ``den = Σ_j a + cw·k_sum``. With segment starts (``chunk.reset``; T == S
  aligned) a query also sees only its own segment's keys, and the state only
  if it is in the span's first segment.
  Per-feature log-scales form ``[T, S, M]`` exponentials: use on chunks.
  """
  fq, lq, fk = chunk.fq, chunk.lq, chunk.fk
  lk = chunk.lk[:, :, None]  # [B, K, 1, S, M']
  state_max = carry.running_max[:, :, None]  # [B, K, 1, M']
  if chunk.reset is not None:
    same = same_segment(chunk.reset)  # [B, 1, T, S]
    visible = same if visible is None else visible[None, None] & same
    state_max = jnp.where(carried(chunk.reset)[..., None], state_max, -jnp.inf)  # [B, K, T, M']
  if visible is not None:
    lk = jnp.where(visible[..., None], lk, -jnp.inf)  # [B, K, T, S, M']
  m = jnp.maximum(state_max, jnp.max(lax.stop_gradient(lk), axis=-2))  # [B, K, T|1, M']
  shift = lax.stop_gradient(exponent_shift(m))
  e = jnp.exp(lk - shift[..., None, :])  # [B, K, T|1, S, M']; 0 where hidden.
  w = jnp.exp(state_max - shift)[:, :, None]  # [B, K, 1, T|1, M']: the state's weight.
  k_sum = carry.k_sum[:, :, None, None]  # [B, K, 1, 1, M]
  coefficients = functools.partial(_coefficients, config.read, fq, lq, m[:, :, None],
                                   m[:, :, None])
  if lk.shape[-1] == 1:  # One log-scale per key: weight = (φ(q)·φ(k)) exp(ℓ_k - m_t).
    e = e[..., 0][:, :, None]  # [B, K, 1, T|1, S]
    coef = coefficients(w * k_sum + jnp.einsum("bkgts,bksm->bkgtm", e, fk))
    a = jnp.einsum("bkgtm,bksm->bkgts", coef, fk)
    a = jnp.where(e > 0, a * e, 0)  # Hidden keys: exact zeros, even where φ(q)·φ(k) = inf.
  else:  # One log-scale per feature: weight = Σ_h coef_h φ(k)_h exp(ℓ_k,h - m_t,h).
    p = fk[:, :, None] * e  # [B, K, T|1, S, M]
    coef = coefficients(w * k_sum + jnp.sum(p, axis=-2)[:, :, None])
    if p.shape[2] == 1:  # No mask: every query has the same keys.
      a = jnp.einsum("bkgtm,bksm->bkgts", coef, p[:, :, 0])
    else:
      a = jnp.einsum("bkgtm,bktsm->bkgts", coef, p)
  return a, coef * w


def _exact_block(config: ReadConfig, carry: Carry, chunk: Chunk,
                 visible: jax.Array | None) -> jax.Array:
  """Queries against the state plus keys ``visible [T, S]``, by :func:`exact_weights`."""
  a, cw = exact_weights(config, carry, chunk, visible)
  num = (jnp.einsum("bkgts,bksd->bkgtd", a, chunk.v)
         + jnp.einsum("bkgtm,bkmd->bkgtd", cw, carry.kv))
  den = jnp.sum(a, axis=-1) + jnp.einsum("bkgtm,bkm->bkgt", cw, carry.k_sum)
  return _finish(config, num, den)


def _chunk_block(config: ReadConfig, carry: Carry, chunk: Chunk):
  """C aligned causal queries against the state and C keys, per-feature log-scales.

  Every key and the state are measured against ``R``, the running max at
  the chunk's first position (which every query of the chunk sees, so ``R``
  is causal): ``e_j = φ(k_j) exp(ℓ_j - R)``, and query t's coefficient
  carries ``exp(R - c_t)``; one exponential per key and feature, then matrix
  products. Exact for the rows whose running max stays within ``MAX_RISE``
  of ``R``; returns ``(out, needs_exact [B, K, C])`` marking the others.
  """
  lk = chunk.lk
  C = lk.shape[2]
  state_max = carry.running_max  # [B, K, M]
  R = jnp.maximum(state_max, lax.stop_gradient(lk[:, :, 0]))  # [B, K, M]
  shift = exponent_shift(R)
  # Key j's climb above R (+inf where a feature starts empty); a row needs the exact form
  # once any key up to it climbed past MAX_RISE.
  climb = jnp.max(jnp.where(lk == -jnp.inf, -jnp.inf, lax.stop_gradient(lk) - R[:, :, None]),
                  axis=-1)  # [B, K, C]
  needs_exact = lax.cummax(climb, axis=2) > MAX_RISE  # [B, K, C]
  # Keys past a row's reach are capped: only rows that need the exact form could see them.
  x = lk - shift[:, :, None]
  e = chunk.fk * jnp.exp(jnp.where(x <= MAX_RISE, x, MAX_RISE))  # [B, K, C, M]
  w = jnp.exp(state_max - shift)  # [B, K, M], <= 1.
  den = (w * carry.k_sum)[:, :, None] + prefix_sums(e, 2)  # [B, K, C, M], units exp(R).
  # A kernel read's per-row shift cancels without eps (attend admits none here): R, which
  # keeps every term within exp(MAX_RISE), serves for all rows.
  coef = _coefficients(config.read, chunk.fq, chunk.lq, R[:, :, None, None], R[:, :, None, None],
                       den[:, :, None])
  # Rows left to the exact form read nothing here (zeros, zero gradients, never inf).
  coef = jnp.where(needs_exact[:, :, None, :, None], 0, coef)
  a = jnp.where(jnp.tril(jnp.ones((C, C), bool)), jnp.einsum("bkgim,bkjm->bkgij", coef, e), 0)
  num = (jnp.einsum("bkgij,bkjd->bkgid", a, chunk.v)
         + jnp.einsum("bkgim,bkmd->bkgid", coef * w[:, :, None, None], carry.kv))
  out = _finish(config, num, jnp.einsum("bkgim,bkim->bkgi", coef, den))
  return out, needs_exact


# Causal bodies of the implementations: (config, carry, chunk) -> (carry, out).


def _chunk_masked(config: ReadConfig, carry: Carry, chunk: Chunk):
  """The masked ``[C, C]`` weights of one chunk (:func:`_exact_block`). With per-feature
  log-scales this forms ``[C, C, M]`` exponentials: :func:`attend` runs those through
  :func:`_blocks_at_once` instead."""
  out = _exact_block(config, carry, chunk, causal(chunk.num_keys))
  return _absorb(config, carry, chunk), out


def _per_token(chunk: Chunk) -> Carry:
  """One state per key: fields ``[B, K, C, ...]``."""
  return summarize(chunk._replace(fk=chunk.fk[..., None, :], lk=chunk.lk[..., None, :],
                                  v=chunk.v[..., None, :]))


def _chunk_scan(config: ReadConfig, carry: Carry, chunk: Chunk):
  def token(carry, one):  # One position: fields without the position axis.
    carry = combine(carry, _per_token(one), None if one.reset is None else one.reset[..., 0])
    return carry, readout(config, carry, one._replace(
        fq=one.fq[:, :, :, None], lq=one.lq[:, :, :, None]))[:, :, :, 0]

  return scan_tokens(token, carry, chunk)


def _chunk_associative_scan(config: ReadConfig, carry: Carry, chunk: Chunk):
  start = jax.tree.map(lambda x: x[:, :, None], carry)
  if chunk.reset is None:
    prefix = lax.associative_scan(combine, _per_token(chunk), axis=2)
    states = combine(start, prefix)  # [B, K, C, ...]
  else:  # (state, reset) pairs: a segment start drops what came before it.
    def compose(a, b):
      return combine(a[0], b[0], b[1]), a[1] | b[1]

    prefix, reset = lax.associative_scan(compose, (_per_token(chunk), chunk.reset[..., 0]),
                                         axis=2)
    states = combine(start, prefix, reset)
  return jax.tree.map(lambda x: x[:, :, -1], states), readout(config, states, chunk)


def _fast_blocks(config: ReadConfig, starts: Carry, blocks: Chunk):
  """:func:`_chunk_block` of every block against the state it starts from (fields with
  the block index first): ``(out [n, B, K, G, C, D], needs_exact [n, B, K, C])``."""
  return jax.vmap(functools.partial(_chunk_block, config))(starts, blocks)


def _exact_blocks(config: ReadConfig, starts: Carry, blocks: Chunk) -> jax.Array:
  """:func:`_exact_block` of every block, one block at a time (``[C, C, M]`` exponentials
  for one block only, recomputed for the gradient)."""
  mask = causal(blocks.lk.shape[3])  # [C, C]: blocks.lk is [n, B, K, C, M].
  one = jax.checkpoint(lambda state, block: _exact_block(config, state, block, mask))
  return lax.map(lambda args: one(*args), (starts, blocks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _read_blocks(config: ReadConfig, starts: Carry, blocks: Chunk) -> jax.Array:
  """Every block's output: :func:`_fast_blocks`, with :func:`_exact_blocks`' rows where
  ``needs_exact``.

  A custom gradient so that the rare exact rows cost nothing when there are none:
  differentiated, a ``lax.cond`` keeps the residuals of both branches, and its
  transpose writes zero cotangents for the operands the taken branch does not read
  (every block's inputs and states, at each call). Here both conds run outside
  differentiation. Reverse mode only (``jax.grad``, ``jax.vjp``).
  """
  return _read_blocks_fwd(config, starts, blocks)[0]


def _read_blocks_fwd(config, starts, blocks):
  out, fast_vjp, needs_exact = jax.vjp(
      functools.partial(_fast_blocks, config), starts, blocks, has_aux=True)
  rows = needs_exact[:, :, :, None, :, None]  # On out [n, B, K, G, C, D].
  any_exact = jnp.any(needs_exact)
  out = lax.cond(any_exact,
                 lambda: jnp.where(rows, _exact_blocks(config, starts, blocks), out),
                 lambda: out)
  return out, (fast_vjp, starts, blocks, rows, any_exact)


def _read_blocks_bwd(config, residuals, g):
  fast_vjp, starts, blocks, rows, any_exact = residuals
  cts = fast_vjp(jnp.where(rows, 0, g))

  def with_exact_rows():
    _, exact_vjp = jax.vjp(functools.partial(_exact_blocks, config), starts, blocks)
    return jax.tree.map(jnp.add, cts, exact_vjp(jnp.where(rows, g, 0)))

  return lax.cond(any_exact, with_exact_rows, lambda: cts)


_read_blocks.defvjp(_read_blocks_fwd, _read_blocks_bwd)


def _blocks_at_once(config: ReadConfig, carry: Carry, blocks: Chunk):
  """The chunked form with per-feature log-scales, every block at once (fields
  ``[n, B, K, ...]``): ``(final carry, out [n, B, K, G, C, D])``.

  Only the states pass from block to block: a scan of :func:`combine` over the
  blocks' summaries gives the state each block starts from, then every block
  is read against its own at once (:func:`_read_blocks`: batched products
  instead of n small ones in a loop).
  """
  def step(state, summary):
    return combine(state, *summary), state

  final, starts = lax.scan(step, carry, jax.vmap(summarize_span)(blocks))
  if blocks.reset is not None:  # Packed: rows of a later segment have their own maxima.
    return final, _exact_blocks(config, starts, blocks)
  return final, _read_blocks(config, starts, blocks)


CAUSAL_BODIES: Mapping[str, Body] = {
    "scan": _chunk_scan,
    "associative_scan": _chunk_associative_scan,
    "chunked": _chunk_masked,
}


def attend(config: ReadConfig, carry: Carry, chunk: Chunk, *, is_causal: bool,
           implementation: str, chunk_size: int,
           prepare: Callable[[Chunk], Chunk] | None = None) -> tuple[jax.Array, Carry]:
  """Output ``[B, K, G, T, D]`` and the final state, from a featurised chunk, or from
  ``recurrence.layout``'s chunk and its ``prepare`` (:func:`featurizing`), applied per
  chunk.

  ``implementation``: ``"reference"`` (the masked ``[T, S]`` weights at
  once), ``"parallel"`` (non-causal: one summary), or a causal body of
  :data:`CAUSAL_BODIES`; without ``is_causal`` every form reads one summary.
  """
  if implementation == "reference":
    chunk = chunk if prepare is None else prepare(chunk)
    visible = causal(chunk.num_queries, chunk.num_keys) if is_causal else None
    return _exact_block(config, carry, chunk, visible), _absorb(config, carry, chunk)
  if not is_causal:  # One summary of every key, read by every query at once.
    chunk_size = max(chunk.num_queries, chunk.num_keys)
  bodies = Bodies(CAUSAL_BODIES[implementation] if is_causal else None, _absorb, readout)
  if is_causal and implementation == "chunked" and carry.running_max.shape[-1] > 1:
    if config.read == "kernel" and config.eps:
      raise ValueError("the chunked form with per-feature log-scales reads a kernel state "
                       f"without eps (Heinsen's); got eps={config.eps}.")
    bodies = bodies._replace(causal_blocks=_blocks_at_once)
  return run_chunks(bodies, config, carry, chunk, is_causal=is_causal, chunk_size=chunk_size,
                    prepare=prepare)

# Feature maps and states ----------------------------------------------------------

# featurizer(params, x [..., H], *, is_query) -> (features [..., M|1],
# log-scale None | [...] | [..., M]); a hashable (static) object, its arrays in params.
Featurizer = Callable[..., tuple[jax.Array, jax.Array | None]]


def _log_scale(features: jax.Array, log_scale: jax.Array | None, dtype) -> jax.Array:
  """A featurizer's log-scale with its trailing axis: ``[..., 1]`` or ``[..., M]``."""
  if log_scale is None:
    return jnp.zeros(features.shape[:-1] + (1,), dtype)
  log_scale = log_scale.astype(dtype)
  return log_scale if log_scale.ndim == features.ndim else log_scale[..., None]


def featurizing(featurizer: Callable[..., Any], dtype) -> Callable[[Chunk], Chunk]:
  """``prepare(chunk)``: a span of ``recurrence.layout``'s chunk, featurised (fields absent
  stay None; hidden keys get lk = -inf, fk = 0). Row-wise, so a chunk's features are those of the
  whole sequence's rows."""
  def prepare(chunk: Chunk) -> Chunk:
    fields = {}
    if chunk.fq is not None:
      fq, lq = featurizer(chunk.fq, is_query=True)
      fq = fq.astype(dtype)
      fields.update(fq=fq, lq=_log_scale(fq, lq, dtype))
    if chunk.fk is not None:
      fk, lk = featurizer(chunk.fk, is_query=False)
      fk = fk.astype(dtype)
      lk = _log_scale(fk, lk, dtype)
      hidden = chunk.lk == -jnp.inf
      fields.update(fk=jnp.where(hidden, 0, fk), lk=jnp.where(hidden, -jnp.inf, lk))
    return chunk._replace(**fields)
  return prepare


def feature_sizes(chunk: Chunk, f: Chunk, *, fn: str) -> tuple[int, int]:
  """``(M, M')`` of ``f``, the featurised ``chunk`` (or its shapes); a ValueError unless the
  feature map keeps the leading axes and gives queries and keys one M."""
  sizes = {x.shape[-1] for x in (f.fq, f.lq, f.fk, f.lk)} - {1}
  if (f.fq.shape[:-1] != chunk.fq.shape[:-1] or f.fk.shape[:-1] != chunk.fk.shape[:-1]
      or len(sizes) > 1 or f.lq.shape[:-1] != f.fq.shape[:-1]
      or f.lk.shape[:-1] != f.fk.shape[:-1]):
    raise ValueError(
        f"{fn}: the feature map must map [..., H] to [..., M] with one M for queries and "
        f"keys; got {chunk.fq.shape} -> {f.fq.shape} and {chunk.fk.shape} -> {f.fk.shape}."
    )
  return max(f.fk.shape[-1], f.lk.shape[-1]), f.lk.shape[-1]


def featurize(p: checks.Prepared, featurizer: Callable[..., Any], lengths, dtype, *,
              fn: str) -> Chunk:
  """The featurised :class:`Chunk` of all positions; padded keys hidden (lk = -inf, fk = v = 0)."""
  chunk = layout(p, lengths, dtype)
  featurised = featurizing(featurizer, dtype)(chunk)
  feature_sizes(chunk, featurised, fn=fn)
  return featurised


def _state_fields(state_cls: type, lead: tuple[int, ...], K: int, M: int, M_log: int,
                  D: int) -> dict[str, tuple[int, ...]]:
  """The shapes of a public state's fields (``kv``, ``k_sum``, optional ``running_max``)."""
  want = {"kv": lead + (K, M, D), "k_sum": lead + (K, M)}
  if "running_max" in state_cls._fields:
    want["running_max"] = lead + (K,) + ((M,) if M_log > 1 else ())
  return want


def as_carry(state) -> Carry:
  """A public state (``kv``, ``k_sum`` and, for stabilised maps, ``running_max``) as a Carry.

  ``running_max`` is per key (``[..., K]``) or per feature (``[..., K, M]``, the
  shape of ``k_sum``); a state without one (plain maps) is in units of ``exp(0)``.
  """
  if "running_max" not in type(state)._fields:  # zeros_like: as device-varying as k_sum.
    return Carry(state.kv, state.k_sum, jnp.zeros_like(jnp.asarray(state.k_sum)[..., :1]))
  rm = jnp.asarray(state.running_max)
  return Carry(state.kv, state.k_sum, rm if rm.ndim == jnp.ndim(state.k_sum) else rm[..., None])


def from_carry(carry: Carry, state_cls: type):
  """The public ``state_cls`` holding ``carry`` (inverse of :func:`as_carry`)."""
  fields = {"kv": carry.kv, "k_sum": carry.k_sum}
  if "running_max" in state_cls._fields:
    rm = carry.running_max
    fields["running_max"] = rm[..., 0] if rm.shape[-1] == 1 else rm
  return state_cls(**fields)


def combine_states(earlier: Any, later: Any) -> Any:
  """The state of ``earlier``'s keys followed by ``later``'s, for any recurrent variant.

  Associative: ``combine_states(combine_states(a, b), c) == combine_states(a,
  combine_states(b, c))``, and combining the summaries of consecutive spans
  equals the summary of their concatenation. Both must be states of one
  variant with the same shapes. Where ``later.reset`` is True (a summary of packed
  keys holding a segment start) the result is ``later`` itself, its ``reset`` kept.

  Raises:
    ValueError: for states of different types, or a field whose shapes differ.
  """
  cls = type(earlier)
  if type(later) is not cls or not hasattr(cls, "_fields") or "kv" not in cls._fields:
    raise ValueError(
        f"combine: both states must be the same variant's state; got {cls.__name__} and "
        f"{type(later).__name__}.")
  for field in cls._fields:
    if field == "reset":  # None, or [B] bool: None is "no segment start".
      continue
    a, b = jnp.shape(getattr(earlier, field)), jnp.shape(getattr(later, field))
    if a != b:
      raise ValueError(f"combine: {cls.__name__}.{field} has shapes {a} and {b}.")
  resets = [getattr(x, "reset", None) for x in (earlier, later)]
  out = from_carry(combine(as_carry(earlier), as_carry(later),
                           None if resets[1] is None else jnp.asarray(resets[1])[..., None]), cls)
  if resets == [None, None]:
    return out
  return out._replace(reset=functools.reduce(
      jnp.logical_or, [jnp.asarray(r) for r in resets if r is not None]))



@dataclasses.dataclass(frozen=True)
class KernelFamily(Family):
  """A kernel variant on the entry pipeline: a feature map and a read rule (static).

  Attributes:
    featurizer: ``featurizer(params, x [..., H], *, is_query) -> (features [..., M|1],
      log-scale None | [...] | [..., M])``; its arrays arrive as ``params``.
    read: how queries read the state (``"kernel"`` or ``"per_feature"``).
    state_cls: the public state NamedTuple (fields ``kv``, ``k_sum`` and, for
      stabilised maps, ``running_max``).
    implementations: the values of ``implementation=`` the variant offers.
    form: whose default chunk size ``chunk_size=None`` takes (None: ``read``'s).
    causal_parallel: whether ``"parallel"`` also runs causally, as every position's
      prefix state at once (an associative scan over one chunk of every position);
      else it is non-causal only.
  """

  featurizer: Featurizer
  read: Read
  state_cls: type
  implementations: tuple[str, ...]
  form: ChunkForm | None = None
  causal_parallel: bool = False

  @property
  def noncausal_only(self) -> frozenset[str]:
    return frozenset() if self.causal_parallel else frozenset({"parallel"})

  def chunk_form(self, token_inputs) -> ChunkForm:
    del token_inputs
    return self.form or self.read

  def start(self, chunk, state, params, inputs, p, options, *, fn):
    del inputs, options
    prepare = featurizing(functools.partial(self.featurizer, params), chunk.v.dtype)
    M, M_log = feature_sizes(chunk, jax.eval_shape(prepare, chunk), fn=fn)  # Shapes only.
    d, dtype = p.dims, chunk.v.dtype
    if state is None:
      return Start(chunk, prepare, empty_carry(d.B, d.K, M, M_log, d.D, dtype, like=chunk.v))
    lead = (d.B,) if p.batched else ()
    state = check_state(state, self.state_cls,
                        _state_fields(self.state_cls, lead, d.K, M, M_log, d.D),
                        dims=f"B={d.B}, K={d.K}, M={M}, D={d.D}" + ("" if p.batched else " (no B)"),
                        what="initial_state", fn=fn)
    carry = jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), as_carry(state))
    return Start(chunk, prepare, carry if p.batched else jax.tree.map(lambda x: x[None], carry))

  def attend(self, carry, chunk, prepare, options):
    implementation, chunk_size = options.implementation, options.chunk_size
    if options.is_causal and implementation == "parallel":  # Every prefix state at once.
      implementation, chunk_size = "associative_scan", max(chunk.num_queries, 1)
    return attend(ReadConfig(self.read, options.eps), carry, chunk, is_causal=options.is_causal,
                  implementation=implementation, chunk_size=chunk_size, prepare=prepare)

  def finish(self, out, carry, state, chunk, options):
    del state, chunk, options
    return out, from_carry(carry, self.state_cls)
