"""Times registered attentions against XLA attention and a matmul baseline.

For every selected variant (and implementation), length ``T = S`` and mode
(``forward``, or ``backward`` = forward plus the vector-Jacobian product
w.r.t. query, key and value), the jitted function is lowered and compiled
once; the compiled temporary/argument/output memory and the compile time are
recorded, then the executable is timed (warm-up calls, then ``--repeats``
calls, each ending in ``jax.block_until_ready``).

Every length also runs, in the same process, ``jax.nn.dot_product_attention``
(``implementation="xla"``) in each mode, and a float32 batched matmul
``[B*N, T, H] x [B*N, H, D]`` whose FLOP rate stands for what the machine
can do. Records quote ``ratio_vs_xla`` (median time over the XLA median) and,
for variants with a FLOP counter, the useful-FLOP rate and its ``fraction_of_matmul_rate``.

With ``--segment_every=L``, every variant whose function takes ``segment_ids``
is also timed packed, in the same run: ``segment_ids = arange(T) // L`` (a new
sequence every L tokens). The packed call and the same call without ids are timed
in turns (one call of each per round), so that a load that changes during the run
weighs on both alike; the packed record quotes ``ratio_vs_unpacked``, the ratio of
the two medians.

With ``--versus=NAME``, every other case of a length and mode is timed in turns with
the registered variant NAME at the case's implementation (its default where it has
not that one), the same way: its record quotes ``ratio_vs_versus``. Ratios between
cases timed one after the other move with the machine's load (on a shared machine
by a fifth and more between runs); ratios taken in turns do not.

With ``--delta_product_steps=n``, Gated DeltaProduct (``delta_product_attention``,
n keys per token: the query-length key and its copies shifted by one to n - 1
positions) is timed too, as ``gated_delta_product_n<n>``, with a decay per token and
write strengths drawn like the registered variants' gates.

With ``--log_linear``, log-linear attention (``log_linear_attention``, no registry entry
either) is timed too, as ``log_linear``, with ``L = bit_length(T - 1) + 1`` levels of
scales drawn in [0.5, 1] and a decay per token like the registered variants' gates.

Writes ``<output_dir>/benchmark.json`` (after every case, so an interrupted
run keeps what it measured) and log-log plots ``time_<mode>.png`` and
``memory.png``.

Usage (from the repository root)::

  python -m experiments.benchmark --lengths=256,512,1024 --modes=forward,backward
  python -m experiments.benchmark --variants=local --options='{"window_size": [256, 0]}' \
      --lengths=8192 --modes=backward --segment_every=1000 --noxla_baseline
  python -m experiments.benchmark --variants=kda --implementations=chunked --lengths=8192 \
      --modes=backward --versus=gated_delta_net --noxla_baseline
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import itertools
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import linattn_jax
from experiments import common

_VARIANTS = flags.DEFINE_list(
    "variants", ["softmax", "flash"], "Registry names to time (see available_attentions()).")
_IMPLEMENTATIONS = flags.DEFINE_list(
    "implementations", None,
    "For variants with several `implementation=` values: which to run. "
    "Default: all but 'reference'.")
_LENGTHS = flags.DEFINE_list("lengths", ["256", "512", "1024"], "Sequence lengths T (= S).")
_BATCH = common.BATCH
_KV_HEADS = common.KV_HEADS
_DTYPE = common.DTYPE
_MODES = flags.DEFINE_list(
    "modes", ["forward", "backward"],
    "forward, backward (forward + gradients w.r.t. q, k, v) and/or step (time per token of "
    "streaming decode steps at position T, after a prefill of T tokens; streaming variants "
    "only).")
_REPEATS = common.REPEATS
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed calls before timing.")
_MAX_MEMORY_FRACTION = flags.DEFINE_float(
    "max_memory_fraction", 0.7,
    "Compile but do not run a case whose temp + argument + output bytes exceed "
    "this fraction of physical RAM.")
_OPTIONS = flags.DEFINE_string(
    "options", None,
    "JSON dict of options for get_attention, applied to every variant, "
    "e.g. '{\"block_q\": 256}' (with --variants=flash).")
_MASKED_BASELINE = flags.DEFINE_bool(
    "masked_baseline", True,
    "For sparse variants (those with a dense_mask), also time softmax_attention's XLA path "
    "with the equivalent dense mask.")
_MATMUL_BASELINE = flags.DEFINE_bool(
    "matmul_baseline", True, "Time the batched-matmul baseline at every length.")
_XLA_BASELINE = flags.DEFINE_bool(
    "xla_baseline", True,
    "Time jax.nn.dot_product_attention's XLA path at every length and mode (without it, no "
    "ratio_vs_xla: e.g. for a packed/unpacked comparison at lengths where it takes minutes).")
_DELTA_PRODUCT_STEPS = flags.DEFINE_integer(
    "delta_product_steps", None,
    "Also time Gated DeltaProduct (delta_product_attention) with this many delta steps per "
    "token (it has no registry entry: its keys are [B, S, n, K, H]). Default: off.")
_LOG_LINEAR = flags.DEFINE_bool(
    "log_linear", False,
    "Also time log_linear_attention (no registry entry: its level_scales are [B, T, N, L]) "
    "with L = bit_length(T - 1) + 1 levels; --options reach it (chunk_size).")
_VERSUS = flags.DEFINE_string(
    "versus", None,
    "A registered variant timed in turns with every other case of the same length and mode "
    "(at the case's implementation where it has it): the record quotes ratio_vs_versus. "
    "Default: off.")
_SEGMENT_EVERY = flags.DEFINE_integer(
    "segment_every", None,
    "Also time each variant that takes segment_ids packed, with segment_ids = arange(T) // N "
    "(a new sequence every N tokens), and quote its ratio to the unpacked call. Default: off.")

# --help lists the shared flags (--heads, --output_dir, ...) with this script's own.
flags.adopt_module_key_flags(common)

MODES = ("forward", "backward", "step")
# Labels of the two baselines in the records and plots.
XLA_VARIANT, XLA_IMPLEMENTATION = "jax_dpa", "xla"
MATMUL_VARIANT, MATMUL_IMPLEMENTATION = "matmul", "einsum_f32"
MASKED_IMPLEMENTATION = "xla+mask"
_SEED = 0
_MIB = 2**20
_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on (the flags, validated and defaulted)."""

  variants: tuple[str, ...]
  implementations: tuple[str, ...] | None
  lengths: tuple[int, ...]
  batch: int
  heads: int
  kv_heads: int
  head_dim: int
  value_dim: int
  dtype: str
  causal: bool
  modes: tuple[str, ...]
  repeats: int
  warmup: int
  output_dir: str
  plot: bool
  max_memory_fraction: float
  options: Mapping[str, Any]
  matmul_baseline: bool
  masked_baseline: bool = True
  segment_every: int | None = None  # Packed cases: segment_ids = arange(T) // segment_every.
  xla_baseline: bool = True
  delta_product_steps: int | None = None  # Gated DeltaProduct cases with n steps per token.
  versus: str | None = None  # A variant timed in turns with each other case (ratio_vs_versus).
  log_linear: bool = False  # Log-linear attention cases.


