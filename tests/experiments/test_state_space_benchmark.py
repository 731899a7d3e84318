"""experiments.state_space_benchmark's comparisons run at tiny sizes and record their
medians, temporary memory and ratios (the figures come from full runs, not from here)."""

from __future__ import annotations

from experiments import state_space_benchmark as ssb


def test_each_comparison_records_medians_memory_and_ratios():
  timing = {"warmup": 0, "repeats": 1}
  gla = ssb.mamba2_vs_simple_gla(8, heads=2, state=4, head_dim=4, **timing)
  assert gla["ratio"] > 0 and gla["mamba2"]["temp_bytes"] is not None
  scan = ssb.selective_scan_vs_mamba2(8, inner=64, d_state=2, **timing)
  assert scan["ratio_scan"] > 0 and scan["ratio_associative_scan"] > 0
  load = ssb.load_vs_read(width=64, repeats=1)
  assert load["ratio"] > 0 and load["bytes"] > 0
