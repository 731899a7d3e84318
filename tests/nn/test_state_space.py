"""``nn.MambaMixer``, ``nn.Mamba2Mixer`` and ``nn.ShortConvMixer`` equal their layers
written out here from the papers' formulas (the recurrences stepped by hand, in float64),
with every keyword at a
non-default value, eagerly and under jit; their parameter tables name every parameter;
bad settings raise. (The released layers themselves judge them too: test_loading.py.)"""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import nn

B, T, F = 2, 7, 16


def _p(m, path):
  for part in path.split("."):
    m = getattr(m, part)
  return np.asarray(m.get_value(), np.float64)


def _conv(x, kernel, bias):
  """Causal depthwise: row W - 1 of ``kernel [W, C]`` weighs x_t."""
  W = kernel.shape[0]
  padded = np.concatenate([np.zeros((x.shape[0], W - 1, x.shape[2])), x], 1)
  y = sum(padded[:, i:i + x.shape[1]] * kernel[i] for i in range(W))
  return y if bias is None else y + bias


def _silu(x):
  return x / (1 + np.exp(-x))


def _mamba2_reference(m, x):
  n, P, G, S = m.num_heads, m.head_dim, m.n_groups, m.state_size
  I = n * P  # noqa: E741
  p = lambda path: _p(m, path)  # noqa: E731
  x = x * m.in_multiplier
  zxbcdt = x @ p("in_proj.kernel") + (p("in_proj.bias") if m.in_proj.bias is not None else 0)
  if m.projection_multipliers is not None:  # Falcon-H1's factors on z, x, B, C, dt.
    sizes = np.cumsum((0, I, I, G * S, G * S, n))
    for a, z_, factor in zip(sizes[:-1], sizes[1:], m.projection_multipliers, strict=True):
      zxbcdt[..., a:z_] *= factor
  z, xbc, dt = zxbcdt[..., :I], zxbcdt[..., I:-n], zxbcdt[..., -n:]
  xbc = _silu(_conv(xbc, p("conv.kernel"), p("conv.bias") if m.conv.bias is not None else None))
  u, b, c = xbc[..., :I].reshape(B, T, n, P), xbc[..., I:I + G * S], xbc[..., I + G * S:]
  b, c = b.reshape(B, T, G, S), c.reshape(B, T, G, S)
  dt = np.clip(np.log1p(np.exp(dt + p("dt_bias"))), *m.time_step_limit)
  A = -np.exp(p("A_log"))
  h = np.zeros((B, n, S, P))
  y = np.zeros((B, T, n, P))
  for t in range(T):
    for head in range(n):
      g = head // (n // G)
      write = b[:, t, g][:, :, None] * u[:, t, head][:, None]  # B_t u_tᵀ [B, S, P]
      h[:, head] = (np.exp(dt[:, t, head] * A[head])[:, None, None] * h[:, head]
                    + dt[:, t, head][:, None, None] * write)
      y[:, t, head] = np.einsum("bs,bsp->bp", c[:, t, g], h[:, head]) + p("D")[head] * u[:, t, head]
  y = y.reshape(B, T, I)
  if m.norm is None:
    y = y * _silu(z)
  else:
    y = y * _silu(z) if m.norm.gate_first else y
    groups = y.reshape(B, T, G, I // G)
    groups = groups / np.sqrt(np.mean(groups ** 2, -1, keepdims=True) + m.norm.epsilon)
    y = groups.reshape(B, T, I) * p("norm.scale")
    y = y if m.norm.gate_first else y * _silu(z)
  return y @ p("out_proj.kernel") + (p("out_proj.bias") if m.out_proj.bias is not None else 0)


def _mamba_reference(m, x):
  """Mamba-1, the recurrence stepped per token in float64."""
  E, S, R = m.intermediate_size, m.state_size, m.time_step_rank
  p = lambda path: _p(m, path)  # noqa: E731
  bias = lambda name: p(f"{name}.bias") if getattr(m, name).bias is not None else 0  # noqa: E731
  u, z = np.split(x @ p("in_proj.kernel") + bias("in_proj"), 2, -1)
  u = _silu(_conv(u, p("conv.kernel"), p("conv.bias") if m.conv.bias is not None else None))
  proj = u @ p("x_proj.kernel")
  delta, b, c = proj[..., :R], proj[..., R:R + S], proj[..., R + S:]
  if m.inner_norm is not None:  # Jamba's RMSNorms (Falcon-Mamba's without scales).
    rms = lambda y, name: y / np.sqrt(np.mean(y ** 2, -1, keepdims=True) + m.dt_norm.epsilon) * (  # noqa: E731
        p(f"{name}.scale") if m.inner_norm == "learned" else 1.0)
    delta, b, c = rms(delta, "dt_norm"), rms(b, "b_norm"), rms(c, "c_norm")
  dt = np.log1p(np.exp(delta @ p("dt_proj.kernel") + p("dt_proj.bias")))  # [B, T, E]
  A = -np.exp(p("A_log"))
  h = np.zeros((B, E, S))
  y = np.zeros((B, T, E))
  for t in range(T):
    h = np.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * b[:, t, None]
    y[:, t] = np.einsum("bes,bs->be", h, c[:, t]) + p("D") * u[:, t]
  return (y * _silu(z)) @ p("out_proj.kernel") + bias("out_proj")


def _short_conv_reference(m, x):
  p = lambda path: _p(m, path)  # noqa: E731
  bias = lambda name: p(f"{name}.bias") if getattr(m, name).bias is not None else 0  # noqa: E731
  b, c, h = np.split(x @ p("in_proj.kernel") + bias("in_proj"), 3, -1)
  conv = _conv(b * h, p("conv.kernel"), p("conv.bias") if m.conv.bias is not None else None)
  return (c * conv) @ p("out_proj.kernel") + bias("out_proj")


_NORMAL = jax.nn.initializers.normal(0.3)
# Together: every keyword of each class at a non-default value.
MAMBA2 = dict(num_heads=4, head_dim=4, state_size=3, n_groups=2, conv_size=3,
              use_conv_bias=False, use_bias=True, norm_eps=1e-3, time_step_limit=(0.01, 0.5),
              gate_first=False, in_multiplier=1.25,
              projection_multipliers=(0.5, 1.5, 0.75, 1.25, 2.0),
              attention_options={"implementation": "scan"}, param_dtype=jnp.float32,
              dtype=jnp.float32, precision="highest", kernel_init=_NORMAL)
# Falcon-H1 without its norm: y ⊙ silu(z).
MAMBA2_UNNORMED = dict(num_heads=2, head_dim=8, use_norm=False)
MAMBA = dict(intermediate_size=24, state_size=3, conv_size=3, time_step_rank=2,
             use_conv_bias=False, use_bias=True, inner_norm="learned", inner_norm_eps=1e-3,
             chunk_size=4, implementation="scan",
             param_dtype=jnp.float32, dtype=jnp.float32, precision="highest", kernel_init=_NORMAL)
SHORT_CONV = dict(conv_size=4, use_bias=True, param_dtype=jnp.float32, dtype=jnp.float32,
                  precision="highest", kernel_init=_NORMAL)


def test_every_keyword_has_a_non_default_value_here():
  for cls, given in ((nn.MambaMixer, MAMBA), (nn.Mamba2Mixer, MAMBA2 | MAMBA2_UNNORMED),
                     (nn.ShortConvMixer, SHORT_CONV)):
    params = inspect.signature(cls.__init__).parameters
    missing = [p for p in params if p not in set(given) | {"self", "hidden_size", "rngs"}]
    assert not missing, f"{cls.__name__}: no non-default value for {missing}"
    assert all(given[k] != params[k].default for k in given
               if params[k].default is not inspect.Parameter.empty and k != "param_dtype")


def _with_drawn_biases(m):
  """Biases start at zero: draw them, and a D and dt_bias away from their initial values."""
  key = iter(jax.random.split(jax.random.key(3), 8))
  for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
    if path[-1] in ("bias", "D", "scale") and path[0] != "dt_proj":
      var.set_value(var.get_value() + 0.3 * jax.random.normal(next(key), var.get_value().shape))
  return m


@pytest.mark.parametrize("cls, kw, reference", [
    (nn.MambaMixer, MAMBA, _mamba_reference),
    (nn.Mamba2Mixer, MAMBA2, _mamba2_reference),
    (nn.Mamba2Mixer, MAMBA2_UNNORMED, _mamba2_reference),
    (nn.ShortConvMixer, SHORT_CONV, _short_conv_reference)],
    ids=["mamba", "mamba2", "mamba2-unnormed", "short_conv"])
def test_equals_its_formulas_eagerly_and_under_jit(cls, kw, reference):
  m = _with_drawn_biases(cls(F, rngs=nnx.Rngs(1), **kw))
  x = jax.random.normal(jax.random.key(0), (B, T, F))
  want = reference(m, np.asarray(x, np.float64))
  np.testing.assert_allclose(m(x), want, atol=2e-5, rtol=2e-5)  # Eagerly.
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(m, x), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cls, kw", [(nn.MambaMixer, MAMBA), (nn.Mamba2Mixer, MAMBA2)],
                         ids=["mamba", "mamba2"])
