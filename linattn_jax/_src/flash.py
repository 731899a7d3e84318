"""Blockwise exact softmax attention with O(T) memory ("flash" attention).

The forward pass visits key/value blocks with an online softmax (see
``online_softmax``) and never forms a ``[T, S]`` array; it saves only the
output and the per-row log-sum-exp ``lse``. The backward pass recomputes each
block's probabilities ``P = exp(Q Kᵀ·scale - lse)`` and accumulates, per
block (Dao, 2023, FlashAttention-2, Alg. 2)::

    dV += Pᵀ dO
    dP  = dO Vᵀ
    dS  = P ∘ (dP - rowsum(dO ∘ O))
    dQ += dS K · scale
    dK += dSᵀ Q · scale

Causal runs (and runs with lengths or packed ``segment_ids``) skip blocks with no
visible key: segment ids do not decrease, so the keys of a query block's segments
form one contiguous range, found by binary search.
Internal layout: queries ``[B, K, G, T, H]``, keys ``[B, K, S, H]``, values
``[B, K, S, D]``, so grouped queries meet their shared key/value head without
copying it. Blocks are computed in float32 (float64 for float64 inputs).

References:
  Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
  IO-Awareness", 2022. Dao, "FlashAttention-2", 2023.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from linattn_jax._src import checks
from linattn_jax._src.blocks import merge_blocks, num_blocks, pad_axis, split_blocks
from linattn_jax._src.dense import softmax_attention_reference
from linattn_jax._src.masks import causal_predicate, length_predicate
from linattn_jax._src.online_softmax import (
  init_softmax_carry,
  online_softmax_finish,
  online_softmax_update,
)
from linattn_jax._src.registry import AttentionSpec, register_attention

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


@dataclasses.dataclass(frozen=True)
class FlashConfig:
  """Static description of one flash call (hashable: a custom_vjp nondiff arg).

  With :func:`forward` and :func:`backward`, the blockwise kernel that ring
  attention (``parallel.py``) runs on each device's block of keys.
  """

  T: int
  S: int
  block_q: int
  block_k: int
  is_causal: bool
  scale: float

  @property
  def num_q_blocks(self) -> int:
    return num_blocks(self.T, self.block_q)

  @property
  def num_k_blocks(self) -> int:
    return num_blocks(self.S, self.block_k)

  def block_mask(self, i, j, q_len, kv_len, q_seg=None, kv_seg=None) -> jax.Array:
    """Visibility of key block j to query block i: ``[B|1, 1, 1, bq, bk]``.

    ``q_seg`` ``[B, T]`` and ``kv_seg`` ``[B, S]``: segment ids (or None); a key is
    visible only to the queries of its own segment.
    """
    q_pos = i * self.block_q + jnp.arange(self.block_q)
    k_pos = j * self.block_k + jnp.arange(self.block_k)
    ok = jnp.broadcast_to(k_pos[None, :] < self.S, (self.block_q, self.block_k))
    if self.is_causal:
      ok &= causal_predicate(q_pos[:, None], k_pos[None, :], self.T, self.S)
    ok = ok[None] & length_predicate(q_pos, q_len)[:, :, None]
    ok &= length_predicate(k_pos, kv_len)[:, None, :]
    if q_seg is not None:
      q_ids = _block_ids(q_seg, i, self.block_q)  # [B, bq]
      k_ids = _block_ids(kv_seg, j, self.block_k)  # [B, bk]
      ok = ok & (q_ids[:, :, None] == k_ids[:, None, :])
    return ok[:, None, None]

  def key_block_range(self, i, q_len, kv_len, q_seg=None, kv_seg=None):
    """Key blocks ``[lo, hi)`` that query block i can see (traced ints)."""
    lo = jnp.asarray(0)
    hi = jnp.asarray(self.num_k_blocks)
    if q_seg is not None:
      first, last = _segment_span(q_seg, kv_seg, i, self.block_q, self.T)
      lo = jnp.maximum(lo, first // self.block_k)
      hi = jnp.minimum(hi, num_blocks(last, self.block_k))
    if self.is_causal:
      last_q = jnp.minimum((i + 1) * self.block_q, self.T) - 1
      last_k = last_q + (self.S - self.T)
      hi = jnp.minimum(hi, jnp.maximum(last_k // self.block_k + 1, 0))
    if kv_len is not None:
      hi = jnp.minimum(hi, num_blocks(jnp.max(kv_len).astype(hi.dtype), self.block_k))
    if q_len is not None:
      hi = jnp.where(i * self.block_q >= jnp.max(q_len).astype(hi.dtype), lo, hi)
    return lo, hi

  def query_block_range(self, j, q_len, kv_len, q_seg=None, kv_seg=None):
    """Query blocks ``[lo, hi)`` that can see key block j (traced ints)."""
    lo = jnp.asarray(0)
    hi = jnp.asarray(self.num_q_blocks)
    if q_seg is not None:
      first, last = _segment_span(kv_seg, q_seg, j, self.block_k, self.S)
      lo = jnp.maximum(lo, first // self.block_q)
      hi = jnp.minimum(hi, num_blocks(last, self.block_q))
    if self.is_causal:
      first_q = j * self.block_k - (self.S - self.T)
      lo = jnp.maximum(lo, first_q // self.block_q)
    if q_len is not None:
      hi = jnp.minimum(hi, num_blocks(jnp.max(q_len).astype(hi.dtype), self.block_q))
    if kv_len is not None:
      hi = jnp.where(j * self.block_k >= jnp.max(kv_len).astype(hi.dtype), lo, hi)
    return lo, jnp.maximum(lo, hi)


def _pad_ids(ids: jax.Array | None, block: int) -> jax.Array | None:
  """``ids [B, L]`` padded to a multiple of ``block`` by repeating the last id (so that
  they stay non-decreasing); the padded positions are masked by their position."""
  if ids is None:
    return None
  extra = num_blocks(ids.shape[1], block) * block - ids.shape[1]
  return jnp.pad(ids, ((0, 0), (0, extra)), mode="edge") if extra else ids


def _block_ids(ids: jax.Array, i, block: int) -> jax.Array:
  """The ids ``[B, block]`` of block i of ``ids [B, L]`` (padded by :func:`_pad_ids`)."""
  return lax.dynamic_slice_in_dim(_pad_ids(ids, block), i * block, block, axis=1)


def _segment_span(own, other, i, block: int, length: int):
  """``[first, last)``: the positions of ``other [B, L']`` whose segment ids occur in
  block i of ``own [B, length]`` (both non-decreasing), over the whole batch."""
  lo_id = own[:, i * block]
  hi_id = own[:, jnp.minimum((i + 1) * block, length) - 1]
  first = jax.vmap(lambda row, x: jnp.searchsorted(row, x, side="left"))(other, lo_id)
  last = jax.vmap(lambda row, x: jnp.searchsorted(row, x, side="right"))(other, hi_id)
  return jnp.min(first), jnp.max(last)


class Residuals(NamedTuple):
  """What the forward pass saves for :func:`backward` (internal layout)."""

  q: jax.Array  # [B, K, G, T, H]
  k: jax.Array  # [B, K, S, H]
  v: jax.Array  # [B, K, S, D]
  out: jax.Array  # [B, K, G, T, D] in the input dtype.
  lse: jax.Array  # [B, K, G, T] in the accumulation dtype; -inf for a row with no key.
  q_len: jax.Array | None  # [B] int32, or None: every query row counts.
  kv_len: jax.Array | None  # [B] int32, or None: every key counts.
  q_seg: jax.Array | None = None  # [B, T] int32 segment ids, or None: one segment.
  kv_seg: jax.Array | None = None  # [B, S] int32.


def _scores(cfg: FlashConfig, q_blk, k_blk, i, j, q_len, kv_len, q_seg=None,
            kv_seg=None) -> jax.Array:
  """Masked, scaled scores (accumulation dtype) ``[B, K, G, bq, bk]`` of one block pair."""
  acc = checks.accumulation_dtype(q_blk.dtype)
  s = jnp.einsum("bkgqh,bkch->bkgqc", q_blk.astype(acc), k_blk.astype(acc))
  return jnp.where(cfg.block_mask(i, j, q_len, kv_len, q_seg, kv_seg), s * cfg.scale,
                   -jnp.inf)


def forward(cfg: FlashConfig, q, k, v, q_len, kv_len, q_seg=None, kv_seg=None):
  """Output ``[B, K, G, T, D]`` (input dtype) and its log-sum-exp ``[B, K, G, T]`` from
  ``q [B, K, G, T, H]``, ``k [B, K, S, H]``, ``v [B, K, S, D]``, optional lengths and
  optional segment ids ``q_seg [B, T]``, ``kv_seg [B, S]`` (both or neither)."""
  B, K, G, _, _ = q.shape
  D = v.shape[-1]
  acc = checks.accumulation_dtype(q.dtype)
  q_blocks = split_blocks(q, 3, cfg.block_q)  # [nq, B, K, G, bq, H]
  k_blocks = split_blocks(k, 2, cfg.block_k)  # [nk, B, K, bk, H]
  v_blocks = split_blocks(v, 2, cfg.block_k)  # [nk, B, K, bk, D]
  q_seg, kv_seg = _pad_ids(q_seg, cfg.block_q), _pad_ids(kv_seg, cfg.block_k)  # Once.

  def one_query_block(args):
    i, q_blk = args

    def visit(j, carry):
      s = _scores(cfg, q_blk, k_blocks[j], i, j, q_len, kv_len, q_seg, kv_seg)
      v_blk = v_blocks[j].astype(acc)
      return online_softmax_update(
          carry, s, lambda p: jnp.einsum("bkgqc,bkcd->bkgqd", p, v_blk)
      )

    lo, hi = cfg.key_block_range(i, q_len, kv_len, q_seg, kv_seg)
    carry = lax.fori_loop(lo, hi, visit,
                          init_softmax_carry((B, K, G, cfg.block_q), D, acc, like=q_blk))
    return online_softmax_finish(carry)

  out, lse = lax.map(one_query_block, (jnp.arange(cfg.num_q_blocks), q_blocks))
  return merge_blocks(out, 3, cfg.T).astype(q.dtype), merge_blocks(lse, 3, cfg.T)


def backward(cfg: FlashConfig, residuals: Residuals,
             d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(dq, dk, dv)`` from the saved :class:`Residuals` and ``d_out [B, K, G, T, D]``
  (FlashAttention-2's backward: P recomputed per block pair from the saved lse)."""
  q, k, v, out, lse, q_len, kv_len, q_seg, kv_seg = residuals
  acc = checks.accumulation_dtype(q.dtype)
  # delta_t = rowsum(dO ∘ O) = sum_j P_tj dP_tj, the softmax-Jacobian term.
  delta = jnp.sum(d_out.astype(acc) * out.astype(acc), axis=-1)
  # Rows that saw no key have lse = -inf; +inf makes their P exactly 0.
  lse = pad_axis(jnp.where(lse == -jnp.inf, jnp.inf, lse), 3, cfg.block_q, jnp.inf)
  q_blocks = split_blocks(q, 3, cfg.block_q)
  do_blocks = split_blocks(d_out, 3, cfg.block_q)
  lse_blocks = split_blocks(lse, 3, cfg.block_q)
  delta_blocks = split_blocks(delta, 3, cfg.block_q)
  k_blocks = split_blocks(k, 2, cfg.block_k)
  v_blocks = split_blocks(v, 2, cfg.block_k)
  q_seg, kv_seg = _pad_ids(q_seg, cfg.block_q), _pad_ids(kv_seg, cfg.block_k)  # Once.

  # dK and dV are accumulated transposed, [H, C] and [D, C]: as ``q_blockᵀ · dS`` and
  # ``dO_blockᵀ · P`` the products read the [Q, C] blocks as they lie, and only the small
  # query-side blocks are transposed (as ``dSᵀ · q`` XLA:CPU copied every [Q, C] block
  # transposed first). Timings: docs/variants.md#differences-from-jaxnn.
  def one_key_block(d_q, args):
    j, k_blk, v_blk = args
    k_acc, v_acc = k_blk.astype(acc), v_blk.astype(acc)

    def visit(i, carry):
      d_q, d_k, d_v = carry
      q_acc = q_blocks[i].astype(acc)
      do_acc = do_blocks[i].astype(acc)
      s = _scores(cfg, q_blocks[i], k_blk, i, j, q_len, kv_len, q_seg, kv_seg)
      p = jnp.exp(s - lse_blocks[i][..., None])
      d_v = d_v + jnp.einsum("bkgqd,bkgqc->bkdc", do_acc, p)
      d_p = jnp.einsum("bkgqd,bkcd->bkgqc", do_acc, v_acc)
      d_s = p * (d_p - delta_blocks[i][..., None]) * cfg.scale
      d_q = d_q.at[i].add(jnp.einsum("bkgqc,bkch->bkgqh", d_s, k_acc))
      d_k = d_k + jnp.einsum("bkgqh,bkgqc->bkhc", q_acc, d_s)
      return d_q, d_k, d_v

    lo, hi = cfg.query_block_range(j, q_len, kv_len, q_seg, kv_seg)
    init = (d_q, jnp.zeros_like(jnp.swapaxes(k_blk, -1, -2), acc),
            jnp.zeros_like(jnp.swapaxes(v_blk, -1, -2), acc))
    d_q, d_k, d_v = lax.fori_loop(lo, hi, visit, init)
    return d_q, (jnp.swapaxes(d_k, -1, -2), jnp.swapaxes(d_v, -1, -2))

  d_q0 = jnp.zeros_like(q_blocks, acc)  # *_like: device-varying as q (shard_map).
  d_q, (d_k, d_v) = lax.scan(
      one_key_block, d_q0, (jnp.arange(cfg.num_k_blocks), k_blocks, v_blocks)
  )
  d_q = merge_blocks(d_q, 3, cfg.T).astype(q.dtype)
  d_k = merge_blocks(d_k, 2, cfg.S).astype(k.dtype)
  d_v = merge_blocks(d_v, 2, cfg.S).astype(v.dtype)
  return d_q, d_k, d_v


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: FlashConfig, q, k, v, q_len, kv_len, q_seg, kv_seg):
  return forward(cfg, q, k, v, q_len, kv_len, q_seg, kv_seg)[0]


