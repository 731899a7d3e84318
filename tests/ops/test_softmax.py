"""Softmax-specific checks beyond the shared suite: bias, mask, alignment,
fully masked rows, dispatch, and the flash path's O(T) structure."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import Shape, assert_close, largest_intermediate, make_qkv

import linattn_jax as la
from linattn_jax._src import softmax as softmax_module


def numpy_attention(q, k, v, *, scale, bias=None, mask=None, causal=False,
                    q_len=None, kv_len=None, window=None, segments=None):
  """Loop-per-row float64 oracle, independent of the library's mask code.

  ``window``: ``(left, right)`` around the bottom-right aligned position;
  ``segments``: ``(q_ids [B, T], kv_ids [B, S])``.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  _, S, K, D = v.shape
  out = np.zeros((B, T, N, D))
  for b in range(B):
    for n in range(N):
      for t in range(T):
        visible = [s for s in range(S)
                   if (not causal or s <= t + S - T)
                   and (kv_len is None or s < kv_len[b])
                   and (q_len is None or t < q_len[b])
                   and (mask is None or mask[b, n, t, s])
                   and (window is None or -window[0] <= s - (t + S - T) <= window[1])
                   and (segments is None or segments[0][b, t] == segments[1][b, s])]
        if not visible:
          continue
        logits = np.array([q[b, t, n] @ k[b, s, n // (N // K)] * scale
                           + (0.0 if bias is None else bias[b, n, t, s]) for s in visible])
        w = np.exp(logits - logits.max())
        w /= w.sum()
        out[b, t, n] = sum(wi * v[b, s, n // (N // K)] for wi, s in zip(w, visible, strict=True))
  return out


SHAPE = Shape(B=2, T=5, S=7, N=4, K=2, H=3, D=2)
IMPLS = ["reference", "xla"]


def _bias_mask(shape, seed=3):
  rng = np.random.default_rng(seed)
  bias = rng.standard_normal((shape.B, shape.N, shape.T, shape.S))
  mask = rng.random((shape.B, shape.N, shape.T, shape.S)) > 0.3
  mask[0, 1, 2] = False  # A fully masked row.
  return jnp.asarray(bias, jnp.float32), jnp.asarray(mask)


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_bias_mask_causal_lengths_against_numpy_loops(implementation, causal):
  q, k, v = make_qkv(SHAPE)
  bias, mask = _bias_mask(SHAPE)
  q_len, kv_len = np.array([5, 3]), np.array([6, 7])
  got = la.softmax_attention(
      q, k, v, bias=bias, mask=mask, is_causal=causal, query_seq_lengths=jnp.asarray(q_len),
      key_value_seq_lengths=jnp.asarray(kv_len), implementation=implementation)
  want = numpy_attention(q, k, v, scale=1 / np.sqrt(SHAPE.H), bias=np.asarray(bias),
                         mask=np.asarray(mask), causal=causal, q_len=q_len, kv_len=kv_len)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got)[0, 2, 1] == 0), "fully masked row must be zeros"


@pytest.mark.parametrize("implementation", ["reference", "xla", "flash"])
@pytest.mark.parametrize("T,S", [(2, 5), (5, 2), (4, 4)])
def test_causal_alignment_is_bottom_right(implementation, T, S):
  shape = Shape(B=1, T=T, S=S, N=2, K=1, H=4, D=3)
  q, k, v = make_qkv(shape)
  got = la.softmax_attention(q, k, v, is_causal=True, implementation=implementation)
  want = numpy_attention(q, k, v, scale=0.5, causal=True)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # T > S: the first T - S queries see no key and are exactly zero.
  assert np.all(np.asarray(got)[:, : max(0, T - S)] == 0)


def test_reference_equals_jax_nn():
  shape = Shape(B=2, T=9, S=9, N=4, K=2, H=8, D=8)
  q, k, v = make_qkv(shape)
  for causal in (False, True):
    want = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    assert_close(la.softmax_attention_reference(q, k, v, is_causal=causal), want, jnp.float32)


def test_bias_gradient_matches_reference():
  q, k, v = make_qkv(SHAPE)
  bias, mask = _bias_mask(SHAPE)

  def loss(bias, implementation):
    out = la.softmax_attention(q, k, v, bias=bias, mask=mask, implementation=implementation)
    return jnp.sum(out * jnp.arange(SHAPE.D, dtype=out.dtype).reshape(1, 1, 1, -1))

  got = jax.grad(loss)(bias, "xla")
  want = jax.grad(loss)(bias, "reference")
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got)[0, 1, 2] == 0)


