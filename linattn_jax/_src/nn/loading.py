"""A released model's token mixer, loaded from its transformers checkpoint.

:func:`load_transformers_layer` reads a checkpoint directory as ``save_pretrained``
writes it (``config.json`` and ``model.safetensors``, or ``model.safetensors.index.json``
and its shards) with the ``safetensors`` package, without PyTorch, and returns the NNX
module of one decoder layer's token mixer with its weights set.

Each model type's mapping is one :class:`Plan`: the module its config builds, the
prefix of that layer's tensors, and a table of :class:`Row` s (a checkpoint tensor, our
parameters, how it is split and laid out). Every tensor under the prefix must be read
and every parameter of the module set: anything else is a ``ValueError``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.typing import Dtype

from linattn_jax._src.nn.mixers import RecurrentMixer
from linattn_jax._src.nn.state_space import Mamba2Mixer, MambaMixer, ShortConvMixer

_FN = "load_transformers_layer"


class Row(NamedTuple):
  """One checkpoint tensor and the parameter(s) it becomes.

  Attributes:
    name: the tensor's name after the layer's prefix (``in_proj.weight``).
    ours: our parameter's path in the module (``in_proj.kernel``), or several when the
      tensor is split.
    layout: ``"copy"`` (as stored, reshaped to our parameter's shape), ``"linear"`` (a
      PyTorch ``Linear`` weight ``[out, in]``, transposed to a kernel ``[in, out]``),
      ``"conv"`` (a depthwise ``Conv1d`` weight ``[C, 1, W]``, as ``[W, C]``) or
      ``"derived"`` (a buffer the checkpoint keeps beside the parameter it is computed
      from: ``ours`` is empty and the plan's ``derived`` function recomputes it from the
      loaded module, which must agree with it).
    parts: the sizes the tensor's first axis splits into, one per parameter of ``ours``.
    groups: the first axis is ``groups`` runs of ``Σ parts`` (a fused projection
      interleaved per key head); each part is gathered from every run, in order.
  """

  name: str
  ours: str | tuple[str, ...]
  layout: str = "copy"
  parts: tuple[int, ...] | None = None
  groups: int = 1


class Plan(NamedTuple):
  """How one layer's token mixer loads: ``build(**settings)`` makes the module (its
  settings: ``dtype``, ``param_dtype``, ``rngs``), ``prefix`` starts the names of its
  tensors, ``rows`` maps them."""

  build: Callable[..., nnx.Module]
  prefix: str
  rows: tuple[Row, ...]
  derived: Callable[[nnx.Module, str], Any] | None = None  # (module, tensor name) -> value.


def _field(config: Mapping[str, Any], name: str, model_type: str) -> Any:
  if name not in config:
    raise ValueError(f"{_FN}: the {model_type} config has no {name!r}.")
  return config[name]


def _kind(config: Mapping[str, Any], index: int, model_type: str, recurrent: str | tuple[str, ...],
          field: str = "layer_types") -> None:
  """Checks that layer ``index`` is a ``recurrent`` layer of the config's ``field``."""
  kinds = config.get(field, config.get("layer_types")) if field != "layer_types" else None
  kinds = _field(config, field, model_type) if kinds is None else kinds
  names = (recurrent,) if isinstance(recurrent, str) else recurrent
  if kinds[index] not in names:
    raise ValueError(f"{_FN}: layer {index} of this {model_type} checkpoint is a "
                     f"{kinds[index]!r} layer, not a {names[0]!r} one; its recurrent layers: "
                     f"{[i for i, k in enumerate(kinds) if k in names]}.")


