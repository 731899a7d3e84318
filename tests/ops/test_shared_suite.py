"""The shared suite: every registered attention against its oracle.

A variant joins by registering an ``AttentionSpec``; every implementation it
lists is checked here against the spec's oracle:

1. forward parity (odd lengths, T < S, T > S, GQA, MQA, D != H, padding);
2. gradient parity on the same cases, and a float64 finite-difference check;
3. causality, by the Jacobian and by perturbing future tokens, with the
   parity test's compiled program (the oracles listed as implementations:
   their own);
   streaming: scanning the one-token step equals the causal pass, and
   splitting a sequence anywhere and carrying the state equals one pass;
   the state protocol: a prefill's state decodes on with ``step``, and the
   recurrent variants' summaries of spans combine associatively into the
   summary of all; mismatched states raise ValueErrors naming the field;
4. jit == eager, no retrace on a second call, vmap, unbatched inputs;
5. dtype round trip for bfloat16 / float16, finite on stress inputs;
6. ValueErrors for bad shapes, dtypes, lengths and options;
9. packed sequences, for entries that take ``segment_ids``: one call equals each
   segment run alone (a sparse pattern cut from the packed call's positions).

An unsupported causal mode is not skipped: the suite checks that it raises.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from _helpers import (
  CONDITIONING_FACTOR,
  FULL_GRID,
  SHAPES,
  TINY,
  Shape,
  assert_causal,
  assert_finite_gradients,
  assert_matches_oracle,
  assert_output_and_gradients_match_oracle,
  assert_stress_output_matches_oracle,
  build,
  conditioning_bound,
  cotangent,
  covering_grid,
  gradient_sensitivity,
  has_custom_vjp,
  kv_lengths,
  make_qkv,
  oracle_output,
  output_and_gradients_program,
  same_program,
  signed_weights,
  spec_cases,
  suite_options,
  unit_roundoff,
)

import linattn_jax as la
from linattn_jax._src.registry import accepted

CASES = spec_cases()
# Parity with the oracle is vacuous for the oracle itself.
PARITY_CASES = [c for c in CASES if c.implementation != "reference"]
CAUSAL_CASES = [c for c in CASES if c.spec.supports(c.implementation, True)]
case_param = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
STREAM_CASES = [c for c in CAUSAL_CASES if c.spec.streaming is not None]
SPLIT_CASES = [c for c in STREAM_CASES if c.spec.streaming.state_passing]
# The state protocol is the variant's, not an implementation's: one case per variant.
STREAM_SPECS = list({c.spec.name: c.spec for c in STREAM_CASES}.values())
RECURRENT_SPECS = [s for s in STREAM_SPECS if s.streaming.summarize is not None]
stream_spec_param = pytest.mark.parametrize("spec", STREAM_SPECS, ids=lambda s: s.name)
recurrent_spec_param = pytest.mark.parametrize("spec", RECURRENT_SPECS, ids=lambda s: s.name)
split_case_param = pytest.mark.parametrize(
    "case", SPLIT_CASES, ids=[c.id for c in SPLIT_CASES])


def _call(fn, q, k, v, is_causal, lengths=None):
  return fn(q, k, v, is_causal=is_causal, key_value_seq_lengths=lengths)


def _hardest_mode(spec, impl) -> bool:
  """``is_causal`` for tests that run one mode per case: causal where supported.

  Its masks, carried states and stabilisers are a superset of the non-causal
  path's work; the parity and gradient tests above run both modes.
  """
  return spec.supports(impl, True)


def _check_or_expect_error(spec, impl, fast, q, k, v, is_causal) -> bool:
  """False (after checking the ValueError) when the mode is unsupported."""
  if spec.supports(impl, is_causal):
    return True
  with pytest.raises(ValueError, match="is_causal"):
    _call(fast, q, k, v, is_causal)
  return False


# 1, 2. Forward and gradient parity ---------------------------------------------


# Each shape runs with padding or without (``lengths=None`` is its own code
# path), so that both are seen on T = S, T < S and T > S across the shapes
# without doubling the cases. Later tests add padding where this has none.
PARITY_SHAPES = ((SHAPES[0], True), (SHAPES[1], False), (SHAPES[2], True))


def _parity_params():
  """Per variant: each implementation's causal mode on its own, and its full mode once
  with all its implementations; these slots are dealt over :data:`PARITY_SHAPES` by
  :func:`covering_grid`: each slot on one shape at least, the variant on every shape
  (``--full``: every slot on every shape). A mode the variant or an implementation
  refuses only has its ValueError checked, on one shape, and takes no shape from the
  others."""
  params = []
  groups = itertools.groupby(PARITY_CASES, key=lambda c: c.spec.name)
  for index, (name, group) in enumerate(groups):
    group = tuple(group)
    causal = [((c,), True, "causal", c.id) for c in group
              if c.spec.supports(c.implementation, True)]
    refused = [((c,), True, "causal", c.id) for c in group
               if not c.spec.supports(c.implementation, True)]
    full = [(group, False, "full", name)]
    if not group[0].spec.supports_noncausal:
      refused, full = refused + full, []
    # Causal first: where a variant has fewer slots than shapes, the causal forms (masks,
    # carried states, chunk boundaries) take the shapes left over.
    dealt = [(slot, PARITY_SHAPES[0]) for slot in refused]
    dealt += covering_grid(causal + full, PARITY_SHAPES, offset=index)
    for (cases, is_causal, mode, case_id), (shape, padded) in dealt:
      shape_id = f"{shape}-{'padded' if padded else 'dense'}"
      params.append(pytest.param(cases, is_causal, shape, padded,
                                 id=f"{shape_id}-{mode}-{case_id}"))
  return params


@pytest.mark.parametrize("cases, is_causal, shape, padded", _parity_params())
def test_output_and_gradients_match_reference(cases, is_causal, shape, padded, seeds):
  """One compiled program gives the output and the gradients of ``Σ ct·out``; in
  the causal mode the same program, with every key visible, judges causality
  (:func:`assert_causal`) on its shape (T = S, T < S or T > S; each one on all three
  with ``--full``).

  In the full mode a variant's implementations often trace to one program (the
  recurrent forms differ only when causal): an implementation whose jaxpr and
  constants equal those of one judged here is that program, and is not
  compiled and judged again.
  """
  lengths = kv_lengths(shape) if padded else None
  q, k, v = make_qkv(shape)  # For tracing and the error checks; the seeds' inputs below.
  trace_ct = cotangent(np.zeros((shape.B, shape.T, shape.N, shape.D), np.float32))
  judged = []
  for spec, impl in cases:
    fast, _ = build(spec, impl)
    if not _check_or_expect_error(spec, impl, fast, q, k, v, is_causal):
      continue
    output_and_gradients = output_and_gradients_program(
        lambda q, k, v, lengths, fast=fast: _call(fast, q, k, v, is_causal, lengths))
    traced = output_and_gradients.trace(trace_ct, q, k, v, lengths)
    if any(same_program(traced, other) for other in judged):
      continue
    judged.append(traced)
    for seed in seeds:
      qs, ks, vs = make_qkv(shape, seed=seed)
      ct = cotangent(np.zeros((shape.B, shape.T, shape.N, shape.D), np.float32), seed=seed + 1)
      out, grads = output_and_gradients(ct, qs, ks, vs, lengths)
      assert out.shape == (shape.B, shape.T, shape.N, shape.D)
      assert out.dtype == qs.dtype
      msg = f"{impl}, seed {seed}:"
      assert_output_and_gradients_match_oracle(out, grads, spec, qs, ks, vs,
                                               is_causal=is_causal, lengths=lengths, ct=ct,
                                               err_msg=msg)
    if is_causal:  # Every key visible: padding would hide a leak.
      full = None if lengths is None else jnp.full_like(lengths, shape.S)
      assert_causal(output_and_gradients, shape, full)


SPECS = sorted({spec.name: spec for spec, _ in CASES}.values(), key=lambda spec: spec.name)


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
@pytest.mark.parametrize("is_causal, padded", [(False, False), (True, True)],
                         ids=["full-dense", "causal-padded"])
def test_gradient_finite_differences_float64(spec, is_causal, padded):
  """Float64 finite differences for the oracle and every hand-written backward.

  Gradients that autodiff derives (every other implementation) are judged
  against the oracle's in ``test_output_and_gradients_match_reference``, at a tighter
  tolerance than finite differences allow; this check makes that oracle,
  and each ``custom_vjp``, trustworthy.
  """
  with jax.enable_x64(True):
    q, k, v = make_qkv(TINY, jnp.float64)
    lengths = jnp.asarray([3], jnp.int32) if padded else None
    checked = []
    for impl in [c.implementation for c in CASES if c.spec is spec]:
      fast, ref = build(spec, impl)
      if not _check_or_expect_error(spec, impl, fast, q, k, v, is_causal):
        continue
      f = functools.partial(_call, fast, is_causal=is_causal, lengths=lengths)
      if impl not in ("reference", None) and not has_custom_vjp(f, q, k, v):
        continue
      # 1e-3, not tighter: the "xla" path (jax.nn) takes its softmax in float32
      # even for float64 inputs. A wrong gradient is off by far more.
      jax.test_util.check_grads(jax.jit(f), (q, k, v), order=1, modes=("rev",), atol=1e-3,
                                rtol=1e-3)
      checked.append(impl)
    # Specs whose implementations= do not list their oracle.
    if "reference" not in checked and spec.supports("reference", is_causal):
      f = functools.partial(_call, ref, is_causal=is_causal, lengths=lengths)
      jax.test_util.check_grads(jax.jit(f), (q, k, v), order=1, modes=("rev",), atol=1e-3,
                                rtol=1e-3)


# 3. Causality --------------------------------------------------------------


ORACLE_CASES = [c for c in CAUSAL_CASES if c.implementation == "reference"]


@pytest.mark.parametrize("case", ORACLE_CASES, ids=[c.id for c in ORACLE_CASES])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_oracles_are_causal(case, shape):
  """The fast implementations' causality is judged in the parity test, by the
  program it compiles; this judges the oracles listed as implementations."""
  fast, _ = build(*case)
  assert_causal(output_and_gradients_program(functools.partial(fast, is_causal=True)), shape)


# Streaming -----------------------------------------------------------------


@stream_spec_param
def test_streaming_step_equals_causal_pass(spec, seeds):
  """The step is the variant's, not an implementation's (it reads only the suite's options):
  one case per variant."""
  stream = spec.streaming
  shape = SHAPES[0]  # T == S.
  q, k, v = make_qkv(shape)
  state = stream.init(q, k, v, **accepted(stream.init, suite_options(spec)))

  @jax.jit
  def decode(q, k, v):
    def one_token(state, qkv):
      return stream.step(state, *qkv, **accepted(stream.step, suite_options(spec)))
    _, outs = jax.lax.scan(one_token, state, tuple(x.swapaxes(0, 1) for x in (q, k, v)))
    return outs.swapaxes(0, 1)

  for seed in seeds:
    q, k, v = make_qkv(shape, seed=seed)
    assert_matches_oracle(decode(q, k, v), spec, q, k, v, is_causal=True,
                          err_msg=f"seed {seed}:")


SPLITS = (1, 6, 12)  # Of SHAPES[0]'s 13 positions: a one-token head, mid-chunk, a one-token tail.


@split_case_param
def test_state_passing_split_equals_one_pass(case, seeds):
  """Each split, carrying the head's state into the tail, equals one pass (the splits
  computed by one compiled program: one per split cost a trace and compile each)."""
  spec, impl = case
  fast, _ = build(spec, impl)

  @jax.jit
  def in_two(q, k, v):
    outs = []
    for split in SPLITS:
      head = lambda x, split=split: x[:, :split]  # noqa: E731
      tail = lambda x, split=split: x[:, split:]  # noqa: E731
      out1, state = fast(head(q), head(k), head(v), is_causal=True, return_state=True)
      out2 = fast(tail(q), tail(k), tail(v), is_causal=True, initial_state=state)
      outs.append(jnp.concatenate([out1, out2], axis=1))
    return outs

  for seed in seeds:
    q, k, v = make_qkv(SHAPES[0], seed=seed)
    for split, out in zip(SPLITS, in_two(q, k, v), strict=True):
      assert_matches_oracle(out, spec, q, k, v, is_causal=True,
                            err_msg=f"split {split}, seed {seed}:")


# The state protocol ------------------------------------------------------------------


@stream_spec_param
def test_prefill_state_then_steps_equal_one_causal_pass(spec):
  """``fn(prompt, is_causal=True, return_state=True)``, then ``step`` per token."""
  stream = spec.streaming
  fast, _ = build(spec, None)
  q, k, v = make_qkv(SHAPES[0])
  P = 6

  @jax.jit
  def prefill_then_decode(q, k, v):
    out, state = fast(q[:, :P], k[:, :P], v[:, :P], is_causal=True, return_state=True)

    def one_token(state, qkv):
      return stream.step(state, *qkv, **accepted(stream.step, suite_options(spec)))
    _, outs = jax.lax.scan(one_token, state, tuple(x[:, P:].swapaxes(0, 1) for x in (q, k, v)))
    return jnp.concatenate([out, outs.swapaxes(0, 1)], axis=1)

  assert_matches_oracle(prefill_then_decode(q, k, v), spec, q, k, v, is_causal=True)


SPANS = ((0, 5), (5, 9), (9, 13))  # Of SHAPES[0]'s 13 keys.


def _span_inputs(spec):
  """SHAPES[0] with the middle span's stabiliser maxima about 100 above the others',
  and the last span padded in one batch row.

  The stabiliser is the key itself for per-feature log-scales (Shen, Heinsen),
  so those keys are shifted by 100 (as are plain maps' keys, which have none);
  a random-feature map's log-scale grows like ``|k|² / (2√H)``, so those keys
  are scaled by 9 (+114 for these keys; a shift of 100 would put float32
  ``sin(w·k)`` arguments in the hundreds, whose rounding no engine can undo).
  A state without a normaliser ``k_sum`` (the gated recurrences) has no
  stabiliser, and its outputs grow with the keys (beyond the table's float32
  tolerance at 100): those keys are scaled by 3, which takes gates derived
  from them from no decay to near resets.
  """
  q, k, v = make_qkv(SHAPES[0])
  stream = spec.streaming
  state = stream.init(q, k, v, **accepted(stream.init, suite_options(spec)))
  if "num_features" in suite_options(spec) or "k_sum" not in type(state)._fields:
    k = k.at[:, 5:9].multiply(9.0 if "k_sum" in type(state)._fields else 3.0)
  else:
    k = k.at[:, 5:9].add(100.0)
  return q, k, v, jnp.asarray([13, 11])


def _summaries(spec, k, v, lengths):
  stream = spec.streaming
  summarize = functools.partial(stream.summarize,
                                **accepted(stream.summarize, suite_options(spec)))
  parts = [summarize(k[:, a:b], v[:, a:b], key_value_seq_lengths=jnp.clip(lengths - a, 0, b - a))
           for a, b in SPANS]
  return parts, summarize(k, v, key_value_seq_lengths=lengths)


def _assert_states_close(got, want, err_msg):
  """Field by field, relative to each field's scale (the units are the running max)."""
  for field, g, w in zip(type(want)._fields, got, want, strict=True):
    if w is None:  # A state's reset flag outside packed summaries.
      assert g is None, f"{err_msg} {field}: {g}"
      continue
    w = np.asarray(w)
    if w.dtype == bool:  # A summary's reset flag.
      np.testing.assert_array_equal(g, w, err_msg=f"{err_msg} {field}")
      continue
    scale = np.max(np.abs(np.where(np.isfinite(w), w, 0)), initial=1e-30)
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * scale, err_msg=f"{err_msg} {field}")


