"""Exact softmax attention: the public dispatcher over the dense and flash paths.

    out = softmax(Q Kᵀ · scale + bias, masked) V

The dense core (validation, the oracle ``softmax_attention_reference`` and
the XLA path) lives in ``dense``; the blockwise O(T)-memory path in ``flash``.
Letters and mask conventions as in ``dense``.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import jax
from jax.typing import ArrayLike

from linattn_jax._src import checks, dense
from linattn_jax._src.dense import softmax_attention_reference
from linattn_jax._src.flash import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, flash_attention_4d
from linattn_jax._src.registry import AttentionSpec, register_attention

SoftmaxImplementation = Literal["reference", "xla", "flash"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(SoftmaxImplementation)

# `implementation=None` switches to flash once a materialised [B, N, T, S]
# float32 score array would exceed this many elements (2 GiB).
FLASH_THRESHOLD_ELEMENTS = 2**29


@checks.compiled("is_causal", "scale", "implementation")
def softmax_attention(
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
    implementation: SoftmaxImplementation | None = None,
) -> jax.Array:
  """Exact scaled dot-product attention.

  ``out[b, t, n] = sum_s w[b, n, t, s] v[b, s, n // G]`` with
  ``w = softmax_s(q[b, t, n] · k[b, s, n // G] · scale + bias)`` over the
  visible keys. Arguments follow ``jax.nn.dot_product_attention``.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA; K = 1 is MQA).
    value: ``[B, S, K, D]``; D may differ from H.
    bias: optional float array broadcastable to ``[B, N, T, S]``, added to the
      scaled scores. Use ``mask`` rather than ``-inf`` entries to hide keys.
    mask: optional bool array broadcastable to ``[B, N, T, S]``; True = attend.
    is_causal: query i sees keys ``j <= i + S - T`` (bottom-right aligned:
      the last query lines up with the last key, as when decoding T new
      tokens against S cached ones; the static T and S are used).
    scale: logit scale; default ``1 / sqrt(H)``.
    query_seq_lengths: optional ``[B]`` ints; rows at or past it return zeros.
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are masked.
    implementation: ``"reference"`` (float32 einsum oracle), ``"xla"``
      (``jax.nn.dot_product_attention``'s XLA path: fastest when the
      ``[B, N, T, S]`` scores fit in memory), ``"flash"`` (blockwise, O(T)
      memory; no ``bias`` / ``mask``, see :func:`flash_attention`), or None:
      ``"flash"`` when there is no bias or mask and the scores would exceed
      ``FLASH_THRESHOLD_ELEMENTS`` elements, else ``"xla"``.

  Returns:
    ``[B, T, N, D]`` (or ``[T, N, D]``) in the input dtype. Rows with no
    visible key are zeros.

  Raises:
    ValueError: on bad ranks, mixed dtypes, mismatched batch/length/heads,
      masks or biases that do not broadcast, an unknown implementation, or
      an option the chosen implementation does not support.

  Examples:
    >>> q = jnp.ones((2, 16, 8, 64)); kv = jnp.ones((2, 16, 2, 64))
    >>> la.softmax_attention(q, kv, kv, is_causal=True).shape
    (2, 16, 8, 64)

    ``is_causal`` is the mask ``masks.causal(T, S)``, bottom-right aligned for T != S
    (here 3 new queries after 5 cached keys):

    >>> q = jax.random.normal(jax.random.key(0), (1, 3, 2, 4))
    >>> kv = jax.random.normal(jax.random.key(1), (1, 8, 2, 4))
    >>> causal = la.softmax_attention(q, kv, kv, is_causal=True)
    >>> masked = la.softmax_attention(q, kv, kv, mask=masks.causal(3, 8))
    >>> bool(jnp.allclose(causal, masked, atol=1e-6))
    True

  References:
    Vaswani et al., "Attention Is All You Need", 2017. Shazeer, "Fast Transformer
    Decoding: One Write-Head is All You Need", 2019 (MQA). Ainslie et al., "GQA: Training
    Generalized Multi-Query Transformer Models from Multi-Head Checkpoints", 2023.
  """
  return _dispatch(
      query, key, value, bias=bias, mask=mask, is_causal=is_causal, scale=scale,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      implementation=implementation, fn="softmax_attention",
  )


def _dispatch(query, key, value, *, implementation, fn, **options):
  checks.check_choice(
      implementation, name="implementation", choices=(None,) + IMPLEMENTATIONS, fn=fn
  )
  a = dense.prepare(query, key, value, fn=fn, **options)
  if implementation is None:
    B, T, S, N = a.prepared.dims[:4]
    big = B * N * T * S > FLASH_THRESHOLD_ELEMENTS
    implementation = "flash" if big and a.bias is None and a.mask is None else "xla"
  if implementation == "reference":
    out = dense.reference(a)
  elif implementation == "xla":
    out = dense.xla(a)
  else:
    checks.reject_unsupported(fn, "flash", bias=a.bias, mask=a.mask)
    out = flash_attention_4d(
        *a.prepared[:3], is_causal=a.is_causal, scale=a.scale,
        query_seq_lengths=a.query_seq_lengths,
        key_value_seq_lengths=a.key_value_seq_lengths,
        block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
    )
  return a.prepared.restore(out)


register_attention(AttentionSpec(
    name="softmax",
    function=softmax_attention,
    reference=softmax_attention_reference,
    implementations=IMPLEMENTATIONS,
))
