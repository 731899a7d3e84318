"""The README stays true: CI runs its test command; its quick start runs."""

from __future__ import annotations

import pathlib
import re

import pytest
import toy_gated

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
  test_command = _blocks("bash")[1].strip()
  ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_command in ci_lines


def test_quick_start_runs():
  namespace: dict = {}
  exec(compile(_blocks("python")[0], "README quick start", "exec"), namespace)  # noqa: S102
  assert namespace["out"].shape == (2, 1024, 8, 64)


@pytest.mark.standard_dtype_promotion  # The example steps optax.
def test_model_example_trains():
  namespace: dict = {}
  exec(compile(_blocks("python")[1], "README model", "exec"), namespace)  # noqa: S102
  losses = namespace["losses"]
  assert len(losses) == 5 and losses[-1] < losses[0]  # One batch, five steps: it fits.


def test_layers_example_runs():
  namespace: dict = {}
  exec(compile(_blocks("python")[2], "README layers", "exec"), namespace)  # noqa: S102
  assert namespace["y"].shape == (2, 64, 128)
  assert [s.shape for s in namespace["steps"]] == [(2, 1, 128)] * 4


def test_context_parallel_example_runs():
  """The example as written, at T = 256 instead of 4096: what it shows (the calls run on the
  mesh they are given, Explicit axes included) does not depend on T, and its ring attention
  at T = 4096 took 10 of this test's 14 s. tests/parallel judges the values."""
  source = _blocks("python")[3]
  assert source.count("(2, 4096, 8, 64)") == 1
  source = source.replace("(2, 4096, 8, 64)", "(2, 256, 8, 64)")
  namespace: dict = {}
  exec(compile(source, "README context parallelism", "exec"), namespace)  # noqa: S102
  assert namespace["out"].shape == (2, 256, 8, 64)
  assert namespace["layer"].context_parallel.axis_name == "seq"


# The support matrix's rows, by registry name; the other registry entries reuse a row's
# function with another feature map.
MATRIX_ROWS = {
    "softmax_attention": "softmax", "flash_attention": "flash", "linear_attention": "linear_elu",
    "performer_attention": "performer", "linear_learned": "linear_learned",
    "efficient_attention": "efficient", "heinsen_attention": "heinsen", "local_attention": "local",
    "strided_attention": "strided", "block_sparse_attention": "block_sparse",
    "longformer_attention": "longformer", "bigbird_attention": "bigbird",
    "retention": "retention", "simple_gla": "simple_gla", "gla": "gla", "delta_net": "delta_net",
    "gated_delta_net": "gated_delta_net",
}
SAME_ROW = {"linear_relu": "linear_elu", "random_fourier": "performer"}


def test_support_matrix_matches_the_registry():
  """Each row says what its registry entry declares; the shared suite tests those claims."""
  import linattn_jax as la

  section = README.split("## Support matrix", 1)[1].split("\n## ", 1)[0]
  rows = {}
  for line in section.splitlines():
    if line.startswith("| `"):
      cells = [c.strip() for c in line.strip("|").split(" | ")]
      rows[re.match(r"`(\w+)`", cells[0]).group(1)] = cells
  assert sorted(rows) == sorted(MATRIX_ROWS)
  library = [n for n in la.available_attentions() if n != toy_gated.NAME]  # Not a row.
  assert sorted([*MATRIX_ROWS.values(), *SAME_ROW]) == sorted(library)
  known = {i for name in la.available_attentions() for i in la.get_spec(name).implementations}
  for row, (_, impls, noncausal, causal, padding, gqa, step, passing) in rows.items():
    spec = la.get_spec(MATRIX_ROWS[row])
    listed = set(re.findall(r"`(\w+)`", impls)) & known
    if impls.startswith("as `linear_attention`"):
      listed |= set(la.get_spec("linear_elu").implementations)
    assert listed == set(spec.implementations) - {None}, row
    assert noncausal.startswith("✓") == spec.supports_noncausal, row
    assert causal.startswith("✓") == spec.supports_causal, row
    assert padding.startswith("✓") and gqa.startswith("✓"), row  # The suite runs both on all.
    assert step.startswith("✓") == (spec.streaming is not None), row
    state_passing = spec.streaming is not None and spec.streaming.state_passing
    assert passing.startswith("✓") == state_passing, row
  for name, same in SAME_ROW.items():
    assert la.get_spec(name).implementations == la.get_spec(same).implementations