@recurrent_spec_param
def test_summaries_of_spans_combine_associatively_into_the_summary_of_all(spec):
  combine = spec.streaming.combine
  q, k, v, lengths = _span_inputs(spec)
  fast, _ = build(spec, None)

  @jax.jit
  def run(q, k, v):
    (a, b, c), whole = _summaries(spec, k, v, lengths)
    left, right = combine(combine(a, b), c), combine(a, combine(b, c))
    # The last span's queries read the combined state of the first two.
    head = fast(q[:, :9], k[:, :9], v[:, :9], is_causal=True)
    tail = fast(q[:, 9:], k[:, 9:], v[:, 9:], is_causal=True, initial_state=combine(a, b),
                key_value_seq_lengths=jnp.clip(lengths - 9, 0, 4))
    return left, right, whole, jnp.concatenate([head, tail], axis=1)

  left, right, whole, out = run(q, k, v)
  chex.assert_trees_all_equal_structs(left, whole)
  _assert_states_close(left, right, "associativity:")
  _assert_states_close(left, whole, "combined summaries vs one summary:")
  assert_matches_oracle(out, spec, q, k, v, is_causal=True, lengths=lengths)


# Segment starts at 4 (inside span a) and 10 (inside span c); span b holds none.
SPAN_IDS = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2]] * 2, np.int32)


