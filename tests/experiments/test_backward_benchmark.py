"""experiments.backward_benchmark runs at tiny sizes and records its medians, ratios and
memory, and its comparison with another library's ops (here a stand-in that calls ours, so
the outputs agree exactly; the figures come from full runs, not from here)."""

from __future__ import annotations

import types

import linattn_jax as la
from experiments import backward_benchmark as bb


def _stand_in():
  def gated_delta_rule(q, k, v, g, beta, *, scale):
    return la.delta_rule_attention(q, k, v, beta, log_decay=g, scale=scale,
                                   is_causal=True), None
  return types.SimpleNamespace(gated_delta_rule=gated_delta_rule)


def test_forward_and_training_step_are_timed_in_turns_with_ratios_and_memory():
  record = bb.compare(8, ["gated_delta_net", "delta_product"], _stand_in(), batch=1, heads=2,
                      dim=4, warmup=0, repeats=1, calls_per_round=2)
  for name in ("gated_delta_net", "delta_product"):
    ours = record[name]["linattn_jax"]
    assert ours["ratio"] > 0 and ours["forward+backward"]["temp_bytes"] is not None
  versus = record["gated_delta_net"]["versus_jla"]
  assert versus["max_abs_difference"] == 0.0
  assert versus["forward+backward"]["time"] > 0 and versus["forward"]["temp_memory"] > 0
  assert "versus_jla" not in record["delta_product"]  # No counterpart there.
