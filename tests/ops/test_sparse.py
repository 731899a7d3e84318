"""Sparse-family checks beyond the shared suite: dense twins, pattern details,
cost that follows the pattern, streaming memory, and bad input."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import Shape, assert_close, largest_intermediate, make_qkv, suite_options

import linattn_jax as la
from linattn_jax import masks
from linattn_jax._src import gather

SHAPE = Shape(B=2, T=21, S=21, N=4, K=2, H=8, D=6)

# (function, options, dense twin (T, S[, is_causal]) -> mask)
CASES = {
    "local": (la.local_attention, dict(window_size=(4, 1), block_size=8),
              lambda T, S: masks.local(T, S, (4, 1))),
    "strided": (la.strided_attention, dict(stride=4, window_size=2, block_size=8),
                lambda T, S: masks.strided(T, S, 4, 2)),
    "block_sparse": (la.block_sparse_attention,
                     dict(layout=np.tril(np.ones((6, 6), bool)) & ~np.eye(6, k=-2, dtype=bool),
                          block_size=4),
                     lambda T, S: masks.block_sparse(
                         np.tril(np.ones((6, 6), bool)) & ~np.eye(6, k=-2, dtype=bool), 4, T, S)),
    "longformer": (la.longformer_attention,
                   dict(window_size=(2, 2), global_positions=(0, 7, 20), block_size=8),
                   lambda T, S: masks.longformer(T, S, (2, 2), (0, 7, 20))),
    "bigbird": (la.bigbird_attention,
                dict(block_size=3, num_window_blocks=3, num_global_blocks=1,
                     num_random_blocks=2, rng=7),
                lambda T, S, causal: masks.bigbird(T, S, 3, num_window_blocks=3,
                                                   num_global_blocks=1, num_random_blocks=2,
                                                   rng=7, is_causal=causal)),
}


# Packed segments of SHAPE's 21 positions: 0-4, 5-8, 9-15, 16-20. Longformer's global
# positions 0, 7 and 20 lie in three of them; BigBird's global block (0-2) in the first.
SEGMENTS = np.repeat(np.array([[0, 1, 2, 3], [4, 4, 5, 6]]),
                     np.array([5, 4, 7, 5]), axis=1).astype(np.int32)
SEGMENTS[1] = np.repeat([4, 5, 6], [9, 9, 3])


def _gradients(fn):
  """``(q, k, v, ct) -> (dq, dk, dv)``: the pullback of ``fn``, compiled once."""
  return jax.jit(lambda q, k, v, ct: jax.vjp(fn, q, k, v)[1](ct))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_nothing_crosses_a_segment_boundary(name, causal):
  """The outputs of one segment's rows have exactly zero gradient with respect to every
  other segment's queries, keys and values: windows, summary columns, blocks, global
  positions (a global row sees only its own segment; a global key is seen only from its
  segment) and random blocks included. Unpacked, the same pattern does cross."""
  fn, options, _ = CASES[name]
  q, k, v = make_qkv(SHAPE)
  ids = jnp.asarray(SEGMENTS)
  packed = _gradients(functools.partial(fn, is_causal=causal, segment_ids=ids, **options))
  whole = _gradients(functools.partial(fn, is_causal=causal, **options))
  ct = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape[:3] + v.shape[3:]),
                   jnp.float32)
  crossed = False
  for segment in np.unique(SEGMENTS):
    other = (SEGMENTS != segment)[:, :, None, None]
    ct_rows = jnp.where(jnp.asarray(~other), ct, 0)  # The segment's outputs only.
    for g in packed(q, k, v, ct_rows):
      assert np.all(np.isfinite(g))
      np.testing.assert_array_equal(np.where(other, g, 0), 0, err_msg=f"segment {segment}")
    crossed |= any(np.any(np.where(other, g, 0) != 0) for g in whole(q, k, v, ct_rows))
  assert crossed, "the unpacked pattern never crosses these boundaries: the test is vacuous"


def test_packed_global_rows_and_random_blocks_stay_in_their_segment():
  """Longformer's global token at 7 sees exactly its segment (5-8), as softmax over it
  would; BigBird's global rows (block 0, in segment 0) likewise."""
  q, k, v = make_qkv(SHAPE)
  ids = jnp.asarray(SEGMENTS)
  _, options, _ = CASES["longformer"]
  out = la.longformer_attention(q, k, v, segment_ids=ids, **options)
  own = la.softmax_attention_reference(q[:1, 5:9], k[:1, 5:9], v[:1, 5:9])
  assert_close(out[:1, 7], own[:, 2], jnp.float32)
  _, options, _ = CASES["bigbird"]
  out = la.bigbird_attention(q, k, v, segment_ids=ids, **options)
  own = la.softmax_attention_reference(q[:1, :5], k[:1, :5], v[:1, :5])
  assert_close(out[:1, :3], own[:, :3], jnp.float32)