def _flash_fwd(cfg: FlashConfig, q, k, v, q_len, kv_len, q_seg, kv_seg):
  out, lse = forward(cfg, q, k, v, q_len, kv_len, q_seg, kv_seg)
  return out, Residuals(q, k, v, out, lse, q_len, kv_len, q_seg, kv_seg)


def _flash_bwd(cfg: FlashConfig, residuals: Residuals, d_out):
  # Lengths and segment ids are integers: no gradient.
  return *backward(cfg, residuals, d_out), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_4d(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    is_causal: bool,
    scale: float,
    query_seq_lengths: jax.Array | None,
    key_value_seq_lengths: jax.Array | None,
    block_q: int,
    block_k: int,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """Flash attention on validated ``[B, T, N, H]`` arrays (no checks); ``segment_ids`` as
  :func:`checks.check_segment_ids` returns them."""
  B, T, N, H = query.shape
  _, S, K, D = value.shape
  G = N // K
  cfg = FlashConfig(
      T=T, S=S, block_q=min(block_q, T), block_k=min(block_k, S),
      is_causal=bool(is_causal), scale=float(scale),
  )
  q = query.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
  k = key.transpose(0, 2, 1, 3)  # [B, K, S, H]
  v = value.transpose(0, 2, 1, 3)  # [B, K, S, D]
  q_seg, kv_seg = (None, None) if segment_ids is None else segment_ids
  out = _flash(cfg, q, k, v, query_seq_lengths, key_value_seq_lengths, q_seg, kv_seg)
  return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, D)