@pytest.mark.parametrize("implementation", ["reference", "xla", "flash"])
def test_rows_without_keys_are_zero_with_finite_gradients(implementation):
  q, k, v = make_qkv(SHAPE)
  q_len, kv_len = jnp.array([2, 5]), jnp.array([0, 4])  # Batch 0 sees no key at all.

  def f(q, k, v):
    return la.softmax_attention(q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                                implementation=implementation)

  out = np.asarray(f(q, k, v))
  assert np.all(out[0] == 0) and np.all(out[1, 5:] == 0)
  assert np.any(out[1, :5] != 0)
  grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(grads[2])[0] == 0)  # No gradient flows to unseen values.


def test_flash_rejects_dense_bias_and_mask():
  q, k, v = make_qkv(SHAPE)
  bias, mask = _bias_mask(SHAPE)
  with pytest.raises(ValueError, match=r"'flash' does not support `bias`"):
    la.softmax_attention(q, k, v, bias=bias, implementation="flash")
  with pytest.raises(ValueError, match=r"'flash' does not support `mask`"):
    la.softmax_attention(q, k, v, mask=mask, implementation="flash")


def test_bias_and_mask_shape_errors():
  q, k, v = make_qkv(SHAPE)
  with pytest.raises(ValueError, match=r"bias of shape \(3, 5, 7\) does not broadcast"):
    la.softmax_attention(q, k, v, bias=jnp.zeros((3, 5, 7)))
  with pytest.raises(ValueError, match="mask must be boolean"):
    la.softmax_attention(q, k, v, mask=jnp.ones((5, 7)))
  with pytest.raises(ValueError, match="unknown implementation"):
    la.softmax_attention(q, k, v, implementation="cudnn")
  # Broadcastable shapes are accepted: per-key bias, per-(T, S) mask.
  la.softmax_attention(q, k, v, bias=jnp.zeros((7,)), mask=jnp.ones((5, 7), bool))


def test_unbatched_inputs_and_lengths():
  q, k, v = make_qkv(SHAPE)
  batched = la.softmax_attention(q, k, v, key_value_seq_lengths=jnp.array([3, 4]))
  single = la.softmax_attention(q[1], k[1], v[1], key_value_seq_lengths=jnp.array(4))
  np.testing.assert_allclose(single, batched[1], atol=1e-6)
  np.testing.assert_array_equal(  # jax.nn's form: a [1] length for unbatched inputs.
      la.softmax_attention(q[1], k[1], v[1], key_value_seq_lengths=jnp.array([4])), single)
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must have shape \(\)"):
    la.softmax_attention(q[1], k[1], v[1], key_value_seq_lengths=jnp.array([4, 4]))


def _primitives(jaxpr) -> set[str]:
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


def test_default_implementation_switches_to_flash_for_long_inputs():
  """``implementation=None`` traces flash exactly where ``prefers_flash`` says, on both sides
  of this backend's switch, and keeps XLA's path for a dense bias. Traced from abstract
  inputs: nothing of the switch's size is allocated or compiled."""
  fastest = softmax_module.FLASH_MIN_SCORES.get(jax.default_backend())
  # The measured switch (CPU), or either side of the memory threshold (2^29 scores).
  side = math.isqrt(fastest - 1) + 1 if fastest else 2**15  # The least side² ≥ fastest.
  below = (fastest - 1) // side if fastest else 2**14  # side · below < fastest.

  def uses_flash(T, S, bias=False):
    qkv = [jax.ShapeDtypeStruct((1, L, 1, 8), jnp.float32) for L in (T, S, S)]
    extra = [jax.ShapeDtypeStruct((1, 1, T, S), jnp.float32)] if bias else []
    jaxpr = jax.make_jaxpr(la.softmax_attention)(*qkv, *extra)
    return "custom_vjp_call" in _primitives(jaxpr.jaxpr)

  assert not uses_flash(SHAPE.T, SHAPE.S)
  assert uses_flash(side, side) and softmax_module.prefers_flash(1, 1, side, side)
  assert not uses_flash(side, below) and not softmax_module.prefers_flash(1, 1, side, below)
  assert not uses_flash(side, side, bias=True)  # A dense bias keeps the XLA path.


def test_default_switches_to_flash_where_measured_faster():
  cpu_from = softmax_module.FLASH_MIN_SCORES["cpu"]
  side = int(cpu_from ** 0.5)
  assert softmax_module.prefers_flash(1, 1, side, side, backend="cpu")
  assert not softmax_module.prefers_flash(1, 1, side, side - 1, backend="cpu")
  # Unmeasured backends keep XLA's path until the scores would not fit.
  assert not softmax_module.prefers_flash(1, 8, 8192, 8192, backend="gpu")
  assert softmax_module.prefers_flash(1, 8, 2**14, 2**14, backend="tpu")


