"""The contract every registered variant keeps: each documented keyword can be used.

For every registered variant, every keyword of its function (read from its
signature, so a new keyword joins by being declared; positional arguments with
a default, softmax's ``bias`` and ``mask``, count too) is called with a value
other than its default, under ``jax.jit`` and eagerly; both must agree, and
where the keyword changes the math the result is judged against the oracle
called with the same keyword. A keyword this file has no value for fails the
test: a documented argument that nothing calls is a defect.

Keywords the shared suite already calls that way are not called again here
(``is_causal`` and ``key_value_seq_lengths`` in every parity test, each
``implementation`` it lists, and the options its ``SUITE_SETTINGS`` set to
other values than the defaults, jitted and eagerly in its jit/eager test);
:func:`test_the_shared_suite_calls_the_keywords_left_to_it` checks that it does.
Per-token inputs (gates, betas) have no default: every call of the suite passes
them, derived from the key.

Also: what a call without ``is_causal`` does is one rule for every entry
(non-causal; a causal-only variant raises a ValueError saying so).
"""

from __future__ import annotations

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import (
  SUITE_SETTINGS,
  TINY,
  SuiteSettings,
  assert_matches_oracle,
  build,
  deriving_inputs,
  kv_lengths,
  make_qkv,
  suite_options,
)

import linattn_jax as la

SPECS = [deriving_inputs(la.get_spec(name)) for name in la.available_attentions()]
CALL_KEYWORDS = ("is_causal", "key_value_seq_lengths")  # Per call; the rest are options.


def _other_feature_map(spec):
  default = inspect.signature(spec.function).parameters["feature_map"].default
  return la.feature_maps.relu if default is not la.feature_maps.relu else (
      la.feature_maps.elu_plus_one)


def _suite_implementations(spec) -> set:
  """The implementations the shared suite runs for ``spec`` (its settings may narrow them;
  the variant's own test file runs the rest, and the contract test one of them)."""
  chosen = SUITE_SETTINGS.get(spec.name, SuiteSettings()).implementations
  return set(chosen or spec.implementations) - {None}


def _other_implementation(spec):
  """One the suite does not run (the contract runs only such a case)."""
  return next(i for i in spec.implementations
              if i is not None and i not in _suite_implementations(spec))


def _arrays_drawn_with_another_seed(spec):
  return dict(spec.params.init(jax.random.key(7), TINY.H, **_param_options(spec)))


def _param_options(spec):
  return {k: v for k, v in suite_options(spec).items() if k == "num_features"}


VALUES = {
    # keyword: value(spec) -> a non-default value.
    "scale": lambda spec: 0.5,
    "implementation": _other_implementation,
    "chunk_size": lambda spec: 3,
    "block_size": lambda spec: 2,
    "block_q": lambda spec: 2,
    "block_k": lambda spec: 4,
    "eps": lambda spec: 1e-2,
    "feature_map": _other_feature_map,
    "kernel": lambda spec: "trig" if spec.name == "performer" else "positive",
    "rng": lambda spec: 3,
    "num_features": lambda spec: 10,
    "projected_length": lambda spec: 3,
    "max_length": lambda spec: 24,
    "window_size": lambda spec: (1, 1),
    "global_positions": lambda spec: (1,),
    "stride": lambda spec: 2,
    "layout": lambda spec: np.tril(np.ones((2, 2), bool)),
    "num_window_blocks": lambda spec: 1,
    "num_global_blocks": lambda spec: 1,
    "num_random_blocks": lambda spec: 2,
    "local_window_size": lambda spec: (2, 1),
    "causal_alignment": lambda spec: "top_left",
    "query_seq_lengths": lambda spec: jnp.array([3], jnp.int32),
    "key_value_seq_lengths": lambda spec: kv_lengths(TINY),
}
# Keywords judged by their own rule below, and the array options of a ParamSpec (given
# all together, drawn with another seed).
SPECIAL = ("initial_state", "return_state", "return_residual")


# Arguments passed by position too that have defaults (softmax's, after jax.nn's signature),
# and packed sequences: called by name at call time, and judged by the oracle called alike.
CALL_ARRAYS = {
    "bias": lambda spec: 0.5 * jnp.tril(jnp.ones((TINY.T, TINY.S))),
    "mask": lambda spec: jnp.ones((TINY.T, TINY.S), bool).at[:, 0].set(False),
    "segment_ids": lambda spec: jnp.array([[0, 0, 1, 1, 1]], jnp.int32),  # TINY: T = S = 5.
}


