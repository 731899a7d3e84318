"""Token mixers: each equals its reference layer's forward, written out here from the
papers' formulas and the recurrences' oracles; decoding and packed rows equal the full
causal pass; the parameter tables name every parameter; every keyword is honoured."""

from __future__ import annotations

import functools
import inspect
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import TOLERANCE, covering_grid
from flax import nnx

import linattn_jax as la
from linattn_jax import nn

B, T, F = 2, 9, 32
# A prompt, a step, a chunk, a step.
PIECES = (4, 1, 3, 1)
# Two documents in row 0 (the second starts at position 5, inside the chunk), one in row 1.
IDS = np.array([[0] * 5 + [1] * 4, [3] * 9], np.int32)


def _value(m, path: str) -> jax.Array:
  for part in path.split("."):
    m = getattr(m, part)
  return jnp.asarray(m.get_value(), jnp.float32)


# --- the reference layers, from their formulas -------------------------------------------

def _conv(x, kernel, bias, activation):
  """A depthwise causal convolution through lax.conv (``kernel [W, C]``, row W-1 weighs x_t)."""
  W, C = kernel.shape
  y = jax.lax.conv_general_dilated(x, kernel[:, None, :], (1,), [(W - 1, 0)],
                                   dimension_numbers=("NWC", "WIO", "NWC"),
                                   feature_group_count=C,
                                   precision=jax.lax.Precision.HIGHEST)
  y = y if bias is None else y + bias[None, None]
  return {None: y, "silu": jax.nn.silu(y)}[activation]


def _rms(o, scale, eps):
  return o / jnp.sqrt(jnp.mean(o * o, -1, keepdims=True) + eps) * scale


def _unit(x):
  return x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)