@checks.compiled("is_causal", "scale", "block_q", "block_k",
                 concrete_checks={"segment_ids": checks.check_segment_order})
def flash_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
) -> jax.Array:
  """Exact softmax attention in O(T) memory, blockwise with an online softmax.

  Computes ``softmax(Q Kᵀ · scale, masked) V`` like
  :func:`softmax_attention`, visiting ``block_q x block_k`` tiles so that no
  ``[T, S]`` array is formed, forward or backward. The backward pass is a
  ``custom_vjp`` that saves only the output and the per-row log-sum-exp and
  recomputes each tile. Causal runs skip tiles above the diagonal; lengths
  need not be multiples of the block sizes.

  Args:
    query: ``[B, T, N, H]`` (or ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA / MQA).
    value: ``[B, S, K, D]``; D may differ from H.
    is_causal: query i sees keys ``j <= i + S - T`` (bottom-right aligned).
    scale: logit scale, default ``1 / sqrt(H)``.
    query_seq_lengths: optional ``[B]`` ints; rows at or past it return zeros.
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are masked.
    block_q: query tile length (static).
    block_k: key tile length (static).
    segment_ids: packed sequences, as in :func:`softmax_attention`: int ids,
      non-decreasing along the sequence; query t sees key j only if
      ``q_ids[b, t] == kv_ids[b, j]``. One array ``[B, T]`` when T == S, or the pair
      ``(query_segment_ids [B, T], kv_segment_ids [B, S])`` (required when T != S).
      The tiles of a query block's keys outside its segments are skipped, forward and
      backward (the keys of its segments form one range, as the ids do not decrease).
      Shapes and dtype are checked at trace time; the order only on an eager call:
      under ``jax.jit``, decreasing ids are not caught and may drop keys.

  Returns:
    ``[B, T, N, D]`` in the input dtype; rows with no visible key are zero.

  Raises:
    ValueError: on bad shapes, dtypes, lengths or block sizes (``block_q``, ``block_k``
      must be positive ints), a traced ``is_causal``, ``scale`` or block size
      (they are static), or malformed ``segment_ids`` (non-integer, wrong shape, one
      array where T != S, or eagerly, decreasing ids).

  Examples:
    >>> q = k = v = jnp.ones((1, 1000, 2, 16))
    >>> la.flash_attention(q, k, v, is_causal=True, block_q=256).shape
    (1, 1000, 2, 16)

    The result is exact: it equals :func:`softmax_attention`, also when the lengths are
    not multiples of the blocks:

    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> flash = la.flash_attention(x, x, x, is_causal=True, block_q=4, block_k=3)
    >>> bool(jnp.allclose(flash, la.softmax_attention(x, x, x, is_causal=True), atol=1e-5))
    True

  References:
    Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
    IO-Awareness", 2022; Dao, "FlashAttention-2", 2023.
  """
  fn = "flash_attention"
  p = checks.prepare_qkv(query, key, value, fn=fn)
  lengths = checks.check_lengths(
      p, fn=fn, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
  )
  out = flash_attention_4d(
      p.query, p.key, p.value,
      is_causal=is_causal,  # A static bool: checked by checks.compiled.
      scale=checks.resolve_scale(scale, p.dims.H),
      block_q=checks.check_positive_int(block_q, name="block_q", fn=fn),
      block_k=checks.check_positive_int(block_k, name="block_k", fn=fn),
      segment_ids=checks.check_segment_ids(segment_ids, p, fn=fn),
      **lengths,
  )
  return p.restore(out)


register_attention(AttentionSpec(
    name="flash",
    function=flash_attention,
    reference=softmax_attention_reference,
    how_options=frozenset({"block_q", "block_k"}),
    full_softmax=True,
))