def _keywords(spec):
  """Every argument but the three arrays: keyword-only, or positional with a default."""
  params = inspect.signature(spec.function).parameters
  return [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY or (
      p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is not p.empty)]


def _same(a, b) -> bool:
  try:
    return bool(np.all(a == b)) if not callable(a) else a is b
  except (TypeError, ValueError):
    return False


def _suite_calls(spec, p) -> bool:
  """Whether the shared suite calls keyword ``p`` of ``spec`` with another value than its
  default, under jit and eagerly (see the module docstring)."""
  if p.name in CALL_KEYWORDS:
    return True
  if p.name == "implementation":
    return _suite_implementations(spec) >= set(spec.implementations) - {None}
  options = suite_options(spec)
  return p.name in options and not _same(options[p.name], p.default)


def _cases():
  cases = []
  for spec in SPECS:
    arrays = set(spec.params.names) if spec.params is not None else set()
    for p in _keywords(spec):
      if p.name in arrays or _suite_calls(spec, p):
        continue  # Params: one case gives them all (below); the suite's: checked below.
      cases.append(pytest.param(spec, p.name, id=f"{spec.name}-{p.name}"))
    if arrays:
      cases.append(pytest.param(spec, "+".join(spec.params.names),
                                id=f"{spec.name}-{'+'.join(spec.params.names)}"))
  return cases


def _run_both(fn, q, k, v, call, arrays):
  """``fn(q, k, v, **call, **arrays)`` eagerly and under jit (``arrays`` as traced
  arguments); the two must agree. Returns the eager result.

  Under jit the call is traced; where every equation of the traced program is a call of
  a compiled program (the library's entries run as one, ``checks.compiled``; the suite's
  derived gates as another), it composes the very programs the eager call ran, with
  nothing of its own, and is not compiled again. Otherwise it is compiled and run, and
  its result must equal the eager one.
  """
  eager = fn(q, k, v, **call, **arrays)
  traced = jax.jit(lambda q, k, v, arrays: fn(q, k, v, **call, **arrays)).trace(
      q, k, v, arrays)
  if _composes_compiled_programs(traced.jaxpr.jaxpr):
    chex.assert_trees_all_equal_shapes_and_dtypes(traced.out_info, eager)
    return eager
  jitted = traced.lower().compile()(q, k, v, arrays)
  chex.assert_trees_all_close(jitted, eager, atol=1e-6, rtol=1e-6)
  return eager


def _composes_compiled_programs(jaxpr) -> bool:
  """Whether each equation of ``jaxpr`` calls a ``jax.jit`` program."""
  return bool(jaxpr.eqns) and all(eqn.primitive.name in ("jit", "pjit") for eqn in jaxpr.eqns)


@pytest.mark.parametrize("spec, keyword", _cases())
def test_every_keyword_is_usable_with_a_non_default_value(spec, keyword):
  q, k, v = make_qkv(TINY)
  is_causal = spec.supports_causal
  options = suite_options(spec)
  call = {"is_causal": is_causal}
  arrays = {}
  if spec.params is not None and keyword == "+".join(spec.params.names):
    arrays = _arrays_drawn_with_another_seed(spec)
    options = {n: v for n, v in options.items() if n not in ("rng", "num_features")}
  elif keyword in SPECIAL:
    return _judge_special(spec, keyword, options, q, k, v)
  elif keyword in CALL_ARRAYS:
    value = CALL_ARRAYS[keyword](spec)
    got = _run_both(spec.build(**options), q, k, v, call, {keyword: value})
    want = spec.build_reference(**spec.what_options(options))(q, k, v, **call, **{keyword: value})
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
    return
  elif keyword not in VALUES:
    if inspect.signature(spec.function).parameters[keyword].default is inspect.Parameter.empty:
      pytest.fail(f"{spec.name}: required keyword `{keyword}` has no value here; add one.")
    pytest.fail(f"{spec.name}: no non-default value for keyword `{keyword}`: add one to VALUES.")
  else:
    value = VALUES[keyword](spec)
    default = inspect.signature(spec.function).parameters[keyword].default
    if keyword in ("key_value_seq_lengths", "query_seq_lengths"):
      arrays[keyword] = value  # Traced under jit, as a caller's per-batch arrays are.
    else:
      assert not _same(value, default), f"{keyword}: {value!r} is the default"
      options = {**options, keyword: value}
  fn = spec.build(**options)
  got = _run_both(fn, q, k, v, call, arrays)
  if keyword == "query_seq_lengths":  # Rows past it are zeros (the oracle's too).
    np.testing.assert_array_equal(got[:, 3:], 0)
  judged = {n: x for n, x in options.items() if n not in spec.how_options}
  judged.update({n: x for n, x in arrays.items() if n not in CALL_KEYWORDS})
  assert_matches_oracle(got, spec, q, k, v, is_causal=call["is_causal"],
                        lengths=arrays.get("key_value_seq_lengths"), options=judged,
                        err_msg=f"{spec.name} with {keyword}")