def test_local_return_state_refuses_segment_ids():
  q, k, v = make_qkv(SHAPE)
  with pytest.raises(ValueError, match="return_state does not support segment_ids"):
    la.local_attention(q, k, v, window_size=(3, 0), is_causal=True, return_state=True,
                       segment_ids=jnp.asarray(SEGMENTS))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_blocked_equals_softmax_with_the_dense_twin(name, causal):
  fn, options, dense = CASES[name]
  q, k, v = make_qkv(SHAPE)
  lengths = jnp.array([21, 13])
  got = jax.jit(functools.partial(fn, is_causal=causal, **options))(
      q, k, v, key_value_seq_lengths=lengths)
  twin = dense(SHAPE.T, SHAPE.S, causal) if name == "bigbird" else dense(SHAPE.T, SHAPE.S)
  want = la.softmax_attention(q, k, v, mask=twin, is_causal=causal,
                              key_value_seq_lengths=lengths, implementation="xla")
  assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("packed", [False, True], ids=["one", "packed"])
@pytest.mark.parametrize("T", [512, 2048])
def test_local_cost_follows_the_window_not_t_squared(T, packed):
  """Packed sequences too: the segment rule is applied to the gathered keys, not as a
  ``[T, S]`` mask."""
  shape = Shape(B=1, T=T, S=T, N=2, K=1, H=4, D=4)
  q, k, v = make_qkv(shape)
  ids = jnp.arange(T)[None] // 100 if packed else None

  def loss(q, k, v):
    out = la.local_attention(q, k, v, window_size=(16, 0), is_causal=True, block_size=16,
                             segment_ids=ids)
    return jnp.sum(out ** 2)

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
  # Scores are [B, K, G, T/16, 16, 16 + 16]: 32 keys per row, whatever T is.
  assert largest_intermediate(jaxpr) <= shape.N * T * 32


@pytest.mark.parametrize("start, stride, R, L", [
    (-5, 4, 3, 9),  # Starts before the sequence, L not a multiple of the stride.
    (0, 4, 3, 4),  # Consecutive rows.
    (3, 2, 5, 7),  # Ends past the sequence.
    (12, 3, 2, 4),  # Wholly past it.
    (-20, 3, 2, 4),  # Wholly before it.
    (-1, 2, 1, 12),  # One long window (a group of rows that reads every key).
])
def test_sliding_windows_equal_the_gathered_positions(start, stride, R, L):
  """``windows`` (slices) gives what gathering the positions gives, with zeros
  outside the sequence; ``window_start`` recognises exactly such position tables."""
  x = np.arange(2 * 10 * 3, dtype=np.float32).reshape(2, 10, 3)
  positions = start + stride * np.arange(R)[:, None] + np.arange(L)[None, :]
  inside = ((positions >= 0) & (positions < 10))[None, :, :, None]
  want = np.where(inside, np.take(x, np.clip(positions, 0, 9), axis=1), 0)
  np.testing.assert_array_equal(gather.windows(jnp.asarray(x), start, stride, R, L), want)
  assert gather.window_start(positions, stride) == start
  positions[-1, 0] += 1
  assert gather.window_start(positions, stride) is None


def test_a_global_row_reading_every_key_does_not_grow_the_program_with_t():
  """Longformer's global rows read all S keys as one window: a slice, not one per block of
  rows (which made the program, and its compile time, grow with T)."""
  def size(T):
    q, k, v = make_qkv(SHAPE._replace(T=T, S=T))
    f = functools.partial(la.longformer_attention, window_size=(4, 0), global_positions=(0, 9),
                          block_size=2, is_causal=True)
    return str(jax.make_jaxpr(f)(q, k, v)).count(" = ")  # Equations, nested ones included.

  assert size(64) == size(256)


