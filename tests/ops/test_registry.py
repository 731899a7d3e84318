"""The registry: names, option checking and the uniform signature."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import (
  SHAPES,
  SUITE_SETTINGS,
  Case,
  assert_matches_oracle,
  build,
  make_qkv,
  spec_cases,
  suite_options,
)

import linattn_jax as la
from linattn_jax._src import registry


def test_foundation_variants_are_registered():
  assert {"softmax", "flash"} <= set(la.available_attentions())
  assert la.available_attentions() == sorted(la.available_attentions())


def test_get_attention_binds_options_and_has_the_uniform_signature():
  q, k, v = make_qkv(SHAPES[0])
  attn = la.get_attention("flash", block_q=4, block_k=8)
  got = attn(q, k, v, is_causal=True, key_value_seq_lengths=None)
  want = la.softmax_attention_reference(q, k, v, is_causal=True)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_unknown_names_and_options_raise():
  with pytest.raises(ValueError, match=r"unknown attention 'nope'; available: \["):
    la.get_attention("nope")
  with pytest.raises(ValueError, match=r"unknown option `block_size`; options are \["):
    la.get_attention("flash", block_size=3)
  with pytest.raises(ValueError, match="`is_causal` is passed at call time"):
    la.get_attention("softmax", is_causal=True)


@pytest.mark.parametrize("name, required", [
    ("local", "window_size"), ("strided", "stride"), ("block_sparse", "layout"),
    ("longformer", "window_size"), ("bigbird", "block_size")])
def test_required_options_are_checked_when_the_function_is_built(name, required):
  with pytest.raises(ValueError, match=rf"missing required option\(s\) \[.*'{required}'"):
    la.get_attention(name)


def test_reference_drops_only_how_options():
  spec = la.get_spec("flash")
  ref = spec.build_reference(block_q=2, scale=0.5)
  q, k, v = make_qkv(SHAPES[0])
  np.testing.assert_allclose(ref(q, k, v), la.softmax_attention_reference(q, k, v, scale=0.5))


def test_names_register_once():
  with pytest.raises(ValueError, match="already registered"):
    la.register_attention(la.get_spec("softmax"))


def test_a_spec_names_its_per_token_inputs_and_calls_without_them_fail():
  """``token_inputs`` (gates, betas): keyword arguments of every call, never options; their
  shapes come from one declaration, and the roles' bounds are checked where concrete."""
  def gated(query, key, value, *, log_decay, is_causal=False, key_value_seq_lengths=None):
    return la.softmax_attention(query, key, value * jnp.exp(log_decay)[..., None],
                                is_causal=is_causal)

  spec = la.AttentionSpec(name="gated_example", function=gated, reference=gated,
                          token_inputs=(la.TokenInput("log_decay", la.Role.DECAY),))
  fn = spec.build()
  x = jnp.ones((1, 4, 2, 3))
  assert fn(x, x, x, log_decay=jnp.zeros((1, 4, 2))).shape == (1, 4, 2, 3)
  with pytest.raises(ValueError, match=r"gated_example: each call needs .*log_decay \[B, S, K\]"):
    fn(x, x, x)
  with pytest.raises(ValueError, match="log_decay.*passed at call time"):
    spec.build(log_decay=jnp.zeros((1, 4, 2)))
  assert la.get_spec("gla").token_input_shapes(x.shape) == {"log_decay": (1, 4, 2, 3)}
  assert spec.token_input_shapes(x.shape) == {"log_decay": (1, 4, 2)}
  assert spec.token_input_shapes((1, 2, 3)) == {"log_decay": (1, 2)}  # One token's.
  assert not spec.unit_keys and la.get_spec("delta_net").unit_keys
  with pytest.raises(ValueError, match=r"gated_example: missing the per-token input\(s\) "
                                       r"log_decay \[B, S, K\]"):
    spec.check_token_inputs({}, x.shape)
  with pytest.raises(ValueError, match=r"log_decay must be a float array \[B, S, K\] = "
                                       r"\(1, 4, 2\) for key \(1, 4, 2, 3\); got int32"):
    spec.check_token_inputs({"log_decay": jnp.zeros((1, 4, 2), jnp.int32)}, x.shape)
  with pytest.raises(ValueError, match=r"log_decay \(decay\) must lie in \[-inf, 0.0\]"):
    spec.check_token_inputs({"log_decay": jnp.ones((1, 4, 2))}, x.shape)
  traced = jax.jit(lambda g: spec.check_token_inputs({"log_decay": g}, x.shape)["log_decay"])
  assert float(traced(jnp.ones((1, 4, 2)))[0, 0, 0]) == 1.0  # Not concrete: not read.


def test_a_registered_variant_joins_the_shared_suite_with_its_defaults(monkeypatch):
  """The suite's cases come from the registry: registering is all a variant does to join.
  One the suite's table (``SUITE_SETTINGS``) does not list runs with its default options
  and every implementation it lists."""

  def halved(query, key, value, *, is_causal=False, key_value_seq_lengths=None,
             implementation="xla"):
    return la.softmax_attention(query, key, value, scale=0.5, is_causal=is_causal,
                                key_value_seq_lengths=key_value_seq_lengths,
                                implementation=implementation)

  spec = la.AttentionSpec(name="halved_softmax", function=halved,
                          reference=functools.partial(la.softmax_attention_reference, scale=0.5),
                          implementations=("xla", "flash"))
  assert spec.name not in SUITE_SETTINGS
  monkeypatch.setitem(registry._REGISTRY, spec.name, spec)
  cases = [c for c in spec_cases() if c.spec is spec]
  assert cases == [Case(spec, "xla"), Case(spec, "flash")]
  assert [c.id for c in cases] == ["halved_softmax-xla", "halved_softmax-flash"]
  assert suite_options(spec) == {}
  q, k, v = make_qkv(SHAPES[0])
  for case in cases:
    fast, _ = build(*case)
    assert_matches_oracle(fast(q, k, v, is_causal=True), spec, q, k, v, is_causal=True)


def test_the_suite_settings_name_registered_variants_implementations_and_options():
  """A stale entry in the suite's table (a renamed variant, a dropped implementation, a
  misspelt option) fails here instead of being silently ignored."""
  for name, settings in SUITE_SETTINGS.items():
    spec = la.get_spec(name)  # Raises for a name that is not registered.
    extra = set(settings.implementations or ()) - set(spec.implementations)
    assert not extra, f"{name}: the suite runs {sorted(extra)}, not among {spec.implementations}"
    spec.build(**settings.options)  # Raises for an option the function does not take.