def _silu(config: Mapping[str, Any], model_type: str, name: str = "hidden_act") -> None:
  act = config.get(name, "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"{_FN}: {model_type} with {name}={act!r}; the layer takes silu only.")


# --- The Gated DeltaNet layers -------------------------------------------------------------


def _separate(projections: str) -> list[Row]:
  """The rows of projections kept apart (``{x}_proj.weight``, for each letter x) and of the
  short convolutions on q, k and v (``{x}_conv1d.weight``)."""
  return ([Row(f"{x}_proj.weight", f"{x}_proj.kernel", "linear") for x in projections]
          + [Row(f"{x}_conv1d.weight", f"{x}_conv.kernel", "conv") for x in "qkv"])


def _qwen3_next(config: Mapping[str, Any], index: int) -> Plan:
  """Qwen3-Next's (and Qwen3.5's) Gated DeltaNet: ``in_proj_qkvz`` is K runs of
  ``[q (H) | k (H) | v (r·D) | z (r·D)]`` and ``in_proj_ba`` K runs of ``[b (r) | a (r)]``
  (r = V / K value heads per key head); one convolution over ``q | k | v``."""
  t = "qwen3_next"
  _kind(config, index, t, "linear_attention")
  _silu(config, t)
  f = lambda name: _field(config, name, t)  # noqa: E731
  F, K, V = f("hidden_size"), f("linear_num_key_heads"), f("linear_num_value_heads")
  H, D, W = f("linear_key_head_dim"), f("linear_value_head_dim"), f("linear_conv_kernel_dim")
  r = V // K

  def build(**settings):
    return RecurrentMixer("gated_deltanet", F, K, head_dim=H, num_v_heads=V, expand_v=D / H,
                          conv_size=W, norm_eps=f("rms_norm_eps"), **settings)

  return Plan(build, f"model.layers.{index}.linear_attn.", (
      Row("in_proj_qkvz.weight", ("q_proj.kernel", "k_proj.kernel", "v_proj.kernel",
                                  "g_proj.kernel"), "linear", (H, H, r * D, r * D), K),
      Row("in_proj_ba.weight", ("b_proj.kernel", "a_proj.kernel"), "linear", (r, r), K),
      Row("conv1d.weight", ("q_conv.kernel", "k_conv.kernel", "v_conv.kernel"), "conv",
          (K * H, K * H, V * D)),
      Row("A_log", "A_log"),
      Row("dt_bias", "dt_bias"),
      Row("norm.weight", "o_norm.scale"),
      Row("out_proj.weight", "o_proj.kernel", "linear"),
  ))


def _qwen3_5(config: Mapping[str, Any], index: int) -> Plan:
  """Qwen3.5's Gated DeltaNet: ``in_proj_qkv`` is ``[q | k | v]`` in plain blocks, with
  ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` apart. A multimodal checkpoint nests the
  text model's config in ``text_config`` and its tensors under ``model.language_model``."""
  t = "qwen3_5"
  nested = "text_config" in config
  config = config["text_config"] if nested else config
  _kind(config, index, t, "linear_attention")
  _silu(config, t)
  f = lambda name: _field(config, name, t)  # noqa: E731
  F, K, V = f("hidden_size"), f("linear_num_key_heads"), f("linear_num_value_heads")
  H, D, W = f("linear_key_head_dim"), f("linear_value_head_dim"), f("linear_conv_kernel_dim")

  def build(**settings):
    return RecurrentMixer("gated_deltanet", F, K, head_dim=H, num_v_heads=V, expand_v=D / H,
                          conv_size=W, norm_eps=f("rms_norm_eps"), **settings)

  model = "model.language_model" if nested else "model"
  return Plan(build, f"{model}.layers.{index}.linear_attn.", (
      Row("in_proj_qkv.weight", ("q_proj.kernel", "k_proj.kernel", "v_proj.kernel"), "linear",
          (K * H, K * H, V * D)),
      Row("in_proj_z.weight", "g_proj.kernel", "linear"),
      Row("in_proj_b.weight", "b_proj.kernel", "linear"),
      Row("in_proj_a.weight", "a_proj.kernel", "linear"),
      Row("conv1d.weight", ("q_conv.kernel", "k_conv.kernel", "v_conv.kernel"), "conv",
          (K * H, K * H, V * D)),
      Row("A_log", "A_log"), Row("dt_bias", "dt_bias"),
      Row("norm.weight", "o_norm.scale"),
      Row("out_proj.weight", "o_proj.kernel", "linear"),
  ))


def _olmo_hybrid(config: Mapping[str, Any], index: int) -> Plan:
  """OLMo's hybrid Gated DeltaNet: projections and convolutions apart, ``β = 2σ(x W_b)``
  with ``linear_allow_neg_eigval``, the output norm's eps 1e-5."""
  t = "olmo_hybrid"
  _kind(config, index, t, "linear_attention")
  _silu(config, t)
  f = lambda name: _field(config, name, t)  # noqa: E731
  F, K, V = f("hidden_size"), f("linear_num_key_heads"), f("linear_num_value_heads")
  H, D, W = f("linear_key_head_dim"), f("linear_value_head_dim"), f("linear_conv_kernel_dim")

  def build(**settings):
    return RecurrentMixer("gated_deltanet", F, K, head_dim=H, num_v_heads=V, expand_v=D / H,
                          conv_size=W, allow_neg_eigval=bool(f("linear_allow_neg_eigval")),
                          norm_eps=1e-5, **settings)

  return Plan(build, f"model.layers.{index}.linear_attn.", (*_separate("qkvabg"),
      Row("A_log", "A_log"), Row("dt_bias", "dt_bias"),
      Row("o_norm.weight", "o_norm.scale"),
      Row("o_proj.weight", "o_proj.kernel", "linear"),
  ))


# --- The KDA layers ------------------------------------------------------------------------


def _kimi_linear(config: Mapping[str, Any], index: int) -> Plan:
  """Kimi Linear's KDA layers (``linear_attn_config.kda_layers``, counted from 1): the
  checkpoint stores the convolutions split and the forget gate's tensors at the top."""
  t = "kimi_linear"
  linear = _field(config, "linear_attn_config", t)
  layers = [i - 1 for i in _field(linear, "kda_layers", t)]
  if index not in layers:
    raise ValueError(f"{_FN}: layer {index} of this {t} checkpoint is not a KDA layer; its "
                     f"KDA layers (from 0): {layers}.")
  _silu(config, t)
  F, N = _field(config, "hidden_size", t), _field(linear, "num_heads", t)
  H, W = _field(linear, "head_dim", t), _field(linear, "short_conv_kernel_size", t)

  def build(**settings):
    return RecurrentMixer("kda", F, N, head_dim=H, conv_size=W, gate_bias=False,
                          norm_eps=_field(config, "rms_norm_eps", t), **settings)

  return Plan(build, f"model.layers.{index}.self_attn.", (*_separate("qkv"),
      Row("f_a_proj.weight", "f_proj.down.kernel", "linear"),
      Row("f_b_proj.weight", "f_proj.up.kernel", "linear"),
      Row("dt_bias", "dt_bias"),
      Row("A_log", "A_log"),  # [1, 1, N, 1] as [N].
      Row("b_proj.weight", "b_proj.kernel", "linear"),
      Row("g_a_proj.weight", "g_proj.down.kernel", "linear"),
      Row("g_b_proj.weight", "g_proj.up.kernel", "linear"),
      Row("o_norm.weight", "o_norm.scale"),
      Row("o_proj.weight", "o_proj.kernel", "linear"),
  ))


def _bailing_hybrid(config: Mapping[str, Any], index: int) -> Plan:
  """Bailing's hybrid (Ling): KDA layers (``linear_attention``) with full-rank decay and
  gate projections and, with ``kda_safe_gate``, the bounded decay; the checkpoint keeps
  them under ``attention`` and names ``o_proj`` ``dense``. The KDA head dim is
  ``linear_head_dim`` where the config has it (transformers overwrites ``head_dim``)."""
  t = "bailing_hybrid"
  _kind(config, index, t, "linear_attention")
  _silu(config, t)
  f = lambda name: _field(config, name, t)  # noqa: E731
  F = f("hidden_size")
  N = config.get("linear_num_heads", f("num_attention_heads"))
  H = config.get("linear_head_dim", f("head_dim"))
  W = config.get("linear_conv_kernel_dim", config.get("short_conv_kernel_size", 4))
  bound = f("kda_lower_bound") if config.get("kda_safe_gate") else None

  def build(**settings):
    return RecurrentMixer("kda", F, N, head_dim=H, conv_size=W, low_rank_gate=False,
                          low_rank_decay=False, decay_bound=bound,
                          norm_eps=f("rms_norm_eps"), **settings)

  return Plan(build, f"model.layers.{index}.attention.", (*_separate("qkvfbg"),
      Row("dt_bias", "dt_bias"), Row("A_log", "A_log"),
      Row("o_norm.weight", "o_norm.scale"),
      Row("dense.weight", "o_proj.kernel", "linear"),
  ))


# --- Lightning attention -------------------------------------------------------------------


def _minimax(config: Mapping[str, Any], index: int) -> Plan:
  """MiniMax-01's lightning attention (its ``linear_attention`` layers): ``qkv_proj`` is N
  runs of ``[q | k | v]``; ``slope_rate`` holds each head's decay rate, and the block
  decays beside it are recomputed from it."""
  t = "minimax"
  _kind(config, index, t, "linear_attention")
  _silu(config, t)
  f = lambda name: _field(config, name, t)  # noqa: E731
  F, N, d = f("hidden_size"), f("num_attention_heads"), f("head_dim")

  def build(**settings):
    return RecurrentMixer("lightning", F, N, head_dim=d, norm_eps=1e-6, layer_index=index,
                          num_layers=f("num_hidden_layers"), **settings)

  def derived(module, name):
    s = np.asarray(module.slope.get_value(), np.float64)[:, None]  # [N, 1]
    i = np.arange(f("block_size"), dtype=np.float64)
    if name == "query_decay":
      return np.exp(-s * (i + 1))[..., None]  # [N, b, 1]
    if name == "key_decay":
      return np.exp(-s * (i[::-1]))[..., None]
    gap = i[:, None] - i[None, :]  # diagonal_decay [1, N, b, b]
    return np.where(gap >= 0, np.exp(-s[..., None] * np.maximum(gap, 0)), 0.0)[None]

  return Plan(build, f"model.layers.{index}.self_attn.", (
      Row("qkv_proj.weight", ("q_proj.kernel", "k_proj.kernel", "v_proj.kernel"), "linear",
          (d, d, d), N),
      Row("output_gate.weight", "g_proj.kernel", "linear"),
      Row("norm.weight", "o_norm.scale"),
      Row("out_proj.weight", "o_proj.kernel", "linear"),
      Row("slope_rate", "slope"),  # [N, 1, 1] as [N].
      *(Row(name, (), "derived") for name in ("query_decay", "key_decay", "diagonal_decay")),
  ), derived)


# --- The Mamba-2 layers: one table, each model type's field names --------------------------


class _Mamba2Sizes(NamedTuple):
  """A Mamba-2 layer's settings, read from whichever fields its model type names them by."""

  hidden: int
  heads: int
  head_dim: int
  inner: int  # expand · hidden, which heads · head_dim must equal.
  state: int
  groups: int
  conv: int
  conv_bias: bool
  bias: bool
  eps: float
  limit: tuple[float, float]
  options: Mapping[str, Any] = {}  # Falcon-H1's: Mamba2Mixer's keywords.


def _mamba2_plan(t: str, m: _Mamba2Sizes, prefix: str) -> Plan:
  """The Mamba-2 table (its fused ``in_proj`` and the convolution over ``x | B | C`` are
  ours as they are), for any model type whose layer is transformers' ``Mamba2Mixer``
  with other field names."""
  if m.heads * m.head_dim != m.inner:
    raise ValueError(f"{_FN}: {t} with {m.heads} heads of {m.head_dim} channels; its inner "
                     f"width is {m.inner}.")

  def build(**settings):
    return Mamba2Mixer(m.hidden, num_heads=m.heads, head_dim=m.head_dim, state_size=m.state,
                       n_groups=m.groups, conv_size=m.conv, use_conv_bias=m.conv_bias,
                       use_bias=m.bias, norm_eps=m.eps, time_step_limit=m.limit,
                       **m.options, **settings)

  rows = [Row("in_proj.weight", "in_proj.kernel", "linear"),
          Row("conv1d.weight", "conv.kernel", "conv"),
          Row("dt_bias", "dt_bias"), Row("A_log", "A_log"), Row("D", "D"),
          Row("out_proj.weight", "out_proj.kernel", "linear")]
  rows += [Row("norm.weight", "norm.scale")] if m.options.get("use_norm", True) else []
  rows += [Row("conv1d.bias", "conv.bias")] if m.conv_bias else []
  rows += [Row(f"{x}_proj.bias", f"{x}_proj.bias") for x in ("in", "out")] if m.bias else []
  return Plan(build, prefix, tuple(rows))


def _limit(config: Mapping[str, Any]) -> tuple[float, float]:
  return tuple(config.get("time_step_limit", (0.0, math.inf)))


def _mamba2(config: Mapping[str, Any], index: int) -> Plan:
  """Mamba-2 (``Mamba2Mixer``, every layer)."""
  t = "mamba2"
  f = lambda name: _field(config, name, t)  # noqa: E731
  _silu(config, t)
  F = f("hidden_size")
  return _mamba2_plan(t, _Mamba2Sizes(
      F, f("num_heads"), f("head_dim"), int(f("expand") * F), f("state_size"), f("n_groups"),
      f("conv_kernel"), f("use_conv_bias"), f("use_bias"), f("layer_norm_epsilon"),
      _limit(config)), f"backbone.layers.{index}.mixer.")


def _bamba_sizes(config: Mapping[str, Any], t: str) -> _Mamba2Sizes:
  f = lambda name: _field(config, name, t)  # noqa: E731
  _silu(config, t)
  F = f("hidden_size")
  return _Mamba2Sizes(F, f("mamba_n_heads"), f("mamba_d_head"), int(f("mamba_expand") * F),
                      f("mamba_d_state"), f("mamba_n_groups"), f("mamba_d_conv"),
                      f("mamba_conv_bias"), f("mamba_proj_bias"), f("rms_norm_eps"),
                      _limit(config))


def _bamba(config: Mapping[str, Any], index: int) -> Plan:
  """Bamba: Mamba-2 layers but those of ``attn_layer_indices``."""
  t = "bamba"
  attention = _field(config, "attn_layer_indices", t)
  if index in attention:
    raise ValueError(f"{_FN}: layer {index} of this {t} checkpoint is an attention layer "
                     f"(attn_layer_indices {attention}).")
  return _mamba2_plan(t, _bamba_sizes(config, t), f"model.layers.{index}.mamba.")


def _granitemoehybrid(config: Mapping[str, Any], index: int) -> Plan:
  """Granite 4.0 (hybrid): its Mamba-2 layers (``layer_types``), Bamba's fields; the
  multipliers act outside the mixer."""
  t = "granitemoehybrid"
  _kind(config, index, t, ("linear_attention", "mamba"))
  return _mamba2_plan(t, _bamba_sizes(config, t), f"model.layers.{index}.mamba.")


def _nemotron_h(config: Mapping[str, Any], index: int) -> Plan:
  """Nemotron-H: its Mamba-2 layers (``layers_block_type``); Δ is clipped below at
  ``time_step_min``."""
  t = "nemotron_h"
  _kind(config, index, t, ("linear_attention", "mamba"), field="layers_block_type")
  f = lambda name: _field(config, name, t)  # noqa: E731
  _silu(config, t, "mamba_hidden_act")
  n, P = f("mamba_num_heads"), f("mamba_head_dim")
  return _mamba2_plan(t, _Mamba2Sizes(
      f("hidden_size"), n, P, n * P, f("ssm_state_size"), f("n_groups"), f("conv_kernel"),
      f("use_conv_bias"), f("use_bias"), f("layer_norm_epsilon"),
      (f("time_step_min"), math.inf)), f"backbone.layers.{index}.mixer.")


def _falcon_h1(config: Mapping[str, Any], index: int) -> Plan:
  """Falcon-H1: the Mamba-2 half of each layer (``part="recurrent"``), with its input and
  projection multipliers and its norm before the gate (``mamba_norm_before_gate``)."""
  t = "falcon_h1"
  f = lambda name: _field(config, name, t)  # noqa: E731
  _silu(config, t)
  if f("mamba_proj_bias") != f("projectors_bias"):
    raise ValueError(f"{_FN}: {t} with mamba_proj_bias={f('mamba_proj_bias')} and "
                     f"projectors_bias={f('projectors_bias')}: the layer has one bias setting.")
  F = f("hidden_size")
  inner = config.get("mamba_d_ssm") or int(f("mamba_expand") * F)
  options = {"gate_first": not f("mamba_norm_before_gate"), "use_norm": f("mamba_rms_norm"),
             "in_multiplier": f("ssm_in_multiplier"),
             "projection_multipliers": tuple(f("ssm_multipliers"))}
  return _mamba2_plan(t, _Mamba2Sizes(
      F, f("mamba_n_heads"), f("mamba_d_head"), inner, f("mamba_d_state"), f("mamba_n_groups"),
      f("mamba_d_conv"), f("mamba_conv_bias"), f("mamba_proj_bias"), f("rms_norm_eps"),
      _limit(config), options), f"model.layers.{index}.mamba.")


def _zamba2(config: Mapping[str, Any], index: int) -> Plan:
  """Zamba2: the Mamba-2 mixer of each layer (a ``hybrid`` layer's sits in its
  ``mamba_decoder``, beside the shared attention block); the convolution always has its
  bias, the norm's eps is 1e-5 and Δ is clipped below at ``time_step_min``."""
  t = "zamba2"
  kinds = _field(config, "layers_block_type", t)
  f = lambda name: _field(config, name, t)  # noqa: E731
  F = f("hidden_size")
  where = "mamba_decoder.mamba" if kinds[index] == "hybrid" else "mamba"
  return _mamba2_plan(t, _Mamba2Sizes(
      F, f("n_mamba_heads"), f("mamba_headdim"), int(f("mamba_expand") * F), f("mamba_d_state"),
      f("mamba_ngroups"), f("mamba_d_conv"), True, f("add_bias_linear"), 1e-5,
      (f("time_step_min"), math.inf)), f"model.layers.{index}.{where}.")


# --- The Mamba-1 layers --------------------------------------------------------------------


def _mamba_plan(t: str, config: Mapping[str, Any], prefix: str, *, F: int, E: int, S: int,
                W: int, R: Any, conv_bias: bool, bias: bool, norm: str | None = None,
                norm_eps: float = 1e-6) -> Plan:
  """The Mamba-1 table: ``in_proj`` is ``[x | z]``, ``x_proj`` ``[δ | B | C]``, ``dt_proj``
  holds Δ's bias; ours in the same layout (and Jamba's inner norms)."""
  _silu(config, t)

  def build(**settings):
    return MambaMixer(F, intermediate_size=E, state_size=S, conv_size=W,
                      time_step_rank=None if R == "auto" else R, use_conv_bias=conv_bias,
                      use_bias=bias, inner_norm=norm, inner_norm_eps=norm_eps, **settings)

  rows = [Row("in_proj.weight", "in_proj.kernel", "linear"),
          Row("conv1d.weight", "conv.kernel", "conv"),
          Row("x_proj.weight", "x_proj.kernel", "linear"),
          Row("dt_proj.weight", "dt_proj.kernel", "linear"),
          Row("dt_proj.bias", "dt_proj.bias"),
          Row("A_log", "A_log"), Row("D", "D"),
          Row("out_proj.weight", "out_proj.kernel", "linear")]
  rows += [Row("conv1d.bias", "conv.bias")] if conv_bias else []
  rows += [Row(f"{x}_proj.bias", f"{x}_proj.bias") for x in ("in", "out")] if bias else []
  if norm == "learned":
    rows += [Row(f"{x}_layernorm.weight", f"{x}_norm.scale") for x in ("dt", "b", "c")]
  return Plan(build, prefix, tuple(rows))


def _mamba(config: Mapping[str, Any], index: int, t: str = "mamba") -> Plan:
  """Mamba-1 (``MambaMixer``, every layer); Falcon-Mamba with its weightless inner norms."""
  f = lambda name: _field(config, name, t)  # noqa: E731
  falcon = t == "falcon_mamba"
  return _mamba_plan(t, config, f"backbone.layers.{index}.mixer.", F=f("hidden_size"),
                     E=f("intermediate_size"), S=f("state_size"), W=f("conv_kernel"),
                     R=f("time_step_rank"), conv_bias=f("use_conv_bias"), bias=f("use_bias"),
                     norm="weightless" if falcon else None,
                     norm_eps=f("mixer_rms_eps") if falcon else 1e-6)


def _jamba(config: Mapping[str, Any], index: int) -> Plan:
  """Jamba: the Mamba-1 layers (attention where ``i % attn_layer_period ==
  attn_layer_offset``), with RMSNorms on δ, B and C."""
  t = "jamba"
  f = lambda name: _field(config, name, t)  # noqa: E731
  if index % f("attn_layer_period") == f("attn_layer_offset"):
    raise ValueError(f"{_FN}: layer {index} of this {t} checkpoint is an attention layer "
                     f"(attn_layer_period {f('attn_layer_period')}, offset "
                     f"{f('attn_layer_offset')}).")
  F = f("hidden_size")
  return _mamba_plan(t, config, f"model.layers.{index}.mamba.", F=F,
                     E=int(f("mamba_expand") * F), S=f("mamba_d_state"), W=f("mamba_d_conv"),
                     R=f("mamba_dt_rank"), conv_bias=f("mamba_conv_bias"),
                     bias=f("mamba_proj_bias"), norm="learned", norm_eps=f("rms_norm_eps"))


# --- The gated short convolution -----------------------------------------------------------


def _lfm2(config: Mapping[str, Any], index: int) -> Plan:
  """LFM2's gated short convolution (its ``"conv"`` layers)."""
  t = "lfm2"
  _kind(config, index, t, "conv")
  bias = bool(config.get("conv_bias", False))

  def build(**settings):
    return ShortConvMixer(_field(config, "hidden_size", t),
                          conv_size=_field(config, "conv_L_cache", t), use_bias=bias, **settings)

  rows = [Row("in_proj.weight", "in_proj.kernel", "linear"),
          Row("conv.weight", "conv.kernel", "conv"),
          Row("out_proj.weight", "out_proj.kernel", "linear")]
  rows += [Row(f"{x}.bias", f"{x}.bias") for x in ("in_proj", "conv", "out_proj")] if bias else []
  return Plan(build, f"model.layers.{index}.conv.", tuple(rows))


PLANS: Mapping[str, Callable[[Mapping[str, Any], int], Plan]] = {
    "qwen3_next": _qwen3_next,
    "kimi_linear": _kimi_linear,
    "qwen3_5": _qwen3_5,
    "qwen3_5_text": _qwen3_5,
    "olmo_hybrid": _olmo_hybrid,
    "minimax": _minimax,
    "bailing_hybrid": _bailing_hybrid,
    "mamba": _mamba,
    "falcon_mamba": functools.partial(_mamba, t="falcon_mamba"),
    "jamba": _jamba,
    "mamba2": _mamba2,
    "bamba": _bamba,
    "granitemoehybrid": _granitemoehybrid,
    "nemotron_h": _nemotron_h,
    "zamba2": _zamba2,
    "falcon_h1": _falcon_h1,
    "lfm2": _lfm2,
}


def _config_value(obj: dict) -> Any:
  """JSON as transformers writes it: ``{"__float__": "Infinity"}`` for an infinite float."""
  return float(obj["__float__"]) if set(obj) == {"__float__"} else obj


def _tensor_files(checkpoint: str) -> dict[str, str]:
  """Every tensor's name -> the safetensors file that holds it."""
  index = os.path.join(checkpoint, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(checkpoint, file) for name, file in weight_map.items()}
  single = os.path.join(checkpoint, "model.safetensors")
  if not os.path.exists(single):
    raise ValueError(f"{_FN}: {checkpoint!r} has neither model.safetensors nor "
                     "model.safetensors.index.json.")
  from safetensors import safe_open
  with safe_open(single, framework="flax") as f:
    return dict.fromkeys(f.keys(), single)


def _torch_shape(param_shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
  """The checkpoint layout of a parameter of ``param_shape`` (before any split)."""
  if layout == "linear":
    return param_shape[::-1]
  if layout == "conv":
    return (param_shape[1], 1, param_shape[0])
  return param_shape


def _split(tensor: jax.Array, row: Row) -> list[jax.Array]:
  """``tensor`` cut along its first axis into ``row.parts``, gathered over ``row.groups``."""
  if row.parts is None:
    return [tensor]
  runs = tensor.reshape((row.groups, sum(row.parts)) + tensor.shape[1:])
  bounds = np.cumsum((0,) + row.parts)
  return [runs[:, a:z].reshape((-1,) + tensor.shape[1:])
          for a, z in zip(bounds[:-1], bounds[1:], strict=True)]


def _laid_out(tensor: jax.Array, layout: str) -> jax.Array:
  if layout == "linear":
    return tensor.T
  if layout == "conv":
    return tensor[:, 0, :].T
  return tensor


def _variable(module: nnx.Module, path: str) -> nnx.Variable:
  target = module
  for part in path.split("."):
    target = getattr(target, part)
  return target


def load_transformers_layer(checkpoint: str | os.PathLike, layer_index: int, *,
                            part: str | None = None, dtype: Dtype | None = None,
                            param_dtype: Dtype | None = None,
                            rngs: nnx.Rngs | None = None) -> nnx.Module:
  """The token mixer of decoder layer ``layer_index`` of a transformers checkpoint.

  ``layer(x)``, with ``x [B, T, F]`` the hidden states transformers passes into that
  submodule, returns its output; the module decodes (``init_cache``, ``decode=True``)
  and takes ``segment_ids`` like every layer here. The model types and the module each
  loads (:data:`PLANS`; the tables are on the docs site):

  ================= ====================================== =========================
  model type        layer (transformers)                   module
  ================= ====================================== =========================
  qwen3_next        ``linear_attn`` (Gated DeltaNet)       ``RecurrentMixer``
                                                           (``gated_deltanet``)
  qwen3_5           ``linear_attn`` (Gated DeltaNet)       the same
  olmo_hybrid       ``linear_attn`` (Gated DeltaNet)       the same, ``β = 2σ``
  kimi_linear       ``self_attn`` (KDA)                    ``RecurrentMixer`` (``kda``)
  bailing_hybrid    ``self_attn`` (KDA, full rank)         the same, bounded decay
  minimax           ``self_attn`` (lightning attention)    ``RecurrentMixer``
                                                           (``lightning``)
  mamba             ``mixer`` (``MambaMixer``)             :class:`MambaMixer`
  falcon_mamba      ``mixer``                              the same, weightless norms
  jamba             ``mamba``                              the same, learned norms
  mamba2            ``mixer`` (``Mamba2Mixer``)            :class:`Mamba2Mixer`
  bamba             ``mamba``                              the same
  granitemoehybrid  ``mamba``                              the same
  nemotron_h        ``mixer``                              the same
  zamba2            ``mamba`` (``mamba_decoder.mamba``)    the same
  falcon_h1         ``mamba`` (beside its attention)       the same, multipliers
  lfm2              ``conv`` (``Lfm2ShortConv``)           :class:`ShortConvMixer`
  ================= ====================================== =========================

  The config decides every option (head counts, groups, widths, eps, ``time_step_limit``).

  Args:
    checkpoint: a directory with ``config.json`` and ``model.safetensors`` (or
      ``model.safetensors.index.json`` and its shards).
    layer_index: the decoder layer, from 0.
    part: ``"recurrent"`` (the default): the layer's recurrent token mixer.
    dtype: the module's computation dtype (default: its inputs').
    param_dtype: the parameters' dtype (default: each tensor's, as stored: bfloat16,
      float16 or float32).
    rngs: unused randomness for the module's construction (every parameter is read
      from the checkpoint); default ``nnx.Rngs(0)``.

  Raises:
    ValueError: for a model type or layer kind it does not load, a layer index out of
      range, a missing tensor, a tensor of the wrong shape (naming it and both shapes),
      or a tensor of that layer left unread.

  Examples:
    >>> layer = nn.load_transformers_layer("tests/fixtures/transformers/mamba2", 0)
    >>> type(layer).__name__, layer.num_heads, layer.n_groups
    ('Mamba2Mixer', 4, 2)
  """
  checkpoint = os.fspath(checkpoint)
  part = "recurrent" if part is None else part
  if part not in ("recurrent", "attention"):
    raise ValueError(f"{_FN}: part must be 'recurrent' or 'attention'; got {part!r}.")
  path = os.path.join(checkpoint, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"{_FN}: no config.json in {checkpoint!r}.")
  with open(path) as f:
    config = json.load(f, object_hook=_config_value)
  model_type = config.get("model_type")
  if model_type not in PLANS:
    raise ValueError(f"{_FN}: model type {model_type!r} is not one it loads; it loads "
                     f"{sorted(PLANS)}.")
  if part == "attention":
    raise ValueError(f"{_FN}: part='attention': {model_type}'s layers load their recurrent "
                     "token mixer only.")
  text = config.get("text_config", config)  # A multimodal model's text layers.
  layers = text.get("num_hidden_layers")
  for kinds in ("layers_block_type", "layer_types"):  # Nemotron-H names no count.
    layers = len(text[kinds]) if layers is None and kinds in text else layers
  if not isinstance(layer_index, int) or not 0 <= layer_index < (layers or 0):
    raise ValueError(f"{_FN}: layer_index={layer_index!r} is out of range for the {layers} "
                     f"layers of this {model_type} checkpoint.")
  plan = PLANS[model_type](config, layer_index)
  files = _tensor_files(checkpoint)
  module = nnx.eval_shape(lambda rngs: plan.build(dtype=dtype, rngs=rngs,
                                                  param_dtype=param_dtype or jnp.float32),
                          rngs or nnx.Rngs(0))
  mine = sorted(n for n in files if n.startswith(plan.prefix))
  wanted = [plan.prefix + row.name for row in plan.rows]
  missing = [n for n in wanted if n not in files]
  if missing:
    raise ValueError(f"{_FN}: the checkpoint lacks {missing} for layer {layer_index}'s "
                     f"{model_type} token mixer.")
  unread = [n for n in mine if n not in wanted]
  if unread:
    raise ValueError(f"{_FN}: layer {layer_index}'s tensors {unread} are not read by the "
                     f"{model_type} table; they would be ignored.")
  from safetensors import safe_open
  params = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))}
  with contextlib.ExitStack() as stack:
    opened = {file: stack.enter_context(safe_open(file, framework="flax"))
              for file in sorted({files[plan.prefix + row.name] for row in plan.rows})}
    _set(module, plan, model_type, params, param_dtype,
         lambda name: opened[files[name]].get_tensor(name))
  if params:  # A table that leaves a parameter unset is a bug of the table, not the user's.
    raise AssertionError(f"{_FN}: the {model_type} table sets no value for {sorted(params)}.")
  return module