@pytest.mark.parametrize("left, Q", [(10, 64), (100, 100), (300, 256)])
def test_the_default_query_block_is_the_window_within_64_and_256(left, Q):
  """Without ``block_size``, local and Longformer attention score blocks of Q rows against
  Q + left keys (causal), with Q the window clipped to [64, 256]."""
  x = jnp.ones((1, 1024, 1, 4))
  R, L = -(-1024 // Q), Q + left
  longformer = functools.partial(la.longformer_attention, global_positions=(0,))
  for f, extra in ((la.local_attention, 0), (longformer, 1)):  # Longformer: one global key.
    jaxpr = str(jax.make_jaxpr(lambda x, f=f: f(x, x, x, window_size=(left, 0), is_causal=True))(x))
    assert f"{R},{Q},{L + extra}]" in jaxpr, (f, R, Q, L + extra)


@pytest.mark.parametrize("packed", [False, True], ids=["one", "packed"])
def test_local_attention_reads_its_windows_without_gather_or_scatter(packed):
  """Forward and backward: slices and pads, which run far faster on CPU than a gather and
  its transpose, a scatter-add; packed segment ids are read the same way."""
  q, k, v = make_qkv(SHAPE)
  ids = jnp.asarray(SEGMENTS) if packed else None
  f = functools.partial(la.local_attention, window_size=(4, 1), block_size=8, is_causal=True,
                        segment_ids=ids)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda *x: jnp.sum(f(*x)), argnums=(0, 1, 2)))(q, k, v))
  assert "gather" not in jaxpr and "scatter" not in jaxpr


def test_bigbird_layout_is_deterministic_and_causal_draws_come_from_the_past():
  a = masks.bigbird_layout(12, num_global_blocks=2, num_random_blocks=3, rng=5)
  np.testing.assert_array_equal(a, masks.bigbird_layout(12, num_global_blocks=2,
                                                        num_random_blocks=3, rng=5))
  assert not np.array_equal(a, masks.bigbird_layout(12, num_global_blocks=2,
                                                    num_random_blocks=3, rng=6))
  key = jax.random.key(3)
  np.testing.assert_array_equal(masks.bigbird_layout(12, rng=key),
                                masks.bigbird_layout(12, rng=key))
  causal = masks.bigbird_layout(12, num_global_blocks=1, num_random_blocks=3, rng=5,
                                is_causal=True)
  assert not np.any(np.triu(causal, 1)), "a causal layout reaches a future block"
  # Rows with enough past have their window (the diagonal and 2 back), global block 0 and
  # 3 random blocks.
  for row in range(7, 12):
    assert causal[row].sum() == 1 + 3 + 3, causal[row]
  assert np.all(a[:2]) and np.all(a[:, :2]), "global rows and columns are full"


def test_bigbird_rejects_traced_rng():
  q, k, v = make_qkv(Shape(B=1, T=8, S=8, N=2, K=1, H=4, D=4))
  f = jax.jit(lambda rng: la.bigbird_attention(q, k, v, block_size=2, rng=rng))
  with pytest.raises(ValueError, match="rng must be static"):
    f(jax.random.key(0))


def test_longformer_global_rows_see_everything():
  q, k, v = make_qkv(SHAPE)
  out = la.longformer_attention(q, k, v, window_size=1, global_positions=(5,))
  full = la.softmax_attention_reference(q, k, v)
  np.testing.assert_allclose(out[:, 5], full[:, 5], atol=1e-5)
  assert not np.allclose(out[:, 6], full[:, 6], atol=1e-3)


def test_block_sparse_per_head_layouts():
  """With key lengths too: their mask meets the per-head key slots ``[B, N, R, 1, L]``."""
  q, k, v = make_qkv(SHAPE)
  rng = np.random.default_rng(0)
  layout = rng.random((SHAPE.N, 6, 6)) > 0.5
  lengths = jnp.array([21, 13])
  got = la.block_sparse_attention(q, k, v, layout=layout, block_size=4,
                                  key_value_seq_lengths=lengths)
  want = la.softmax_attention_reference(q, k, v, mask=masks.block_sparse(layout, 4, 21, 21)[None],
                                        key_value_seq_lengths=lengths)
  assert_close(got, want, jnp.float32)


