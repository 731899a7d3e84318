"""The dense softmax core: validation, the float32 oracle and the XLA path.

    out = softmax(Q Kᵀ · scale + bias, masked) V

Both form the ``[B, N, T, S]`` scores. The public dispatcher
(``softmax.softmax_attention``) and the blockwise form (``flash``) build on
this module; sparse patterns use the oracle for their ``reference`` path, and
local's decoding step the XLA path.

Letters: B batch, T query length, S key length, N query heads, K key/value
heads (G = N // K), H query/key head dim, D value head dim.

Masks combine by logical and: the boolean ``mask`` (True = attend), the causal
pattern (query i sees keys ``j <= i + S - T``, bottom-right aligned, see
``masks.causal``) and the padding from ``query_seq_lengths`` /
``key_value_seq_lengths``, and, for packed sequences, equal ``segment_ids``
(query t sees key j only if ``q_ids[b, t] == kv_ids[b, j]``). A query row that
can see no key returns zeros.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from linattn_jax._src import checks
from linattn_jax._src import masks as masks_lib
from linattn_jax._src.online_softmax import online_softmax_finish, softmax_block


class Args(NamedTuple):
  """Validated batched arguments of one softmax attention call."""

  prepared: checks.Prepared
  bias: jax.Array | None  # [B|1, N|1, T|1, S|1]
  mask: jax.Array | None  # [B|1, N|1, T|1, S|1] bool
  is_causal: bool
  scale: float
  query_seq_lengths: jax.Array | None  # [B] int32
  key_value_seq_lengths: jax.Array | None  # [B] int32
  window: tuple[int, int] | None = None  # (left, right) of local_window_size.
  offset: int = 0  # Query i sits at key position i + offset: S - T (bottom-right) or 0.
  segment_ids: tuple[jax.Array, jax.Array] | None = None  # ([B, T], [B, S]) int32.


CausalAlignment = Literal["bottom_right", "top_left"]


def prepare(query, key, value, *, bias, mask, is_causal, scale,
            query_seq_lengths, key_value_seq_lengths, fn: str, local_window_size: Any = None,
            causal_alignment: CausalAlignment = "bottom_right", segment_ids: Any = None) -> Args:
  p = checks.prepare_qkv(query, key, value, fn=fn)
  B, T, S, N, H = p.dims.B, p.dims.T, p.dims.S, p.dims.N, p.dims.H
  # Unbatched calls broadcast masks and biases as jax.nn does: to [1, N, T, S].
  target = (B, N, T, S)
  bias, mask = (
      checks.check_broadcast(x, name=name, target=target, fn=fn, dtype_kind=kind)
      for x, name, kind in ((bias, "bias", "float"), (mask, "mask", "bool"))
  )
  if bias is not None:  # A bias of -inf hides its key: a mask, so that every path sees it.
    visible = ~jnp.isneginf(bias)
    mask = visible if mask is None else mask & visible
  lengths = checks.check_lengths(
      p, fn=fn, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
  )
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  checks.check_choice(causal_alignment, name="causal_alignment",
                      choices=("bottom_right", "top_left"), fn=fn)
  window = (None if local_window_size is None
            else masks_lib.normalize_window(local_window_size, fn=fn, name="local_window_size"))
  offset = S - T if causal_alignment == "bottom_right" else 0
  segments = checks.check_segment_ids(segment_ids, p, fn=fn)
  return Args(p, bias, mask, is_causal, checks.resolve_scale(scale, H), **lengths,
              window=window, offset=offset, segment_ids=segments)


def segment_mask(a: Args) -> jax.Array | None:
  """``[B, 1, T, S]``: True where query and key lie in the same packed segment, or None."""
  if a.segment_ids is None:
    return None
  q_ids, kv_ids = a.segment_ids
  return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


def position_mask(a: Args) -> jax.Array | None:
  """``[T, S]``: the causal and window patterns with query i at key position ``i + offset``."""
  if not a.is_causal and a.window is None:
    return None
  T, S = a.prepared.dims.T, a.prepared.dims.S
  rel = jnp.arange(S)[None, :] - (jnp.arange(T)[:, None] + a.offset)  # Key minus query position.
  ok = rel <= 0 if a.is_causal else jnp.ones((T, S), bool)
  if a.window is not None:
    left, right = a.window
    ok = ok & (rel >= -left) & (rel <= right)
  return ok


def combined_mask(a: Args) -> jax.Array | None:
  """The logical and of every mask in ``a``: ``[B|1, N|1, T, S]``, or None."""
  T, S = a.prepared.dims.T, a.prepared.dims.S
  parts = []
  if a.mask is not None:
    parts.append(a.mask)
  positions = position_mask(a)
  if positions is not None:
    parts.append(positions[None, None])
  segments = segment_mask(a)
  if segments is not None:
    parts.append(segments)
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


def scores(a: Args) -> jax.Array:
  """``q kᵀ·scale + bias`` ``[B, N, T, S]`` in the accumulation dtype, -inf where masked."""
  acc = checks.accumulation_dtype(a.prepared.query.dtype)
  q, k = (x.astype(acc) for x in a.prepared[:2])
  k = jnp.repeat(k, a.prepared.dims.G, axis=2)  # [B, S, N, H]: head n uses kv head n // G.
  s = jnp.einsum("btnh,bsnh->bnts", q, k) * a.scale
  if a.bias is not None:
    s = s + a.bias.astype(acc)
  valid = combined_mask(a)
  return s if valid is None else jnp.where(valid, s, -jnp.inf)


def weights(a: Args) -> jax.Array:
  """The softmax weights ``[B, N, T, S]`` (accumulation dtype); a row with no key is zeros."""
  return online_softmax_finish(softmax_block(scores(a), lambda p: p))[0]


def apply_weights(a: Args, w: jax.Array) -> jax.Array:
  """``Σ_s w[b, n, t, s] v[b, s, n // G]``: ``[B, T, N, D]`` in the input dtype."""
  v = jnp.repeat(a.prepared.value.astype(w.dtype), a.prepared.dims.G, axis=2)
  return jnp.einsum("bnts,bsnd->btnd", w, v).astype(a.prepared.query.dtype)


def reference(a: Args) -> jax.Array:
  return apply_weights(a, weights(a))


def log_sum_exp(a: Args) -> jax.Array:
  """``log Σ_s exp(scores)`` ``[B, T, N]`` (``-inf`` for a row with no key), not differentiated.

  The residual of ``jax.nn.dot_product_attention(..., return_residual=True)``.
  """
  lse = jax.nn.logsumexp(scores(a), axis=-1).transpose(0, 2, 1)
  return jax.lax.stop_gradient(lse).astype(a.prepared.query.dtype)


def xla(a: Args, *, return_residual: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
  """``jax.nn.dot_product_attention(implementation="xla")`` plus what it lacks.

  It needs H == D, so the shorter of the two head dims is zero padded (which
  changes neither Q Kᵀ nor the kept output columns). Its causal and window
  masks put query i at key position i (top-left); other alignments reach it
  as ``mask``. It gives fully masked rows uniform weights; those rows are
  zeroed (and their log-sum-exp is -inf). Its float16 matmuls do not compile
  on CPU, so there float16 runs in float32; so do 16-bit inputs under strict
  dtype promotion, where its gradient would mix dtypes.
  """
  q, k, v = a.prepared[:3]
  dtype = q.dtype
  strict = jax.config.jax_numpy_dtype_promotion == "strict"
  if (dtype == jnp.float16 and jax.default_backend() == "cpu") or (
      strict and dtype in (jnp.bfloat16, jnp.float16)):
    # jax.nn's gradient mixes 16-bit and float32 arrays, which strict promotion refuses.
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  H, D = a.prepared.dims.H, a.prepared.dims.D
  width = max(H, D)
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])  # noqa: E731
  mask, native_causal = a.mask, a.is_causal and a.offset == 0 and a.window is None
  if not native_causal:
    positions = position_mask(a)
    if positions is not None:
      mask = positions[None, None] if mask is None else mask & positions[None, None]
  segments = segment_mask(a)
  if segments is not None:
    mask = segments if mask is None else mask & segments
  # jax.nn promotes bfloat16 with float32 internally, which strict dtype promotion refuses:
  # its own arithmetic runs under the standard rules, ours stays strict.
  with jax.numpy_dtype_promotion("standard"):
    result = jax.nn.dot_product_attention(
        pad(q), pad(k), pad(v),
        bias=a.bias,
        mask=mask,
        scale=a.scale,
        is_causal=native_causal,
        query_seq_lengths=a.query_seq_lengths,
        key_value_seq_lengths=a.key_value_seq_lengths,
        implementation="xla",
        return_residual=return_residual,
    )
  out, lse = result if return_residual else (result, None)
  out = out[..., :D]
  valid = combined_mask(a)
  if valid is not None:
    has_key = jnp.any(valid, axis=-1).transpose(0, 2, 1)  # [B|1, T, N|1]
    out = jnp.where(has_key[..., None], out, 0)
    if lse is not None:
      lse = jnp.where(has_key, lse, -jnp.inf)
  out = out.astype(dtype)
  return (out, lse.astype(dtype)) if return_residual else out


