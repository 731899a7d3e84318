"""Inputs, tolerances and spec helpers shared by the tests."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from linattn_jax._src.checks import Dims, accumulation_dtype

# (atol, rtol) of a fast implementation against its oracle, per input dtype.
# The oracle runs on the same (already rounded) inputs, so the budget covers
# only the fast path's own rounding: float32 blockwise sums, and for 16-bit
# inputs the final cast of the output (bf16 keeps 8 bits, f16 11).
TOLERANCE = {
    jnp.dtype(jnp.float64): (1e-10, 1e-10),
    jnp.dtype(jnp.float32): (2e-5, 2e-5),
    jnp.dtype(jnp.float16): (4e-3, 4e-3),
    jnp.dtype(jnp.bfloat16): (3e-2, 3e-2),
}
# Gradients add a few more roundings than outputs.
GRAD_TOLERANCE = {
    jnp.dtype(jnp.float64): (1e-9, 1e-9),
    jnp.dtype(jnp.float32): (1e-4, 1e-4),
    jnp.dtype(jnp.float16): (2e-2, 2e-2),
    jnp.dtype(jnp.bfloat16): (1e-1, 1e-1),
}


class Shape(Dims):
  """Sizes of one test case, in the toolkit's letters (the library's ``Dims``)."""

  __slots__ = ()

  def __str__(self) -> str:
    return f"B{self.B}T{self.T}S{self.S}N{self.N}K{self.K}H{self.H}D{self.D}"


# Odd lengths, T < S, T > S, GQA (K < N), MQA (K = 1), D != H.
SHAPES = (
    Shape(B=2, T=13, S=13, N=4, K=2, H=8, D=8),
    Shape(B=1, T=7, S=19, N=3, K=1, H=8, D=5),
    Shape(B=2, T=19, S=11, N=2, K=2, H=4, D=6),
)
TINY = Shape(B=1, T=5, S=5, N=2, K=1, H=3, D=2)


def host_array(x, dtype) -> jax.Array:
  """``x`` cast to ``dtype`` in numpy, then placed on the device: ``jnp.asarray(x, dtype)``
  compiles a program per shape (a cast, or, for an array of the dtype, ``lax.stage``)."""
  return jax.device_put(np.asarray(x, dtype))


def make_qkv(shape: Shape, dtype: Any = jnp.float32, seed: int = 0, amplitude: float = 1.0):
  """Random normal query, key and value of ``shape`` (cast to ``dtype``)."""
  rng = np.random.default_rng(seed)
  dims = ((shape.B, shape.T, shape.N, shape.H), (shape.B, shape.S, shape.K, shape.H),
          (shape.B, shape.S, shape.K, shape.D))
  return tuple(host_array(amplitude * rng.standard_normal(d), dtype) for d in dims)


def kv_lengths(shape: Shape) -> jax.Array:
  """Per-example key lengths: a short one, (B > 1) an empty one, (B > 2) a full one.

  Full rows without padding are what ``lengths=None`` runs; an empty row
  must give zeros (and zero, finite gradients), not NaN.
  """
  choices = [max(1, shape.S // 3), 0, shape.S]
  return host_array([choices[b % 3] for b in range(shape.B)], np.int32)


def cotangent(out: jax.Array, seed: int = 1) -> jax.Array:
  """A fixed random output cotangent, so that gradients see every entry."""
  rng = np.random.default_rng(seed)
  return host_array(rng.standard_normal(out.shape), out.dtype)


def assert_close(actual, expected, dtype, table=None, err_msg: str = "") -> None:
  atol, rtol = (table or TOLERANCE)[jnp.dtype(dtype)]
  np.testing.assert_allclose(
      np.asarray(actual, np.float64), np.asarray(expected, np.float64),
      atol=atol, rtol=rtol, err_msg=err_msg,
  )


def example_layout(num_q_blocks: int, num_k_blocks: int) -> np.ndarray:
  """A block-sparse layout for any length: block diagonal, first column, one off-diagonal."""
  a = np.arange(num_q_blocks)[:, None] + (num_k_blocks - num_q_blocks)
  b = np.arange(num_k_blocks)[None, :]
  return (b == a) | (b == 0) | (b == a - 2)


class SuiteSettings(NamedTuple):
  """How the shared suite runs one built-in variant on its small shapes."""

  options: Mapping[str, Any] = MappingProxyType({})  # Small blocks and chunks, so that
  # several and a partial one are exercised.
  implementations: tuple[str | None, ...] | None = None  # None: every one the spec lists.


# A registered variant not listed here runs with its defaults and every implementation.
# The recurrent core runs in every form through "performer" (its running-max stabiliser
# is the general case); the entries that swap one ingredient (a feature map, a read
# rule) run their summary and default causal forms (and Shen's read its scan form).
_CORE_FORMS = ("parallel", "chunked")
SUITE_SETTINGS: dict[str, SuiteSettings] = {
    "bigbird": SuiteSettings({"block_size": 2, "num_window_blocks": 3, "num_global_blocks": 1,
                              "num_random_blocks": 1, "rng": 0}),
    "block_sparse": SuiteSettings({"layout": example_layout, "block_size": 3}),
    # Its oracle is judged by its own tests; the default dispatch by test_efficient.
    "efficient": SuiteSettings({"chunk_size": 4}, ("parallel", "scan", "chunked")),
    "flash": SuiteSettings({"block_q": 4, "block_k": 8}),
    # Positions re-weight the ReLU kernel over L = 40 (tests/parallel runs T = 37).
    "cosformer": SuiteSettings({"chunk_size": 4, "max_length": 40}, _CORE_FORMS),
    # The gated recurrences run their default, chunked form (with its checkpointed chunk
    # scan and, for the delta rule, the WY triangular inverse) and, through the streaming
    # steps, their scan form. Their oracles are judged, and every form of each runs, against the
    # float64 token recurrence in tests/ops/test_gated.py (outputs, states, gradients);
    # here each variant's registry entry (its gates, fixed decays, summaries) meets every
    # test of the suite once (test_dplr.py judges dplr's and rwkv7's forms alike).
    **{name: SuiteSettings({"chunk_size": 4}, ("chunked",))
       for name in ("retention", "simple_gla", "gla", "delta_net", "gated_delta_net", "kda",
                    "dplr", "rwkv7")},
    # Heinsen's per-feature log-scale in the summary (whole-sequence prefix) form and the
    # chunked one; its scan form runs through the streaming step.
    "heinsen": SuiteSettings({"chunk_size": 4}, _CORE_FORMS),
    "linear_elu": SuiteSettings({"chunk_size": 4}, _CORE_FORMS),
    "linear_learned": SuiteSettings({"chunk_size": 4, "num_features": 6}, _CORE_FORMS),
    "linear_relu": SuiteSettings({"chunk_size": 4}, _CORE_FORMS),
    "local": SuiteSettings({"window_size": (3, 2), "block_size": 4}),
    "longformer": SuiteSettings({"window_size": (2, 1), "global_positions": (0, 3),
                                 "block_size": 4}),
    "performer": SuiteSettings({"chunk_size": 4, "num_features": 16}),
    # Signed features: some rows' normalisers nearly cancel; judged by their conditioning.
    "random_fourier": SuiteSettings({"chunk_size": 4, "num_features": 16}, _CORE_FORMS),
    "strided": SuiteSettings({"stride": 3, "window_size": (2, 1), "block_size": 4}),
}


def suite_options(spec) -> dict[str, Any]:
  """The options the suite calls ``spec`` with (its small-shape settings)."""
  return dict(SUITE_SETTINGS.get(spec.name, SuiteSettings()).options)


# Set from ``--full`` (conftest.py) before the test modules are collected.
FULL_GRID = False


def covering_grid(slots: Sequence[Any], shapes: Sequence[Any], *, offset: int = 0,
                  full: bool | None = None) -> list[tuple[Any, Any]]:
  """``(slot, shape)`` pairs in which every slot and every shape appears.

  With ``full`` (default: ``--full``) every pair, the product. Otherwise the slots and
  the shapes are dealt out together, ``max(len(slots), len(shapes))`` pairs, the shapes
  starting at ``offset`` (a variant's index, so that variants with one slot per
  implementation do not always give the same implementation the same shape). This is
  the parity test's default: each implementation of each variant on one shape, each
  variant on every shape; ``--full`` runs the product (as JAX's own suite samples its
  test grids and runs them whole on demand).

  >>> covering_grid(["a", "b"], [1, 2, 3], full=False)
  [('a', 1), ('b', 2), ('a', 3)]
  >>> len(covering_grid(["a", "b"], [1, 2, 3], full=True))
  6
  """
  if FULL_GRID if full is None else full:
    return list(itertools.product(slots, shapes))
  count = max(len(slots), len(shapes))
  return [(slots[i % len(slots)], shapes[(i + offset) % len(shapes)]) for i in range(count)]


def layer_paths(names: Sequence[str]) -> list[str]:
  """The first of ``names`` for each path a layer takes to a variant: its decode cache, a
  pattern (and whether a decoded row gathers its keys) or not, exact softmax or not, arrays
  it owns, per-token inputs it projects, and a positional state.

  The layer tests that check what the layer adds (its cache's bookkeeping, segment ids
  reaching the call, gradients that stay in their document) run these; those that check
  each variant's own decode or packed path run every name, and the shared suite checks
  each variant's function (packed, streamed, split) against its oracle.
  """
  seen, chosen = set(), []
  for name in names:
    spec = la.get_spec(name)
    path = (spec.cache_kind, spec.dense_mask is not None, spec.decode_rows is not None,
            spec.full_softmax,
            spec.params is not None, bool(spec.token_inputs),
            spec.streaming is not None and spec.streaming.positional)
    if path not in seen:
      seen.add(path)
      chosen.append(name)
  return chosen


class Case(NamedTuple):
  """One registered implementation the suite runs."""

  spec: Any
  implementation: str | None

  @property
  def id(self) -> str:
    return self.spec.name if self.implementation is None else (
        f"{self.spec.name}-{self.implementation}")


def spec_cases() -> list[Case]:
  """A :class:`Case` for every implementation of every registered variant.

  A variant with ``token_inputs`` runs as :func:`deriving_inputs` makes it.
  """
  cases = []
  for spec in map(la.get_spec, la.available_attentions()):
    chosen = SUITE_SETTINGS.get(spec.name, SuiteSettings()).implementations
    spec = deriving_inputs(spec)
    cases += [Case(spec, impl) for impl in (chosen or spec.implementations)]
  return cases


# Per-token inputs from the key, by role and shape (last axis H of the key or of one token's).
_DERIVED = {
    # A decay per head, exp(-softplus(k_0 - 2)): about 0.88 for k_0 = 0, so the carried state
    # matters across several chunks of 4; a large key resets.
    (la.Role.DECAY, False): lambda k: -jax.nn.softplus(k[..., 0] - 2.0),
    # A decay per key feature, sigmoid(k)^(1/4): about 0.84 for k = 0.
    (la.Role.DECAY, True): lambda k: jax.nn.log_sigmoid(k) / 4.0,
    # Write strengths in (0, 1).
    (la.Role.WRITE_STRENGTH, False): lambda k: jax.nn.sigmoid(k[..., 1]),
    # A low-rank transition b aᵀ as RWKV-7's: a = -κ̂ and b = κ̂ ⊙ σ(k) for the unit κ̂ of k,
    # so the state's part along κ̂ shrinks by the rate σ(k) and nothing grows.
    (la.Role.TRANSITION_READ, True): lambda k: -_unit(k),
    (la.Role.TRANSITION_WRITE, True): lambda k: _unit(k) * jax.nn.sigmoid(k),
}


def _unit(k):
  return k / jnp.sqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)


def deriving_inputs(spec):
  """``spec`` with its ``token_inputs`` (gates, betas) derived from the key, as a layer would.

  The shared suite calls every variant as ``fn(q, k, v, is_causal=...,
  key_value_seq_lengths=...)``. For a spec that declares per-token inputs,
  every entry point the suite calls (function, oracle, streaming ``step`` and
  ``summarize``) is wrapped by :func:`with_derived_inputs`. The fast
  function and its oracle get the same wrapper, so parity still judges the
  implementation; a key's gates are as future as the key, so the causality
  tests still hold; and gradients reach the gates through ``k``. The wrapped
  spec declares no ``token_inputs``. A spec without extra inputs is returned
  as it is.
  """
  if not spec.token_inputs:
    return spec
  wrap = functools.partial(with_derived_inputs, spec)
  streaming = spec.streaming
  if streaming is not None:
    streaming = dataclasses.replace(
        streaming, step=wrap(streaming.step, key_at=2),
        summarize=None if streaming.summarize is None else wrap(streaming.summarize, key_at=0))
  return dataclasses.replace(spec, function=wrap(spec.function),
                             reference=wrap(spec.reference), streaming=streaming,
                             token_inputs=())


def with_derived_inputs(spec, fn, key_at: int = 1):
  """``fn``, which takes ``spec``'s per-token inputs by name, computing them from its key.

  The key is the positional argument at ``key_at``. The inputs are computed
  position by position, in float32 (float64 for float64 keys) whatever the
  key's dtype:

  - a decay per head ``[B, S, K]``: ``-softplus(k[..., 0] - 2)``;
  - a decay per key feature ``[B, S, K, H]``: ``log_sigmoid(k) / 4``;
  - a write strength ``[B, S, K]``: ``sigmoid(k[..., 1])``;
  - a low-rank transition's ``a`` and ``b`` ``[B, S, K, H]``: ``-κ̂`` and ``κ̂ ⊙ sigmoid(k)``
    for ``κ̂ = k / |k|`` (RWKV-7's form);

  and a spec with a write strength (a delta rule: its role wants unit keys) gets keys
  scaled to a norm in
  ``[1/√2, √2]``, since the raw delta rule grows without bound for
  ``β |k|² > 2``: scaled by a power of two, not divided by the norm, so that a
  16-bit key and its float32 copy (which the stress tests give the oracle)
  give the same scaled key, exactly. A gated variant of your own whose inputs have
  these roles and shapes runs as it is (another needs a rule in ``_DERIVED``).
  ``fn`` itself for a spec without per-token inputs.
  """
  if not spec.token_inputs:
    return fn
  derived = _deriver(spec.name, spec.token_inputs)

  def wrapped(*args, **kwargs):
    if len(args) <= key_at or jnp.ndim(args[key_at]) < 2:
      return fn(*args, **kwargs)  # Not enough to derive from: the function names the ranks.
    key, gates = derived(jnp.asarray(args[key_at]))
    return fn(*args[:key_at], key, *args[key_at + 1:], **gates, **kwargs)

  names = {x.name for x in spec.token_inputs}
  signature = inspect.signature(fn)
  wrapped.__signature__ = signature.replace(
      parameters=[p for p in signature.parameters.values() if p.name not in names])
  wrapped.__name__ = getattr(fn, "__name__", spec.name)
  return wrapped


@functools.cache
def _deriver(name: str, token_inputs: tuple[la.TokenInput, ...]):
  """``key -> (key, inputs)`` for :func:`with_derived_inputs`, one program per key shape
  (also where the suite calls the oracle eagerly)."""
  unknown = [x for x in token_inputs if (x.role, x.per_feature) not in _DERIVED]
  if unknown:
    raise ValueError(f"{name}: no rule derives {unknown} from the key; add one to _DERIVED.")
  normalise = any(x.role.unit_keys for x in token_inputs)

  @jax.jit
  def derived(key):
    k32 = key.astype(accumulation_dtype(key.dtype))
    gates = {x.name: _DERIVED[(x.role, x.per_feature)](k32) for x in token_inputs}
    if normalise:  # Exact in every dtype: the scale is 2^-round(log2 |k|).
      norm = jnp.sqrt(jnp.sum(k32 * k32, axis=-1, keepdims=True))
      key = key * jax.lax.stop_gradient(jnp.exp2(-jnp.round(jnp.log2(norm)))).astype(key.dtype)
    return key, gates
  return derived


def build(spec, impl, **options):
  """(fast, oracle) for one spec/implementation with the suite's options."""
  options = {**suite_options(spec), **options}
  if impl is not None:
    options["implementation"] = impl
  return spec.build(**options), spec.build_reference(**options)


def largest_intermediate(jaxpr) -> int:
  """Element count of the largest value a jaxpr (and its sub-jaxprs) produces."""
  size = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      size = max(size, int(np.prod(var.aval.shape)) if var.aval.shape else 1)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      size = max(size, largest_intermediate(sub))
  return size


# Judging by conditioning ---------------------------------------------------------
#
# A kernel variant computes ``out_td = num_td / den_t`` with
# ``num_td = Σ_j w_tj v_jd`` and ``den_t = Σ_j w_tj + eps``, and each weight
# ``w_tj`` is itself a sum of M feature products. Any order of float32
# summation gives ``|δnum_td| <= γ Σ_j a_tj |v_jd|`` and ``|δden_t| <= γ Σ_j a_tj``,
# with ``a_tj`` the summed magnitudes of the terms forming ``w_tj`` (the
# spec's ``ImpliedWeights.magnitudes``) and ``γ`` a small multiple of the unit
# roundoff u (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1).
# To first order, then,
#
#     |δout_td| <= γ (Σ_j a_tj |v_jd| + |out_td| Σ_j a_tj) / |den_t|.
#
# For positive features a = w, and this is γ times (the weighted mean of
# |v| + |out|): a fixed tolerance. For signed (random Fourier) features the
# normaliser can cancel, ``Σ a / |den|`` is the row's condition number, and
# two correct float32 programs may honestly differ by that much.

# γ / u. The blocked and pairwise sums here stay far below the worst case
# n·u: over 20 input seeds, every shape, mode and implementation, the fast
# paths and the float32 oracle stay within 6.1 u of the bound's terms.
CONDITIONING_FACTOR = 16.0


def unit_roundoff(dtype) -> float:
  """u = 2^-(p) for a dtype with p bits of significand (float32: 2^-24)."""
  return 2.0 ** -(jnp.finfo(dtype).nmant + 1)


def conditioning_bound(weights, value, out, dtype) -> np.ndarray:
  """Per-element error bound ``[B, T, N, D]`` of a kernel variant's output (see above).

  ``weights`` is the spec's ``ImpliedWeights`` (``[B, N, T, S]``) and ``out``
  the exact output, both float64; ``value`` is ``[B, S, K, D]``. Computation
  runs in float32 for 16-bit inputs, whose outputs are rounded once more to
  ``dtype`` at the end.
  """
  a = np.asarray(weights.magnitudes, np.float64)
  G = a.shape[1] // value.shape[2]
  abs_v = np.repeat(np.abs(np.asarray(value, np.float64)), G, axis=2)  # [B, S, N, D]
  abs_out = np.abs(np.asarray(out, np.float64))
  row = lambda x: np.asarray(x, np.float64).transpose(0, 2, 1)[..., None]  # noqa: E731
  terms = np.einsum("bnts,bsnd->btnd", a, abs_v) + abs_out * row(a.sum(-1))
  den = np.abs(row(weights.normalizer))
  scaled = np.divide(terms, den, out=np.zeros_like(terms), where=terms > 0)
  u_compute = unit_roundoff(accumulation_dtype(dtype))
  final_rounding = unit_roundoff(dtype) * abs_out + float(jnp.finfo(dtype).smallest_subnormal) / 2
  return CONDITIONING_FACTOR * u_compute * scaled + final_rounding


_ORACLE_PROGRAMS: dict[Any, Any] = {}


def _oracle_program(spec, what, kind: Any, is_causal: bool, make):
  """``jax.jit(make())``, one per (variant, options, kind, mode) while options are hashable.

  Eager dispatch would compile each of an oracle's ops on its own, and many
  tests judge by the same oracle on the same shapes: sharing one compiled
  program per case is most of the suite's speed. Lengths are arguments.
  """
  try:
    key = (spec, tuple(sorted(what.items())), kind, is_causal)
    hash(key)
  except TypeError:  # Options holding arrays: compiled per call.
    return jax.jit(make())
  if key not in _ORACLE_PROGRAMS:
    _ORACLE_PROGRAMS[key] = jax.jit(make())
  return _ORACLE_PROGRAMS[key]


def _oracle_forward(spec, what, is_causal: bool, with_weights: bool):
  """The compiled oracle ``(q, k, v, lengths) -> (out, weights or None)``."""
  def make():
    oracle = spec.build_reference(**what)

    def run(q, k, v, lengths):
      out = oracle(q, k, v, is_causal=is_causal, key_value_seq_lengths=lengths)
      if not with_weights:
        return out, None
      return out, spec.weights(q, k, is_causal=is_causal, key_value_seq_lengths=lengths, **what)
    return run
  return _oracle_program(spec, what, ("output", with_weights), is_causal, make)


def oracle_output(spec, options, q, k, v, is_causal, lengths):
  """The spec's oracle on ``q, k, v``: float64 on the same rounded inputs when it judges
  by weights, else at least float32 (the fast paths' own accumulation, so that the
  table's budget is their rounding alone, and 16-bit inputs share the float32 program).

  Returns ``(out, weights)``; ``weights`` is None for variants judged by the table.
  """
  what = spec.what_options({**suite_options(spec), **options})
  with_weights = spec.weights is not None
  run = _oracle_forward(spec, what, is_causal, with_weights)
  if not with_weights:
    compute = accumulation_dtype(q.dtype)
    return run(*(host_array(x, compute) for x in (q, k, v)), lengths)
  with jax.enable_x64(True):
    out, weights = run(*(host_array(x, np.float64) for x in (q, k, v)), lengths)
    return np.asarray(out), jax.tree.map(np.asarray, weights)


def _assert_within(got, want, bound, dtype, what: str, err_msg: str) -> None:
  """``|got - want| <= bound`` element-wise; ±inf passes only where rounding may overflow.

  Where a signed normaliser nearly cancels, the exact value can exceed a
  16-bit dtype's range; the result may then be ±inf, but only with the
  exact value's sign and where ``|want| + bound`` reaches the dtype's max.
  """
  got = np.asarray(got, np.float64)
  excess = np.abs(got - want) - bound
  overflow = (np.isinf(got) & (np.sign(got) == np.sign(want))
              & (np.abs(want) + bound >= float(jnp.finfo(dtype).max)))
  excess = np.where(overflow, -np.inf, np.where(np.isnan(got), np.inf, excess))
  if np.any(excess > 0):
    i = np.unravel_index(np.argmax(excess), excess.shape)
    raise AssertionError(
        f"{err_msg} {what}: {np.sum(excess > 0)} of {excess.size} elements exceed the "
        f"conditioning bound; worst at {i}: got {got[i]:.9g}, float64 oracle {want[i]:.9g}, "
        f"bound {bound[i]:.3g}.")


def assert_matches_oracle(got, spec, q, k, v, *, is_causal, lengths=None, options=None,
                          err_msg: str = "") -> None:
  """Judges ``got`` (a fast path's output on ``q, k, v``) against the spec's oracle.

  Variants with ``weights`` are judged against the float64 oracle on the
  same rounded inputs, element by element within :func:`conditioning_bound`;
  the others against the oracle in float32 (float64 for float64 inputs) on
  the same rounded inputs, within the input dtype's ``TOLERANCE`` (their
  normalisers are sums of positive terms).
  """
  want, weights = oracle_output(spec, options or {}, q, k, v, is_causal, lengths)
  _judge_output(got, want, weights, q.dtype, v, err_msg)


def _judge_output(got, want, weights, dtype, v, err_msg: str) -> None:
  dtype = jnp.dtype(dtype)
  if weights is None:
    assert_close(got, want, dtype, err_msg=err_msg)
    return
  _assert_within(got, want, conditioning_bound(weights, v, want, dtype), dtype, "output",
                 err_msg)


def assert_stress_output_matches_oracle(got, spec, q, k, v, *, is_causal, lengths, amplitude,
                                        err_msg: str = "") -> None:
  """Judges outputs on stress inputs (16-bit, entries of size ``amplitude``).

  Signed weights keep :func:`conditioning_bound`. For the other variants,
  the feature maps' own rounding (FAVOR+ exponents of size ``|x|²``) is not
  in that bound's model: compare to the float32 oracle within ``TOLERANCE``
  scaled by the amplitude, and require finite outputs wherever the oracle's
  value fits the dtype. Variants without a normaliser (the gated
  recurrences) can exceed float16's range here: there ±inf of the oracle's
  sign is the correctly rounded output.
  """
  dtype = jnp.dtype(q.dtype)
  if spec.weights is not None:
    want, weights = oracle_output(spec, {}, q, k, v, is_causal, lengths)
    if signed_weights(weights):
      _assert_within(got, want, conditioning_bound(weights, v, want, dtype), dtype, "output",
                     err_msg)
      return
  run = _oracle_forward(spec, spec.what_options(suite_options(spec)), is_causal, False)
  want, _ = run(*(x.astype(jnp.float32) for x in (q, k, v)), lengths)
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  atol, rtol = TOLERANCE[dtype]
  fits = np.abs(want) * (1 + rtol) + atol * amplitude < float(jnp.finfo(dtype).max)
  assert np.all(np.isfinite(got[fits])), f"{err_msg} output not finite"
  overflow = ~fits & np.isinf(got) & (np.sign(got) == np.sign(want))
  np.testing.assert_allclose(np.where(overflow, want, got), want, atol=atol * amplitude,
                             rtol=rtol, err_msg=err_msg)


# Gradients -------------------------------------------------------------------------
#
# To first order, a float32 program's gradient is the exact gradient of the
# same maths at weights, numerators and normalisers perturbed by their
# rounding: ``w_tj + ε_tj a_tj``, ``num_td + ν_td Σ_j a_tj |v_jd|`` and
# ``den_t + δ_t Σ_j a_tj``, each perturbation within γ. The gradient's error
# is then within ``γ Σ_p |∂g/∂p|`` over all those unit perturbations p,
# which ``jax.jacfwd`` computes exactly in float64. Where the normaliser
# cancels this term carries the 1/den² the gradient picks up; for positive
# features it is below the fixed table, so only signed weights pay for it.


def signed_weights(weights) -> bool:
  """Whether a kernel variant's ``ImpliedWeights`` hold terms of both signs (their
  normalisers can cancel: judged by conditioning)."""
  return bool(np.any(np.asarray(weights.magnitudes)
                     > np.abs(np.asarray(weights.weights)) * (1 + 1e-9)))


def gradient_sensitivity(spec, what, q, k, v, *, is_causal, lengths, ct):
  """``Σ_p |∂g/∂p|`` for each gradient element (float64; see above)."""
  G = q.shape[2] // k.shape[2]

  def perturbed_gradient(perturbation):
    epsilon, nu, delta = perturbation  # [B, N, T, S], [B, T, N, D], [B, N, T].

    def loss(q, k, v):
      weights = spec.weights(q, k, is_causal=is_causal, key_value_seq_lengths=lengths, **what)
      a = jax.lax.stop_gradient(weights.magnitudes)
      w = weights.weights + epsilon * a
      v_n = jnp.repeat(v, G, axis=2)  # [B, S, N, D]
      num = (jnp.einsum("bnts,bsnd->btnd", w, v_n)
             + nu * jnp.einsum("bnts,bsnd->btnd", a, jnp.abs(v_n)))
      den = weights.normalizer + jnp.sum(epsilon * a, -1) + delta * jnp.sum(a, -1)
      return jnp.sum(ct * num / den.transpose(0, 2, 1)[..., None])

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  B, T, N, _ = q.shape
  S, D = k.shape[1], v.shape[-1]
  zeros = tuple(jnp.zeros(s, q.dtype) for s in ((B, N, T, S), (B, T, N, D), (B, N, T)))
  jacobian = jax.jacfwd(perturbed_gradient)(zeros)
  return tuple(sum(jnp.abs(j).reshape(g.shape + (-1,)).sum(-1) for j in js)
               for g, js in zip((q, k, v), jacobian, strict=True))


def oracle_output_and_gradients(spec, options, q, k, v, is_causal, lengths, ct,
                                with_sensitivity=True):
  """``(out, weights, grads, sensitivity)``: the oracle's output and its gradients of
  ``Σ ct·out`` for ``q, k, v`` from one compiled program (the sensitivity from another).

  In the input's precision for table-judged variants (weights and
  sensitivity None); in float64 on the same rounded inputs otherwise, with
  :func:`gradient_sensitivity` for signed weights (else zeros).
  """
  what = spec.what_options({**suite_options(spec), **options})

  def make():
    oracle = spec.build_reference(**what)

    def run(q, k, v, lengths, ct):
      out, vjp = jax.vjp(lambda q, k, v: oracle(q, k, v, is_causal=is_causal,
                                                key_value_seq_lengths=lengths), q, k, v)
      grads = vjp(ct.astype(out.dtype))
      if spec.weights is None:
        return out, grads, None
      return out, grads, spec.weights(q, k, is_causal=is_causal, key_value_seq_lengths=lengths,
                                      **what)
    return run

  run = _oracle_program(spec, what, "output_and_gradients", is_causal, make)
  if spec.weights is None:
    out, grads, _ = run(q, k, v, lengths, host_array(ct, q.dtype))
    return out, None, grads, None
  with jax.enable_x64(True):
    q, k, v, ct = (host_array(x, np.float64) for x in (q, k, v, ct))
    out, grads, weights = run(q, k, v, lengths, ct)
    if with_sensitivity and signed_weights(weights):
      sensitivity = _oracle_program(
          spec, what, "sensitivity", is_causal,
          lambda: lambda q, k, v, lengths, ct: gradient_sensitivity(
              spec, what, q, k, v, is_causal=is_causal, lengths=lengths, ct=ct))(
                  q, k, v, lengths, ct)
      sensitivity = tuple(np.asarray(x) for x in sensitivity)
    else:
      sensitivity = tuple(np.zeros(g.shape) for g in grads)
    return (np.asarray(out), jax.tree.map(np.asarray, weights),
            tuple(np.asarray(g) for g in grads), sensitivity)


def assert_output_and_gradients_match_oracle(got, grads, spec, q, k, v, *, is_causal, lengths,
                                             ct, options=None, err_msg: str = "") -> None:
  """Judges an output as :func:`assert_matches_oracle` does, and its gradients of
  ``Σ ct·out`` for ``q, k, v`` against the oracle's (one compiled oracle for both):
  within ``GRAD_TOLERANCE``, plus for signed weights ``γ Σ_p |∂g/∂p|`` (see
  :func:`gradient_sensitivity`) against the float64 oracle.
  """
  want, weights, wants, sensitivity = oracle_output_and_gradients(
      spec, options or {}, q, k, v, is_causal, lengths, ct)
  _judge_output(got, want, weights, q.dtype, v, err_msg)
  dtype = jnp.dtype(q.dtype)
  atol, rtol = GRAD_TOLERANCE[dtype]
  for name, g, want in zip("qkv", grads, wants, strict=True):
    assert g.dtype == dtype
    if sensitivity is None:
      assert_close(g, want, dtype, GRAD_TOLERANCE, err_msg=f"{err_msg} d{name}")
      continue
    gamma = CONDITIONING_FACTOR * unit_roundoff(accumulation_dtype(dtype))
    bound = atol + rtol * np.abs(want) + gamma * sensitivity["qkv".index(name)]
    _assert_within(g, want, bound, dtype, f"d{name}", err_msg)


def assert_finite_gradients(grads, spec, q, k, v, *, is_causal, lengths, ct,
                            err_msg: str = "") -> None:
  """Gradients are finite wherever the exact ones fit the dtype with room to spare.

  For table-judged variants: everywhere. Signed weights can make an exact
  gradient exceed a 16-bit range (a normaliser near zero); there ±inf is
  the correctly rounded result, so only elements below half the dtype's
  max must be finite.
  """
  dtype = jnp.dtype(q.dtype)
  finite = [np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads]
  if all(finite) or spec.weights is None:
    assert all(finite), f"{err_msg} d{'qkv'[finite.index(False)]} not finite"
    return
  _, _, wants, _ = oracle_output_and_gradients(spec, {}, q, k, v, is_causal, lengths, ct,
                                               with_sensitivity=False)
  limit = float(jnp.finfo(dtype).max) / 2
  for name, g, want in zip("qkv", grads, wants, strict=True):
    bad = ~np.isfinite(np.asarray(g, np.float64)) & (np.abs(want) < limit)
    assert not np.any(bad), f"{err_msg} d{name}: not finite at {np.argwhere(bad)[:5].tolist()}"


def output_and_gradients_program(fn):
  """``jax.jit`` of ``(ct, q, k, v, *args) -> (out, (dq, dk, dv))`` for ``out = fn(q, k, v,
  *args)``: the output and the gradients of ``Σ ct·out``, one compiled program."""
  @jax.jit
  def output_and_gradients(ct, q, k, v, *args):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *args), q, k, v)
    return out, vjp(ct.astype(out.dtype))
  return output_and_gradients