class Case(NamedTuple):
  """One measurement: ``kind`` is "attention", "packed", "xla", "masked", "matmul",
  "delta_product" or "log_linear".

  "masked" is softmax attention's XLA path with the dense twin of the sparse
  variant ``variant``; "packed" is the attention case called with
  ``segment_ids = arange(T) // segment_every``.
  """

  kind: str
  variant: str
  implementation: str | None
  length: int
  mode: str


class Inputs(NamedTuple):
  """Device arrays of one length: attention inputs, cotangent, matmul operands."""

  query: jax.Array  # [B, T, N, H]
  key: jax.Array  # [B, S, K, H]
  value: jax.Array  # [B, S, K, D]
  cotangent: jax.Array  # [B, T, N, D]
  lhs: jax.Array  # [B*N, T, H] float32
  rhs: jax.Array  # [B*N, H, D] float32


# ----------------------------------------------------------------- config ---


def config_from_flags() -> Config:
  """Reads and checks the flags (the only place they are read)."""
  config = Config(
      variants=tuple(_VARIANTS.value),
      implementations=(tuple(_IMPLEMENTATIONS.value)
                       if _IMPLEMENTATIONS.value is not None else None),
      lengths=tuple(_parse_int_list(_LENGTHS.value, "lengths")),
      batch=_BATCH.value,
      heads=common.HEADS.value,
      kv_heads=_KV_HEADS.value if _KV_HEADS.value is not None else common.HEADS.value,
      head_dim=common.HEAD_DIM.value,
      value_dim=common.value_dim(),
      dtype=_DTYPE.value,
      causal=common.CAUSAL.value,
      modes=tuple(_MODES.value),
      repeats=_REPEATS.value,
      warmup=_WARMUP.value,
      output_dir=common.output_dir("benchmark"),
      plot=common.PLOT.value,
      max_memory_fraction=_MAX_MEMORY_FRACTION.value,
      options=_parse_options(_OPTIONS.value),
      matmul_baseline=_MATMUL_BASELINE.value,
      masked_baseline=_MASKED_BASELINE.value,
      segment_every=_SEGMENT_EVERY.value,
      xla_baseline=_XLA_BASELINE.value,
      delta_product_steps=_DELTA_PRODUCT_STEPS.value,
      versus=_VERSUS.value,
      log_linear=_LOG_LINEAR.value,
  )
  _validate(config)
  return config