@recurrent_spec_param
def test_packed_summaries_compose_across_segment_starts_and_calls_continue(spec):
  """A span holding a segment start summarises to "drop the state, then this": summaries
  of packed spans combine into the packed summary of all of them, and a packed call from
  the combined state of the spans before it (``initial_state``, which seeds its first
  segment) continues the one packed call."""
  combine = spec.streaming.combine
  q, k, v, lengths = _span_inputs(spec)
  fast, _ = build(spec, None)
  ids = jnp.asarray(SPAN_IDS)
  summarize = functools.partial(spec.streaming.summarize,
                                **accepted(spec.streaming.summarize, suite_options(spec)))

  @jax.jit
  def run(q, k, v, ids):
    a, b, c = (summarize(k[:, s:e], v[:, s:e], segment_ids=ids[:, s:e],
                         key_value_seq_lengths=jnp.clip(lengths - s, 0, e - s))
               for s, e in SPANS)
    whole = summarize(k, v, segment_ids=ids, key_value_seq_lengths=lengths)
    left, right = combine(combine(a, b), c), combine(a, combine(b, c))
    one = fast(q, k, v, is_causal=True, segment_ids=ids, key_value_seq_lengths=lengths)
    tail = fast(q[:, 9:], k[:, 9:], v[:, 9:], is_causal=True, initial_state=combine(a, b),
                segment_ids=ids[:, 9:], key_value_seq_lengths=jnp.clip(lengths - 9, 0, 4))
    return left, right, whole, one, tail

  left, right, whole, one, tail = run(q, k, v, ids)
  chex.assert_trees_all_equal_structs(left, whole)
  _assert_states_close(left, right, "associativity:")
  _assert_states_close(left, whole, "combined packed summaries vs one packed summary:")
  scale = np.max(np.abs(np.asarray(one)))
  np.testing.assert_allclose(tail, one[:, 9:], rtol=2e-5, atol=2e-5 * scale)


