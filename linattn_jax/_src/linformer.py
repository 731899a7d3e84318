"""Linformer: softmax attention over keys and values projected along the sequence.

Learned projections ``E, F [P, L]`` (P projected rows, L the longest sequence
they were made for) map the S keys and values to P rows each, and the T
queries attend to those with an exact softmax::

    K̃ = E_S K   [P, H]        Ṽ = F_S V   [P, D]        out = softmax(Q K̃ᵀ · scale) Ṽ

``E_S``, ``F_S`` are the first S columns (S <= L), with the columns of padded
keys (``key_value_seq_lengths``) zeroed, so that a padded key reaches no
projected row. Cost O(T·P) instead of O(T·S); the projections are shared by
every head (GQA / MQA as usual: K key/value heads, N query heads).

Non-causal only: every projected row sums over all positions, so no query can
be kept from later keys. Not streaming either (there is no state to decode
from: a new key changes every projected row).

Implementations: ``"reference"`` (plain float32 einsums, the oracle) and
``"xla"`` (the projection, then ``softmax_attention``'s XLA path, i.e.
``jax.nn.dot_product_attention``, on the float32 projected rows).

References:
  Wang et al., "Linformer: Self-Attention with Linear Complexity", 2020.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from linattn_jax._src import checks
from linattn_jax._src.registry import AttentionSpec, ParamSpec, register_attention
from linattn_jax._src.softmax import softmax_attention

LinformerImplementation = Literal["reference", "xla"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(LinformerImplementation)
DEFAULT_PROJECTED_LENGTH = 256
DEFAULT_MAX_LENGTH = 512


def _check_projections(key_projection: Any, value_projection: Any, S: int, *,
                       fn: str) -> tuple[jax.Array, jax.Array]:
  """The projections as arrays ``[P, L]`` of one shape with S <= L, or a ValueError."""
  arrays = []
  for name, x in (("key_projection", key_projection), ("value_projection", value_projection)):
    try:
      x = jnp.asarray(x)
    except TypeError:
      raise ValueError(f"{fn}: {name} must be a float array [P, L]; got "
                       f"{type(x).__name__}.") from None
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{fn}: {name} must be a float array [P, L]; got {x.dtype} {x.shape}.")
    arrays.append(x)
  e, f = arrays
  if e.shape != f.shape:
    raise ValueError(f"{fn}: key_projection {e.shape} and value_projection {f.shape} must "
                     "have one shape [P, L].")
  if S > e.shape[1]:
    raise ValueError(f"{fn}: key length S={S} exceeds the projections' L={e.shape[1]} "
                     f"(key_projection {e.shape} is [P, L]); make them for a longer max_length.")
  return e, f


def _project(p: checks.Prepared, e: jax.Array, f: jax.Array, lengths: Any, dtype: Any):
  """``(K̃ [B, P, K, H], Ṽ [B, P, K, D])`` in ``dtype``: the first S columns of ``e``, ``f``,
  zero at padded keys, times the keys and values."""
  S = p.dims.S
  valid = (jnp.ones((1, S), bool) if lengths is None
           else jnp.arange(S, dtype=jnp.int32)[None] < lengths[:, None])  # [B|1, S]
  e, f = (jnp.where(valid[:, None, :], x[None, :, :S].astype(dtype), 0) for x in (e, f))
  k, v = p.key.astype(dtype), p.value.astype(dtype)
  return jnp.einsum("bps,bskh->bpkh", e, k), jnp.einsum("bps,bskd->bpkd", f, v)


def _linformer(query, key, value, key_projection, value_projection, *, is_causal,
               key_value_seq_lengths, scale, implementation, fn: str) -> jax.Array:
  p = checks.prepare_qkv(query, key, value, fn=fn)
  if is_causal:
    raise ValueError(
        f"{fn}: is_causal=True is not supported: each projected key and value sums over "
        "every position of the sequence, so no query can be kept from later keys; use "
        "is_causal=False (or a causal variant).")
  e, f = _check_projections(key_projection, value_projection, p.dims.S, fn=fn)
  (lengths,) = checks.check_lengths(p, fn=fn, key_value_seq_lengths=key_value_seq_lengths
                                    ).values()
  d = p.dims
  dtype = checks.accumulation_dtype(p.query.dtype)
  scale = checks.resolve_scale(scale, d.H)
  k, v = _project(p, e, f, lengths, dtype)
  q = p.query.astype(dtype)
  if implementation == "xla":
    out = softmax_attention(q, k, v, scale=scale, implementation="xla")
  else:  # The oracle: grouped heads, plain einsums.
    qg = q.reshape(d.B, d.T, d.K, d.G, d.H)
    scores = jnp.einsum("btkgh,bpkh->bkgtp", qg, k) * scale
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgtp,bpkd->btkgd", weights, v).reshape(d.B, d.T, d.N, d.D)
  return p.restore(out.astype(p.query.dtype))


@checks.compiled("is_causal", "scale", "implementation")
def linformer_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    key_projection: ArrayLike,
    value_projection: ArrayLike,
    is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None,
    scale: float | None = None,
    implementation: LinformerImplementation | None = None,
) -> jax.Array:
  """Linformer attention: softmax over P rows of keys and values projected along the sequence.

  ``out = softmax(Q (E_S K)ᵀ · scale) (F_S V)`` with the learned ``E``
  (``key_projection``) and ``F`` (``value_projection``) ``[P, L]``; ``E_S``,
  ``F_S`` are their first S columns, zero at padded keys. O(T·P) time and memory
  instead of O(T·S); softmax and projections in float32 (float64 for float64
  inputs). Non-causal only.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N (GQA / MQA); S <= L.
    value: ``[B, S, K, D]``.
    key_projection: E, ``[P, L]`` float: P projected rows, L the longest key length
      it serves. An array (traced under jit, learned by gradient).
    value_projection: F, ``[P, L]``, the shape of ``key_projection``.
    is_causal: must be False: a projected row mixes every position, so causal
      attention cannot be expressed; True raises.
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it reach no
      projected row (their columns of E and F are zeroed). A row with no valid
      key returns zeros.
    scale: the logit scale (static float; None: ``1 / sqrt(H)``).
    implementation: ``"reference"`` (plain einsums), ``"xla"``
      (``jax.nn.dot_product_attention`` on the projected rows), or None (``"xla"``).

  Returns:
    ``[B, T, N, D]`` in the input dtype.

  Raises:
    ValueError: on bad shapes, dtypes or lengths, ``is_causal=True``, projections
      that are not float ``[P, L]`` arrays of one shape or have L < S, a bad
      ``scale``, or an unknown implementation.

  Examples:
    >>> rng = jax.random.split(jax.random.key(0), 3)
    >>> e, f = (jax.random.normal(r, (4, 32)) / 2 for r in rng[:2])  # [P, L]
    >>> x = jax.random.normal(rng[2], (2, 20, 4, 8))  # [B, T, N, H]; S = 20 <= L.
    >>> out = la.linformer_attention(x, x, x, key_projection=e, value_projection=f)
    >>> out.shape
    (2, 20, 4, 8)

    The same as softmax attention over the projected keys and values:

    >>> k, v = jnp.einsum("ps,bsnh->bpnh", e[:, :20], x), jnp.einsum("ps,bsnh->bpnh", f[:, :20], x)
    >>> bool(jnp.allclose(out, la.softmax_attention(x, k, v), atol=1e-5))
    True

  References:
    Wang et al., "Linformer: Self-Attention with Linear Complexity", 2020.
  """
  fn = "linformer_attention"
  implementation = checks.check_choice(implementation, name="implementation",
                                       choices=(None, *IMPLEMENTATIONS), fn=fn) or "xla"
  return _linformer(query, key, value, key_projection, value_projection, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths,
                    scale=checks.check_scale(scale, fn=fn), implementation=implementation,
                    fn=fn)


@checks.compiled("is_causal", "scale")
def linformer_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    key_projection: ArrayLike,
    value_projection: ArrayLike,
    is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None,
    scale: float | None = None,
) -> jax.Array:
  """The oracle of :func:`linformer_attention`: projections and softmax in plain einsums.

  ``K̃ = E_S K``, ``Ṽ = F_S V`` (``[B, P, K, H|D]``, padded keys' columns
  zeroed), then ``softmax(Q K̃ᵀ · scale) Ṽ`` with the ``[B, N, T, P]`` weights
  formed at once, in float32 (float64 for float64 inputs); never optimised.

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, K, H]``; K must divide N.
    value: ``[B, S, K, D]``.
    key_projection, value_projection, is_causal, key_value_seq_lengths, scale: as
      in :func:`linformer_attention`.

  Returns:
    ``[B, T, N, D]`` in the input dtype.

  Raises:
    ValueError: as :func:`linformer_attention`.

  Examples:
    >>> e = f = jnp.ones((3, 16)) / 4  # [P, L]
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> fast = la.linformer_attention(x, x, x, key_projection=e, value_projection=f)
    >>> slow = la.linformer_attention_reference(x, x, x, key_projection=e, value_projection=f)
    >>> bool(jnp.allclose(fast, slow, atol=1e-5))
    True

  References:
    Wang et al., "Linformer: Self-Attention with Linear Complexity", 2020.
  """
  return _linformer(query, key, value, key_projection, value_projection, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths,
                    scale=checks.check_scale(scale, fn="linformer_attention_reference"),
                    implementation="reference", fn="linformer_attention_reference")


def _init_projections(rng: jax.Array, head_dim: int, *,
                      projected_length: int = DEFAULT_PROJECTED_LENGTH,
                      max_length: int = DEFAULT_MAX_LENGTH) -> dict[str, jax.Array]:
  """The registry's ``params.init``: ``E, F [P, L] ~ N(0, 1/P)``, the random projection of the
  paper's analysis (its Theorem 1), from which training starts."""
  del head_dim  # Projections act along the sequence.
  fn = "linformer"
  P = checks.check_positive_int(projected_length, name="projected_length", fn=fn)
  L = checks.check_positive_int(max_length, name="max_length", fn=fn)
  e, f = (jax.random.normal(r, (P, L), jnp.float32) / jnp.sqrt(jnp.float32(P))
          for r in jax.random.split(rng))
  return {"key_projection": e, "value_projection": f}


_PARAMS = ParamSpec(init=_init_projections, names=("key_projection", "value_projection"),
                    trainable=True)
register_attention(AttentionSpec(
    name="linformer",
    function=_PARAMS.bind(linformer_attention),
    reference=_PARAMS.bind(linformer_attention_reference),
    implementations=IMPLEMENTATIONS,
    supports_causal=False,
    params=_PARAMS,
))