def _rope(x):
  """RoPE at positions 0..T-1 with complex numbers: feature pair (i, i + H/2) is the complex
  number x_i + i·x_{i+H/2}, multiplied by e^{i p θ_i}, θ_i = 10000^(-2i/H)."""
  H = x.shape[-1]
  z = jax.lax.complex(x[..., :H // 2], x[..., H // 2:])
  theta = 10000.0 ** (-jnp.arange(H // 2, dtype=jnp.float32) * 2.0 / H)
  p = jnp.arange(x.shape[1], dtype=jnp.float32).reshape((1, -1) + (1,) * (x.ndim - 2))
  z = z * jnp.exp(jax.lax.complex(jnp.zeros_like(p * theta), p * theta))  # e^{i p θ}
  return jnp.concatenate([z.real, z.imag], -1).astype(x.dtype)


def _reference_recurrent(m: nn.RecurrentMixer, x: jax.Array) -> jax.Array:
  """The reference layer's forward (flash-linear-attention's layers), in float32."""
  r = m.recipe
  N, K, V, H, D = m.num_heads, m.num_kv_heads, m.num_v_heads, m.head_dim, m.value_dim
  x = x.astype(jnp.float32)
  p = lambda path: _value(m, path)  # noqa: E731
  q, k, v = x @ p("q_proj.kernel"), x @ p("k_proj.kernel"), x @ p("v_proj.kernel")
  if m.short_conv:
    q, k, v = (_conv(y, p(f"{c}_conv.kernel"), None, "silu")
               for c, y in zip("qkv", (q, k, v), strict=True))
  elif r.unit_qk or r.qkv_silu:
    q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
  n = m.num_householder  # Keys, values and β: n per token, laid out (n, heads, dims).
  steps = () if n == 1 else (n,)
  q, k, v = (q.reshape(B, -1, N, H), k.reshape((B, -1) + steps + (K, H)),
             v.reshape((B, -1) + steps + (V, D)))
  if r.unit_qk:
    q, k = _unit(q), _unit(k)
  if m.rotary:
    q, k = _rope(q), _rope(k)
  if r.decay == "mamba2":
    g = -jnp.exp(p("A_log")) * jax.nn.softplus(x @ p("a_proj.kernel") + p("dt_bias"))
  elif r.decay == "kda":
    low = isinstance(m.f_proj, nn.LowRank)
    f = (x @ p("f_proj.down.kernel") @ p("f_proj.up.kernel") if low else x @ p("f_proj.kernel")
         ) + p("dt_bias")
    a = jnp.exp(p("A_log"))[..., None]
    g = (-a * jax.nn.softplus(f.reshape(B, -1, V, H)) if m.decay_bound is None else
         m.decay_bound * jax.nn.sigmoid(a * f.reshape(B, -1, V, H)))  # Bailing's bounded gate.
  elif r.decay == "gla":
    logit = x @ p("gk_proj.down.kernel") @ p("gk_proj.up.kernel") + p("gk_proj.up.bias")
    g = jax.nn.log_sigmoid(logit).reshape(B, -1, V, H) / 16
  elif r.decay == "logsigmoid":
    g = jax.nn.log_sigmoid(x @ p("gk_proj.kernel") + p("gk_proj.bias")) / 16
  elif r.decay == "lightning":  # MiniMax: s_h = 2^(-8(h+1)/N) (1 - l/(L-1) + 1e-5), l = 1, L = 3.
    s_h = 2.0 ** (-8.0 * (jnp.arange(V, dtype=jnp.float32) + 1) / V) * (1 - 1 / (2 + 1e-5) + 1e-5)
    g = jnp.broadcast_to(-s_h, (B, x.shape[1], V))
  elif r.attention == "retention":  # RetNet: gamma_h = 1 - 2^(-5-h).
    g = jnp.broadcast_to(jnp.log(1 - 2.0 ** (-5.0 - jnp.arange(V, dtype=jnp.float32))),
                         (B, x.shape[1], V))
  if r.beta:
    beta = jax.nn.sigmoid(x @ p("b_proj.kernel")) * (2 if m.allow_neg_eigval else 1)
    beta = beta.reshape((B, -1) + steps + (V,))
    oracle = la.delta_rule_attention_reference if n == 1 else la.delta_product_attention_reference
    o = oracle(q, k, v, beta, log_decay=g if r.decay else None, is_causal=True)
  else:
    o = la.gated_linear_attention_reference(q, k, v, g, is_causal=True, scale=r.scale)
  if r.norm_over_heads:  # One norm over every head's channels.
    o = o.reshape(B, x.shape[1], -1)
  o = _rms(o, p("o_norm.scale"), m.o_norm.epsilon)
  if m.g_proj is not None:
    if isinstance(m.g_proj, nn.LowRank):
      bias = 0.0 if m.g_proj.up.bias is None else p("g_proj.up.bias")
      gate = x @ p("g_proj.down.kernel") @ p("g_proj.up.kernel") + bias
    else:
      gate = x @ p("g_proj.kernel")
    gate = gate.reshape(o.shape)
    o = o * (jax.nn.sigmoid(gate) if m.o_norm.activation == "sigmoid" else jax.nn.silu(gate))
  return o.reshape(B, x.shape[1], -1) @ p("o_proj.kernel")


def _reference_rwkv7(m: nn.RWKV7TimeMixer, x: jax.Array, v_first=None):
  """RWKV7Attention's forward, in float32: ``(out, v_first)``."""
  K, H = m.num_heads, m.head_dim
  L = x.shape[1]
  p = lambda path: _value(m, path)  # noqa: E731
  lora = lambda name, y, act: act(y @ p(f"{name}.down.kernel")) @ p(f"{name}.up.kernel") + (  # noqa: E731
      p(f"{name}.up.bias") if getattr(getattr(m, name).up, "bias", None) is not None else 0)
  x = x.astype(jnp.float32)
  delta = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1] - x
  xr, xw, xk, xv, xa, xg = (x + delta * p(f"x_{c}") for c in "rwkvag")
  r, k, v = xr @ p("r_proj.kernel"), xk @ p("k_proj.kernel"), xv @ p("v_proj.kernel")
  w = -math.exp(-0.5) * jax.nn.sigmoid(lora("w_lora", xw, jnp.tanh))
  if m.v_lora is None:
    v_first = v
  else:
    v = v + (v_first - v) * jax.nn.sigmoid(lora("v_lora", xv, lambda y: y))
  a = jax.nn.sigmoid(lora("a_lora", xa, lambda y: y))
  gate = lora("g_lora", xg, jax.nn.sigmoid)
  heads = lambda y: y.reshape(B, L, K, H)  # noqa: E731
  kk = _unit(heads(k * p("k_k")))
  k = k + k * (a - 1) * p("k_a")
  o = la.dplr_attention_reference(heads(r), heads(k), heads(v), -kk, kk * heads(a),
                                  log_decay=heads(w), scale=1.0, is_causal=True)
  mean = jnp.mean(o, -1, keepdims=True)
  var = jnp.mean((o - mean) ** 2, -1, keepdims=True)
  eps = m.g_norm.epsilon
  o = ((o - mean) / jnp.sqrt(var + eps)).reshape(B, L, -1) * p("g_norm.scale") + p("g_norm.bias")
  bonus = jnp.sum(heads(r) * heads(k) * p("r_k"), -1, keepdims=True) * heads(v)
  return ((o + bonus.reshape(B, L, -1)) * gate) @ p("o_proj.kernel"), v_first


# --- configurations: together they give every keyword a non-default value -----------------

_NORMAL = jax.nn.initializers.normal(0.3)
CONFIGS = {
    "gated_deltanet": ("gated_deltanet", dict(num_heads=2, num_v_heads=4)),
    # Three steps per token, and grouped value heads.
    "gated_deltaproduct": ("gated_deltaproduct", dict(num_heads=2, num_v_heads=4,
                                                      num_householder=3)),
    "kda": ("kda", dict(num_heads=2, num_v_heads=4, head_dim=8, gate_bias=False)),  # Kimi's.
    # Bailing's: full-rank decay and gate projections, the bounded decay.
    "kda_full_rank": ("kda", dict(num_heads=2, head_dim=8, low_rank_gate=False,
                                  low_rank_decay=False, decay_bound=-5.0)),
    "gla": ("gla", dict(num_heads=4, num_kv_heads=2, short_conv=True, conv_size=3,
                        expand_v=2.0)),
    # RetNet's rotary embedding on another mixer.
    "simple_gla": ("simple_gla", dict(num_heads=2, output_gate=False, norm_eps=1e-2,
                                      kernel_init=_NORMAL, rotary=True)),
    # bfloat16 parameters, float32 computation (the tests promote no dtype implicitly).
    "retnet": ("retnet", dict(num_heads=2, attention_options={"implementation": "scan"},
                              param_dtype=jnp.bfloat16, dtype=jnp.float32,
                              precision="highest")),
    # β in [0, 2].
    "deltanet": ("deltanet", dict(num_heads=2, short_conv=False, output_gate=True,
                                  allow_neg_eigval=True, attention_options={"chunk_size": 4})),
    "deltaproduct": ("deltanet", dict(num_heads=2, num_householder=2)),  # No gate, n = 2.
    # MiniMax's second of three layers.
    "lightning": ("lightning", dict(num_heads=4, layer_index=1, num_layers=3)),
    "rwkv7": ("rwkv7", dict(head_dim=8, num_layers=3, decay_rank=8, a_rank=8, gate_rank=4,
                            norm_eps=1e-3, attention_options={"chunk_size": 4},
                            precision="highest")),
    "rwkv7_later_layer": ("rwkv7", dict(head_dim=16, layer_index=2, num_layers=3, v_rank=8,
                                        param_dtype=jnp.bfloat16, dtype=jnp.float32)),
}


def _build(case: str, dtype=None) -> nnx.Module:
  name, kw = CONFIGS[case]
  kw = {**kw, "dtype": dtype} if dtype is not None else kw
  if name == "rwkv7":
    m = nn.RWKV7TimeMixer(F, rngs=nnx.Rngs(0), **kw)
    # The reference starts o_proj at zero (a fresh layer outputs zeros): draw it.
    m.o_proj.kernel.set_value(0.3 * jax.random.normal(jax.random.key(5), (F, F)))
    return m
  return nn.RecurrentMixer(name, F, rngs=nnx.Rngs(0), **kw)


@functools.cache
def _built(case: str, dtype=None) -> nnx.Module:
  """``_build(case, dtype)`` as one compiled program (eagerly, each initialiser compiles on
  its own), built once per session: tests that change it take a ``nnx.clone``."""
  return nnx.jit(lambda: _build(case, dtype))()


def _v_first(m, x):
  """The first layer's values for a later RWKV-7 layer (any [B, L, F] array will do)."""
  return None if getattr(m, "v_lora", None) is None else jnp.tanh(x[..., ::-1]).astype(x.dtype)


def _call(m, x, **kw):
  if isinstance(m, nn.RWKV7TimeMixer):
    return m(x, _v_first(m, x), **kw)[0]
  return m(x, **kw)


def _reference(m, x):
  # The oracles broadcast parameters [F] against [B, T, F] as the formulas read.
  with jax.numpy_rank_promotion("allow"):
    if isinstance(m, nn.RWKV7TimeMixer):
      return _reference_rwkv7(m, x, _v_first(m, x))[0]
    return _reference_recurrent(m, x)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_mixer_equals_its_reference_layer_eagerly_and_under_jit(case):
  m = _built(case)
  x = jax.random.normal(jax.random.key(1), (B, T, F))
  want = nnx.jit(_reference)(m, x)  # The formulas, compiled: the layer runs eagerly below.
  jitted = nnx.jit(_call)(m, x)
  eager = _call(m, x)
  # bfloat16 parameters: the oracle reads them in float32, the layer computes in float32
  # from them too, but casts between steps differ.
  atol = 1e-2 if case in ("retnet", "rwkv7_later_layer") else 2e-5
  np.testing.assert_allclose(jitted, want, atol=atol, rtol=atol, err_msg=case)
  np.testing.assert_allclose(eager, jitted, atol=2e-5, rtol=2e-5, err_msg=case)
  assert float(jnp.max(jnp.abs(want))) > 1e-2  # The comparison is not between zeros.


@nnx.jit
def _full_pieces_and_alone(m, x, ids):
  """The causal pass with ``ids``; decoding it in ``PIECES`` (with their ids) from a fresh
  cache; and row 0's second document run alone (one program)."""
  full = _call(m, x, segment_ids=ids)
  bounds = np.cumsum((0,) + PIECES)
  pieces = jnp.concatenate([_call(m, x[:, a:b], decode=True, segment_ids=ids[:, a:b])
                            for a, b in zip(bounds[:-1], bounds[1:], strict=True)], 1)
  start = int(np.argmax(IDS[0] == 1))
  alone = _call(m, x[:1, start:])
  return full, pieces, alone


# Each mixer in one dtype, the dtypes dealt over the mixers (both on every mixer with --full):
# each mixer's decode and packed rows, and each dtype's casts, are checked.
DECODE_MIXERS = ("gated_deltanet", "gated_deltaproduct", "kda", "gla", "simple_gla", "retnet",
                 "deltanet", "rwkv7", "lightning")
DECODE_CASES = covering_grid([jnp.float32, jnp.bfloat16], DECODE_MIXERS)


def test_the_decode_cases_cover_every_mixer_and_both_dtypes():
  assert {case for _, case in DECODE_CASES} == set(DECODE_MIXERS)
  assert {dtype for dtype, _ in DECODE_CASES} == {jnp.float32, jnp.bfloat16}


@pytest.mark.parametrize("dtype, case", [
    pytest.param(dtype, case, id=f"{case}-{jnp.dtype(dtype).name}")
    for dtype, case in DECODE_CASES])
def test_prefill_then_steps_and_packed_rows_equal_the_full_pass(case, dtype):
  """Decoding a prompt, steps and a chunk (a document starting inside the chunk) equals
  the packed causal pass, whose second document equals that document alone."""
  m = nnx.clone(_built(case, dtype))
  x = jax.random.normal(jax.random.key(2), (B, T, F)).astype(dtype)
  m.init_cache(x.shape)
  full, pieces, alone = _full_pieces_and_alone(m, x, jnp.asarray(IDS))
  assert full.dtype == pieces.dtype == dtype
  atol, rtol = TOLERANCE[jnp.dtype(dtype)]
  f32 = lambda y: np.asarray(y, np.float32)  # noqa: E731
  np.testing.assert_allclose(f32(pieces), f32(full), atol=atol, rtol=rtol, err_msg=case)
  start = int(np.argmax(IDS[0] == 1))
  np.testing.assert_allclose(f32(full[:1, start:]), f32(alone), atol=atol, rtol=rtol,
                             err_msg=case)




def _table(cls) -> list[tuple[str, str]]:
  """(our name, shape) for each name in the first column of a class docstring's parameter
  table (its rows: ``name`` ..., then a shape ``[...]``)."""
  rows = []
  for line in cls.__doc__.splitlines():
    columns = re.split(r"\s{2,}", line.strip())
    if len(columns) > 1 and columns[0].startswith("``") and columns[1].startswith("["):
      rows += [(name, columns[1]) for name in re.findall(r"``([\w.]+)``", columns[0])]
  return rows


def _shape(text: str, sizes: dict[str, int]) -> tuple[int, ...]:
  dims = text.strip("[]").split(",")
  return tuple(math.prod(sizes[s] if s in sizes else int(s) for s in re.findall(r"\w+", d))
               for d in dims)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_parameter_tables_name_every_parameter_with_its_shape(case):
  m = _built(case)
  params = {".".join(map(str, path)): x.shape
            for path, x in nnx.to_flat_state(nnx.state(m, nnx.Param))}
  if isinstance(m, nn.RWKV7TimeMixer):
    K, H = m.num_heads, m.head_dim
    sizes = {"F": F, "K": K, "H": H, "Rw": m.w_lora.down.kernel.shape[1],
             "Ra": m.a_lora.down.kernel.shape[1], "Rg": m.g_lora.down.kernel.shape[1],
             "Rv": m.v_lora.down.kernel.shape[1] if m.v_lora is not None else 0}
    rows = _table(nn.RWKV7TimeMixer) + [(f"x_{c}", "[F]") for c in "wkva"]  # "x_r … x_g"
  else:
    sizes = {"F": F, "N": m.num_heads, "K": m.num_kv_heads, "V": m.num_v_heads,
             "H": m.head_dim, "D": m.value_dim, "O": max(m.num_heads, m.num_v_heads),
             "n": m.num_householder,
             "W": CONFIGS[case][1].get("conv_size", 4)}
    rows = _table(nn.RecurrentMixer)
  documented: dict[str, set] = {}
  for name, shape in rows:
    documented.setdefault(name, set()).add(_shape(shape, sizes))
  for name, shape in params.items():
    assert name in documented, f"{case}: {name} is not in the table"
    assert shape in documented[name], f"{case}: {name} {shape} vs {documented[name]}"


def test_every_constructor_keyword_has_a_non_default_value_above():
  """CONFIGS give each class's every keyword a non-default value (dtype: the bf16 test too)."""
  owned = {"self", "rngs", "name", "hidden_size", "num_heads", "dtype"}
  for cls, is_rwkv in ((nn.RecurrentMixer, False), (nn.RWKV7TimeMixer, True)):
    given = {k for name, kw in CONFIGS.values() if (name == "rwkv7") == is_rwkv for k in kw}
    missing = [p for p in inspect.signature(cls.__init__).parameters if p not in given | owned]
    assert not missing, f"{cls.__name__}: no non-default value for {missing}"


# --- the parts ---------------------------------------------------------------------------

@functools.cache
def _parts():
  """The parts the formulas test judges, built once (one compiled program)."""
  def build():
    convs = [nn.ShortConvolution(6, 3, activation=a, use_bias=True, rngs=nnx.Rngs(1))
             for a in _ACTIVATIONS]
    bf16 = nn.ShortConvolution(6, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                               rngs=nnx.Rngs(1))
    plain = nn.GatedRMSNorm(6, activation=None, use_scale=False, epsilon=0.5, rngs=nnx.Rngs(0))
    gated = nn.GatedRMSNorm(6, activation="sigmoid", dtype=jnp.bfloat16,
                            param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    low = nn.LowRank(6, 2, 5, activation="tanh", use_bias=False, dtype=jnp.float32,
                     param_dtype=jnp.float32, precision="highest",
                     down_init=_NORMAL, up_init=_NORMAL, bias_init=_NORMAL, rngs=nnx.Rngs(0))
    return convs, bf16, plain, gated, low
  return nnx.jit(build)()


_ACTIVATIONS = (None, "silu", "swish", "sigmoid", "tanh")


@nnx.jit
def _formulas(convs, low, x, g):
  """What each part should give, from its formula (one compiled program)."""
  wants = []
  for activation, conv in zip(_ACTIVATIONS, convs, strict=True):
    y = _conv(x, conv.kernel.get_value(), conv.bias.get_value(), None)
    wants.append({None: y, "silu": jax.nn.silu(y), "swish": jax.nn.silu(y),
                  "sigmoid": jax.nn.sigmoid(y), "tanh": jnp.tanh(y)}[activation])
  return (wants, _rms(x, 1.0, 0.5), _rms(x, 1.0, 1e-5) * jax.nn.sigmoid(g),
          jnp.tanh(x @ low.down.kernel.get_value()) @ low.up.kernel.get_value(),
          jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_parts_equal_their_formulas(jit):
  """ShortConvolution (every activation, with a bias), GatedRMSNorm (no gate, no scale,
  sigmoid), LowRank (an activation, no bias) and TokenShift, against their formulas."""
  x = jax.random.normal(jax.random.key(3), (B, T, 6))
  g = jax.random.normal(jax.random.key(4), (B, T, 6))
  run = nnx.jit(lambda m, *a: m(*a)) if jit else (lambda m, *a: m(*a))
  convs, bf16, plain, gated, low = _parts()
  conv_wants, plain_want, gated_want, low_want, shift_want = _formulas(convs, low, x, g)
  for activation, conv, want in zip(_ACTIVATIONS, convs, conv_wants, strict=True):
    np.testing.assert_allclose(run(conv, x), want, atol=1e-5, err_msg=str(activation))
  assert run(bf16, x).dtype == jnp.bfloat16
  np.testing.assert_allclose(run(plain, x), plain_want, atol=1e-6)
  out = run(gated, x, g)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), gated_want, atol=3e-2, rtol=3e-2)
  np.testing.assert_allclose(run(low, x), low_want, atol=1e-5)
  shift = nn.TokenShift(6)
  np.testing.assert_allclose(run(shift, x), shift_want)


def test_mixers_by_name_and_errors():
  assert len(nn.token_mixer_names()) == 12
  # layer_index and num_layers reach lightning's decays: deeper layers forget more slowly.
  deep = nn.token_mixer("lightning", F, 4, layer_index=2, num_layers=3, rngs=nnx.Rngs(0))
  first = nn.token_mixer("lightning", F, 4, rngs=nnx.Rngs(0))
  assert float(deep.slope.get_value()[0]) < float(first.slope.get_value()[0])
  assert isinstance(nn.token_mixer("mamba", F, 4, rngs=nnx.Rngs(0)), nn.MambaMixer)
  assert isinstance(nn.token_mixer("lfm2", F, 4, rngs=nnx.Rngs(0)), nn.ShortConvMixer)
  wide = nn.token_mixer("mamba2", F, 4, head_dim=4, state_size=8, rngs=nnx.Rngs(0))
  assert (wide.num_heads, wide.head_dim, wide.state_size) == (4, 4, 8)
  assert isinstance(nn.token_mixer("rwkv7", F, 4, rngs=nnx.Rngs(0)), nn.RWKV7TimeMixer)
  assert nn.token_mixer("kda", F, 4, rngs=nnx.Rngs(0)).recipe.attention == "kda"
  # layer_index and num_layers reach RWKV-7's initial values and its value residual.
  later = nn.token_mixer("rwkv7", F, 4, layer_index=2, num_layers=3, rngs=nnx.Rngs(0))
  same = nn.RWKV7TimeMixer(F, head_dim=F // 4, layer_index=2, num_layers=3, rngs=nnx.Rngs(0))
  assert later.v_lora is not None
  x = jax.random.normal(jax.random.key(6), (B, T, F))
  np.testing.assert_array_equal(later(x, x)[0], same(x, x)[0])
  assert not np.allclose(_value(later, "x_r"), _value(nn.token_mixer("rwkv7", F, 4,
                                                                     rngs=nnx.Rngs(0)), "x_r"))
  with pytest.raises(ValueError, match="unknown name='mamba3'"):
    nn.token_mixer("mamba3", F, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"num_v_heads=3 must be a multiple of num_kv_heads=2"):
    nn.RecurrentMixer("gated_deltanet", F, 2, num_v_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"num_householder=2 and allow_neg_eigval=False act on "
                     "the delta rule's writes; 'gla' has none"):
    nn.RecurrentMixer("gla", F, 2, num_householder=2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="unknown|not an option|chunk_sise"):
    nn.RecurrentMixer("gla", F, 2, attention_options={"chunk_sise": 4}, rngs=nnx.Rngs(0))
  m = nn.RecurrentMixer("deltanet", F, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"inputs must be \[B, T, 32\]"):
    m(jnp.ones((2, 3, 8)))
  with pytest.raises(ValueError, match=r"segment_ids must be integers \[B, T\]"):
    m(jnp.ones((2, 3, F)), segment_ids=jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="call init_cache first"):
    m(jnp.ones((2, 3, F)), decode=True)
  later = nn.RWKV7TimeMixer(F, head_dim=8, layer_index=1, num_layers=2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="needs v_first"):
    later(jnp.ones((2, 3, F)))
  with pytest.raises(ValueError, match="must divide hidden_size"):
    nn.RWKV7TimeMixer(F, head_dim=5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="takes no gate"):
    nn.GatedRMSNorm(4, activation=None, rngs=nnx.Rngs(0))(jnp.ones(4), jnp.ones(4))
