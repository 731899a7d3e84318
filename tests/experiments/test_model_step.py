"""experiments.model_step runs end to end on a tiny model and writes its ratios."""

from __future__ import annotations

import json

import pytest

from experiments import model_step

# The training step runs optax (see conftest: standard dtype promotion for it).
pytestmark = pytest.mark.standard_dtype_promotion


def test_model_step_times_the_three_models_and_writes_ratios(tmp_path):
  """A gated variant, whose per-token gates Flax's layer cannot take, times ours and the
  identity model only, instead of failing."""
  config = model_step.Config(
      attentions=("linear_elu", "simple_gla"),
      options={"linear_elu": {"implementation": "reference"},
               "simple_gla": {"implementation": "scan"}},
      lengths=(16,), width=16, layers=1, heads=2, batch=1, dtype="float32", repeats=1, warmup=0,
      seed=0, output_dir=str(tmp_path), plot=False)
  model_step.run(config)
  plain, gated = json.loads((tmp_path / "model_step.json").read_text())["records"]
  for record in plain, gated:
    assert record["status"] == "ok", record["status"]
    assert record["length"] == 16
  assert set(plain["times_s"]) == set(model_step.MODELS)
  for key in ("ours_s", "flax_s", "identity_s", "ours_vs_identity", "flax_vs_identity",
              "ours_vs_flax"):
    assert plain[key] > 0, key
  assert set(gated["times_s"]) == {"ours", "identity"} and gated["ours_vs_identity"] > 0
  for record in plain, gated:  # The kernel's share of each model's step.
    for key in ("page_faults_per_step", "system_s_per_step"):
      assert set(record[key]) == set(record["times_s"]) and min(record[key].values()) >= 0, key
  assert "flax_s" not in gated and "ours_vs_flax" not in gated
