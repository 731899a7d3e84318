"""Flax NNX layers: decode caches for every causal variant, Flax parity, transforms, errors."""

from __future__ import annotations

import dataclasses
import functools

import _helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import TOLERANCE, CompileCounter, layer_paths, suite_options
from flax import linen, nnx

import linattn_jax as la
from linattn_jax import nn
from linattn_jax._src.nn import attention
from linattn_jax._src.registry import get_spec

B, T, IN, N, K = 2, 11, 16, 4, 2  # GQA: two query heads per key/value head.
# A prompt, a step, a second chunk at a later position, then steps: every decode path.
PIECES = (5, 1, 3, 1, 1)
CAUSAL = [name for name in la.available_attentions() if get_spec(name).supports_causal]
GATED = [name for name in la.available_attentions() if get_spec(name).token_inputs]
# The gate parameters each gated variant's layer declares: name -> shape (H = IN // N).
GATE_PARAMS = {
    "simple_gla": {"a_kernel": (IN, K), "A_log": (K,), "dt_bias": (K,)},
    "gla": {"gk_kernel_1": (IN, 16), "gk_kernel_2": (16, K * (IN // N)),
            "gk_bias": (K * (IN // N),)},
    "delta_net": {"b_kernel": (IN, K)},
    "gated_delta_net": {"a_kernel": (IN, K), "A_log": (K,), "dt_bias": (K,),
                        "b_kernel": (IN, K)},
    "kda": {"gk_kernel_1": (IN, 16), "gk_kernel_2": (16, K * (IN // N)),
            "gk_bias": (K * (IN // N),), "b_kernel": (IN, K)},
    **{name: {"gk_kernel_1": (IN, 16), "gk_kernel_2": (16, K * (IN // N)),
              "gk_bias": (K * (IN // N),), "kappa_kernel": (IN, K * (IN // N)),
              "iclr_kernel": (IN, K * (IN // N))} for name in ("dplr", "rwkv7")},
    # The tests' own gated variant (support/toy_gated.py): a decay and a write strength.
    "toy_gated": {"a_kernel": (IN, K), "A_log": (K,), "dt_bias": (K,), "b_kernel": (IN, K)},
}


def test_gate_projections_follow_the_declared_inputs_and_others_are_refused(monkeypatch):
  """The layer reads what to project off the spec's token_inputs: a new variant declaring a
  decay per head gets the Mamba2 gate; an input it has no projection for is named."""
  custom = dataclasses.replace(get_spec("simple_gla"), name="custom_gated")
  monkeypatch.setattr(attention, "get_spec", lambda name: custom)
  layer = nn.MultiHeadAttention(N, IN, num_kv_heads=K, attention="custom_gated",
                                rngs=nnx.Rngs(0))
  assert {"a_kernel", "A_log", "dt_bias"} <= set(nnx.state(layer, nnx.Param))
  custom = dataclasses.replace(custom, token_inputs=(
      la.TokenInput("log_decay", la.Role.DECAY), la.TokenInput("alpha", la.Role.DECAY)))
  with pytest.raises(ValueError, match=r"attention='custom_gated' needs per-token inputs "
                     r"\(log_decay \[B, S, K\] \(decay\), alpha \[B, S, K\] \(decay\)\) that "
                     r"this layer has no projection for"):
    nn.MultiHeadAttention(N, IN, num_kv_heads=K, attention="custom_gated", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", GATED)
def test_gate_parameters_and_the_gates_they_make(name, monkeypatch):
  """Each gated variant declares its papers' gate parameters; the function gets log_decay ≤ 0
  and beta in (0, 1) from the key/value input, one per key (per key feature for gla)."""
  layer = _layer(name)
  params = nnx.state(layer, nnx.Param)
  gate_params = {k: tuple(v.get_value().shape) for k, v in params.items()
                 if k not in ("query", "key", "value", "out")}
  assert gate_params == GATE_PARAMS[name]
  if "A_log" in gate_params:  # exp(A_log) in [1, 16]; softplus(dt_bias) in [0.001, 0.1].
    assert np.all((np.exp(layer.A_log.get_value()) >= 1) & (np.exp(layer.A_log.get_value()) <= 16))
    dt = np.asarray(jax.nn.softplus(layer.dt_bias.get_value()))
    assert np.all((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 1e-1 * (1 + 1e-5)))
  x = jax.random.normal(jax.random.key(12), (B, T, IN))
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2)))(layer)
  for param in GATE_PARAMS[name]:  # The gates are trained with the layer.
    assert np.abs(grads[param].get_value()).sum() > 0, param
  seen = {}

  def capture(*args, **kwargs):  # The gates as the compiled call computes them.
    jax.debug.callback(lambda **gates: seen.update(gates),
                       **{x.name: kwargs[x.name] for x in spec.token_inputs})
    return spec.function(*args, **kwargs)

  spec = get_spec(name)
  monkeypatch.setattr(layer, "_spec", dataclasses.replace(spec, function=capture))
  S = 7
  x_q = jax.random.normal(jax.random.key(9), (B, 5, IN))
  x_kv = 3 * jax.random.normal(jax.random.key(10), (B, S, IN))  # Cross: gates from x_kv.
  layer(x_q, x_kv, is_causal=True)
  jax.effects_barrier()
  assert sorted(seen) == sorted(x.name for x in spec.token_inputs)
  H = IN // N
  if "log_decay" in seen:
    g = np.asarray(seen["log_decay"])
    assert g.shape == ((B, S, K, H) if name in ("gla", "kda", "dplr", "rwkv7") else (B, S, K))
    assert np.all(g <= 0) and np.all(np.isfinite(g)) and np.any(g < 0)
    if "A_log" in gate_params:  # -exp(A_log) softplus(x W_a + dt_bias), recomputed.
      want = -np.exp(layer.A_log.get_value())[None, None] * jax.nn.softplus(
          x_kv @ layer.a_kernel.get_value() + layer.dt_bias.get_value()[None, None])
      np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
  if "beta" in seen:
    beta = np.asarray(seen["beta"])
    assert beta.shape == (B, S, K) and np.all((beta > 0) & (beta < 1))
    np.testing.assert_allclose(beta, jax.nn.sigmoid(x_kv @ layer.b_kernel.get_value()),
                               rtol=1e-5, atol=1e-7)
  if "a" in seen:  # RWKV-7's a = -κ̂ (a unit removal key per head), b = κ̂ ⊙ σ(x W_iclr).
    a, b = np.asarray(seen["a"]), np.asarray(seen["b"])
    assert a.shape == b.shape == (B, S, K, H)
    np.testing.assert_allclose(np.linalg.norm(a, axis=-1), 1, rtol=1e-5)
    iclr = jax.nn.sigmoid(x_kv @ layer.iclr_kernel.get_value()).reshape(B, S, K, H)
    np.testing.assert_allclose(b, -a * iclr, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["delta_net", "gated_delta_net"])
def test_delta_variants_normalise_queries_and_keys(name):
  """The delta rule sees unit queries and keys: scaling the query and key projections
  leaves the output as it was (unnormalised, a key of norm 10 overshoots the state)."""
  layer = _layer(name)
  x = jax.random.normal(jax.random.key(11), (B, T, IN))
  want = _full(layer, x)
  for projection, factor in ((layer.query, 3.0), (layer.key, 10.0)):
    projection.kernel.set_value(projection.kernel.get_value() * factor)
    projection.bias.set_value(projection.bias.get_value() * factor)
  np.testing.assert_allclose(_full(layer, x), want, atol=2e-5, rtol=2e-5)


def _options(name: str) -> dict:
  """The suite's small options, minus those the layer owns (it draws its own arrays)."""
  spec = get_spec(name)
  owned = spec.params.names + ("rng",) if spec.params is not None else ()
  return {k: v for k, v in suite_options(spec).items() if k not in owned}


def _layer(name: str, dtype=None, **kw) -> nn.MultiHeadAttention:
  return nn.MultiHeadAttention(N, IN, num_kv_heads=K, attention=name, dtype=dtype,
                               attention_options=_options(name), rngs=nnx.Rngs(0), **kw)


@nnx.jit
def _full(layer, x):
  return layer(x, is_causal=True)


@nnx.jit
def _decode(layer, x):
  return layer(x, decode=True)  # Flax's form: decoding is causal by construction.


@nnx.jit
def _full_and_pieces(layer, x):
  """One causal call over ``x``, and the layer decoding ``x`` in ``PIECES`` from its fresh
  cache (one program: the pieces' shapes would each compile their own)."""
  full = layer(x, is_causal=True)  # Reads no cache.
  bounds = np.cumsum((0,) + PIECES)
  return full, jnp.concatenate([layer(x[:, a:b], decode=True)
                                for a, b in zip(bounds[:-1], bounds[1:], strict=True)], 1)


def _prefill_cases() -> list[tuple[str, object]]:
  """Every variant decodes here, in float32 through the layer's paths (the first variant of
  each) and in bfloat16 otherwise; a path no other variant takes runs in both. Every path
  decodes in both dtypes, every variant in one (with ``--full``: every variant in bfloat16
  and each path in float32 too)."""
  paths = layer_paths(CAUSAL)
  if _helpers.FULL_GRID:  # Set at configuration, before collection.
    return [(name, jnp.bfloat16) for name in CAUSAL] + [(name, jnp.float32) for name in paths]
  shared = {name for name in paths  # Another variant takes this path (in bfloat16).
            if any(layer_paths([name, other]) == [name] for other in CAUSAL if other != name)}
  return [(name, dtype) for name in CAUSAL
          for dtype in ((jnp.float32,) if name in shared else (jnp.bfloat16, jnp.float32))
          if name in paths or dtype == jnp.bfloat16]


# In float32 every variant decodes with segment ids in test_nn_packing.py too (one program:
# prompt, steps, chunks).
def test_the_prefill_cases_decode_every_variant_and_every_path_in_both_dtypes():
  """The dealing cannot shrink: every variant in a dtype, every layer path in both."""
  cases = _prefill_cases()
  assert {name for name, _ in cases} == set(CAUSAL)
  for path in layer_paths(CAUSAL):
    same = {n for n in CAUSAL if layer_paths([path, n]) == [path]}
    assert {d for n, d in cases if n in same} == {jnp.float32, jnp.bfloat16}, path


@pytest.mark.parametrize("name, dtype", [
    pytest.param(name, dtype, id=f"{name}-{'f32' if dtype == jnp.float32 else 'bf16'}")
    for name, dtype in _prefill_cases()])
def test_prefill_then_steps_equals_one_causal_call(name, dtype):
  """A prompt, single tokens, a later chunk: together one causal call over the sequence."""
  layer = _layer(name, dtype)
  x = jax.random.normal(jax.random.key(1), (B, T, IN)).astype(dtype)
  layer.init_cache(x.shape)
  want, got = _full_and_pieces(layer, x)
  assert got.dtype == want.dtype == dtype
  atol, rtol = TOLERANCE[jnp.dtype(dtype)]
  # Signed features: a normaliser can nearly cancel (docs/testing.md#how-the-shared-suite-judges).
  if name == "random_fourier":
    atol, rtol = 10 * atol, 10 * rtol
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=atol, rtol=rtol, err_msg=name)
  assert int(layer.cache.get_value().index) == T


def test_cache_kinds_and_sizes():
  """A recurrent cache is the fixed [B, K, M, H] state; a KV cache grows with its capacity."""
  def nbytes(name, capacity):
    layer = _layer(name)
    layer.init_cache((B, capacity, IN))
    return sum(x.nbytes for x in jax.tree.leaves(layer.cache.get_value()))

  H = IN // N
  assert nn.cache_kind("linear_elu") == "recurrent"
  assert nn.cache_kind("local") == "window" and nn.cache_kind("softmax") == "kv"
  # elu+1 keeps M = H: kv [B, K, H, H] and k_sum [B, K, H] in float32, plus the index and
  # the last position's segment id [B].
  assert nbytes("linear_elu", 8) == nbytes("linear_elu", 4096) == 4 * (
      B * K * H * (H + 1) + 1 + B)
  # Keys and values, the index, and a segment id per position [B, C].
  assert nbytes("softmax", 4096) == 2 * 4 * B * 4096 * K * H + 4 + 4 * B * 4096
  left = _options("local")["window_size"][0]
  assert nbytes("local", 4096) == 2 * 4 * B * (left + 1) * K * H + 4 + 4 + 4 * B


def test_same_parameters_and_outputs_as_flax_multi_head_attention():
  ours = nn.MultiHeadAttention(N, IN, num_kv_heads=K, qkv_features=24, out_features=8,
                               rngs=nnx.Rngs(0))
  theirs = nnx.MultiHeadAttention(N, IN, num_kv_heads=K, qkv_features=24, out_features=8,
                                  decode=False, rngs=nnx.Rngs(1))
  shapes = lambda m: jax.tree.map(jnp.shape, nnx.state(m, nnx.Param))  # noqa: E731
  assert shapes(ours) == shapes(theirs)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  x = jax.random.normal(jax.random.key(2), (B, T, IN))
  outputs = nnx.jit(lambda ours, theirs, x: [  # One compiled program.
      (ours(x, is_causal=c), theirs(x, is_causal=c)) for c in (False, True)])(ours, theirs, x)
  for causal, (got, want) in zip((False, True), outputs, strict=True):
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6, err_msg=f"causal={causal}")


def test_flax_attention_fn_adapter():
  """Flax's own layer runs linear attention through the hook; what it cannot honour raises."""
  theirs = nnx.MultiHeadAttention(N, IN, decode=False, rngs=nnx.Rngs(0),
                                  attention_fn=nn.as_flax_attention_fn(la.linear_attention))
  ours = nn.MultiHeadAttention(N, IN, attention="linear_elu", rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  x = jax.random.normal(jax.random.key(3), (B, T, IN))
  np.testing.assert_allclose(theirs(x, is_causal=True), ours(x, is_causal=True),
                             atol=2e-6, rtol=2e-6)
  with pytest.raises(ValueError, match="mask"):
    theirs(x, mask=jnp.ones((B, 1, T, T), bool))
  dropping = nnx.MultiHeadAttention(N, IN, decode=False, dropout_rate=0.1, rngs=nnx.Rngs(0),
                                    attention_fn=nn.as_flax_attention_fn(la.linear_attention))
  with pytest.raises(ValueError, match="dropout"):
    dropping(x, deterministic=False)
  masked = nnx.MultiHeadAttention(N, IN, decode=False, rngs=nnx.Rngs(0),
                                  attention_fn=nn.as_flax_attention_fn(la.softmax_attention))
  mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
  np.testing.assert_allclose(masked(x, mask=mask), masked(x, is_causal=True), atol=1e-6)


def test_linen_bridge():
  """The layer inside a flax.linen model, through nnx.bridge."""

  class Block(linen.Module):
    @linen.compact
    def __call__(self, x):
      attend = nnx.bridge.to_linen(nn.MultiHeadAttention, N, IN, attention="linear_elu")
      return x + attend(linen.LayerNorm()(x), is_causal=True)

  x = jax.random.normal(jax.random.key(4), (B, T, IN))
  model = Block()
  variables = jax.jit(model.init)(jax.random.key(0), x)  # Compiled programs, not op by op.

  @jax.jit
  def run(variables, x):
    """The model's output and gradient, and the LayerNorm's output (one program)."""
    norm = linen.LayerNorm().apply({"params": variables["params"]["LayerNorm_0"]}, x)
    grads = jax.grad(lambda v: model.apply(v, x).sum())(variables)
    return model.apply(variables, x), norm, grads

  out, norm, grads = run(variables, x)
  layer = nnx.jit(lambda: nn.MultiHeadAttention(N, IN, attention="linear_elu",
                                                rngs=nnx.Rngs(5)))()
  params = variables["params"]["ToLinen_0"]
  nnx.update(layer, nnx.State({k: {kk: nnx.Param(vv) for kk, vv in v.items()}
                               for k, v in params.items()}))
  np.testing.assert_allclose(out, x + _full(layer, norm), atol=2e-6, rtol=2e-6)
  assert np.all(np.isfinite(jax.tree.leaves(grads)[0]))


def test_jit_grad_scan_over_layers_and_mixed_precision():
  """nnx.scan over a stack of layers, nnx.grad of trainable maps only, bf16 compute."""
  depth = 3

  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return nn.MultiHeadAttention(N, IN, num_kv_heads=K, attention="linear_learned",
                                 dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                 rngs=nnx.Rngs(key))

  stack = nnx.jit(make)(jax.random.split(jax.random.key(0), depth))  # One program.

  @nnx.jit
  def loss(stack, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, h):
      return h + layer(h, is_causal=True)

    return jnp.mean(body(stack, x).astype(jnp.float32) ** 2)

  x = jax.random.normal(jax.random.key(6), (B, T, IN)).astype(jnp.bfloat16)
  value, grads = nnx.jit(nnx.value_and_grad(loss))(stack, x)
  assert np.isfinite(value)
  assert grads["feature_weight"].get_value().shape == (depth, IN // N, IN // N)
  assert grads["feature_weight"].get_value().dtype == jnp.float32
  assert np.abs(grads["feature_weight"].get_value()).sum() > 0  # The map is trained.
  # The same loss layer by layer, without nnx transforms (one compiled program).
  graphdef, state = nnx.split(stack)

  @jax.jit
  def layer_by_layer(state, x):
    h = x
    for i in range(depth):
      layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
      h = h + layer(h, is_causal=True)
    return jnp.mean(h.astype(jnp.float32) ** 2)

  np.testing.assert_allclose(value, layer_by_layer(state, x), rtol=2e-2)


def test_projection_is_data_redraw_is_pure_and_never_trained():
  layer = nn.MultiHeadAttention(N, IN, attention="performer",
                                attention_options={"num_features": 8}, rngs=nnx.Rngs(0))
  assert isinstance(layer.projection, nn.FeatureProjection)
  assert "projection" in nnx.state(layer, nn.FeatureProjection)
  assert "projection" not in nnx.state(layer, nnx.Param)  # Not a parameter.
  grads = nnx.jit(nnx.grad(lambda m, x: m(x, is_causal=True).sum()))(layer, jnp.ones((1, 4, IN)))
  assert "projection" not in grads
  x = jax.random.normal(jax.random.key(7), (1, 6, IN))
  first = _full(layer, x)
  layer.redraw(jax.random.key(1))
  drawn = layer.projection.get_value()
  with CompileCounter() as compiles:
    second = _full(layer, x)
  assert compiles.count == 0  # A new projection is new data, not a new program.
  assert not np.allclose(first, second)
  layer.redraw(jax.random.key(1))
  np.testing.assert_array_equal(layer.projection.get_value(), drawn)
  with pytest.raises(ValueError, match="no random projection"):
    nn.MultiHeadAttention(N, IN, rngs=nnx.Rngs(0)).redraw(jax.random.key(0))


def test_capacity_is_enforced_when_the_program_runs():
  layer = _layer("softmax")
  layer.init_cache((B, 4, IN))
  x = jnp.ones((B, 3, IN))
  _decode(layer, x)
  with pytest.raises(Exception, match="past the KV cache's capacity 4"):
    jax.block_until_ready(_decode(layer, x))
  with pytest.raises(ValueError, match="capacity 4"):
    _decode(layer, jnp.ones((B, 5, IN)))


@pytest.mark.parametrize("make, match", [
    (lambda: nn.MultiHeadAttention(3, IN, rngs=nnx.Rngs(0)), "qkv_features=16 must be divisible"),
    (lambda: nn.MultiHeadAttention(4, IN, num_kv_heads=3, rngs=nnx.Rngs(0)), "num_kv_heads=3"),
    (lambda: nn.MultiHeadAttention(4, IN, attention="nope", rngs=nnx.Rngs(0)), "'nope'"),
    (lambda: nn.MultiHeadAttention(4, IN, attention="linear_elu",
                                   attention_options={"window_size": 3}, rngs=nnx.Rngs(0)),
     "unknown option `window_size`"),
    (lambda: nn.MultiHeadAttention(4, IN, attention="local", rngs=nnx.Rngs(0)),
     "missing required option"),
    (lambda: nn.MultiHeadAttention(4, IN, attention="performer",
                                   attention_options={"rng": 3}, rngs=nnx.Rngs(0)),
     "managed by the layer"),
    (lambda: nn.MultiHeadAttention(4, IN, attention="linear_learned",
                                   attention_options={"feature_weight": 1}, rngs=nnx.Rngs(0)),
     "managed by the layer"),
])
def test_bad_configurations_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_calls_raise():
  layer = _layer("linear_elu")
  x = jnp.ones((B, 3, IN))
  with pytest.raises(ValueError, match="init_cache"):
    layer(x, is_causal=True, decode=True)
  layer.init_cache((B, 8, IN))
  with pytest.raises(ValueError, match="is_causal=False with 3 positions"):
    layer(x, decode=True, is_causal=False)
  with pytest.raises(ValueError, match="one causal self-attention sequence"):
    layer(x, x, is_causal=True, decode=True)
  with pytest.raises(ValueError, match="batch dims"):
    layer(jnp.ones((3, 1, IN)), is_causal=True, decode=True)
  with pytest.raises(ValueError, match=r"inputs_q must be \[..., length, 16\]"):
    layer(jnp.ones((B, 3, IN + 1)))


def test_layer_decode_matches_the_function_step():
  """The layer's decode is the registry's protocol: its state equals the function's."""
  layer = _layer("heinsen")
  x = jax.random.normal(jax.random.key(8), (B, 6, IN))
  layer.init_cache(x.shape)
  _decode(layer, x)
  _, state = nnx.jit(lambda m, x: la.heinsen_attention(  # One compiled program.
      m.query(x), m.key(x), m.value(x), is_causal=True, return_state=True))(layer, x)
  jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-5, rtol=1e-5),
               layer.cache.get_value().state, state)