def _parse_int_list(values: Sequence[str], name: str) -> list[int]:
  try:
    return [int(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f"--{name} must be a list of integers: {values}") from e


def _parse_options(text: str | None) -> dict[str, Any]:
  if not text:
    return {}
  try:
    options = json.loads(text)
  except json.JSONDecodeError as e:
    raise app.UsageError(f"--options is not valid JSON: {e}") from e
  if not isinstance(options, dict):
    raise app.UsageError("--options must be a JSON object (dict).")
  if "implementation" in options:
    raise app.UsageError("choose implementations with --implementations, not --options.")
  return options


def _validate(config: Config) -> None:
  """Fails fast, before anything is compiled, on an impossible configuration."""
  unknown_modes = set(config.modes) - set(MODES)
  if unknown_modes:
    raise app.UsageError(f"--modes: unknown {sorted(unknown_modes)}; choose from {MODES}.")
  if config.heads % config.kv_heads:
    raise app.UsageError("--kv_heads must divide --heads.")
  if config.repeats < 1 or config.warmup < 0 or min(config.lengths, default=0) < 1:
    raise app.UsageError("need --repeats >= 1, --warmup >= 0 and positive --lengths.")
  if config.segment_every is not None and config.segment_every < 1:
    raise app.UsageError(f"--segment_every must be positive; got {config.segment_every}.")
  if config.delta_product_steps is not None and (config.delta_product_steps < 1
                                                 or not config.causal):
    raise app.UsageError("--delta_product_steps needs a positive n and --causal; got "
                         f"{config.delta_product_steps}.")
  if config.log_linear and not config.causal:
    raise app.UsageError("--log_linear needs --causal (log-linear attention is causal only).")
  if config.versus is not None and config.versus not in linattn_jax.available_attentions():
    raise app.UsageError(f"--versus: unknown variant {config.versus!r}; registered: "
                         f"{linattn_jax.available_attentions()}.")
  offered = set()
  for name in config.variants:
    try:
      spec = linattn_jax.get_spec(name)
      linattn_jax.get_attention(name, **config.options)  # Checks the option names.
    except ValueError as e:
      raise app.UsageError(str(e)) from e
    offered.update(spec.implementations)
  unknown = set(config.implementations or ()) - offered
  if unknown:
    raise app.UsageError(
        f"--implementations: {sorted(unknown)} offered by none of {config.variants}.")
  if "step" in config.modes:
    no_step = [name for name in config.variants if not _streams(name)]
    if no_step:
      raise app.UsageError(
          f"--modes=step: {no_step} have no streaming step (variants with one: "
          f"{[n for n in linattn_jax.available_attentions() if _streams(n)]}).")


# ------------------------------------------------------------------- plan ---


def variant_implementations(name: str, requested: Sequence[str] | None) -> list[str | None]:
  """Implementations of variant ``name`` to run (``[None]``: it has no choice)."""
  offered = linattn_jax.get_spec(name).implementations
  if offered == (None,):
    return [None]
  if requested is None:
    return [impl for impl in offered if impl != "reference"]
  return [impl for impl in offered if impl in requested]


def _supports(name: str, causal: bool) -> bool:
  spec = linattn_jax.get_spec(name)
  return spec.supports_causal if causal else spec.supports_noncausal


def takes_segment_ids(name: str) -> bool:
  """Whether variant ``name``'s function takes packed ``segment_ids``."""
  return "segment_ids" in inspect.signature(linattn_jax.get_spec(name).function).parameters


def _streams(name: str) -> bool:
  """Whether variant ``name`` has a step function and returns its state after a pass."""
  streaming = linattn_jax.get_spec(name).streaming
  return streaming is not None and streaming.state_passing


def plan_cases(config: Config) -> list[Case]:
  """All cases, length by length; baselines come first so ratios can be quoted at once."""
  attention = [
      (name, impl)
      for name in config.variants if _supports(name, config.causal)
      for impl in variant_implementations(name, config.implementations)
  ]
  cases = []
  for length in config.lengths:
    if config.matmul_baseline:
      cases.append(Case("matmul", MATMUL_VARIANT, MATMUL_IMPLEMENTATION, length, "forward"))
    for mode in config.modes:
      if mode == "step":
        cases.extend(Case("attention", name, impl, length, mode) for name, impl in attention
                     if _streams(name) and linattn_jax.get_spec(name).supports(impl, True))
        continue
      if config.xla_baseline:
        cases.append(Case("xla", XLA_VARIANT, XLA_IMPLEMENTATION, length, mode))
      masked = [name for name in dict.fromkeys(name for name, _ in attention)
                if config.masked_baseline and linattn_jax.get_spec(name).dense_mask is not None]
      cases.extend(Case("masked", name, MASKED_IMPLEMENTATION, length, mode) for name in masked)
      for name, impl in attention:
        cases.append(Case("attention", name, impl, length, mode))
        if config.segment_every is not None and takes_segment_ids(name):
          cases.append(Case("packed", name, impl, length, mode))
      if config.delta_product_steps:
        cases.append(Case("delta_product", f"gated_delta_product_n{config.delta_product_steps}",
                          None, length, mode))
      if config.log_linear:
        cases.append(Case("log_linear", "log_linear", None, length, mode))
  return cases


# ------------------------------------------------------------- functions ---


def make_inputs(config: Config, length: int) -> Inputs:
  """Seeded standard-normal inputs for sequence length ``length``."""
  rng = np.random.default_rng(_SEED)
  B, N, K, H, D = config.batch, config.heads, config.kv_heads, config.head_dim, config.value_dim
  shapes = [(B, length, N, H), (B, length, K, H), (B, length, K, D), (B, length, N, D)]
  attention = [jnp.asarray(rng.standard_normal(s, np.float32), dtype=config.dtype)
               for s in shapes]
  lhs = jnp.asarray(rng.standard_normal((B * N, length, H), np.float32))
  rhs = jnp.asarray(rng.standard_normal((B * N, H, D), np.float32))
  return Inputs(*attention, lhs, rhs)


def attention_function(config: Config, case: Case) -> Callable[..., jax.Array]:
  """``fn(q, k, v, *extra)`` of an attention, XLA or masked case, ``is_causal`` bound."""
  if case.kind == "xla":
    fn = functools.partial(jax.nn.dot_product_attention, implementation="xla")
  elif case.kind == "masked":
    fn = lambda q, k, v, mask, **kw: linattn_jax.softmax_attention(  # noqa: E731
        q, k, v, mask=mask, implementation="xla", **kw)
  else:
    options = dict(config.options)
    if case.implementation is not None:
      options["implementation"] = case.implementation
    fn = linattn_jax.get_attention(case.variant, **options)
    names = [x.name for x in linattn_jax.get_spec(case.variant).token_inputs]
    if case.kind == "packed":  # The ids arrive positionally after the value, then the gates.
      names = ["segment_ids", *names]
    if names:  # Gates and betas arrive positionally after the value (see gate_inputs).
      fn = _with_named_inputs(fn, names)
  return functools.partial(fn, is_causal=config.causal)


def _with_named_inputs(fn: Callable[..., jax.Array], names: Sequence[str]) -> Callable:
  def call(query, key, value, *inputs, **kwargs):
    return fn(query, key, value, **dict(zip(names, inputs, strict=True)), **kwargs)
  return call


def packed_segment_ids(config: Config, length: int) -> jax.Array:
  """``[B, T]`` int32 ``arange(T) // segment_every``: a new sequence every ``segment_every``
  tokens."""
  ids = jnp.arange(length, dtype=jnp.int32) // config.segment_every
  return jnp.broadcast_to(ids, (config.batch, length))


def gate_inputs(config: Config, case: Case, length: int) -> tuple[jax.Array, ...]:
  """A variant's per-token inputs, seeded (see ``common.gate_from_normal``)."""
  rng = np.random.default_rng(_SEED + 1)
  key_shape = (config.batch, length, config.kv_heads, config.head_dim)
  return tuple(common.gate_from_normal(x, jnp.asarray(rng.standard_normal(x.shape(key_shape),
                                                                          np.float32)))
               for x in linattn_jax.get_spec(case.variant).token_inputs)


def dense_twin(config: Config, case: Case) -> jax.Array:
  """The dense mask with which softmax attention equals sparse variant ``case.variant``."""
  spec = linattn_jax.get_spec(case.variant)
  return jnp.asarray(spec.dense_mask(case.length, case.length, is_causal=config.causal,
                                     **spec.what_options(config.options)))


def forward_backward(attention: Callable[..., jax.Array]) -> Callable[..., Any]:
  """``fn(q, k, v, ct, *extra)``: gradients of ``sum(attention(q, k, v, *extra) * ct)``
  w.r.t. q, k, v."""

  def fn(query, key, value, cotangent, *extra):
    _, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, *extra), query, key, value)
    return pullback(cotangent)

  return fn


