"""Dense mask builders against their definitions, written as plain loops."""

from __future__ import annotations

import numpy as np
import pytest

from linattn_jax import masks


def loop_mask(T, S, rule):
  return np.array([[rule(i, j) for j in range(S)] for i in range(T)], bool)


@pytest.mark.parametrize("T,S", [(4, 4), (2, 5), (5, 2)])
def test_causal(T, S):
  want = loop_mask(T, S, lambda i, j: j <= i + S - T)
  np.testing.assert_array_equal(masks.causal(T, S), want)


def test_causal_defaults_to_square():
  np.testing.assert_array_equal(masks.causal(3), np.tril(np.ones((3, 3), bool)))


@pytest.mark.parametrize("window,left,right", [(1, 1, 1), ((2, 0), 2, 0), ((0, 3), 0, 3)])
@pytest.mark.parametrize("T,S", [(6, 6), (3, 6)])
def test_local(window, left, right, T, S):
  want = loop_mask(T, S, lambda i, j: i + S - T - left <= j <= i + S - T + right)
  np.testing.assert_array_equal(masks.local(T, S, window), want)


def test_local_with_zero_right_is_banded_causal():
  np.testing.assert_array_equal(masks.local(7, 7, (7, 0)), masks.causal(7))


@pytest.mark.parametrize("window", [-1, (1, -2), (1, 2, 3), "x", 1.5])
def test_local_rejects_bad_windows(window):
  with pytest.raises(ValueError, match="window_size"):
    masks.local(4, 4, window)


def test_strided():
  want = loop_mask(6, 6, lambda i, j: j % 3 == 0 or i - 1 <= j <= i)
  np.testing.assert_array_equal(masks.strided(6, 6, 3, window_size=(1, 0)), want)
  np.testing.assert_array_equal(masks.strided(2, 5, 2), loop_mask(2, 5, lambda i, j: j % 2 == 0))
  with pytest.raises(ValueError, match="stride"):
    masks.strided(4, 4, 0)


def test_block_sparse_crops_partial_blocks_and_accepts_per_head_layouts():
  layout = np.array([[1, 0], [1, 1]], bool)
  want = loop_mask(3, 4, lambda i, j: layout[i // 2, j // 2])
  np.testing.assert_array_equal(masks.block_sparse(layout, 2, 3, 4), want)
  per_head = np.stack([layout, ~layout])
  got = masks.block_sparse(per_head, 2, 3, 4)
  assert got.shape == (2, 3, 4)
  np.testing.assert_array_equal(got[1], ~want)


def test_longformer_rejects_global_positions_outside_the_keys():
  for positions in ([5], [-1], [1.5]):
    with pytest.raises(ValueError, match=r"longformer: global_positions must be ints in \[0, "):
      masks.longformer(4, 5, (1, 0), positions)


def test_block_sparse_rejects_wrong_layouts():
  with pytest.raises(ValueError, match=r"layout must have shape \[2, 2\]"):
    masks.block_sparse(np.ones((3, 2)), 2, 3, 4)
  with pytest.raises(ValueError, match="block_size"):
    masks.block_sparse(np.ones((2, 2)), 0, 3, 4)


def test_padding():
  got = masks.padding(3, 4, query_seq_lengths=np.array([2, 3]),
                      key_value_seq_lengths=np.array([3, 0]))
  want = np.stack([loop_mask(3, 4, lambda i, j: i < 2 and j < 3),
                   loop_mask(3, 4, lambda i, j: False)])
  np.testing.assert_array_equal(got, want)
  only_keys = masks.padding(2, 4, key_value_seq_lengths=np.array([1]))
  np.testing.assert_array_equal(only_keys, loop_mask(2, 4, lambda i, j: j < 1)[None])
  with pytest.raises(ValueError, match="give query_seq_lengths or key_value_seq_lengths"):
    masks.padding(2, 2)
  with pytest.raises(ValueError, match=r"shape \[B\]"):
    masks.padding(2, 2, key_value_seq_lengths=np.array(3))


@pytest.mark.parametrize("name,make", [
    ("causal", lambda T, S: masks.causal(T, S)),
    ("padding", lambda T, S: masks.padding(T, S, key_value_seq_lengths=np.array([1]))),
    ("local", lambda T, S: masks.local(T, S, 1)),
    ("strided", lambda T, S: masks.strided(T, S, 2)),
    ("block_sparse", lambda T, S: masks.block_sparse(np.ones((1, 1)), 4, T, S)),
    ("longformer", lambda T, S: masks.longformer(T, S, 1, [0])),
    ("bigbird", lambda T, S: masks.bigbird(T, S, 4, num_random_blocks=0)),
])
def test_masks_reject_lengths_that_are_not_positive_ints(name, make):
  assert make(3, 2).shape[-2:] == (3, 2)
  for T, S in ((0, 2), (3, -1), (3.0, 2), (3, None if name != "causal" else "2")):
    with pytest.raises(ValueError, match=rf"^{name}: (T|S) must be a positive int"):
      make(T, S)


def test_bigbird_names_itself_for_bad_block_counts_and_rng():
  with pytest.raises(ValueError, match=r"^bigbird: num_window_blocks must be a non-negative int"):
    masks.bigbird(8, 8, 2, num_window_blocks=-1)
  with pytest.raises(ValueError, match=r"^bigbird: rng must be an int seed or a jax PRNG key"):
    masks.bigbird(8, 8, 2, rng="seed")