def _set(module: nnx.Module, plan: Plan, model_type: str, params: set[str], param_dtype: Any,
         read: Callable[[str], jax.Array]) -> None:
  """Sets ``module``'s parameters from the tensors ``read(name)`` returns (JAX arrays:
  XLA transposes them, several times faster than numpy's strided copies), discarding each
  from ``params``; then checks the derived buffers."""
  for row in plan.rows:
    name = plan.prefix + row.name
    if row.layout == "derived":
      continue  # Checked once the parameters are set.
    tensor = read(name)
    ours = (row.ours,) if isinstance(row.ours, str) else row.ours
    variables = [_variable(module, p) for p in ours]
    shapes = [_torch_shape(tuple(v.get_value().shape), row.layout) for v in variables]
    want = (sum(s[0] for s in shapes),) + shapes[0][1:] if row.parts else shapes[0]
    if row.layout == "copy" and math.prod(tensor.shape) == math.prod(want):
      tensor = tensor.reshape(want)  # Kimi's A_log [1, 1, N, 1] is our [N].
    if tuple(tensor.shape) != want:
      raise ValueError(f"{_FN}: tensor {name} has shape {tuple(tensor.shape)}; the "
                       f"{model_type} config implies {want} (for {', '.join(ours)}).")
    for variable, piece, p in zip(variables, _split(tensor, row), ours, strict=True):
      value = _laid_out(piece, row.layout)
      variable.set_value(value.astype(param_dtype) if param_dtype else value)
      params.discard(p)
  for row in plan.rows:
    if row.layout != "derived":
      continue
    name = plan.prefix + row.name
    stored = np.asarray(read(name)).astype(np.float64)
    want = plan.derived(module, row.name)
    if stored.shape != want.shape or not np.allclose(stored, want, rtol=1e-2, atol=1e-6):
      raise ValueError(f"{_FN}: tensor {name} {stored.shape} disagrees with what the "
                       f"{model_type} layer computes from its parameters {want.shape}.")