def batched_matmul(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """The matmul baseline: ``[G, T, H] x [G, H, D] -> [G, T, D]``."""
  return jnp.einsum("bth,bhd->btd", lhs, rhs)


def case_function(config: Config, case: Case, inputs: Inputs) -> tuple[Callable, tuple]:
  """The function a case times and its arguments."""
  if case.kind == "matmul":
    return batched_matmul, (inputs.lhs, inputs.rhs)
  if case.mode == "step":
    return decode_step(config, case, inputs)
  if case.kind == "delta_product":
    return delta_product_case(config, case, inputs)
  if case.kind == "log_linear":
    return log_linear_case(config, case, inputs)
  attention = attention_function(config, case)
  qkv = (inputs.query, inputs.key, inputs.value)
  extra = (functools.partial(dense_twin, config, case),) if case.kind == "masked" else ()
  if case.kind not in ("xla", "masked"):
    extra = gate_inputs(config, case, case.length)
  if case.kind == "packed":
    extra = (packed_segment_ids(config, case.length),) + extra
  if case.mode == "forward":
    return attention, qkv + extra
  return forward_backward(attention), qkv + (inputs.cotangent,) + extra


def delta_product_case(config: Config, case: Case, inputs: Inputs) -> tuple[Callable, tuple]:
  """Gated DeltaProduct with n = ``--delta_product_steps`` keys per token (the key, then
  copies shifted by one position), a decay per token and write strengths per step."""
  n, rng = config.delta_product_steps, np.random.default_rng(_SEED + 2)
  steps = lambda x: jnp.stack([jnp.roll(x, j, axis=1) for j in range(n)], axis=2)  # noqa: E731
  B, T, K = config.batch, case.length, config.kv_heads
  draw = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
  beta = common.gate_from_normal(
      linattn_jax.TokenInput("beta", linattn_jax.Role.WRITE_STRENGTH), draw((B, T, n, K)))
  log_decay = common.gate_from_normal(
      linattn_jax.TokenInput("log_decay", linattn_jax.Role.DECAY), draw((B, T, K)))

  def attention(query, key, value, beta, log_decay):
    return linattn_jax.delta_product_attention(query, key, value, beta, log_decay=log_decay,
                                               is_causal=True, **config.options)

  args = (inputs.query, steps(inputs.key), steps(inputs.value))
  if case.mode == "forward":
    return attention, args + (beta, log_decay)
  return forward_backward(attention), args + (inputs.cotangent, beta, log_decay)


def log_linear_case(config: Config, case: Case, inputs: Inputs) -> tuple[Callable, tuple]:
  """Log-linear attention with ``L = bit_length(T - 1) + 1`` levels: scales in [0.5, 1] per
  query head and level, and a decay per token and head."""
  rng = np.random.default_rng(_SEED + 3)
  B, T, N, K = config.batch, case.length, config.heads, config.kv_heads
  level_scales = jnp.asarray(rng.uniform(0.5, 1.0, (B, T, N, (T - 1).bit_length() + 1)),
                             jnp.float32)
  log_decay = common.gate_from_normal(
      linattn_jax.TokenInput("log_decay", linattn_jax.Role.DECAY),
      jnp.asarray(rng.standard_normal((B, T, K), np.float32)))

  def attention(query, key, value, level_scales, log_decay):
    return linattn_jax.log_linear_attention(query, key, value, level_scales,
                                            log_decay=log_decay, is_causal=True, **config.options)

  args = (inputs.query, inputs.key, inputs.value)
  if case.mode == "forward":
    return attention, args + (level_scales, log_decay)
  return forward_backward(attention), args + (inputs.cotangent, level_scales, log_decay)


# A timed "step" call decodes this many tokens in one lax.scan, as a decoding
# loop inside jit does; records quote the time per token. A single tiny step
# per call would time Python dispatch (tens of µs, noisy on a shared machine).
DECODE_STEPS = 16


def decode_step(config: Config, case: Case, inputs: Inputs) -> tuple[Callable, tuple]:
  """``DECODE_STEPS`` streaming steps after a causal prefill of ``case.length`` tokens,
  and their arguments."""
  spec = linattn_jax.get_spec(case.variant)
  options = dict(config.options)
  if case.implementation is not None:
    options["implementation"] = case.implementation
  gates = dict(zip([x.name for x in spec.token_inputs],
                   gate_inputs(config, case, case.length), strict=True))
  prefill = jax.jit(functools.partial(spec.build(**options), is_causal=True, return_state=True))
  _, state = prefill(inputs.query, inputs.key, inputs.value, **gates)
  step = spec.streaming.step
  names = inspect.signature(step).parameters
  step = functools.partial(step, **{k: v for k, v in options.items() if k in names})
  last = tuple(x[:, -1] for x in (inputs.query, inputs.key, inputs.value))
  last_gates = {name: g[:, -1] for name, g in gates.items()}

  def decode(state, query, key, value, gates):
    def one(state, _):
      return step(state, query, key, value, **gates)
    return jax.lax.scan(one, state, length=DECODE_STEPS)

  return decode, (state, *last, last_gates)


def softmax_flops(batch: int, heads: int, length: int, key_length: int, head_dim: int,
                  value_dim: int, *, mode: str, causal: bool) -> float:
  """Useful floating-point operations of exact softmax attention.

  Forward: the two matmuls ``Q Kᵀ`` (``2·T·S·H`` per head) and ``P V``
  (``2·T·S·D``), i.e. ``4·B·N·T·S·H`` when D = H; halved when causal (about
  half the scores are visible). ``backward`` (forward plus backward) adds the
  four backward matmuls ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dQ = dS K``,
  ``dK = dSᵀ Q``, twice the forward: 3x the forward in all. Work an
  implementation chooses to redo (flash recomputes ``Q Kᵀ`` in its backward)
  is not useful and not counted; softmax and other elementwise work is
  ignored.
  """
  forward = 2.0 * batch * heads * length * key_length * (head_dim + value_dim)
  if causal:
    forward /= 2
  return forward if mode == "forward" else 3.0 * forward


def linear_flops(batch: int, heads: int, length: int, key_length: int, head_dim: int,
                 value_dim: int, *, mode: str, causal: bool) -> float:
  """Useful floating-point operations of kernel linear attention with M = H features.

  Forward ``4·B·N·T·M·D``: building the ``[M, D]`` summaries ``Σ φ(k) vᵀ``
  (``2·M·D`` per token) and reading them with ``φ(q)`` (``2·M·D`` per
  token), causal or not; ``backward`` (forward plus backward) counts 3x.
  Intra-chunk products of the chunked form are work an implementation
  chooses and are not counted.
  """
  del key_length, causal
  forward = 4.0 * batch * heads * length * head_dim * value_dim
  return forward if mode == "forward" else 3.0 * forward


# Useful-FLOP counters by registry name; variants not listed report no rate.
USEFUL_FLOPS: dict[str, Callable[..., float]] = {
    "softmax": softmax_flops,
    "flash": softmax_flops,
    "linear_elu": linear_flops,
    "linear_relu": linear_flops,
}


def case_flops(config: Config, case: Case) -> float | None:
  """Useful FLOPs of a case, or None when no counter is known for the variant."""
  B, N, T = config.batch, config.heads, case.length
  if case.kind == "matmul":
    return 2.0 * B * N * T * config.head_dim * config.value_dim
  if case.kind == "packed":  # The work a packed call skips is not counted against it.
    return None
  counter = softmax_flops if case.kind in ("xla", "masked") else USEFUL_FLOPS.get(case.variant)
  if counter is None:
    return None
  if case.mode == "step":  # One query against a state (linear) or T cached keys (softmax).
    return counter(B, N, 1, T, config.head_dim, config.value_dim, mode="forward", causal=False)
  return counter(B, N, T, T, config.head_dim, config.value_dim,
                 mode=case.mode, causal=config.causal)


# ------------------------------------------------------------ measurement ---


def physical_memory_bytes() -> int:
  """Physical RAM of this machine."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def compile_function(fn: Callable, args: Sequence[Any]) -> tuple[Any, float]:
  """``jax.jit(fn)`` lowered and compiled for ``args``, and the seconds it took."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - start


def memory_stats(compiled: Any) -> dict[str, int | None]:
  """Compiled temp/argument/output bytes (None where the backend does not say)."""
  try:
    stats = compiled.memory_analysis()
  except (NotImplementedError, RuntimeError):
    stats = None
  names = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
  return {name: getattr(stats, name, None) for name in names}


def time_executable(compiled: Any, args: Sequence[Any], *, warmup: int,
                    repeats: int) -> list[float]:
  """Seconds of each of ``repeats`` calls, after ``warmup`` untimed ones."""
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return times


def time_in_turns(calls: Sequence[tuple[Any, Sequence[Any]]], *, warmup: int,
                  repeats: int, rotate: bool = False,
                  calls_per_round: int = 1) -> list[list[float]]:
  """Seconds of each of ``repeats`` calls of every ``(compiled, args)``, made in turns (one
  call of each per round, after ``warmup`` untimed rounds): one list per executable.

  ``rotate``: each round starts one executable later, so that none always follows the
  same one (a large program slows the call after it). ``calls_per_round``: a round's time
  is the least of that many calls (a shared machine's bursts of load last about a call).
  """
  for _ in range(warmup):
    for compiled, args in calls:
      jax.block_until_ready(compiled(*args))
  times: list[list[float]] = [[] for _ in calls]
  n = len(calls)
  for r in range(repeats):
    for i in ((r + j) % n if rotate else j for j in range(n)):
      compiled, args = calls[i]
      spent = []
      for _ in range(calls_per_round):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        spent.append(time.perf_counter() - start)
      times[i].append(min(spent))
  return times


def measure(fn: Callable, args: Sequence[Any], config: Config,
            twin: tuple[Callable, Sequence[Any]] | None = None,
            twin_name: str = "unpacked") -> dict[str, Any]:
  """Compiles ``fn``, records its memory, and times it unless it needs too much.

  An argument may be a zero-argument callable (a large array such as a dense
  mask): it is compiled from its shape and only built if the case runs.
  ``twin``: a call and its arguments timed in turns with ``fn`` (:func:`time_in_turns`):
  for a packed case the same call without segment ids (``twin_name="unpacked"``), with
  ``--versus`` that variant's (``"versus"``); the record then also holds its times and
  ``ratio_vs_<twin_name>``, the ratio of the two medians.
  """
  abstract = [jax.eval_shape(a) if callable(a) else a for a in args]
  compiled, compile_s = compile_function(fn, abstract)
  memory = memory_stats(compiled)
  record: dict[str, Any] = {"compile_s": compile_s, "memory": memory}
  needed = sum(v for v in memory.values() if v is not None)
  if needed > config.max_memory_fraction * physical_memory_bytes():
    record["status"] = f"skipped: needs {needed / _GIB:.3g} GiB"
    return record
  concrete = [a() if callable(a) else a for a in args]
  if twin is None:
    times = time_executable(compiled, concrete, warmup=config.warmup, repeats=config.repeats)
  else:
    other, _ = compile_function(*twin)
    times, twin_times = time_in_turns([(compiled, concrete), (other, twin[1])],
                                      warmup=config.warmup, repeats=config.repeats)
    twin_median = statistics.median(twin_times)
    record.update({f"{twin_name}_times_s": twin_times, f"{twin_name}_median_s": twin_median,
                   f"ratio_vs_{twin_name}": statistics.median(times) / twin_median})
  record.update(status="ok", times_s=times, median_s=statistics.median(times),
                min_s=min(times))
  return record


def versus_case(config: Config, case: Case) -> Case | None:
  """The ``--versus`` variant's case timed in turns with ``case`` (None: none is)."""
  if (config.versus is None or case.kind not in ("attention", "delta_product", "log_linear")
      or case.mode == "step" or case.variant == config.versus):
    return None
  offered = linattn_jax.get_spec(config.versus).implementations
  implementation = case.implementation if case.implementation in offered else None
  return Case("attention", config.versus, implementation, case.length, case.mode)


def run_case(config: Config, case: Case, inputs: Inputs) -> dict[str, Any]:
  """The record of one case; failures are recorded, not raised."""
  record: dict[str, Any] = {**case._asdict(), "key_length": case.length, "status": None}
  if case.kind == "xla" and config.head_dim != config.value_dim:
    record["status"] = "skipped: dot_product_attention needs value_dim == head_dim"
    return record
  try:
    if case.kind == "packed":
      twin, twin_name = case_function(config, case._replace(kind="attention"), inputs), "unpacked"
    elif versus_case(config, case) is not None:
      twin, twin_name = case_function(config, versus_case(config, case), inputs), "versus"
      record["versus"] = config.versus
    else:
      twin, twin_name = None, "unpacked"
    record.update(measure(*case_function(config, case, inputs), config, twin, twin_name))
  except Exception as e:  # One failed case (e.g. out of memory) must not end the sweep.
    first_line = next(iter(str(e).splitlines()), "")
    record["status"] = f"error: {type(e).__name__}: {first_line[:200]}"
  if case.mode == "step" and record.get("status") == "ok":  # Per token, not per call.
    record["steps_per_call"] = DECODE_STEPS
    record["times_s"] = [t / DECODE_STEPS for t in record["times_s"]]
    record["median_s"] /= DECODE_STEPS
    record["min_s"] /= DECODE_STEPS
  record["flops"] = case_flops(config, case)
  if record["flops"] is not None and "median_s" in record:
    record["gflops"] = record["flops"] / record["median_s"] / 1e9
  return record


def add_ratios(record: dict[str, Any], earlier: Sequence[dict[str, Any]]) -> None:
  """Adds ``ratio_vs_xla``, ``ratio_vs_masked_xla``, ``memory_vs_masked_xla`` and
  ``fraction_of_matmul_rate`` from same-length baselines (a packed case's
  ``ratio_vs_unpacked`` comes from :func:`measure`)."""
  if record["kind"] == "matmul":
    return
  for base in earlier:
    if base["length"] != record["length"]:
      continue
    same_mode = base["mode"] == record["mode"]
    twin = (base["kind"] == "masked" and same_mode and record["kind"] == "attention"
            and base["variant"] == record["variant"])
    if twin:  # Compiled memory is known even for a baseline too big to run.
      temp, base_temp = ((r.get("memory") or {}).get("temp_size_in_bytes")
                         for r in (record, base))
      if temp is not None and base_temp:
        record["memory_vs_masked_xla"] = temp / base_temp
    if base.get("status") != "ok" or "median_s" not in record:
      continue
    if base["kind"] == "xla" and same_mode:
      record["ratio_vs_xla"] = record["median_s"] / base["median_s"]
    if twin:
      record["ratio_vs_masked_xla"] = record["median_s"] / base["median_s"]
    if base["kind"] == "matmul" and "gflops" in record and "gflops" in base:
      record["matmul_gflops"] = base["gflops"]
      record["fraction_of_matmul_rate"] = record["gflops"] / base["gflops"]


# ---------------------------------------------------------------- output ---

_ROW_START = "{:>9} {:<10} {:<10} {:>6} {:<9}"
_ROW_END = " {:>10} {:>7} {:>8} {:>8} {:>9} {:>9}  {}"


def print_header() -> None:
  """Prints the column titles of the progress table."""
  start = _ROW_START.format("case", "variant", "impl", "T", "mode")
  end = _ROW_END.format("median_ms", "x_xla", "x_masked", "x_turns", "GFLOP/s", "temp_MiB",
                        "status")
  print(start + end, flush=True)


def print_row_start(index: int, total: int, case: Case) -> None:
  """Prints the case's name before it runs (the line ends when it finishes)."""
  impl = (case.implementation or "-") + ("+packed" if case.kind == "packed" else "")
  print(_ROW_START.format(f"[{index}/{total}]", case.variant, impl, case.length, case.mode),
        end="", flush=True)


def print_row_end(record: dict[str, Any]) -> None:
  """Completes the case's table line with its results."""
  temp = (record.get("memory") or {}).get("temp_size_in_bytes")
  print(_ROW_END.format(
      _format(record.get("median_s"), 1e3, ".3f"),
      _format(record.get("ratio_vs_xla"), 1, ".2f"),
      _format(record.get("ratio_vs_masked_xla"), 1, ".3f"),
      _format(record.get("ratio_vs_unpacked", record.get("ratio_vs_versus")), 1, ".3f"),
      _format(record.get("gflops"), 1, ".1f"),
      _format(temp, 1 / _MIB, ".1f"),
      record["status"],
  ), flush=True)


def _format(value: float | None, factor: float, spec: str) -> str:
  return "-" if value is None else format(value * factor, spec)


def run_metadata(config: Config) -> dict[str, Any]:
  """Versions, machine and configuration of this run."""
  device = jax.devices()[0]
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "jax_version": jax.__version__,
      "linattn_jax_version": linattn_jax.__version__,
      "backend": jax.default_backend(),
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "cpu_count": os.cpu_count(),
      "physical_memory_bytes": physical_memory_bytes(),
      "config": dataclasses.asdict(config),
  }