@pytest.mark.parametrize("causal", [False, True])
def test_flash_never_forms_a_t_by_s_array(causal):
  shape = Shape(B=1, T=256, S=256, N=2, K=1, H=8, D=8)
  q, k, v = make_qkv(shape)

  def loss(q, k, v):
    out = la.flash_attention(q, k, v, is_causal=causal, block_q=32, block_k=32)
    return jnp.sum(out ** 2)

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
  biggest = largest_intermediate(jaxpr)
  assert biggest < shape.T * shape.S, f"an intermediate has {biggest} elements"
  dense = jax.make_jaxpr(functools.partial(la.softmax_attention, implementation="xla"))(q, k, v)
  assert largest_intermediate(dense.jaxpr) >= shape.N * shape.T * shape.S  # The check can fail.


@pytest.mark.parametrize("block_q,block_k", [(1, 3), (64, 64), (5, 2)])
def test_flash_block_sizes_do_not_change_the_result(block_q, block_k):
  shape = Shape(B=2, T=11, S=13, N=2, K=2, H=4, D=3)
  q, k, v = make_qkv(shape)
  lengths = jnp.array([13, 6])
  want = la.softmax_attention_reference(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
  got = la.flash_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                           block_q=block_q, block_k=block_k)
  assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, None])
def test_flash_rejects_bad_block_sizes(bad):
  q, k, v = make_qkv(SHAPE)
  with pytest.raises(ValueError, match="block_q must be a positive int"):
    la.flash_attention(q, k, v, block_q=bad)


# -- jax.nn.dot_product_attention's whole signature --------------------------------------------


def test_bias_and_mask_are_positional_as_in_jax_nn():
  q, k, v = make_qkv(SHAPE)
  bias, mask = _bias_mask(SHAPE)
  want = la.softmax_attention(q, k, v, bias=bias, mask=mask)
  np.testing.assert_array_equal(la.softmax_attention(q, k, v, bias, mask), want)
  np.testing.assert_allclose(la.softmax_attention_reference(q, k, v, bias, mask), want,
                             atol=1e-5)


@pytest.mark.parametrize("window", [2, (3, 1), (0, 2)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T, S", [(7, 7), (5, 9)])
def test_local_window_size_matches_jax_nn_top_left(window, causal, T, S):
  """With causal_alignment="top_left" every path gives jax.nn's result, T != S included."""
  q, k, v = make_qkv(Shape(B=2, T=T, S=S, N=4, K=2, H=8, D=8))
  want = jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window)
  for implementation in ("reference", "xla", None):
    got = la.softmax_attention(q, k, v, is_causal=causal, local_window_size=window,
                               causal_alignment="top_left", implementation=implementation)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=str(implementation))


