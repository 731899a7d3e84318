"""The experiment scripts run end to end on tiny settings."""

from __future__ import annotations

import importlib
import json
import pathlib
import subprocess
import sys

import pytest
from absl import app, flags

from experiments import approximation, benchmark


def test_every_script_imports_beside_the_others():
  """absl flags live in one registry: two scripts defining one name cannot both load."""
  scripts = sorted(p.stem for p in pathlib.Path("experiments").glob("*.py")
                   if p.stem != "__init__")
  assert {"benchmark", "compare", "context_parallel", "train"} <= set(scripts)
  for name in scripts:
    importlib.import_module(f"experiments.{name}")


def test_benchmark_runs_and_writes_ratios(tmp_path):
  config = benchmark.Config(
      variants=("softmax", "flash"), implementations=None, lengths=(32,), batch=1, heads=2,
      kv_heads=1, head_dim=8, value_dim=8, dtype="float32", causal=True,
      modes=("forward", "backward"), repeats=1, warmup=0, output_dir=str(tmp_path), plot=True,
      max_memory_fraction=0.7, options={}, matmul_baseline=True)
  benchmark.run_benchmark(config)
  report = json.loads((tmp_path / "benchmark.json").read_text())
  cases = report["cases"]
  assert all(c["status"] == "ok" for c in cases), [c["status"] for c in cases]
  attention = [c for c in cases if c["kind"] == "attention"]
  assert {(c["variant"], c["implementation"]) for c in attention} == {
      ("softmax", "xla"), ("softmax", "flash"), ("flash", None)}
  for case in attention:
    assert case["ratio_vs_xla"] > 0 and case["fraction_of_matmul_rate"] > 0
    assert case["memory"]["temp_size_in_bytes"] is not None
  assert (tmp_path / "memory.png").exists()


def test_benchmark_times_sparse_variants_against_their_masked_dense_twin(tmp_path):
  config = benchmark.Config(
      variants=("local",), implementations=("blocked",), lengths=(48,), batch=1, heads=2,
      kv_heads=2, head_dim=8, value_dim=8, dtype="float32", causal=True,
      modes=("forward", "backward"), repeats=1, warmup=0, output_dir=str(tmp_path), plot=False,
      max_memory_fraction=0.7, options={"window_size": [8, 0], "block_size": 8},
      matmul_baseline=False, masked_baseline=True)
  cases = benchmark.run_benchmark(config)["cases"]
  assert [c["kind"] for c in cases] == ["xla", "masked", "attention"] * 2
  assert all(c["status"] == "ok" for c in cases), [c["status"] for c in cases]
  for case in cases[2::3]:
    assert case["ratio_vs_masked_xla"] > 0 and case["memory_vs_masked_xla"] > 0


def test_benchmark_times_packed_calls_against_the_unpacked_ones(tmp_path):
  """``segment_every``: each variant that takes segment_ids runs packed too, after its
  unpacked case, timed in turns with the unpacked call for its ratio."""
  config = benchmark.Config(
      variants=("local",), implementations=("blocked",), lengths=(48,),
      batch=2, heads=2, kv_heads=2, head_dim=8, value_dim=8, dtype="float32", causal=True,
      modes=("backward",), repeats=1, warmup=0, output_dir=str(tmp_path), plot=False,
      max_memory_fraction=0.7, options={"window_size": [8, 0], "block_size": 8},
      matmul_baseline=False, masked_baseline=False, segment_every=10, xla_baseline=False)
  cases = benchmark.run_benchmark(config)["cases"]
  assert [c["kind"] for c in cases] == ["attention", "packed"]
  assert all(c["status"] == "ok" for c in cases), [c["status"] for c in cases]
  local = {c["kind"]: c for c in cases}
  packed = local["packed"]
  assert len(packed["unpacked_times_s"]) == len(packed["times_s"]) == 1
  assert packed["ratio_vs_unpacked"] == pytest.approx(
      packed["median_s"] / packed["unpacked_median_s"])
  ids = benchmark.packed_segment_ids(config, 25)
  assert ids.shape == (2, 25) and ids[0, 9] == 0 and ids[1, 10] == 1 and ids[0, 24] == 2