def test_the_parameter_tables_name_every_parameter(cls, kw):
  m = cls(F, rngs=nnx.Rngs(0), **(kw | {"use_conv_bias": True}))  # With every parameter.
  params = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m, nnx.Param))}
  rows = set(re.findall(r"^\s*``([\w.]+)``\s+\[", cls.__doc__, flags=re.M))
  assert params == rows
  m = nn.ShortConvMixer(F, rngs=nnx.Rngs(0), **SHORT_CONV)
  params = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m, nnx.Param))}
  assert params == {"in_proj.kernel", "in_proj.bias", "conv.kernel", "conv.bias",
                    "out_proj.kernel", "out_proj.bias"}


def test_bad_settings_raise_value_errors_naming_them():
  with pytest.raises(ValueError, match=r"n_groups=3 must divide num_heads=4"):
    nn.Mamba2Mixer(F, num_heads=4, n_groups=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"time_step_limit must be \(low, high\).*\(0.5, 0.1\)"):
    nn.Mamba2Mixer(F, num_heads=4, time_step_limit=(0.5, 0.1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"projection_multipliers are five factors"):
    nn.Mamba2Mixer(F, num_heads=4, projection_multipliers=(1.0,), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"unknown|chunk"):
    nn.Mamba2Mixer(F, num_heads=4, attention_options={"chunks": 4}, rngs=nnx.Rngs(0))
  m = nn.ShortConvMixer(F, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"inputs must be \[B, T, 16\]; got shape \(2, 3, 8\)"):
    m(jnp.zeros((2, 3, 8)))
  with pytest.raises(ValueError, match=r"decode=True needs a cache"):
    nn.Mamba2Mixer(F, num_heads=4, head_dim=4, rngs=nnx.Rngs(0))(jnp.zeros((1, 2, F)),
                                                                  decode=True)
  with pytest.raises(ValueError, match=r"implementation must be one of"):
    nn.MambaMixer(F, implementation="chunked", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"decode=True needs a cache"):
    nn.MambaMixer(F, rngs=nnx.Rngs(0))(jnp.zeros((1, 2, F)), decode=True)
  with pytest.raises(ValueError, match=r"inner_norm"):
    nn.MambaMixer(F, inner_norm="layer", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"group_size=3 must divide features=4"):
    nn.GatedRMSNorm(4, group_size=3, rngs=nnx.Rngs(0))
