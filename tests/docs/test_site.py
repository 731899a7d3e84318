"""The documentation site covers what it must, checked without building it.

The API pages (``docs/api/*.md``) declare their entries in ``autosummary``
lists; every public name of ``linattn_jax`` and its namespaces has one entry.
Every notebook is a page; every result file renders into a table that a page
includes; every link into ``docs/`` from the README or the code lands on a heading. The
support matrix (``docs/variants.md``) says what the registry declares. The
build itself (``sphinx-build -W``) runs in CI, after the tests.
"""

from __future__ import annotations

import collections
import importlib.util
import inspect
import json
import pathlib
import re
import types

import pytest
import toy_gated

import linattn_jax as la
from linattn_jax import feature_maps, masks, nn, parallel

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
NAMESPACES = (la, nn, parallel, masks, feature_maps)


def _declared_api() -> dict[str, list[str]]:
  """``{module: [names]}`` from the ``currentmodule`` and ``autosummary`` blocks of the API
  pages, in the order they are declared (a name twice is listed twice)."""
  declared = collections.defaultdict(list)
  for page in sorted((DOCS / "api").glob("*.md")):
    for block in re.findall(r"```\{eval-rst\}\n(.*?)```", page.read_text(), flags=re.S):
      module = re.search(r"^\.\. currentmodule:: (\S+)$", block, flags=re.M)
      summary = re.search(r"^\.\. autosummary::\n((?:   .*\n|\n)*)", block, flags=re.M)
      if module and summary:
        names = [line.strip() for line in summary.group(1).splitlines()
                 if line.strip() and not line.strip().startswith(":")]
        declared[module.group(1)].extend(names)
  return declared


@pytest.mark.parametrize("module", NAMESPACES, ids=lambda m: m.__name__)
def test_every_public_name_has_an_api_entry(module):
  declared = _declared_api()[module.__name__]
  public = [name for name in module.__all__
            if not isinstance(getattr(module, name), types.ModuleType)]
  assert sorted(declared) == sorted(set(declared)), "a name is declared twice"
  assert set(declared) == set(public), (
      f"missing: {sorted(set(public) - set(declared))}; "
      f"not public: {sorted(set(declared) - set(public))}")


def test_every_api_page_is_in_the_api_index():
  index = (DOCS / "api" / "index.md").read_text()
  pages = sorted(p.stem for p in (DOCS / "api").glob("*.md") if p.stem != "index")
  toctree = re.search(r"```\{toctree\}\n(.*?)```", index, flags=re.S).group(1)
  assert pages == sorted(line for line in toctree.split() if not line.startswith(":"))


def test_every_notebook_is_a_page():
  listed = (DOCS / "notebooks.md").read_text()
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    assert f"notebooks/{path.stem}\n" in listed, path.name