def test_benchmark_times_gated_delta_product_beside_the_registered_variants(tmp_path):
  """``delta_product_steps``: delta_product_attention with n keys per token, in each mode
  (``log_linear``: log_linear_attention, the same way);
  ``versus``: each other case timed in turns with that variant (at the case's
  implementation where it has it), for ``ratio_vs_versus``."""
  config = benchmark.Config(
      variants=("gated_delta_net", "simple_gla"), implementations=("chunked",), lengths=(12,),
      batch=1, heads=2, kv_heads=2, head_dim=4, value_dim=4, dtype="float32", causal=True,
      modes=("forward", "backward"), repeats=2, warmup=0, output_dir=str(tmp_path), plot=False,
      max_memory_fraction=0.7, options={}, matmul_baseline=False, masked_baseline=False,
      xla_baseline=False, delta_product_steps=3, versus="gated_delta_net", log_linear=True)
  cases = benchmark.run_benchmark(config)["cases"]
  assert [(c["kind"], c["variant"][:10], c["mode"]) for c in cases] == [
      ("attention", "gated_delt", "forward"), ("attention", "simple_gla", "forward"),
      ("delta_product", "gated_delt", "forward"), ("log_linear", "log_linear", "forward"),
      ("attention", "gated_delt", "backward"), ("attention", "simple_gla", "backward"),
      ("delta_product", "gated_delt", "backward"), ("log_linear", "log_linear", "backward")]
  assert all(c["status"] == "ok" for c in cases), [c["status"] for c in cases]
  assert cases[2]["variant"] == "gated_delta_product_n3"
  assert "ratio_vs_versus" not in cases[0]  # The variant itself.
  for case in cases[1:4] + cases[5:]:
    assert case["versus"] == "gated_delta_net" and len(case["versus_times_s"]) == 2
    assert case["ratio_vs_versus"] == pytest.approx(
        case["median_s"] / case["versus_median_s"])
  assert benchmark.versus_case(config, benchmark.Case(
      "attention", "performer", "parallel", 12, "forward")).implementation is None


def test_benchmark_times_a_decode_step_after_prefill(tmp_path):
  config = benchmark.Config(
      variants=("efficient",), implementations=("chunked",), lengths=(16, 32), batch=1, heads=2,
      kv_heads=1, head_dim=8, value_dim=8, dtype="float32", causal=True, modes=("step",),
      repeats=2, warmup=1, output_dir=str(tmp_path), plot=False, max_memory_fraction=0.7,
      options={}, matmul_baseline=False)
  cases = benchmark.run_benchmark(config)["cases"]
  assert [(c["mode"], c["length"]) for c in cases] == [("step", 16), ("step", 32)]
  assert all(c["status"] == "ok" and c["median_s"] > 0 for c in cases)
  # A step's useful work does not grow with the prefill: one query against the state.
  assert benchmark.case_flops(config, benchmark.Case("attention", "linear_elu", "chunked", 16,
                                                     "step")) == 4.0 * 2 * 8 * 8


def test_approximation_error_falls_with_more_features(tmp_path):
  config = approximation.Config(
      num_features=(4, 128), kinds=("orthogonal", "gaussian"), kernels=("positive",), draws=4,
      length=16, heads=2, head_dim=8, value_dim=4, input_scale=0.5, causal=True, seed=0,
      output_dir=str(tmp_path), plot=True)
  results = approximation.run_approximation(config)["results"]
  assert (tmp_path / "approximation.json").exists() and (tmp_path / "approximation.png").exists()
  for kind in config.kinds:
    few, many = (r["mean"] for r in results if r["kind"] == kind)
    assert 0 < many < few, (kind, few, many)