def same_program(traced, other) -> bool:
  """Whether two traced programs (``jax.jit(f).trace(...)``) are one computation: equal
  jaxprs and equal constants (an array closed over, such as a projection, is a constant)."""
  consts = traced.jaxpr.consts, other.jaxpr.consts
  return str(traced.jaxpr) == str(other.jaxpr) and len(consts[0]) == len(consts[1]) and all(
      np.array_equal(a, b) for a, b in zip(*consts, strict=True))


def assert_causal(output_and_gradients, shape: Shape, *args) -> None:
  """No output depends on a later key or on another query, and scaling future tokens
  by ×±30 or ×1e4 leaves past outputs unchanged and finite.

  Judged with one compiled ``(ct, q, k, v) -> (out, (dq, dk, dv))`` program
  of the causal mode, which compiles at most on its first call here: the
  gradients for a random cotangent on query position t alone are row t of the
  Jacobian contracted with random weights, which are zero wherever that row is
  zero (and, but for a measure-zero set of cotangents, nowhere else). ``args``
  follow ``(ct, q, k, v)`` in every call; every key should be visible to the
  program: a padded key would hide a leak.
  """
  q, k, v = (np.asarray(x) for x in make_qkv(shape))  # Perturbed in numpy below.
  ct = np.asarray(cotangent(np.zeros((shape.B, shape.T, shape.N, shape.D), np.float32), seed=7))
  base = np.asarray(output_and_gradients(ct, q, k, v, *args)[0])
  with CompileCounter() as compiles:
    # dependence[i][t, j]: does any output at query t depend on position j of input i?
    dependence = [np.zeros((shape.T, n)) for n in (shape.T, shape.S, shape.S)]
    for t in range(shape.T):
      one_query = np.zeros_like(ct)
      one_query[:, t] = ct[:, t]
      _, grads = output_and_gradients(one_query, q, k, v, *args)
      for dep, g in zip(dependence, grads, strict=True):
        dep[t] = np.abs(np.asarray(g, np.float64)).sum(axis=(0, 2, 3))
    t = np.arange(shape.T)[:, None]
    offset = shape.S - shape.T  # Query t sees keys j <= t + offset (bottom-right aligned).
    future = np.arange(shape.S)[None, :] > t + offset
    other_queries = np.arange(shape.T)[None, :] != t
    dq, dk, dv = dependence
    assert np.all(dk[future] == 0) and np.all(dv[future] == 0), "depends on future keys"
    assert np.all(dq[other_queries] == 0), "depends on other queries"
    assert np.any(dv[~future] > 0), "vacuous: no dependence on visible values"

    for factor, t0 in itertools.product([30.0, -30.0, 1e4],
                                        range(max(0, -offset), shape.T - 1, 2)):
      cut = t0 + 1 + offset  # First key position in query t0's future.
      q2, k2, v2 = q.copy(), k.copy(), v.copy()
      k2[:, cut:] *= factor
      v2[:, cut:] *= factor
      q2[:, t0 + 1:] *= factor
      past = np.asarray(output_and_gradients(ct, q2, k2, v2, *args)[0])[:, : t0 + 1]
      assert np.all(np.isfinite(past)), f"non-finite past output (t0={t0}, factor={factor})"
      np.testing.assert_allclose(past, base[:, : t0 + 1], rtol=1e-6, atol=1e-6,
                                 err_msg=f"past changed: future after t0={t0} times {factor}")
  assert compiles.count == 0, (
      f"{compiles.count} programs compiled after the first call: call the program as its "
      "first call did (same argument structure), so that one program judges causality")


def has_custom_vjp(fn, *args) -> bool:
  """Whether ``fn(*args)`` runs a hand-written backward (a ``custom_vjp`` in its jaxpr)."""
  def walk(jaxpr) -> bool:
    return any(eqn.primitive.name.startswith("custom_vjp")
               or any(walk(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)
  return walk(jax.make_jaxpr(fn)(*args).jaxpr)


class CompileCounter:
  """Counts XLA compilations while active: ``with CompileCounter() as c: ...; c.count``."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.count = 0

  def _listener(self, event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    self.count += event == self.EVENT

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)