def test_local_streaming_state_is_constant_in_position():
  shape = Shape(B=1, T=40, S=40, N=2, K=1, H=4, D=3)
  q, k, v = make_qkv(shape)
  state = la.init_local_state(1, 1, 4, 3, window_size=(5, 0))
  step = jax.jit(la.local_attention_step)
  outs = []
  for t in range(shape.T):
    state, out = step(state, q[:, t], k[:, t], v[:, t])
    outs.append(out)
  assert state.keys.shape == (1, 6, 1, 4)  # left + 1 slots, after 40 tokens.
  want = la.local_attention(q, k, v, window_size=(5, 0), is_causal=True)
  assert_close(jnp.stack(outs, 1), want, jnp.float32)


def test_local_decoding_continues_an_unbatched_prefill():
  """Unbatched local_attention returns an unbatched state; the step takes it and array-likes."""
  q, k, v = (x[0] for x in make_qkv(Shape(B=1, T=9, S=9, N=2, K=1, H=4, D=3)))
  _, state = la.local_attention(q[:6], k[:6], v[:6], window_size=(3, 0), is_causal=True,
                                return_state=True)
  assert state.keys.shape == (4, 1, 4)
  outs = []
  for t in range(6, 9):  # Nested lists, as a user might pass them.
    state, out = la.local_attention_step(state, q[t].tolist(), k[t].tolist(), v[t].tolist())
    outs.append(out)
  assert state.keys.shape == (4, 1, 4) and outs[0].shape == (2, 3)
  want = la.local_attention(q, k, v, window_size=(3, 0), is_causal=True)[6:]
  assert_close(jnp.stack(outs), want, jnp.float32)
  with pytest.raises(ValueError, match=r"^local_attention_step: expected query \[B, N, H\]"):
    la.local_attention_step(state, q[None, 6], k[None, 6], v[None, 6])  # Batched, state not.


@pytest.mark.parametrize("call,match", [
    (functools.partial(la.local_attention, window_size=-1), "window_size"),
    (functools.partial(la.local_attention, window_size=(2, 1), block_size=0), "block_size"),
    (functools.partial(la.strided_attention, stride=0), "stride"),
    (functools.partial(la.block_sparse_attention, layout=np.ones((3, 3)), block_size=4),
     r"layout must have shape \[6, 6\]"),
    (functools.partial(la.block_sparse_attention, layout=np.ones((3, 6, 6)), block_size=4),
     "per-head layout needs N=4"),
    (functools.partial(la.longformer_attention, window_size=1, global_positions=(21,)),
     "global_positions"),
    (functools.partial(la.longformer_attention, window_size=1, global_positions=(-1,)),
     "global_positions"),
    (functools.partial(la.bigbird_attention, block_size=2, num_random_blocks=-1),
     "^bigbird_attention: num_random_blocks must be a non-negative int"),
    (functools.partial(la.bigbird_attention, block_size=2, rng=1.5),
     "^bigbird_attention: rng must be an int seed or a jax PRNG key"),
    (functools.partial(la.local_attention, window_size=1, implementation="dense"),
     "unknown implementation"),
])
def test_bad_options_raise(call, match):
  q, k, v = make_qkv(SHAPE)
  with pytest.raises(ValueError, match=match):
    call(q, k, v)


@pytest.mark.parametrize("name", ["local", "strided", "block_sparse", "longformer", "bigbird"])
@pytest.mark.parametrize("causal", [False, True])
def test_registered_dense_mask_is_the_twin(name, causal):
  spec = la.get_spec(name)
  q, k, v = make_qkv(Shape(B=1, T=12, S=12, N=2, K=1, H=4, D=3))
  mask = spec.dense_mask(12, 12, is_causal=causal, **spec.what_options(suite_options(spec)))
  got = jax.jit(functools.partial(spec.build(**suite_options(spec)), is_causal=causal))(q, k, v)
  want = la.softmax_attention(q, k, v, mask=mask, is_causal=causal)
  assert_close(got, want, jnp.float32)