def _render_results():
  spec = importlib.util.spec_from_file_location("render_results", DOCS / "render_results.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_result_file_renders_into_an_included_table(tmp_path):
  """Each ``docs/results/<folder>/<script>.json`` becomes ``<folder>.md`` with a table whose
  numbers are the file's, and a page includes it (with the command that made it)."""
  render = _render_results()
  written = render.render_all(DOCS / "results", tmp_path)
  assert {p.name for p in written} >= {"benchmark.md", "model_step.md", "decode.md"}
  pages = "".join(p.read_text() for p in DOCS.glob("*.md"))
  for path in written:
    assert f"```{{include}} _generated/{path.name}\n" in pages, path.name
    assert (f"--output_dir=docs/results/{path.stem}" in pages
            or f"--cost-report=docs/results/{path.stem}/" in pages), f"no command for {path.stem}"
    assert "\n|---|" in path.read_text(), f"{path.name}: no table"


def _command_for(folder: str) -> str:
  """The page's shell command that wrote ``docs/results/<folder>``, continuation lines joined."""
  pages = "".join(p.read_text() for p in DOCS.glob("*.md"))
  for block in re.findall(r"```bash\n(.*?)```", pages, flags=re.S):
    command = block.replace("\\\n", " ")
    words = command.split()
    if f"--output_dir=docs/results/{folder}" in words or any(
        w.startswith(f"--cost-report=docs/results/{folder}/") for w in words):
      return command
  raise AssertionError(f"no command writes docs/results/{folder}")


def _flag(command: str, name: str) -> str | None:
  found = re.search(rf"--{name}=(\S+)", command)
  return found and found.group(1)


def test_each_result_file_was_written_by_the_command_beside_it():
  """The settings a file records are the ones its command on the page passes."""
  for path in sorted(DOCS.glob("results/*/*.json")):
    report, command = json.loads(path.read_text()), _command_for(path.parent.name)
    if path.name == "benchmark.json":
      config = report["metadata"]["config"]
      assert _flag(command, "lengths") == ",".join(map(str, config["lengths"])), path
      assert _flag(command, "variants") == ",".join(config["variants"]), path
      assert int(_flag(command, "repeats") or 5) == config["repeats"], path
    elif path.name == "model_step.json":
      config = report["metadata"]["config"]
      assert _flag(command, "seq_lengths") == ",".join(map(str, config["lengths"])), path
      assert _flag(command, "attentions") == ",".join(config["attentions"]), path
      assert int(_flag(command, "repeats") or 5) == config["repeats"], path
    elif path.name == "decode.json":
      records = report["records"]
      positions = ",".join(map(str, dict.fromkeys(r["position"] for r in records)))
      assert _flag(command, "positions") == positions, path
      attentions = ",".join(dict.fromkeys(r["attention"] for r in records))
      assert _flag(command, "attentions") == attentions, path


def test_benchmark_tables_show_the_measured_medians(tmp_path):
  render = _render_results()
  render.render_all(DOCS / "results", tmp_path)
  for path in (DOCS / "results").glob("*/benchmark.json"):
    table = (tmp_path / f"{path.parent.name}.md").read_text()
    for case in json.loads(path.read_text())["cases"]:
      if case["status"] == "ok" and case["kind"] != "matmul":
        assert f"| {render._ms(case['median_s'])}" in table or (
            f" {render._ms(case['median_s'])} (" in table), (path, case["variant"])


def test_the_test_cost_table_shows_each_file_and_the_total(tmp_path):
  render = _render_results()
  render.render_all(DOCS / "results", tmp_path)
  report = json.loads((DOCS / "results" / "test_costs" / "test_costs.json").read_text())
  table = (tmp_path / "test_costs.md").read_text()
  for name, cost in report["files"].items():
    assert f"| `{name}` | {cost['tests']} | {cost['seconds']:.1f} | {cost['compiles']} |" in table
  assert f"{sum(c['tests'] for c in report['files'].values()):,} tests" in table
  assert f"({report['distinct_programs']:,} distinct programs)" in table


def _slug(heading: str) -> str:
  """The anchor GitHub and MyST give a heading."""
  text = re.sub(r"[`*]", "", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _headings(page: pathlib.Path) -> set[str]:
  return {_slug(h) for h in re.findall(r"^#{1,4} (.+)$", page.read_text(), flags=re.M)}


def test_readme_links_into_docs_land_on_headings():
  readme = (ROOT / "README.md").read_text()
  links = re.findall(r"\]\((docs/[\w/]+\.md)(?:#([\w-]+))?\)", readme)
  assert links
  for page, anchor in links:
    assert (ROOT / page).exists(), page
    if anchor:
      assert anchor in _headings(ROOT / page), f"{page}#{anchor}"


def test_code_links_to_measurements_land_on_headings():
  """Code comments cite timings by a link such as ``docs/benchmarks.md#chunk-size``."""
  sources = [p for folder in ("linattn_jax", "experiments", "tests", "notebooks")
             for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".ipynb")]
  for source in sources:
    for page, anchor in re.findall(r"docs/([\w/]+\.md)#([\w-]+)", source.read_text()):
      assert (DOCS / page).exists() and anchor in _headings(DOCS / page), (
          f"{source.relative_to(ROOT)}: docs/{page}#{anchor}")


# The support matrix's rows, by registry name; the other registry entries reuse a row's
# function with another feature map.
MATRIX_ROWS = {
    "softmax_attention": "softmax", "flash_attention": "flash", "linear_attention": "linear_elu",
    "performer_attention": "performer", "linear_learned": "linear_learned",
    "cosformer_attention": "cosformer", "linformer_attention": "linformer",
    "efficient_attention": "efficient", "heinsen_attention": "heinsen", "local_attention": "local",
    "strided_attention": "strided", "block_sparse_attention": "block_sparse",
    "longformer_attention": "longformer", "bigbird_attention": "bigbird",
    "retention": "retention", "simple_gla": "simple_gla", "gla": "gla", "delta_net": "delta_net",
    "gated_delta_net": "gated_delta_net", "kda": "kda", "dplr_attention": "dplr",
}
SAME_ROW = {"linear_relu": "linear_elu", "random_fourier": "performer", "rwkv7": "dplr"}


def test_support_matrix_matches_the_registry():
  """Each row says what its registry entry declares; the shared suite tests those claims."""
  page = (DOCS / "variants.md").read_text()
  section = page.split("## Support matrix", 1)[1].split("\n## ", 1)[0]
  rows = {}
  for line in section.splitlines():
    if line.startswith("| `"):
      cells = [c.strip() for c in line.strip("|").split(" | ")]
      rows[re.match(r"`(\w+)`", cells[0]).group(1)] = cells
  assert sorted(rows) == sorted(MATRIX_ROWS)
  library = [n for n in la.available_attentions() if n != toy_gated.NAME]  # The tests' own.
  assert sorted([*MATRIX_ROWS.values(), *SAME_ROW]) == sorted(library)
  known = {i for name in la.available_attentions() for i in la.get_spec(name).implementations}
  for row, (_, impls, noncausal, causal, padding, gqa, step, passing, packed) in rows.items():
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
    takes_ids = "segment_ids" in inspect.signature(spec.function).parameters
    if not takes_ids:  # Linformer: a projected row mixes every position.
      assert packed.startswith("–"), row
      continue
    assert packed == "causal, T = S" if spec.packed_causal_only else packed.startswith("✓"), row
  for name, same in SAME_ROW.items():
    assert la.get_spec(name).implementations == la.get_spec(same).implementations