def _judge_special(spec, keyword, options, q, k, v):
  """``return_state``: the output is the oracle's, the state is the pass's own (its
  continuation is judged by the shared suite's split test); ``initial_state``: a state
  of earlier keys continues as the oracle over all keys; ``return_residual``: the
  oracle's residual too."""
  fn = spec.build(**options)
  is_causal = spec.supports_causal
  if keyword == "return_residual":
    got = _run_both(fn, q, k, v, {"is_causal": is_causal, "return_residual": True}, {})
    want = spec.build_reference(**spec.what_options(options))(
        q, k, v, is_causal=is_causal, return_residual=True)
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
    return
  call = {"is_causal": True, "return_state": True}
  if keyword == "return_state":
    out, state = _run_both(fn, q, k, v, call, {})
    assert jax.tree.leaves(state) and all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
    assert_matches_oracle(out, spec, q, k, v, is_causal=True, options=options,
                          err_msg=f"{spec.name} with return_state")
    return
  q0, k0, v0 = make_qkv(TINY, seed=5)
  _, state = fn(q0, k0, v0, **call)
  out = _run_both(fn, q, k, v, {"is_causal": True}, {"initial_state": state})
  both_k, both_v = (jnp.concatenate(x, axis=1) for x in ((k0, k), (v0, v)))
  assert_matches_oracle(out, spec, q, both_k, both_v, is_causal=True, options=options,
                        err_msg=f"{spec.name} with initial_state")


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_the_shared_suite_calls_the_keywords_left_to_it(spec):
  """The keywords not called here are called by the suite: the per-call two in every
  parity test (both modes where supported, padded), every listed implementation, and
  options whose suite value differs from the default."""
  from test_shared_suite import PARITY_SHAPES, _parity_params
  left = [p.name for p in _keywords(spec) if _suite_calls(spec, p)]
  assert {"is_causal", "key_value_seq_lengths"} <= set(left)
  assert any(padded for _, padded in PARITY_SHAPES)
  params = [param.values for param in _parity_params()]
  judged = {(case.spec.name, case.implementation, is_causal)
            for cases, is_causal, _, _ in params for case in cases}
  bound = build(spec, None if None in spec.implementations else spec.implementations[-1])[0]
  for name in left:
    if name == "implementation":  # Each but the oracle's own, judged against it.
      listed = {i for i in spec.implementations if i is not None}
      assert {i for n, i, _ in judged if n == spec.name} >= listed - {"reference"}
    elif name not in CALL_KEYWORDS:  # The suite's builder binds the option it sets.
      assert _same(bound.keywords[name], suite_options(spec)[name]), name


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_a_call_without_is_causal_is_non_causal_for_every_entry(spec):
  """One rule: every entry's ``is_causal`` defaults to False (as ``jax.nn``'s); a
  causal-only variant then raises a ValueError that says to pass ``is_causal=True``."""
  default = inspect.signature(spec.function).parameters["is_causal"].default
  assert default is False, f"{spec.name}: is_causal defaults to {default!r}"
  q, k, v = make_qkv(TINY)
  fn = spec.build(**suite_options(spec))
  if not spec.supports_noncausal:
    with pytest.raises(ValueError, match="is_causal=False is not supported.*is_causal=True"):
      fn(q, k, v)
    return
  np.testing.assert_array_equal(fn(q, k, v), fn(q, k, v, is_causal=False))