@recurrent_spec_param
def test_mismatched_states_raise_value_errors_naming_the_field_and_shapes(spec):
  fast, _ = build(spec, None)
  q, k, v = make_qkv(SHAPES[0])
  stream = spec.streaming
  # A summary, which for the gated family is a type of its own (a state does not combine).
  state = stream.summarize(k, v, **accepted(stream.summarize, suite_options(spec)))
  name = type(state).__name__

  def call(bad):
    return fast(q, k, v, is_causal=True, initial_state=bad)

  cases = {
      "batch": jax.tree.map(lambda x: x[:1], state),
      "heads": jax.tree.map(lambda x: x[:, :1], state),
      # One feature (M, or H of a gated state) of every field that has one.
      "features": jax.tree.map(lambda x: x[:, :, :1] if x.ndim > 2 else x, state),
  }
  for bad in cases.values():
    with pytest.raises(ValueError, match=rf"{name}\.\w+ has shape \(.*\); expected \("):
      call(bad)
    with pytest.raises(ValueError, match=rf"combine: {name}\.\w+ has shapes \(.*\) and \("):
      spec.streaming.combine(state, bad)
  with pytest.raises(ValueError, match=rf"{name}\.kv must be floating point"):
    call(state._replace(kv=state.kv.astype(jnp.int32)))
  other = collections.namedtuple("OtherState", type(state)._fields)
  another = other(*state)  # Same fields and shapes, another type.
  with pytest.raises(ValueError, match=rf"must be a {name}.*got OtherState"):
    call(another)
  with pytest.raises(ValueError, match=rf"combine: .*{name} and OtherState"):
    spec.streaming.combine(state, another)


# 4. Transformations --------------------------------------------------------


def _hardest_inputs(case):
  """The case's function, its hardest mode, and ``SHAPES[0]``'s inputs with padding."""
  fast, _ = build(*case)
  return fast, _hardest_mode(*case), SHAPES[0], make_qkv(SHAPES[0]), kv_lengths(SHAPES[0])


@case_param
def test_jit_eager_vmap_and_unbatched_agree_without_retracing(case):
  """The compiled call equals the eager one and does not retrace on new values; under
  ``vmap`` (over a new leading axis, and over the batch, so that the function
  sees unbatched ``[T, N, H]`` inputs) every example equals its row of the call.

  One compiled program judges all three: ``jit(vmap(vmap(fn)))`` over two batches, the
  second the first reversed, equals the eager call row by row, and a second call with
  new values traces nothing."""
  fast, is_causal, shape, (q, k, v), lengths = _hardest_inputs(case)
  traces = []

  def unbatched(q, k, v, n):  # One example at a time: unbatched inputs, a scalar length.
    traces.append(None)
    return _call(fast, q, k, v, is_causal, n)

  stack = lambda x: jnp.stack([x, x[::-1]])  # noqa: E731
  jitted = jax.jit(jax.vmap(jax.vmap(unbatched)))
  mapped = jitted(stack(q), stack(k), stack(v), stack(lengths))
  out_eager = _call(fast, q, k, v, is_causal, lengths)
  assert mapped.shape == (2,) + out_eager.shape
  np.testing.assert_allclose(mapped[0], out_eager, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mapped[1], out_eager[::-1], rtol=1e-5, atol=1e-6)
  q2, k2, v2 = make_qkv(shape, seed=5)
  traced = len(traces)
  again = jitted(stack(q2), stack(k2), stack(v2), stack(lengths + 0))
  assert len(traces) == traced, "second call with the same shapes retraced"
  np.testing.assert_allclose(again[0], _call(fast, q2, k2, v2, is_causal, lengths),
                             rtol=1e-5, atol=1e-6)


