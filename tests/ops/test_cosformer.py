"""cosFormer beyond the shared suite: a numpy oracle of the distance re-weighting, every
implementation (the suite runs two), where positions start (after a state, per segment), the
state's position, and the errors about ``max_length``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import Shape, make_qkv

import linattn_jax as la

SHAPE = Shape(B=2, T=7, S=9, N=4, K=2, H=4, D=3)
L = 12


def numpy_cosformer(q, k, v, *, causal, offset=0, lengths=None, eps=1e-6):
  """float64: ``w_ij = relu(q_i)·relu(k_j) cos(π(i - j) / 2L)`` with query i at
  ``offset + i + S - T`` and key j at ``offset + j``; no state."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  k, v = (np.repeat(x, N // K, axis=2) for x in (k, v))
  i = offset + np.arange(T) + S - T
  j = offset + np.arange(S)
  w = np.einsum("btnh,bsnh->bnts", np.maximum(q, 0), np.maximum(k, 0))
  w = w * np.cos(np.pi * (i[:, None] - j[None]) / (2 * L))
  visible = np.ones((B, 1, T, S), bool)
  if causal:
    visible &= j[None] <= i[:, None]
  if lengths is not None:
    visible &= (j[None] < np.asarray(lengths)[:, None])[:, None, None]
  w = np.where(visible, w, 0)
  return np.einsum("bnts,bsnd->btnd", w, v) / (w.sum(-1).transpose(0, 2, 1)[..., None] + eps)


@functools.cache
def _program(implementation, causal):
  return jax.jit(functools.partial(la.cosformer_attention, max_length=L, is_causal=causal,
                                   implementation=implementation, chunk_size=3))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T, S", [(7, 9), (9, 7)], ids=["T<S", "T>S"])
def test_every_implementation_is_the_distance_reweighting(causal, T, S):
  shape = SHAPE._replace(T=T, S=S)
  q, k, v = make_qkv(shape)
  lengths = jnp.asarray([S - 3, S], jnp.int32)
  want = numpy_cosformer(q, k, v, causal=causal, lengths=lengths)
  impls = ["reference", "scan", "associative_scan", "chunked"] + ([] if causal else ["parallel"])
  for impl in impls:
    got = _program(impl, causal)(q, k, v, key_value_seq_lengths=lengths)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=impl)
  np.testing.assert_allclose(la.cosformer_attention_reference(
      q, k, v, max_length=L, is_causal=causal, key_value_seq_lengths=lengths), want,
      rtol=2e-5, atol=2e-5)


def test_a_state_puts_the_next_keys_at_its_position_padded_ones_included():
  q, k, v = make_qkv(SHAPE._replace(T=9))
  lengths = jnp.asarray([2, 4], jnp.int32)
  _, state = la.cosformer_attention(q[:, :4], k[:, :4], v[:, :4], max_length=L, is_causal=True,
                                    key_value_seq_lengths=lengths, return_state=True)
  np.testing.assert_array_equal(state.position, [[4, 4], [4, 4]])  # Indices, as in one pass.
  np.testing.assert_array_equal(state.max_length, L)
  # The next call's keys sit at 4.., its queries at their keys' positions.
  got = la.cosformer_attention(q[1:, 4:], k[1:, 4:], v[1:, 4:], max_length=L, is_causal=True,
                               initial_state=jax.tree.map(lambda x: x[1:], state))
  want = numpy_cosformer(q[1:], k[1:], v[1:], causal=True)[:, 4:]
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_positions_restart_at_each_segment():
  """A packed row equals its segments run alone (each from position 0), and the state
  returned counts the last segment's keys only."""
  q, k, v = make_qkv(SHAPE._replace(B=1, T=9, S=9))
  ids = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1, 1]], jnp.int32)
  out, state = la.cosformer_attention(q, k, v, max_length=L, is_causal=True, segment_ids=ids,
                                      return_state=True, chunk_size=3)
  for a, b in ((0, 4), (4, 9)):
    alone = numpy_cosformer(q[:, a:b], k[:, a:b], v[:, a:b], causal=True)
    np.testing.assert_allclose(out[:, a:b], alone, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(state.position, [[5, 5]])


def test_combine_rotates_the_later_summary_by_the_earlier_length():
  _, k, v = make_qkv(SHAPE)
  summarize = functools.partial(la.get_spec("cosformer").streaming.summarize, max_length=L)
  combined = la.get_spec("cosformer").streaming.combine(summarize(k[:, :4], v[:, :4]),
                                                         summarize(k[:, 4:], v[:, 4:]))
  whole = summarize(k, v)
  for got, want in zip(combined[:4], whole[:4], strict=True):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_max_length_errors_name_the_option_and_the_lengths():
  q, k, v = make_qkv(SHAPE)
  with pytest.raises(ValueError, match=r"max_length=8 must cover.*T=7.*S=9"):
    la.cosformer_attention(q, k, v, max_length=8)
  with pytest.raises(ValueError, match=r"cosformer_attention_reference: max_length=8 must"):
    la.cosformer_attention_reference(q, k, v, max_length=8)
  with pytest.raises(ValueError, match="max_length must be a positive int"):
    la.cosformer_attention(q, k, v, max_length=12.0)
  _, state = la.cosformer_attention(q, k, v, max_length=L, is_causal=True, return_state=True)
  with pytest.raises(ValueError, match=r"initial_state.position=9 plus key length S=9 exceeds "
                     "max_length=12"):
    la.cosformer_attention(q, k, v, max_length=L, is_causal=True, initial_state=state)
  with pytest.raises(ValueError, match=r"initial_state was made with max_length \[12.0\]; this "
                     "call has max_length=30"):
    la.cosformer_attention(q, k, v, max_length=30, is_causal=True, initial_state=state)
  # The oracle judges a concrete state's values too (after its one compiled program).
  with pytest.raises(ValueError, match=r"cosformer_attention_reference: initial_state.position=9 "
                     "plus key length S=9 exceeds max_length=12"):
    la.cosformer_attention_reference(q, k, v, max_length=L, is_causal=True, initial_state=state)
  with pytest.raises(ValueError, match=r"cosformer_attention_reference: initial_state was made "
                     r"with max_length \[12.0\]"):
    la.cosformer_attention_reference(q, k, v, max_length=30, is_causal=True, initial_state=state)
  with pytest.raises(ValueError, match="init_cosformer_state: max_length must be a positive"):
    la.init_cosformer_state(1, 1, 4, 4, max_length=0)
