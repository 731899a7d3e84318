"""Gated DeltaProduct: n delta-rule steps per token.

Letters as in ``gated.py``, with n the steps per token. Each token decays the state
once, then writes n keys by the delta rule; its query reads the state after them::

    S ← exp(g_t) S,   then for j = 1..n:   S ← S + β_tj k_tj (v_tj − Sᵀ k_tj)ᵀ
    o_t = scale · q_tᵀ S

The transition of a token is a product of n generalised Householder matrices
``I − β_j k_j k_jᵀ`` (rank n, where the delta rule's is rank one). This is the
delta rule over the n·S steps laid out in order (token t's steps at positions
``t·n + j``), with the token's decay on its first step and its query on its last:
every form of :func:`delta_rule_attention` (the chunked WY form included), its
state, summaries and context parallelism serve it unchanged.

References:
  Siems et al., "DeltaProduct: Improving State-Tracking in Linear RNNs via
  Householder Products", 2025.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from linattn_jax._src import checks
from linattn_jax._src.delta import DeltaImplementation, DeltaSummary, run_delta_rule
from linattn_jax._src.gated import GatedState, grouped_value_heads
from linattn_jax._src.registry import Role, TokenInput


def steps_in_order(query, key, value, beta, log_decay, lengths, segment_ids, *, fn: str):
  """The call as the delta rule over n·S steps: ``(query, key, value, beta, log_decay,
  lengths, segment_ids, n)``, each array with its positions interleaved (no B unbatched)."""
  q, k, v = (jnp.asarray(x) for x in (query, key, value))
  if not (k.ndim == v.ndim == q.ndim + 1 and k.ndim in (4, 5)) or k.shape[-3] != v.shape[-3]:
    raise ValueError(
        f"{fn}: query [B, T, N, H], key [B, S, n, K, H] and value [B, S, n, K, D] (n delta "
        "steps per token; no B unbatched) must have ranks 4, 5, 5 (or 3, 4, 4) and the same "
        f"n; got {q.shape}, {k.shape}, {v.shape}.")
  first = v[..., 0, :, :]
  checks.prepare_qkv(*grouped_value_heads(q, k[..., 0, :, :], first, fn=fn), first, fn=fn)
  n = k.shape[-3]
  lead, S, T = k.shape[:-4], k.shape[-4], q.shape[-3]
  heads = k.shape[:-2] + v.shape[-2:-1] + k.shape[-1:]  # [B, S, n, V, H]: inputs per value head.
  beta = TokenInput("beta", Role.WRITE_STRENGTH).check(beta, heads, fn=fn)
  if log_decay is not None:
    per_feature = jnp.ndim(log_decay) == k.ndim - 1
    log_decay = TokenInput("log_decay", Role.DECAY, per_feature=per_feature).check(
        log_decay, heads[:-3] + heads[-2:], fn=fn)
    log_decay = _first_step(jnp.asarray(log_decay), n, len(lead))
  flat = lambda x: x.reshape(lead + (S * n,) + x.shape[len(lead) + 2:])  # noqa: E731
  # Each token's query on its last step (zeros on the others, whose outputs are dropped).
  at = q.ndim - 2  # The step axis, after T.
  queries = jnp.concatenate([jnp.zeros(q.shape[:at] + (n - 1,) + q.shape[at:], q.dtype),
                             jnp.expand_dims(q, at)], axis=at)
  queries = queries.reshape(q.shape[:-3] + (T * n,) + q.shape[-2:])
  if lengths is not None:
    lengths = jnp.asarray(lengths) * n
  if segment_ids is not None and not isinstance(segment_ids, tuple | list):
    segment_ids = jnp.repeat(jnp.asarray(segment_ids), n, axis=-1)
  return queries, flat(k), flat(v), flat(jnp.asarray(beta)), log_decay, lengths, segment_ids, n


def _first_step(g: jax.Array, n: int, batch_axes: int) -> jax.Array:
  """``g [.., S, K(, H)]`` laid out over n steps per token: ``g`` on each token's first
  step, 0 on the others, ``[.., S·n, K(, H)]``."""
  at = batch_axes + 1  # The step axis, after S.
  padded = jnp.concatenate([jnp.expand_dims(g, at),
                            jnp.zeros(g.shape[:at] + (n - 1,) + g.shape[at:], g.dtype)], axis=at)
  return padded.reshape(g.shape[:at - 1] + (-1,) + g.shape[at:])


def _delta_product(query, key, value, beta, *, log_decay, key_value_seq_lengths, segment_ids,
                   fn: str, **options):
  checks.check_static_bool(options["is_causal"], name="is_causal", fn=fn)  # Its error first.
  query, key, value, beta, log_decay, lengths, segment_ids, n = steps_in_order(
      query, key, value, beta, log_decay, key_value_seq_lengths, segment_ids, fn=fn)
  result = run_delta_rule(query, key, value, beta, log_decay=log_decay, query_stride=n,
                          key_value_seq_lengths=lengths, segment_ids=segment_ids, fn=fn,
                          **options)
  out, state = result if options.get("return_state") else (result, None)
  out = out.reshape(out.shape[:-3] + (-1, n) + out.shape[-2:])[..., n - 1, :, :]
  return (out, state) if options.get("return_state") else out


def delta_product_attention(
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
    initial_state: GatedState | DeltaSummary | None = None,
    return_state: bool = False,
    implementation: DeltaImplementation | None = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """Gated DeltaProduct: per token a decay, then n delta-rule steps.

  ``S ← exp(g_t) S``, then for j = 1..n ``S ← S + β_tj k_tj (v_tj − Sᵀ k_tj)ᵀ``;
  ``o_t = scale · q_tᵀ S``. Runs as :func:`delta_rule_attention` over the n·S steps in
  order (token t's steps at ``t·n + j``; decay on the first, query on the last).

  Args:
    query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``).
    key: ``[B, S, n, K, H]``: n keys per token; K must divide N.
    value: ``[B, S, n, K, D]`` (or ``[B, S, n, V, D]``: grouped value heads, N = K).
    beta: ``[B, S, n, K]`` write strengths in [0, 2] (checked where concrete).
    log_decay: optional ``[B, S, K]`` (or ``[B, S, K, H]``), ≤ 0: one decay per token
      (None: DeltaProduct without a gate).
    scale: multiplies the query (a static float); default ``1 / sqrt(H)``.
    is_causal: must be True (a recurrence); the default False raises, as for every
      causal-only variant.
    key_value_seq_lengths: optional ``[B]`` in tokens: tokens at or past it are identity
      steps.
    segment_ids: packed sequences, ``[B, T]`` ints that do not decrease (T == S): the
      state is dropped where the id changes.
    initial_state: a :class:`GatedState` or :class:`DeltaSummary` to continue from.
    return_state: also return the final state (for a summary ``initial_state``, that
      summary followed by these tokens).
    implementation: as :func:`delta_rule_attention`'s (default ``"chunked"``).
    chunk_size: steps (not tokens) per chunk, as :func:`delta_rule_attention`'s. With a
      multiple of n (the defaults, powers of two, for n = 2, 4, ...) and a decay per head
      or none, the chunked form forms only the rows of each token's last step, where its
      query reads.

  Returns:
    ``[B, T, N, D]`` in the input dtype; with ``return_state`` the pair ``(out, state)``.
    T ≠ S is bottom-right aligned.

  Raises:
    ValueError: for ``is_causal=False``, ranks, shapes or dtypes that do not match (named),
      ``beta`` or ``log_decay`` out of range (where concrete), and as
      :func:`delta_rule_attention`.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 2, 4))  # [B, S, n=2, K, H]
    >>> k = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    >>> out = la.delta_product_attention(x[:, :, 0], k, x, jnp.full((1, 8, 2, 2), 0.5),
    ...                                  log_decay=jnp.full((1, 8, 2), -0.1), is_causal=True)
    >>> out.shape  # [B, T, N, D]
    (1, 8, 2, 4)

  References:
    Siems et al., "DeltaProduct: Improving State-Tracking in Linear RNNs via Householder
    Products", 2025.
  """
  return _delta_product(query, key, value, beta, log_decay=log_decay, scale=scale,
                        is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                        segment_ids=segment_ids, initial_state=initial_state,
                        return_state=return_state, implementation=implementation,
                        chunk_size=chunk_size, fn="delta_product_attention")


def delta_product_attention_reference(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, beta: ArrayLike, *,
    log_decay: ArrayLike | None = None, scale: float | None = None, is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None, segment_ids: ArrayLike | None = None,
    initial_state: GatedState | DeltaSummary | None = None, return_state: bool = False,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, GatedState]:
  """The oracle of :func:`delta_product_attention`: the token recurrence of its n·S steps.

  Every state kept (small S only), float32.
  Takes the arrays ``[B, T, N, H]``, ``[B, S, n, K, H]``, ``[B, S, n, K, D]``,
  ``[B, S, n, K]`` and the options of :func:`delta_product_attention` but
  ``implementation``.

  Raises:
    ValueError: as :func:`delta_product_attention`, under this name.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 6, 2, 1, 4)) / 2  # [B, S, n, K, H]
    >>> beta = jnp.full((1, 6, 2, 1), 0.5)
    >>> fast = la.delta_product_attention(x[:, :, 0], x, x, beta, is_causal=True)
    >>> ref = la.delta_product_attention_reference(x[:, :, 0], x, x, beta, is_causal=True)
    >>> bool(jnp.allclose(fast, ref, atol=1e-5))
    True

  References:
    Siems et al., "DeltaProduct: Improving State-Tracking in Linear RNNs via Householder
    Products", 2025.
  """
  return _delta_product(query, key, value, beta, log_decay=log_decay, scale=scale,
                        is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                        segment_ids=segment_ids, initial_state=initial_state,
                        return_state=return_state, chunk_size=chunk_size,
                        implementation="reference", fn="delta_product_attention_reference")


def delta_product_attention_step(state: GatedState, query: ArrayLike, key: ArrayLike,
                                 value: ArrayLike, beta: ArrayLike, *,
                                 log_decay: ArrayLike | None = None,
                                 scale: float | None = None) -> tuple[GatedState, jax.Array]:
  """One decoding step (one token, its n delta steps) of :func:`delta_product_attention`.

  Args:
    state: the :class:`GatedState` so far (``kv [B, K, H, D]``).
    query: ``[B, N, H]`` (no B when unbatched, like the state).
    key: ``[B, n, K, H]``.
    value: ``[B, n, K, D]``.
    beta: ``[B, n, K]`` in [0, 2].
    log_decay: optional ``[B, K]`` (or ``[B, K, H]``), ≤ 0.
    scale: multiplies the query; default ``1 / sqrt(H)``.

  Returns:
    ``(state, out [B, N, D])``, the state in the dtype it came in.

  Raises:
    ValueError: as :func:`delta_product_attention`.

  Examples:
    >>> state = la.init_gated_state(batch=1, num_kv_heads=1, head_dim=2, value_dim=2)
    >>> e = jnp.eye(2)[None, :, None]  # [B, n=2, K, H]: keys e_0, then e_1
    >>> state, out = la.delta_product_attention_step(state, e[:, 0], e, 2 * e, jnp.ones((1, 2, 1)))
    >>> state.kv[0, 0]  # β = 1: each key stores its value
    Array([[2., 0.],
           [0., 2.]], dtype=float32)

  References:
    Siems et al., "DeltaProduct: Improving State-Tracking in Linear RNNs via Householder
    Products", 2025.
  """
  at = jnp.ndim(query) - 2  # The position axis: after B (if any).
  expand = lambda x: None if x is None else jnp.expand_dims(jnp.asarray(x), at)  # noqa: E731
  out, new = delta_product_attention(
      expand(query), expand(key), expand(value), expand(beta), log_decay=expand(log_decay),
      scale=scale, is_causal=True, implementation="scan", initial_state=state,
      return_state=True)
  new = jax.tree.map(lambda x, old: x.astype(jnp.result_type(old)), new, state)
  return new, jnp.squeeze(out, at)

