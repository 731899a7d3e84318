"""A gated recurrence the library does not have, registered for the tests only.

It shows that registering is all a new gated variant takes: ``conftest.py``
imports this module before collection, and the shared suite (``tests/ops``),
the contract test, the layer (``tests/nn``) and context parallelism
(``tests/parallel``) take it by its name, with no change to the library::

    S_t = exp(g_t) S_{t-1} + β_t k_t v_tᵀ        o_t = scale · q_tᵀ S_t

gated linear attention whose writes have a strength ``β_t ∈ [0, 2]`` (a decay
per head, g ≤ 0). Built from the core's pieces: a ``gated.MatrixFamily``
with its own token and chunk bodies and oracle, on the one entry pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax.numpy as jnp
from jax import lax

import linattn_jax as la
from linattn_jax._src import gated, recurrence

NAME = "toy_gated"
INPUTS = (la.TokenInput("log_decay", la.Role.DECAY),
          la.TokenInput("beta", la.Role.WRITE_STRENGTH))
# A layer draws these for it (a decay per head and a write strength, by their roles).
LAYER_PARAMS = ("a_kernel", "A_log", "dt_bias", "b_kernel")


# Bodies on the chunk driver: chunk.fq [B, K, G, C, H] (scaled queries), fk [B, K, C, H],
# v [B, K, C, D], gates (g, β) each [B, K, C, 1]; the carry is S [B, K, H, D].


def _token(S, x):
  q, k, v, g, beta = x  # [B, K, G, H], [B, K, H], [B, K, D], [B, K, 1], [B, K, 1]
  S = jnp.exp(g)[..., None] * S + (beta * k)[..., None] * v[..., None, :]
  return S, jnp.einsum("bkgh,bkhd->bkgd", q, S)


def _scan(config, S, chunk):
  del config
  return gated.by_token(_token, S, chunk)


def _absorb(config, S, chunk):
  del config
  g, beta = chunk.gates
  to_end = jnp.exp(gated.suffix_sums(g, 2))  # [B, K, C, 1]
  return (jnp.exp(jnp.sum(g, axis=2))[..., None] * S
          + jnp.einsum("bkjh,bkjd->bkhd", chunk.fk * beta * to_end, chunk.v))


def _chunk(config, S, chunk):
  g, beta = chunk.gates
  q, k = chunk.fq, chunk.fk * beta
  decay = jnp.exp(gated.segment_sums(g[..., 0], 2))  # [B, K, C(i), C(j)]; 0 where j > i.
  reads = jnp.exp(jnp.cumsum(g, axis=2))[:, :, None]  # [B, K, 1, C, 1]
  a = jnp.einsum("bkgih,bkjh->bkgij", q, k) * decay[:, :, None]
  out = (jnp.einsum("bkgij,bkjd->bkgid", a, chunk.v)
         + jnp.einsum("bkgih,bkhd->bkgid", q * reads, S))
  return _absorb(config, S, chunk), out


def _reference(S0, chunk):
  """The recurrence written out: every key's state kept, each query reads its own."""
  chunk = gated.aligned(chunk)
  T, S = chunk.num_queries, chunk.num_keys

  def key_step(state, x):
    k, v, g, beta = x
    state = jnp.exp(g)[..., None] * state + (beta * k)[..., None] * v[..., None, :]
    return state, state

  keys = tuple(jnp.moveaxis(x, 2, 0) for x in (chunk.fk, chunk.v, *chunk.gates))
  state, states = lax.scan(key_step, S0, keys)
  return jnp.einsum("bkgth,tbkhd->bkgtd", chunk.fq, states[S - T:]), state


@dataclasses.dataclass(frozen=True)
class ToyFamily(gated.MatrixFamily):
  implementations: ClassVar[tuple[str, ...]] = ("reference", "scan", "chunked")
  bodies: ClassVar[Mapping[str, Any]] = {"scan": _scan, "chunked": _chunk}
  summary_cls: ClassVar[type] = la.GatedSummary
  input_names: ClassVar[tuple[str, ...]] = tuple(x.name for x in INPUTS)

  def token_inputs(self, inputs, key):
    return INPUTS

  def absorb(self, config, S, chunk):
    return _absorb(config, S, chunk)

  def reference(self, S0, chunk):
    return _reference(S0, chunk)

  def summary_fields(self, lead, K, H, gates):
    return {"log_decay": lead + (K,)}

  def finish(self, out, carry, state, chunk, options):
    if isinstance(state, la.GatedSummary):  # A summary continues as one.
      return out, la.GatedSummary(carry, state.log_decay + jnp.sum(chunk.gates[0], 2)[..., 0])
    return out, la.GatedState(carry)


def toy_attention(query, key, value, *, log_decay, beta, scale=None, is_causal=False,
                  key_value_seq_lengths=None, segment_ids=None, initial_state=None,
                  return_state=False, implementation=None, chunk_size=None):
  """The toy recurrence (module docstring) on the entry pipeline."""
  return recurrence.recurrent_attention(
      ToyFamily(), query, key, value, inputs={"log_decay": log_decay, "beta": beta},
      scale=scale, is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids, initial_state=initial_state, return_state=return_state,
      implementation=implementation, chunk_size=chunk_size, fn="toy_attention")


def toy_attention_reference(query, key, value, *, log_decay, beta, scale=None, is_causal=False,
                            key_value_seq_lengths=None, segment_ids=None, initial_state=None,
                            return_state=False, chunk_size=None):
  """Its oracle: the recurrence written out, token by token."""
  return toy_attention(query, key, value, log_decay=log_decay, beta=beta, scale=scale,
                       is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                       segment_ids=segment_ids, initial_state=initial_state,
                       return_state=return_state, implementation="reference",
                       chunk_size=chunk_size)


def toy_attention_step(state, query, key, value, *, log_decay, beta, scale=None):
  return gated.one_token(toy_attention, state, query, key, value,
                         {"log_decay": log_decay, "beta": beta}, scale=scale)


def _identity(key, value):
  empty = gated.empty_kv(key, value)
  if empty is None:
    return None
  kv, lead, _ = empty
  return la.GatedSummary(kv, jnp.zeros_like(kv, shape=lead + kv.shape[-3:-2]))


def _summarize(key, value, *, log_decay, beta, key_value_seq_lengths=None, chunk_size=None,
               segment_ids=None):
  return recurrence.summarize_keys(toy_attention, key, value, log_decay=log_decay, beta=beta,
                                   initial_state=_identity(key, value), chunk_size=chunk_size,
                                   key_value_seq_lengths=key_value_seq_lengths,
                                   segment_ids=segment_ids)


def register() -> None:
  """Registers ``toy_gated`` (once per process)."""
  if NAME in la.available_attentions():
    return
  gated.register_matrix(
      NAME, family=ToyFamily(), function=toy_attention, reference=toy_attention_reference,
      step=toy_attention_step, summarize=_summarize, identity=_identity,
      combine=la.get_spec("simple_gla").streaming.combine, token_inputs=INPUTS)

