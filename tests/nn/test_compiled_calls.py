"""An eager layer call runs as one compiled program (``linattn_jax._src.nn.compiled``).

Each layer, called eagerly, compiles one program on its first call and none on a second
call of the same shapes, and gives what the same call under an outer ``nnx.jit`` gives
(the method as written, traced), decoding included: the outputs and the caches the calls
leave are equal. Values a compiled program cannot judge are judged before it:
``segment_ids`` that decrease raise eagerly, naming the layer.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from _helpers import CompileCounter
from flax import nnx

from linattn_jax import nn

F = 8  # Features.
LAYERS = {
    "MultiHeadAttention": lambda: nn.MultiHeadAttention(2, F, attention="linear_elu",
                                                        rngs=nnx.Rngs(0)),
    "RecurrentMixer": lambda: nn.RecurrentMixer("gated_deltanet", F, num_heads=2,
                                                rngs=nnx.Rngs(0)),
    "Mamba2Mixer": lambda: nn.Mamba2Mixer(F, num_heads=2, head_dim=4, state_size=4,
                                          rngs=nnx.Rngs(0)),
    "MambaMixer": lambda: nn.MambaMixer(F, state_size=4, rngs=nnx.Rngs(0)),
    "ShortConvMixer": lambda: nn.ShortConvMixer(F, rngs=nnx.Rngs(0)),
    "RWKV7TimeMixer": lambda: nn.RWKV7TimeMixer(F, head_dim=4, rngs=nnx.Rngs(0)),
    "ShortConvolution": lambda: nn.ShortConvolution(F, rngs=nnx.Rngs(0)),
    "TokenShift": lambda: nn.TokenShift(F),
    "GatedRMSNorm": lambda: nn.GatedRMSNorm(F, activation=None, rngs=nnx.Rngs(0)),
    "LowRank": lambda: nn.LowRank(F, 2, F, rngs=nnx.Rngs(0)),
}
DECODES = [name for name in LAYERS if name not in ("GatedRMSNorm", "LowRank")]


@nnx.jit(static_argnames="decode")
def _traced(layer, x, decode=False):
  """The call as written, traced inside an outer program."""
  return layer(x, decode=decode) if decode else layer(x)


@pytest.mark.parametrize("name", LAYERS)
def test_an_eager_call_is_one_program_equal_to_the_traced_call(name):
  eager, traced = LAYERS[name](), LAYERS[name]()
  x = jax.random.normal(jax.random.key(0), (2, 6, F))
  with CompileCounter() as first:
    got = eager(x)
  with CompileCounter() as second:
    again = eager(x)
  assert (first.count, second.count) == (1, 0), name
  chex.assert_trees_all_close(got, again, _traced(traced, x), atol=1e-6, rtol=1e-6)
  if name not in DECODES:
    return
  for layer in (eager, traced):
    layer.init_cache(x.shape)
  for a, b in ((0, 4), (4, 5), (5, 6)):  # A prompt, then single tokens.
    chex.assert_trees_all_close(eager(x[:, a:b], decode=True),
                                _traced(traced, x[:, a:b], decode=True), atol=1e-6, rtol=1e-6)
  chex.assert_trees_all_close(nnx.state(eager, nnx.Cache), nnx.state(traced, nnx.Cache),
                              atol=1e-6, rtol=1e-6)


def test_decreasing_segment_ids_raise_eagerly_naming_the_layer():
  layer = LAYERS["RecurrentMixer"]()
  x = np.ones((1, 4, F), np.float32)
  with pytest.raises(ValueError, match=r"RecurrentMixer: segment_ids must not decrease"):
    layer(x, segment_ids=np.array([[1, 1, 0, 0]], np.int32))


def test_with_jit_disabled_the_call_runs_as_written():
  layer = LAYERS["TokenShift"]()
  x = jax.random.normal(jax.random.key(1), (1, 3, F))
  with jax.disable_jit():
    shifted = layer(x)
  np.testing.assert_array_equal(shifted[:, 1:], x[:, :-1])
  np.testing.assert_array_equal(shifted[:, 0], 0)