@pytest.mark.parametrize("T, S", [(7, 7), (5, 9)])
def test_local_window_size_bottom_right_is_the_local_mask(T, S):
  """The default alignment: the window of masks.local; implementation=None runs local_attention
  (packed sequences too)."""
  q, k, v = make_qkv(Shape(B=2, T=T, S=S, N=4, K=2, H=8, D=8))
  lengths = jnp.array([S, S - 2], jnp.int32)
  ids = tuple(jnp.asarray(np.arange(n)[None].repeat(2, 0) // 3, jnp.int32) for n in (T, S))
  for causal, segment_ids in itertools.product((False, True), (None, ids)):
    want = la.softmax_attention_reference(
        q, k, v, mask=la.masks.local(T, S, (2, 1))[None, None], is_causal=causal,
        key_value_seq_lengths=lengths, segment_ids=segment_ids)
    for implementation in ("xla", None):
      got = la.softmax_attention(q, k, v, local_window_size=(2, 1), is_causal=causal,
                                 key_value_seq_lengths=lengths, implementation=implementation,
                                 segment_ids=segment_ids)
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  q, k, v = make_qkv(Shape(B=2, T=256, S=256, N=4, K=2, H=8, D=8))
  ids = jnp.arange(256)[None].repeat(2, 0) // 100
  packed = jax.make_jaxpr(functools.partial(la.softmax_attention, local_window_size=(2, 1),
                                            segment_ids=ids))(q, k, v)
  assert largest_intermediate(packed.jaxpr) < 2 * 4 * 256 * 256, "[B, N, T, S]: not local's path"
  with pytest.raises(ValueError, match="local_window_size must be a non-negative int"):
    la.softmax_attention(q, k, v, local_window_size=(-1, 2))
  with pytest.raises(ValueError, match="'flash' does not support `local_window_size`"):
    la.softmax_attention(q, k, v, local_window_size=2, implementation="flash")


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_return_residual_is_jax_nn_log_sum_exp(implementation):
  q, k, v = make_qkv(Shape(B=2, T=5, S=9, N=4, K=2, H=8, D=8))
  bias, _ = _bias_mask(Shape(B=2, T=5, S=9, N=4, K=2, H=8, D=8))
  lengths = jnp.array([9, 4], jnp.int32)
  out, lse = la.softmax_attention(q, k, v, bias, is_causal=True, key_value_seq_lengths=lengths,
                                  return_residual=True, causal_alignment="top_left",
                                  implementation=implementation)
  want, want_lse = jax.nn.dot_product_attention(q, k, v, bias, is_causal=True,
                                                key_value_seq_lengths=lengths,
                                                return_residual=True)
  assert lse.shape == (2, 5, 4) and lse.dtype == q.dtype
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
  # A row with no key: zeros out (jax.nn: the values' mean) and lse = -inf.
  none = jnp.zeros((2, 1, 5, 9), bool).at[:, :, 1:].set(True)
  out, lse = la.softmax_attention(q, k, v, mask=none, return_residual=True,
                                  implementation=implementation)
  assert np.all(np.asarray(out)[:, 0] == 0) and np.all(np.isneginf(np.asarray(lse)[:, 0]))
  assert np.all(np.isfinite(np.asarray(lse)[:, 1:]))
  with pytest.raises(ValueError, match="'flash' does not support `return_residual`"):
    la.softmax_attention(q, k, v, return_residual=True, implementation="flash")


def test_unbatched_inputs_broadcast_4d_masks_and_biases_as_jax_nn():
  shape = Shape(B=2, T=5, S=7, N=4, K=2, H=4, D=4)  # jax.nn needs D == H.
  q, k, v = (x[0] for x in make_qkv(shape))
  bias, mask = (x[:1] for x in _bias_mask(shape))  # [1, N, T, S]
  mask = mask.at[0, 1, 2].set(True)  # No empty row: there jax.nn returns the values' mean.
  got = la.softmax_attention(q, k, v, bias, mask)
  np.testing.assert_allclose(got, jax.nn.dot_product_attention(q, k, v, bias, mask), atol=1e-6)
  with pytest.raises(ValueError, match="does not broadcast"):
    la.softmax_attention(q, k, v, None, jnp.ones((2, 1, 5, 7), bool))


def test_under_strict_promotion_the_session_runs_with():
  """conftest turns both on for every test; this one says so where it can fail."""
  assert jax.config.jax_numpy_rank_promotion == "raise"
  assert jax.config.jax_numpy_dtype_promotion == "strict"
  q, k, v = make_qkv(SHAPE)
  lengths = jnp.array([3, 7], jnp.int32)
  la.softmax_attention(q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths)


# Packed sequences (segment_ids) ---------------------------------------------------------
# The shared suite checks that a packed call equals each segment run alone; here: the
# segment mask combined with every other option, the pair form with causal T != S, and
# flash's skipping of the key blocks of other segments.

SEGMENT_PAIR = (np.array([[0, 0, 1, 1, 1], [0, 1, 2, 2, 3]], np.int32),
                np.array([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 2, 2, 2, 3]], np.int32))


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_combine_with_every_mask_against_numpy_loops(implementation, causal):
  q, k, v = make_qkv(SHAPE)  # T = 5, S = 7: the pair form.
  bias, mask = _bias_mask(SHAPE)
  q_len, kv_len = np.array([5, 4]), np.array([6, 7])
  got = la.softmax_attention(
      q, k, v, bias=bias, mask=mask, is_causal=causal, query_seq_lengths=jnp.asarray(q_len),
      key_value_seq_lengths=jnp.asarray(kv_len), local_window_size=(3, 1),
      implementation=implementation, segment_ids=tuple(map(jnp.asarray, SEGMENT_PAIR)))
  want = numpy_attention(q, k, v, scale=1 / np.sqrt(SHAPE.H), bias=np.asarray(bias),
                         mask=np.asarray(mask), causal=causal, q_len=q_len, kv_len=kv_len,
                         window=(3, 1), segments=SEGMENT_PAIR)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["reference", "xla", "flash"])
