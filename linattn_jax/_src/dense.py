"""The dense softmax core: validation, the float32 oracle and the XLA path.

    out = softmax(Q Kᵀ · scale + bias, masked) V

Both form the ``[B, N, T, S]`` scores. The public dispatcher
(``softmax.softmax_attention``) and the blockwise form (``flash``) build on
this module; sparse patterns use the oracle for their ``reference`` path.

Letters: B batch, T query length, S key length, N query heads, K key/value
heads (G = N // K), H query/key head dim, D value head dim.

Masks combine by logical and: the boolean ``mask`` (True = attend), the causal
pattern (query i sees keys ``j <= i + S - T``, bottom-right aligned, see
``masks.causal``) and the padding from ``query_seq_lengths`` /
``key_value_seq_lengths``. A query row that can see no key returns zeros.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from linattn_jax._src import checks
from linattn_jax._src import masks as masks_lib


class Args(NamedTuple):
  """Validated batched arguments of one softmax attention call."""

  prepared: checks.Prepared
  bias: jax.Array | None  # [B|1, N|1, T|1, S|1]
  mask: jax.Array | None  # [B|1, N|1, T|1, S|1] bool
  is_causal: bool
  scale: float
  query_seq_lengths: jax.Array | None  # [B] int32
  key_value_seq_lengths: jax.Array | None  # [B] int32


def prepare(query, key, value, *, bias, mask, is_causal, scale,
             query_seq_lengths, key_value_seq_lengths, fn: str) -> Args:
  p = checks.prepare_qkv(query, key, value, fn=fn)
  B, T, S, N, _, H, _ = p.dims
  target = (B, N, T, S) if p.batched else (N, T, S)
  bias, mask = (
      checks.check_broadcast(x, name=name, target=target, fn=fn, dtype_kind=kind)
      for x, name, kind in ((bias, "bias", "float"), (mask, "mask", "bool"))
  )
  if not p.batched:
    bias, mask = (None if x is None else x[None] for x in (bias, mask))
  if bias is not None:  # A bias of -inf hides its key: a mask, so that every path sees it.
    visible = ~jnp.isneginf(bias)
    mask = visible if mask is None else mask & visible
  lengths = checks.check_lengths(
      p, fn=fn, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
  )
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  return Args(p, bias, mask, is_causal, checks.resolve_scale(scale, H), **lengths)


def combined_mask(a: Args) -> jax.Array | None:
  """The logical and of every mask in ``a``: ``[B|1, N|1, T, S]``, or None."""
  T, S = a.prepared.dims.T, a.prepared.dims.S
  parts = []
  if a.mask is not None:
    parts.append(a.mask)
  if a.is_causal:
    parts.append(masks_lib.causal(T, S)[None, None])
  if a.query_seq_lengths is not None or a.key_value_seq_lengths is not None:
    parts.append(masks_lib.padding(
        T, S, query_seq_lengths=a.query_seq_lengths,
        key_value_seq_lengths=a.key_value_seq_lengths)[:, None])
  if not parts:
    return None
  out = parts[0]
  for part in parts[1:]:
    out = out & part
  return jnp.broadcast_to(out, out.shape[:2] + (T, S))


def reference(a: Args) -> jax.Array:
  acc = checks.accumulation_dtype(a.prepared.query.dtype)
  q, k, v = (x.astype(acc) for x in a.prepared[:3])
  G = a.prepared.dims.G
  k = jnp.repeat(k, G, axis=2)  # [B, S, N, H]: head n uses kv head n // G.
  v = jnp.repeat(v, G, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, k) * a.scale
  if a.bias is not None:
    s = s + a.bias.astype(acc)
  valid = combined_mask(a)
  if valid is not None:
    s = jnp.where(valid, s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
  l = jnp.sum(p, axis=-1, keepdims=True)
  w = p / jnp.where(l == 0.0, 1.0, l)
  out = jnp.einsum("bnts,bsnd->btnd", w, v)
  return out.astype(a.prepared.query.dtype)


def xla(a: Args) -> jax.Array:
  """``jax.nn.dot_product_attention(implementation="xla")`` plus what it lacks.

  It needs H == D, so the shorter of the two head dims is zero padded (which
  changes neither Q Kᵀ nor the kept output columns). Its ``is_causal`` is
  top-left aligned, so for T != S the bottom-right causal mask is passed as
  ``mask``. It gives fully masked rows uniform weights; those rows are zeroed.
  Its float16 matmuls do not compile on CPU, so there float16 runs in float32.
  """
  q, k, v = a.prepared[:3]
  dtype = q.dtype
  if dtype == jnp.float16 and jax.default_backend() == "cpu":
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  _, T, S, _, _, H, D = a.prepared.dims
  width = max(H, D)
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])  # noqa: E731
  mask = a.mask
  if a.is_causal and T != S:
    causal = masks_lib.causal(T, S)[None, None]
    mask = causal if mask is None else mask & causal
  out = jax.nn.dot_product_attention(
      pad(q), pad(k), pad(v),
      bias=a.bias,
      mask=mask,
      scale=a.scale,
      is_causal=a.is_causal and T == S,
      query_seq_lengths=a.query_seq_lengths,
      key_value_seq_lengths=a.key_value_seq_lengths,
      implementation="xla",
  )[..., :D]
  valid = combined_mask(a)
  if valid is not None:
    has_key = jnp.any(valid, axis=-1).transpose(0, 2, 1)  # [B|1, T, N|1]
    out = jnp.where(has_key[..., None], out, 0)
  return out.astype(dtype)


def softmax_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    bias: Any = None,
    mask: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
) -> jax.Array:
  """The oracle of :func:`softmax_attention`: plain float32 einsums, O(T·S) memory.

  ``out[b, t, n] = Σ_s softmax_s(q[b, t, n]·k[b, s, n // G]·scale + bias) v[b, s, n // G]``
  over the visible keys. Key/value heads are repeated G times, the ``[B, N, T, S]``
  scores, the softmax and the weighted sum are float32, and the output is cast to the
  input dtype. Same arguments and result as :func:`softmax_attention`; the tests judge
  every exact-softmax path (and the sparse patterns) against it. Never optimised.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``.
    bias: optional float array broadcastable to ``[B, N, T, S]``.
    mask: optional bool array broadcastable to ``[B, N, T, S]``; True = attend.
    is_causal: query i sees keys ``j <= i + S - T`` (bottom-right aligned).
    scale: logit scale; default ``1 / sqrt(H)``.
    query_seq_lengths: optional ``[B]`` ints; rows at or past it return zeros.
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are masked.

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype; rows with no visible key
    are zeros.

  Raises:
    ValueError: on bad ranks, mixed or unsupported dtypes, mismatched batch, length or
      head sizes, a mask that is not boolean, a bias that is not floating point, masks or
      biases that do not broadcast, lengths that are not ``[B]`` ints, or a traced
      ``is_causal``.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> ref = la.softmax_attention_reference(x, x, x, is_causal=True)
    >>> ref.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(la.softmax_attention(x, x, x, is_causal=True), ref, atol=1e-5))
    True

  References:
    Vaswani et al., "Attention Is All You Need", 2017.
  """
  a = prepare(query, key, value, bias=bias, mask=mask, is_causal=is_causal, scale=scale,
              query_seq_lengths=query_seq_lengths,
              key_value_seq_lengths=key_value_seq_lengths,
              fn="softmax_attention_reference")
  return a.prepared.restore(reference(a))