@checks.compiled("is_causal", "scale", "local_window_size", "return_residual", "causal_alignment",
                 concrete_checks={"segment_ids": checks.check_segment_order})
def softmax_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    return_residual: bool = False,
    causal_alignment: CausalAlignment = "bottom_right",
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
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
    scale: logit scale; default ``1 / sqrt(H)``.
    is_causal: query i sees keys ``j <= i + S - T`` (bottom-right aligned).
    query_seq_lengths: optional ``[B]`` ints; rows at or past it return zeros.
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are masked.
    local_window_size: int or ``(left, right)``: keys within the window of the query.
    return_residual: also return the rows' log-sum-exp ``[B, T, N]``.
    causal_alignment: ``"bottom_right"`` or ``"top_left"``, as in :func:`softmax_attention`.
    segment_ids: packed sequences, as in :func:`softmax_attention`: query t sees key j
      only where their segment ids are equal (one int array ``[B, T]`` when T == S, else
      the pair ``(query_segment_ids [B, T], kv_segment_ids [B, S])``).

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype; rows with no visible key
    are zeros. With ``return_residual``, ``(out, lse)``.

  Raises:
    ValueError: on bad ranks, mixed or unsupported dtypes, mismatched batch, length or
      head sizes, a mask that is not boolean, a bias that is not floating point, masks or
      biases that do not broadcast, lengths that are not ``[B]`` ints, a malformed window
      or alignment, a traced ``is_causal``, or malformed ``segment_ids`` (see
      :func:`softmax_attention`).

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
              key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
              causal_alignment=causal_alignment, segment_ids=segment_ids,
              fn="softmax_attention_reference")
  out = reference(a)
  result = (out, log_sum_exp(a)) if return_residual else out
  return jax.tree.map(a.prepared.restore, result)