# 5. Low precision -----------------------------------------------------------


LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def _low_precision_params():
  """Each fast implementation in one 16-bit dtype and each variant's fast implementations
  in both, dealt as :func:`covering_grid` deals (a variant with one fast implementation:
  both dtypes, from one program); the oracle in one (``--full``: every implementation in
  both)."""
  params = []
  for index, (_, group) in enumerate(itertools.groupby(CASES, key=lambda c: c.spec.name)):
    group = list(group)
    fast = [c for c in group if c.implementation != "reference"]
    for case in group:
      dtypes = LOW_PRECISION
      if case not in fast and not FULL_GRID:
        dtypes = (LOW_PRECISION[index % len(LOW_PRECISION)],)
      elif len(fast) >= len(LOW_PRECISION) and not FULL_GRID:
        dtypes = (LOW_PRECISION[(fast.index(case) + index) % len(LOW_PRECISION)],)
      name = "+".join(jnp.dtype(d).name for d in dtypes)
      params.append(pytest.param(case, dtypes, id=f"{case.id}-{name}"))
  return params


@pytest.mark.parametrize("case, dtypes", _low_precision_params())
def test_low_precision_round_trip(case, dtypes, seeds):
  """bfloat16 and float16 inputs: outputs and gradients keep the dtype, match the oracle
  (near one-hot weights too) and stay finite. Several dtypes' outputs and gradients come
  from one compiled program (one per dtype cost a trace and compile each)."""
  spec, impl = case
  fast, _ = build(spec, impl)
  is_causal = _hardest_mode(spec, impl)
  shape = SHAPES[0]
  lengths = kv_lengths(shape)
  cts = [cotangent(np.zeros((shape.B, shape.T, shape.N, shape.D), dtype))
         for dtype in dtypes]

  one_dtype = output_and_gradients_program(
      lambda q, k, v: _call(fast, q, k, v, is_causal, lengths)).__wrapped__
  output_and_gradients = jax.jit(lambda cts, qkvs: [one_dtype(ct, *qkv)
                                                     for ct, qkv in zip(cts, qkvs, strict=True)])
  for seed, amplitude in itertools.product(seeds, (1.0, 30.0)):  # 30: near one-hot weights.
    qkvs = [make_qkv(shape, dtype, seed=seed, amplitude=amplitude) for dtype in dtypes]
    results = output_and_gradients(cts, qkvs)
    for dtype, ct, (q, k, v), (out, grads) in zip(dtypes, cts, qkvs, results,
                                                  strict=True):
      assert out.dtype == dtype
      msg = f"{jnp.dtype(dtype).name}, seed {seed}, amplitude {amplitude}:"
      if amplitude == 1.0:
        assert_matches_oracle(out, spec, q, k, v, is_causal=is_causal, lengths=lengths,
                              err_msg=msg)
      else:
        assert_stress_output_matches_oracle(out, spec, q, k, v, is_causal=is_causal,
                                            lengths=lengths, amplitude=amplitude, err_msg=msg)
      assert all(g.dtype == dtype for g in grads)
      assert_finite_gradients(grads, spec, q, k, v, is_causal=is_causal, lengths=lengths,
                              ct=ct, err_msg=msg)


BIAS_CASES = [c for c in CASES if "bias" in inspect.signature(c.spec.function).parameters]


@pytest.mark.parametrize("case", BIAS_CASES, ids=[c.id for c in BIAS_CASES])
def test_a_row_masked_by_an_infinite_bias_is_zero_with_finite_gradients(case):
  spec, impl = case
  fast, ref = build(spec, impl)
  q = k = v = jnp.ones((1, 3, 1, 4))
  bias = jnp.zeros((1, 1, 3, 3)).at[0, 0, 1].set(-jnp.inf)  # Query 1 sees no key.
  if impl == "flash":  # Its O(T) memory rules out a dense bias: it must say so.
    with pytest.raises(ValueError, match="bias"):
      fast(q, k, v, bias=bias)
    return
  out, vjp = jax.vjp(lambda q, k, v: fast(q, k, v, bias=bias), q, k, v)
  np.testing.assert_array_equal(out[0, :, 0, 0], [1.0, 0.0, 1.0])
  for g in vjp(jnp.ones_like(out)):
    assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(out, ref(q, k, v, bias=bias))


# 9. Packed sequences ------------------------------------------------------------


SEGMENT_CASES = [c for c in CASES
                 if "segment_ids" in inspect.signature(c.spec.function).parameters]
segment_case_param = pytest.mark.parametrize(
    "case", SEGMENT_CASES, ids=[c.id for c in SEGMENT_CASES])
PACKED = Shape(B=2, T=11, S=11, N=2, K=1, H=4, D=3)
# Row 0: segments of 3, 1, 3 and 4 positions (boundaries inside every block size the
# suite uses), the last one padding past key_value_seq_lengths = 8; row 1: one segment.
PACKED_IDS = np.array([[0, 0, 0, 1, 2, 2, 2, 3, 3, 3, 3], [5] * 11], np.int32)
PACKED_LENGTHS = np.array([8, 11], np.int32)


def _spans(ids):
  """``[(id, start, stop)]`` of a non-decreasing row of ids."""
  starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]]
  return [(ids[a], a, b) for a, b in zip(starts, starts[1:] + [len(ids)], strict=True)]


