"""Exact softmax attention: the public dispatcher over the dense and flash paths.

    out = softmax(Q Kᵀ · scale + bias, masked) V

The dense core (validation, the oracle ``softmax_attention_reference`` and
the XLA path) lives in ``dense``; the blockwise O(T)-memory path in ``flash``.
Letters and mask conventions as in ``dense``.
"""

from __future__ import annotations

import typing
from typing import Literal

import jax
from jax.typing import ArrayLike

from linattn_jax._src import checks, dense
from linattn_jax._src.dense import CausalAlignment, softmax_attention_reference
from linattn_jax._src.flash import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, flash_attention_4d
from linattn_jax._src.registry import AttentionSpec, register_attention
from linattn_jax._src.sparse import local_attention

SoftmaxImplementation = Literal["reference", "xla", "flash"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(SoftmaxImplementation)

# `implementation=None` runs flash from FLASH_MIN_SCORES scores per head (T·S) on the backends
# where it was measured faster than XLA's path: docs/variants.md#differences-from-jaxnn. Other
# backends keep XLA's fused path until the [B, N, T, S] float32 scores would pass
# FLASH_THRESHOLD_ELEMENTS (2 GiB), where flash's O(T) memory decides.
FLASH_MIN_SCORES: dict[str, int] = {"cpu": 128 * 128}
FLASH_THRESHOLD_ELEMENTS = 2**29


def prefers_flash(B: int, N: int, T: int, S: int, backend: str | None = None) -> bool:
  """Whether ``implementation=None`` picks flash for these sizes on ``backend``.

  ``backend``: ``"cpu"``, ``"gpu"``, ``"tpu"``; None is ``jax.default_backend()``.
  """
  backend = backend or jax.default_backend()
  fastest = FLASH_MIN_SCORES.get(backend)
  return (fastest is not None and T * S >= fastest) or B * N * T * S > FLASH_THRESHOLD_ELEMENTS


@checks.compiled("is_causal", "scale", "implementation", "local_window_size", "return_residual",
                 "causal_alignment",
                 concrete_checks={"segment_ids": checks.check_segment_order})
def softmax_attention(
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
    implementation: SoftmaxImplementation | None = None,
    return_residual: bool = False,
    causal_alignment: CausalAlignment = "bottom_right",
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Exact scaled dot-product attention, with ``jax.nn.dot_product_attention``'s signature.

  ``out[b, t, n] = sum_s w[b, n, t, s] v[b, s, n // G]`` with
  ``w = softmax_s(q[b, t, n] · k[b, s, n // G] · scale + bias)`` over the
  visible keys. Every argument of ``jax.nn.dot_product_attention`` is taken,
  in its order; docs/variants.md#differences-from-jaxnn lists where the results
  differ and why: a row with no visible key is zeros (jax.nn: the mean of the values), D may
  differ from H, and **with T != S, causal and window masks are aligned
  bottom-right** (query i sits at key position ``i + S - T``, as when T new
  tokens follow S - T cached ones) where jax.nn aligns them top-left;
  ``causal_alignment="top_left"`` gives jax.nn's alignment.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA; K = 1 is MQA).
    value: ``[B, S, K, D]``; D may differ from H.
    bias: optional float array broadcastable to ``[B, N, T, S]`` (``[1, N, T, S]``
      unbatched), added to the scaled scores; a ``-inf`` entry hides its key.
    mask: optional bool array broadcastable like ``bias``; True = attend.
    scale: logit scale; default ``1 / sqrt(H)``.
    is_causal: query i sees keys up to its own position (see ``causal_alignment``).
    query_seq_lengths: optional ``[B]`` ints; rows at or past it return zeros.
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are masked.
    local_window_size: int ``w`` or ``(left, right)``: query i sees only keys
      within ``left`` before and ``right`` after its position (an int is
      ``(w, w)``). Without ``bias``, ``mask`` or ``query_seq_lengths``, and
      with the bottom-right alignment, ``implementation=None`` runs it as
      :func:`local_attention` in O(T·window) (with ``segment_ids`` too).
    implementation: ``"reference"`` (float32 einsum oracle), ``"xla"``
      (``jax.nn.dot_product_attention``'s XLA path: fastest when the
      ``[B, N, T, S]`` scores fit in memory), ``"flash"`` (blockwise, O(T)
      memory; no ``bias``, ``mask``, window, residual or top-left alignment,
      see :func:`flash_attention`), or None: a window as above, else
      ``"flash"`` when nothing rules it out and :func:`prefers_flash` (it
      was measured faster on this backend, or the scores would not fit),
      else ``"xla"``.
    return_residual: also return the log-sum-exp of each row's scores,
      ``lse[b, t, n] = log Σ_s exp(scores)`` over the visible keys, as
      jax.nn defines it (``-inf`` for a row with no visible key), without a
      gradient.
    causal_alignment: ``"bottom_right"`` (default) or ``"top_left"`` (query i
      at key position i, as jax.nn); the same when T == S.
    segment_ids: packed sequences (not in jax.nn; appended after its keywords): int
      ids, non-decreasing along the sequence, e.g. ``[0, 0, 0, 1, 1, 2]``. Query t
      sees key j only if ``q_ids[b, t] == kv_ids[b, j]``, in addition to every other
      mask, bias, window and length above, so that one call equals each segment run
      alone (causal alignment inside a segment is the ordinary one). With T == S one
      array ``[B, T]`` (``[T]`` unbatched) serves queries and keys; with T != S (or for
      other ids on the keys) pass the pair ``(query_segment_ids [B, T], kv_segment_ids
      [B, S])`` as a tuple. Shapes and the integer dtype are checked at trace time;
      that the ids do not decrease only on an eager call (under ``jax.jit`` they are
      tracers and cannot be read; there, decreasing ids are not caught and flash,
      which skips key blocks by the segments' ranges, may drop keys of a repeated id).

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype; rows with no
    visible key are zeros. With ``return_residual``, ``(out, lse)`` with
    ``lse`` ``[B, T, N]`` (or ``[T, N]``).

  Raises:
    ValueError: on bad ranks, mixed dtypes, mismatched batch/length/heads,
      masks or biases that do not broadcast, a malformed window or
      alignment, an unknown implementation, or an option the chosen
      implementation does not support; for ``segment_ids`` that are not integers, have
      the wrong shape, are one array where T != S, or (eagerly) decrease.

  Examples:
    >>> q = jnp.ones((2, 16, 8, 64)); kv = jnp.ones((2, 16, 2, 64))
    >>> la.softmax_attention(q, kv, kv, is_causal=True).shape
    (2, 16, 8, 64)

    ``is_causal`` is the mask ``masks.causal(T, S)``, bottom-right aligned for T != S
    (here 3 new queries after 5 cached keys):

    >>> q = jax.random.normal(jax.random.key(0), (1, 3, 2, 4))
    >>> kv = jax.random.normal(jax.random.key(1), (1, 8, 2, 4))
    >>> causal = la.softmax_attention(q, kv, kv, is_causal=True)
    >>> masked = la.softmax_attention(q, kv, kv, None, masks.causal(3, 8)[None, None])
    >>> bool(jnp.allclose(causal, masked, atol=1e-6))
    True

    jax.nn's top-left alignment, and its residual, on request:

    >>> ours, lse = la.softmax_attention(q, kv, kv, is_causal=True, return_residual=True,
    ...                                  causal_alignment="top_left")
    >>> theirs, their_lse = jax.nn.dot_product_attention(q, kv, kv, is_causal=True,
    ...                                                   return_residual=True)
    >>> bool(jnp.allclose(ours, theirs, atol=1e-6)), bool(jnp.allclose(lse, their_lse, atol=1e-6))
    (True, True)

    Packed sequences: one call over two sequences of 3 and 5 tokens equals each alone:

    >>> x = jax.random.normal(jax.random.key(2), (1, 8, 2, 4))
    >>> ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    >>> packed = la.softmax_attention(x, x, x, is_causal=True, segment_ids=ids)
    >>> second = la.softmax_attention(x[:, 3:], x[:, 3:], x[:, 3:], is_causal=True)
    >>> bool(jnp.allclose(packed[:, 3:], second, atol=1e-6))
    True

  References:
    Vaswani et al., "Attention Is All You Need", 2017. Shazeer, "Fast Transformer
    Decoding: One Write-Head is All You Need", 2019 (MQA). Ainslie et al., "GQA: Training
    Generalized Multi-Query Transformer Models from Multi-Head Checkpoints", 2023.
  """
  fn = "softmax_attention"
  checks.check_choice(
      implementation, name="implementation", choices=(None,) + IMPLEMENTATIONS, fn=fn
  )
  a = dense.prepare(
      query, key, value, bias=bias, mask=mask, is_causal=is_causal, scale=scale,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, causal_alignment=causal_alignment, fn=fn,
      segment_ids=segment_ids,
  )
  B, T, S, N = a.prepared.dims[:4]
  general = a.bias is not None or a.mask is not None or return_residual
  aligned = a.offset == S - T  # The bottom-right alignment every other path uses.
  if implementation is None and a.window is not None:
    if not general and aligned and a.query_seq_lengths is None:
      return a.prepared.restore(local_attention(
          *a.prepared[:3], window_size=a.window, is_causal=a.is_causal, scale=a.scale,
          key_value_seq_lengths=a.key_value_seq_lengths, segment_ids=a.segment_ids))
    implementation = "xla"
  if implementation is None:
    faster = prefers_flash(B, N, T, S)
    implementation = "flash" if faster and not general and aligned else "xla"
  if implementation == "flash":
    checks.reject_unsupported(
        "flash", fn=fn, bias=a.bias, mask=a.mask, local_window_size=a.window,
        return_residual=return_residual,
        causal_alignment=None if aligned or not a.is_causal else causal_alignment)
    return a.prepared.restore(flash_attention_4d(
        *a.prepared[:3], is_causal=a.is_causal, scale=a.scale,
        query_seq_lengths=a.query_seq_lengths,
        key_value_seq_lengths=a.key_value_seq_lengths, segment_ids=a.segment_ids,
        block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
    ))
  if implementation == "reference":
    out = dense.reference(a)
    result = (out, dense.log_sum_exp(a)) if return_residual else out
  else:
    result = dense.xla(a, return_residual=return_residual)
  return jax.tree.map(a.prepared.restore, result)


register_attention(AttentionSpec(
    name="softmax",
    function=softmax_attention,
    reference=softmax_attention_reference,
    implementations=IMPLEMENTATIONS,
    forms_weights=True,
    full_softmax=True,
))
