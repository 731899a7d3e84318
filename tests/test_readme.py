"""The README stays true: CI runs its test command; its quick start runs."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
  namespace: dict = {}
  exec(compile(_blocks("python")[3], "README context parallelism", "exec"), namespace)  # noqa: S102
  assert namespace["out"].shape == (2, 4096, 8, 64)
  assert namespace["layer"].context_parallel.axis_name == "seq"