def test_causal_pair_of_segment_ids_with_t_not_s(implementation):
  """Causal alignment stays the call's own (bottom-right), segments mask on top of it."""
  q, k, v = make_qkv(SHAPE)
  q_len, kv_len = np.array([5, 3]), np.array([7, 6])
  got = la.softmax_attention(
      q, k, v, is_causal=True, query_seq_lengths=jnp.asarray(q_len),
      key_value_seq_lengths=jnp.asarray(kv_len), implementation=implementation,
      segment_ids=tuple(map(jnp.asarray, SEGMENT_PAIR)))
  want = numpy_attention(q, k, v, scale=1 / np.sqrt(SHAPE.H), causal=True, q_len=q_len,
                         kv_len=kv_len, segments=SEGMENT_PAIR)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_q, block_k", [(3, 2), (4, 5), (2, 7)])
def test_flash_segment_boundaries_inside_blocks(block_q, block_k):
  """Boundaries at 2, 3, 6 and 9 fall inside blocks; forward and gradients equal the
  reference's, causal and not, with padding keys after the last segment."""
  shape = Shape(B=2, T=11, S=11, N=2, K=1, H=4, D=3)
  q, k, v = make_qkv(shape)
  ids = jnp.array([[0, 0, 1, 2, 2, 2, 3, 3, 3, 4, 4], [7] * 11])
  lengths = jnp.array([9, 11])
  ct = jnp.asarray(np.random.default_rng(2).standard_normal((2, 11, 2, 3)), jnp.float32)
  for causal in (False, True):
    def loss(fn, q, k, v, causal=causal, **blocks):
      out = fn(q, k, v, is_causal=causal, key_value_seq_lengths=lengths, segment_ids=ids,
               **blocks)
      return jnp.sum(out * ct), out

    (_, got), g_got = jax.jit(jax.value_and_grad(
        functools.partial(loss, la.flash_attention, block_q=block_q, block_k=block_k),
        argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (_, want), g_want = jax.jit(jax.value_and_grad(
        functools.partial(loss, la.softmax_attention_reference), argnums=(0, 1, 2),
        has_aux=True))(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(got)[0, 9:] == 0)  # Its keys are all padding.
    for a, b in zip(g_got, g_want, strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_flash_visits_only_the_key_blocks_of_a_query_blocks_segments():
  """Segment ids do not decrease, so a query block's keys are one range of blocks:
  forward (key blocks per query block) and backward (query blocks per key block)."""
  from linattn_jax._src.flash import FlashConfig

  cfg = FlashConfig(T=12, S=12, block_q=4, block_k=4, is_causal=False, scale=1.0)
  ids = jnp.array([[0] * 5 + [1] * 3 + [2] * 4])  # Blocks: {0}, {0, 1}, {2}.
  ranges = [tuple(int(x) for x in cfg.key_block_range(i, None, None, ids, ids))
            for i in range(3)]
  assert ranges == [(0, 2), (0, 2), (2, 3)]
  ranges = [tuple(int(x) for x in cfg.query_block_range(j, None, None, ids, ids))
            for j in range(3)]
  assert ranges == [(0, 2), (0, 2), (2, 3)]
  causal = dataclasses.replace(cfg, is_causal=True)
  assert int(causal.key_block_range(0, None, None, ids, ids)[1]) == 1


def test_unbatched_segment_ids():
  shape = Shape(B=1, T=6, S=6, N=2, K=1, H=4, D=3)
  q, k, v = (x[0] for x in make_qkv(shape))
  ids = jnp.array([0, 0, 0, 1, 1, 2])
  want = la.softmax_attention_reference(q[None], k[None], v[None], segment_ids=ids[None])[0]
  for implementation in ("reference", "xla", "flash"):
    for given in (ids, ids[None]):
      got = la.softmax_attention(q, k, v, segment_ids=given, implementation=implementation)
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  got = la.flash_attention(q, k, v, segment_ids=ids, block_q=4, block_k=4)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match=r"segment_ids must have shape \[T\] = \(6,\)"):
    la.softmax_attention(q, k, v, segment_ids=jnp.stack([ids, ids]))


def test_decreasing_segment_ids_are_caught_eagerly_only():
  """The docstring's promise: the order is checked on concrete ids, not under jit."""
  q, k, v = make_qkv(Shape(B=1, T=4, S=4, N=1, K=1, H=2, D=2))
  ids = jnp.array([[1, 1, 0, 0]])
  for fn in (la.softmax_attention, la.flash_attention, la.softmax_attention_reference):
    with pytest.raises(ValueError, match="must not decrease"):
      fn(q, k, v, segment_ids=ids)
  out = jax.jit(lambda ids: la.softmax_attention(q, k, v, segment_ids=ids,
                                                 implementation="xla"))(ids)
  assert np.all(np.isfinite(np.asarray(out)))