def _run_script(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                        cwd=pathlib.Path(__file__).resolve().parents[2], timeout=300, check=False)


def test_help_lists_the_shared_flags_too():
  """``--help`` prints the main module's flags and the flags it adopts (absl's
  ``module_help``): run once as a user would, and read for the other scripts in-process."""
  result = _run_script("experiments.decode", "--help")  # absl exits with status 1 after --help.
  helps = {"experiments.decode": result.stdout}
  for script in ("experiments.benchmark", "experiments.approximation"):
    helps[script] = flags.FLAGS.module_help(importlib.import_module(script))
  for script, text in helps.items():
    for flag in ("--output_dir", "--heads", "--[no]plot"):
      assert flag in text, f"{script} --help omits {flag}"


def test_a_bad_attentions_value_prints_one_error_line_not_the_flag_list():
  result = _run_script("experiments.decode", "--attentions=softmax,no_such_attention")
  assert result.returncode != 0
  lines = (result.stdout + result.stderr).strip().splitlines()
  assert lines[0].startswith("FATAL Flags parsing error: flag --attentions=")
  assert "unknown attention(s) ['no_such_attention']; available: [" in lines[0]
  assert lines[1:] == ["Pass --helpshort or --helpfull to see help on flags."]


def test_a_failing_case_makes_the_run_fail_after_writing_every_case(tmp_path):
  result = _run_script(
      "experiments.benchmark", "--variants=local", "--options={\"window_size\": [-1, 0]}",
      "--lengths=16", "--modes=forward", "--heads=1", "--head_dim=4", "--repeats=1",
      "--warmup=0", "--noplot", "--nomatmul_baseline", f"--output_dir={tmp_path}")
  assert result.returncode != 0
  assert "Unable to initialize backend" not in result.stdout + result.stderr  # No TPU: quiet.
  assert "2 benchmark case(s) failed" in result.stderr  # The variant and its masked twin.
  assert "FAILED local blocked T=16 forward" in result.stdout
  cases = json.loads((tmp_path / "benchmark.json").read_text())["cases"]
  assert [(c["kind"], c["status"].split(":")[0]) for c in cases] == [
      ("xla", "ok"), ("masked", "error"), ("attention", "error")]


def test_step_mode_rejects_variants_without_a_step():
  config = benchmark.Config(
      variants=("softmax",), implementations=None, lengths=(16,), batch=1, heads=2,
      kv_heads=2, head_dim=8, value_dim=8, dtype="float32", causal=True, modes=("step",),
      repeats=1, warmup=0, output_dir="unused", plot=False, max_memory_fraction=0.7,
      options={}, matmul_baseline=True)
  with pytest.raises(app.UsageError, match=r"--modes=step: \['softmax'\] have no streaming step"):
    benchmark._validate(config)


def test_decode_benchmark_runs_and_reports_cache_bytes(tmp_path):
  """Its ``main`` in-process, with the flags parsed as the command line would be (the command
  line itself: the tests of ``--help`` and of a bad ``--attentions`` above)."""
  from experiments import decode

  flags.FLAGS.unparse_flags()
  try:
    argv = flags.FLAGS([
        "decode", "--attentions=softmax,local,linear_elu", "--positions=8,32", "--heads=2",
        "--head_dim=4", "--steps=2", "--repeats=1", "--noplot", f"--output_dir={tmp_path}"])
    decode.main(argv)
  finally:
    flags.FLAGS.unparse_flags()
  records = json.loads((tmp_path / "decode.json").read_text())["records"]
  by = {(r["attention"], r["position"]): r for r in records}
  assert all(r["status"] == "ok" and r["step_s"] > 0 for r in records)
  # A KV cache (capacity P + steps) grows with P; a recurrent state does not.
  assert by["softmax", 32]["cache_bytes"] > by["softmax", 8]["cache_bytes"]
  assert by["linear_elu", 32]["cache_bytes"] == by["linear_elu", 8]["cache_bytes"]