def _label(record: dict[str, Any]) -> str:
  impl = record["implementation"]
  label = record["variant"] if impl is None else f"{record['variant']}/{impl}"
  return f"{label}+packed" if record["kind"] == "packed" else label


def _series(records: Sequence[dict[str, Any]],
            value: Callable[[dict], float | None]) -> dict[str, tuple[list, list]]:
  """``{label: (lengths, values)}`` of the records whose value is positive."""
  out: dict[str, tuple[list, list]] = {}
  for record in records:
    y = value(record)
    if y is not None and y > 0:
      xs, ys = out.setdefault(_label(record), ([], []))
      xs.append(record["length"])
      ys.append(y)
  return out


def _draw_log_log(ax: Any, series: Mapping[str, tuple[list, list]], ylabel: str,
                  title: str) -> None:
  """A line per series on log-log axes; the XLA baseline is black and dashed."""
  for name, (xs, ys) in sorted(series.items()):
    style = {"color": "black", "linestyle": "--"} if name.startswith(XLA_VARIANT) else {}
    ax.plot(xs, ys, marker="o", label=name, **style)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length T (= S)")
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize="medium")
  ax.grid(True, which="both", alpha=0.3)
  if series:
    ax.legend(fontsize="small")


def write_plots(output_dir: pathlib.Path, records: Sequence[dict[str, Any]],
                config: Config) -> list[pathlib.Path]:
  """Writes ``time_<mode>.png`` and ``memory.png`` (a panel per mode); returns their paths."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plots written.", flush=True)
    return []
  shape = (f"B={config.batch} N={config.heads} K={config.kv_heads} H={config.head_dim} "
           f"D={config.value_dim} {config.dtype} causal={config.causal}")
  by_mode = {mode: [r for r in records if r["kind"] != "matmul" and r["mode"] == mode]
             for mode in config.modes}
  paths = []
  for mode, cases in by_mode.items():
    fig, ax = plt.subplots(figsize=(7, 5))
    timed = [r for r in cases if r["status"] == "ok"]
    _draw_log_log(ax, _series(timed, lambda r: r["median_s"]), "median time (s)",
                  f"{mode}: {shape}")
    paths.append(_save(plt, fig, output_dir / f"time_{mode}.png"))
  fig, axes = plt.subplots(1, len(by_mode), figsize=(7 * len(by_mode), 5), squeeze=False)
  for ax, (mode, cases) in zip(axes[0], by_mode.items(), strict=True):
    temp = _series(cases, lambda r: (r.get("memory") or {}).get("temp_size_in_bytes"))
    _draw_log_log(ax, temp, "compiled temp bytes", f"{mode} memory: {shape}")
  paths.append(_save(plt, fig, output_dir / "memory.png"))
  return paths


def _save(plt: Any, fig: Any, path: pathlib.Path) -> pathlib.Path:
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ------------------------------------------------------------------- main ---


def run_benchmark(config: Config) -> dict[str, Any]:
  """Runs every planned case, printing the table and writing the JSON; returns the report."""
  output_dir = pathlib.Path(config.output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  json_path = output_dir / "benchmark.json"
  report: dict[str, Any] = {"metadata": run_metadata(config), "cases": []}
  cases = plan_cases(config)
  print_header()
  numbered = enumerate(cases, start=1)
  for length, group in itertools.groupby(numbered, key=lambda item: item[1].length):
    inputs = make_inputs(config, length)
    for index, case in group:
      print_row_start(index, len(cases), case)
      record = run_case(config, case, inputs)
      add_ratios(record, report["cases"])
      report["cases"].append(record)
      print_row_end(record)
      common.write_json(json_path, report)
    del inputs
    jax.clear_caches()
  print(f"wrote {json_path}", flush=True)
  if config.plot:
    for path in write_plots(output_dir, report["cases"], config):
      print(f"wrote {path}", flush=True)
  return report


def failed_cases(report: dict[str, Any]) -> list[dict[str, Any]]:
  """The records whose case raised (a skip for lack of memory is not a failure)."""
  return [r for r in report["cases"] if str(r["status"]).startswith("error")]


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  failed = failed_cases(run_benchmark(config_from_flags()))
  if failed:  # Every case ran and was written; the run still fails, loudly.
    for r in failed:
      print(f"FAILED {r['variant']} {r['implementation']} T={r['length']} {r['mode']}: "
            f"{r['status']}", flush=True)
    sys.exit(f"{len(failed)} benchmark case(s) failed.")


if __name__ == "__main__":
  common.run(main)