def _segments(q_ids, kv_ids, lengths):
  """``[(b, rows, keys, n)]``: each query segment of each row, the slice of its rows, the
  slice of its keys and its count of unpadded keys (``keys`` None: no key has its id)."""
  out = []
  for b in range(len(q_ids)):
    keys = {i: (a, z) for i, a, z in _spans(kv_ids[b])}
    for i, a, z in _spans(q_ids[b]):
      ka, kz = keys.get(i, (0, 0))
      out.append((b, slice(a, z), slice(ka, kz) if i in keys else None,
                  int(np.clip(lengths[b] - ka, 0, kz - ka))))
  return out


class _Padded(NamedTuple):
  """The segments that have keys, as the rows of one padded call: each segment's queries
  padded at their end to the longest, its keys too, and hidden there by its ``lengths``
  (the count of its unpadded keys). A segment's queries then see exactly its own keys,
  causal ones too."""

  segments: list  # [(b, rows, keys, n)] (:func:`_segments`).
  rows: int
  keys: int
  lengths: jax.Array  # [P] int32.

  @classmethod
  def of(cls, q_ids, kv_ids, lengths):
    segments = [x for x in _segments(q_ids, kv_ids, lengths) if x[2] is not None]
    return cls(segments, max(r.stop - r.start for _, r, _, _ in segments),
               max(c.stop - c.start for _, _, c, _ in segments),
               jnp.asarray([n for *_, n in segments], jnp.int32))

  def cut(self, x, keys=False):
    """``x [B, T|S, ...]`` as ``[P, rows|keys, ...]``, zeros past each segment (in numpy for
    a numpy ``x``)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    size = self.keys if keys else self.rows
    parts = [x[b, c if keys else r] for b, r, c, _ in self.segments]
    return xp.stack([xp.pad(y, [(0, size - y.shape[0])] + [(0, 0)] * (y.ndim - 1))
                     for y in parts])

  def place(self, y, like, keys=False):
    """``y [P, rows|keys, ...]`` back at the segments' positions of ``like [B, T|S, ...]``
    (zeros elsewhere), as float64 numbers."""
    out, y = np.zeros(like.shape, np.float64), np.asarray(y)
    for i, (b, r, c, _) in enumerate(self.segments):
      s = c if keys else r
      out[b, s] = np.asarray(y[i, :s.stop - s.start])
    return out


def _one_segment_at_a_time(spec, fast, is_causal, q, k, q_ids, kv_ids, lengths):
  """``(q, k, v) -> out``: each segment's queries against its own keys (keys past
  ``lengths`` masked there too), concatenated; a query whose segment has no key is zeros.

  The segments run as the rows of one call (:class:`_Padded`): of ``fast`` itself, unless
  the variant's pattern is tied to positions (it has a ``dense_mask``: strided's columns,
  block grids, global and random positions stay where the packed call has them); then of
  the softmax oracle with the whole call's pattern and causal mask, cut to each segment's
  rows and keys.
  """
  padded = _Padded.of(q_ids, kv_ids, lengths)
  if spec.dense_mask is None:
    call = lambda *x: _call(fast, *x, is_causal, padded.lengths)  # noqa: E731
  else:
    T, S = q.shape[1], k.shape[1]
    pattern = np.asarray(spec.dense_mask(T, S, is_causal=is_causal,
                                         **spec.what_options(suite_options(spec))))
    if is_causal:
      pattern = pattern & np.asarray(la.masks.causal(T, S))
    heads = pattern.shape[0] if pattern.ndim == 3 else 1
    masks = np.zeros((len(padded.segments), heads, padded.rows, padded.keys), bool)
    for i, (_, r, c, _) in enumerate(padded.segments):
      masks[i, :, :r.stop - r.start, :c.stop - c.start] = pattern[..., r, c]
    call = lambda *x: la.softmax_attention_reference(  # noqa: E731
        *x, mask=jnp.asarray(masks), key_value_seq_lengths=padded.lengths)
  starts = {(b, r.start) for b, r, _, _ in padded.segments}

  def run(q, k, v):
    outs = iter(call(padded.cut(q), padded.cut(k, True), padded.cut(v, True)))
    result = []
    for b in range(q.shape[0]):
      parts = []
      for _, a, z in _spans(q_ids[b]):
        parts.append(next(outs)[:z - a] if (b, a) in starts else
                     jnp.zeros((z - a,) + q.shape[2:3] + v.shape[3:], q.dtype))
      result.append(jnp.concatenate(parts, axis=0))
    return jnp.stack(result)
  return run


@functools.cache
def _sensitivity_of_segments(name, is_causal, q_ids, kv_ids, lengths):
  """:func:`_separate_sensitivity` of the suite's packed inputs (``make_qkv`` of their
  shape, the output's ``cotangent``): once per variant and mode, the same for all of its
  implementations."""
  spec = next(c.spec for c in CASES if c.spec.name == name)
  q_ids, kv_ids, lengths = (np.asarray(x) for x in (q_ids, kv_ids, lengths))
  q, k, v = (np.asarray(x) for x in make_qkv(PACKED._replace(T=q_ids.shape[1])))
  zeros = [np.zeros(x.shape) for x in (q, k, v)]
  what = spec.what_options(suite_options(spec))
  if spec.weights is None or not signed_weights(jax.jit(  # One program, not one per op.
      lambda q, k, lengths: spec.weights(q, k, is_causal=is_causal, key_value_seq_lengths=lengths,
                                         **what))(q, k, lengths)):
    return zeros
  padded = _Padded.of(q_ids, kv_ids, lengths)
  ct = padded.cut(np.asarray(cotangent(np.zeros(q.shape[:3] + v.shape[3:], q.dtype))))
  with jax.enable_x64(True):  # One compiled program (op by op, it compiled hundreds).
    parts = jax.jit(functools.partial(gradient_sensitivity, spec, what, is_causal=is_causal))(
        *(jnp.asarray(padded.cut(x, keys=i > 0), jnp.float64) for i, x in enumerate((q, k, v))),
        lengths=padded.lengths, ct=jnp.asarray(ct, jnp.float64))
  return [padded.place(y, x, keys=i > 0)
          for i, (y, x) in enumerate(zip(parts, (q, k, v), strict=True))]


@functools.cache
def _output_bound_of_segments(name, is_causal, q_ids, kv_ids, lengths):
  """:func:`conditioning_bound` (float32) of each segment of the suite's packed inputs run
  alone, at the packed positions: once per variant and mode. Zeros where the weights are
  positive (the fixed tolerance judges those)."""
  spec = next(c.spec for c in CASES if c.spec.name == name)
  q_ids, kv_ids, lengths = (np.asarray(x) for x in (q_ids, kv_ids, lengths))
  q, k, v = (np.asarray(x) for x in make_qkv(PACKED._replace(T=q_ids.shape[1])))
  like = np.zeros(q.shape[:3] + v.shape[3:])
  padded = _Padded.of(q_ids, kv_ids, lengths)
  qs, ks, vs = (padded.cut(x, keys=i > 0) for i, x in enumerate((q, k, v)))
  want, weights = oracle_output(spec, {}, qs, ks, vs, is_causal, padded.lengths)
  if weights is None or not signed_weights(weights):
    return like
  return padded.place(conditioning_bound(weights, vs, want, jnp.float32), like)


def _separate_output_bound(spec, is_causal, q_ids, kv_ids, lengths):
  """For signed weights: twice each segment's output :func:`conditioning_bound` (both
  sides are float32 programs); zeros for the other variants."""
  return 2 * _output_bound_of_segments(spec.name, is_causal, _as_key(q_ids), _as_key(kv_ids),
                                       _as_key(lengths))


def _as_key(x):
  return tuple(map(tuple, np.asarray(x).tolist())) if np.ndim(x) > 1 else tuple(
      np.asarray(x).tolist())


def _separate_sensitivity(spec, is_causal, q_ids, kv_ids, lengths):
  """For signed weights (random Fourier features, whose normalisers can cancel): each
  segment's :func:`gradient_sensitivity` run alone, ``Σ_p |∂g/∂p|`` per gradient element
  (float64), the conditioning two correct float32 programs' gradients may differ by;
  zeros for the other variants."""
  return _sensitivity_of_segments(spec.name, is_causal, _as_key(q_ids), _as_key(kv_ids),
                                  _as_key(lengths))


def _assert_packed_equals_separate(spec, fast, is_causal, q, k, v, segment_ids, q_ids, kv_ids,
                                   lengths, err_msg):
  """Output and gradients of ``Σ ct·out`` of one jitted packed call equal those of the
  segments run one at a time (:func:`_one_segment_at_a_time`; with signed weights, within
  twice the conditioning of each segment's gradients: both are float32 programs). The
  contract test calls ``segment_ids`` eagerly too."""
  def packed(q, k, v):
    return fast(q, k, v, is_causal=is_causal, key_value_seq_lengths=lengths,
                segment_ids=segment_ids)

  separate = _one_segment_at_a_time(spec, fast, is_causal, q, k, q_ids, kv_ids, lengths)
  ct = cotangent(np.zeros(q.shape[:3] + v.shape[3:], q.dtype))
  # Each side is one compiled program: the segments' calls, dispatched op by op, compiled
  # each op on its own.
  want, wants = output_and_gradients_program(separate)(ct, q, k, v)
  got, gots = output_and_gradients_program(packed)(ct, q, k, v)
  fixed = 1e-5 + 1e-5 * np.abs(np.asarray(want))
  if not np.all(np.abs(np.asarray(got) - want) <= fixed):  # Signed weights' conditioning.
    bound = fixed + _separate_output_bound(spec, is_causal, q_ids, kv_ids, lengths)
    np.testing.assert_array_less(np.abs(np.asarray(got) - want), bound + 1e-12,
                                 err_msg=f"{err_msg}: output")
  within = lambda g, w, s: np.all(  # noqa: E731
      np.abs(np.asarray(g) - w) <= 1e-5 + 1e-4 * np.abs(w) + s)
  gamma = 2 * CONDITIONING_FACTOR * unit_roundoff(jnp.float32)
  slack = [0.0] * 3
  if not all(within(g, w, 0.0) for g, w in zip(gots, wants, strict=True)):  # Only then.
    slack = [gamma * s for s in _separate_sensitivity(spec, is_causal, q_ids, kv_ids, lengths)]
  for g, w, s, name in zip(gots, wants, slack, "qkv", strict=True):
    assert np.all(np.isfinite(g)), f"{err_msg}: d{name} not finite"
    np.testing.assert_array_less(np.abs(np.asarray(g) - w), 1e-5 + 1e-4 * np.abs(w) + s + 1e-12,
                                 err_msg=f"{err_msg}: d{name}")


@segment_case_param
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_packed_call_equals_each_segment_run_alone(case, is_causal):
  """Segments of length 1, a row that is one segment, padding keys after the last
  segment, boundaries inside blocks: one call with ``segment_ids`` equals the segments
  run one at a time, forward and gradient (a sparse pattern keeps the packed call's
  positions, see :func:`_one_segment_at_a_time`)."""
  spec, impl = case
  fast, _ = build(spec, impl)
  if not _check_or_expect_error(spec, impl, fast, *make_qkv(PACKED), is_causal):
    return
  q, k, v = make_qkv(PACKED)
  ids = jnp.asarray(PACKED_IDS)
  if spec.packed_causal_only and not is_causal:  # A recurrence reads its prefix only.
    with pytest.raises(ValueError, match="segment_ids needs is_causal=True"):
      fast(q, k, v, is_causal=False, segment_ids=ids)
    return
  _assert_packed_equals_separate(spec, fast, is_causal, q, k, v, ids, PACKED_IDS, PACKED_IDS,
                                 PACKED_LENGTHS, f"{case.id} causal={is_causal}")


@segment_case_param
def test_packed_cross_attention_takes_the_pair_of_ids(case):
  """T != S: ``(query_segment_ids [B, T], kv_segment_ids [B, S])``; a query segment
  absent from the keys gives zeros. (Non-causal: the causal alignment is the whole
  call's, not each segment's; so is a window's, which :func:`_one_segment_at_a_time`
  cuts from the call's pattern.)"""
  spec, impl = case
  fast, _ = build(spec, impl)
  shape = PACKED._replace(T=6)
  q, k, v = make_qkv(shape)
  q_ids = np.array([[0, 0, 2, 2, 2, 4], [5] * 6], np.int32)  # Segment 4 has no key.
  pair = (jnp.asarray(q_ids), jnp.asarray(PACKED_IDS))
  if spec.packed_causal_only:  # One array, T == S: the pair is refused, saying why.
    with pytest.raises(ValueError, match="segment_ids must be one array"):
      fast(q, k, v, is_causal=spec.supports(impl, True), segment_ids=pair)
    return
  _assert_packed_equals_separate(spec, fast, False, q, k, v, pair, q_ids, PACKED_IDS,
                                 PACKED_LENGTHS, f"{case.id} pair")


@segment_case_param
def test_bad_segment_ids_raise_value_errors_naming_the_argument(case):
  spec, impl = case
  fast, _ = build(spec, impl)
  q, k, v = make_qkv(PACKED)
  ids = jnp.asarray(PACKED_IDS)

  mode = {"is_causal": True} if spec.packed_causal_only else {}
  if spec.packed_causal_only and not spec.supports(impl, True):  # A non-causal-only form.
    with pytest.raises(ValueError, match="segment_ids needs is_causal=True"):
      fast(q, k, v, segment_ids=ids)
    return

  def raises(match, segment_ids, q=q, k=k, v=v):
    with pytest.raises(ValueError, match=match):
      fast(q, k, v, segment_ids=segment_ids, **mode)

  raises(r"segment_ids must be integers.*float32", ids.astype(jnp.float32))
  raises(r"segment_ids must have shape.*\(2, 11\); got \(2, 10\)", ids[:, :10])
  raises(r"segment_ids must have shape.*got \(11,\)", ids[0])
  raises(r"segment_ids must not decrease.*\(2, 11\)", ids[:, ::-1])
  if spec.packed_causal_only:
    raises(r"segment_ids needs query length T equal to key length S.*T=6, S=11", ids[:, :6],
           q=q[:, :6])
    raises(r"segment_ids must be one array.*tuple of 2", (ids, ids))
  else:
    raises(r"T=6 differs from key length S=11.*pair.*\(2, 6\)", ids[:, :6], q=q[:, :6])
    np.testing.assert_array_equal(fast(q, k, v, segment_ids=(ids, ids)),  # The pair, T == S.
                                  fast(q, k, v, segment_ids=ids))
    raises(r"query_segment_ids.*shape.*\(2, 6\); got \(2, 11\)", (ids, ids), q=q[:, :6])
    raises(r"kv_segment_ids.*integers", (ids[:, :6], ids.astype(jnp.float32)), q=q[:, :6])
    raises(r"pair.*3 items", (ids, ids, ids))
  # Under jit the values are unknown: shapes and dtypes are still checked.
  with pytest.raises(ValueError, match="segment_ids must be integers"):
    jax.jit(lambda ids: fast(q, k, v, segment_ids=ids, **mode))(ids.astype(jnp.float32))


# 6. Errors -------------------------------------------------------------------


@case_param
def test_bad_inputs_raise_value_errors_naming_shapes(case):
  spec, impl = case
  fast, _ = build(spec, impl)
  is_causal = _hardest_mode(spec, impl)
  q, k, v = make_qkv(Shape(B=2, T=5, S=6, N=4, K=2, H=8, D=3))

  def raises(match, *args, **kw):
    with pytest.raises(ValueError, match=match):
      _call(fast, *args, is_causal=is_causal, **kw)

  raises("rank", q[0, 0], k, v)
  raises("rank", q[None], k, v)
  raises(r"multiple of.*K=2", q[:, :, :3], k, v)
  raises(r"batch sizes differ.*\(2, 5, 4, 8\)", q, k[:1], v[:1])
  raises(r"lengths differ.*\(2, 6, 2, 8\)", q, k, v[:, :5])
  raises(r"head counts differ", q, k, v[:, :, :1])
  raises(r"head dims differ", q, k[..., :4], v)
  raises(r"dtype", q, k.astype(jnp.bfloat16), v)
  raises(r"key_value_seq_lengths.*shape", q, k, v, lengths=jnp.array([1, 2, 3]))
  raises(r"key_value_seq_lengths.*integers", q, k, v, lengths=jnp.array([1.0, 2.0]))
  with pytest.raises(ValueError, match="unknown"):
    options = {**suite_options(spec), "implementation": "no-such-implementation"}
    _call(spec.build(**options), q, k, v, is_causal)
  with pytest.raises(ValueError, match="unknown option"):
    spec.build(no_such_option=1)
  with pytest.raises(ValueError, match="is_causal must be a static Python bool"):
    jax.jit(fast)(q, k, v, is_causal=is_causal)
