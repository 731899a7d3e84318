"""What each test costs: seconds, and the programs JAX traces, lowers and compiles for it.

A pytest plugin (``tests/conftest.py`` loads it). Every test is measured with
``jax.monitoring``'s compile events (trace, lowering to MLIR, backend compile;
a program the persistent cache returns still counts as a compilation, its
event spans the lookup). With ``--cost-report=PATH`` the session writes the
per-file totals, and the slowest tests, to ``PATH`` as JSON (each xdist worker
writes its part, the controller joins them); ``docs/render_results.py``
renders ``docs/results/test_costs/test_costs.json`` on the Testing page.

The number of distinct programs the session's test processes compiled (the
union of their compilation-cache keys) does not depend on how the tests are
dealt to the workers, nor on the machine: ``--cost-report`` records it, and
``tests/compile_budget.json`` bounds it (checked at the end of a whole-suite
run; see :func:`check_budget`). The training runs and notebook kernels the
tests start are not in it.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import time

import jax
import pytest

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
FIELDS = ("tests", "seconds", "compiles", "trace_s", "lower_s", "compile_s")
BUDGET = pathlib.Path(__file__).parent.parent / "compile_budget.json"


class _Meter:
  """Sums the compile events (trace, lower and compile seconds, compilations) until :meth:`take`."""

  def __init__(self):
    self.totals = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(self._listener)

  def _listener(self, event: str, duration: float, **kwargs) -> None:
    del kwargs
    field = _EVENTS.get(event)
    if field is not None:
      self.totals[field] += duration
      self.totals["compiles"] += field == "compile_s"

  def take(self) -> collections.Counter:
    out, self.totals = self.totals, collections.Counter()
    return out


_meter: _Meter | None = None
_records: dict[str, collections.Counter] = {}
_keys: set[str] = set()  # The persistent-cache keys of this process's compilations.


def _record_cache_keys() -> bool:
  """Notes the compilation-cache key of every program this process compiles or reads.

  A key hashes the program (without source locations), its compile options and the
  backend, so the union over the workers is the session's distinct programs, whichever
  worker compiled which, whether or not the cache kept an entry. JAX logs each key on a
  cache hit or miss (``jax._src.compiler``); both log functions are wrapped here. Returns
  False where this JAX has neither (the count is then unknown).
  """
  from jax._src import compiler
  names = ("log_persistent_cache_hit", "log_persistent_cache_miss")
  if not all(hasattr(compiler, name) for name in names):
    return False
  for name in names:
    original = getattr(compiler, name)

    def noting(module_name, cache_key, original=original):
      _keys.add(cache_key)
      return original(module_name, cache_key)
    setattr(compiler, name, noting)
  return True


_KEYED = False


def pytest_addoption(parser):
  parser.addoption(
      "--cost-report", default=None, metavar="PATH",
      help="write each test file's seconds, compilations and trace/lower/compile seconds, "
           "the slowest tests and the session's distinct compiled programs to PATH (JSON)")


def pytest_configure(config):
  global _meter, _KEYED
  _meter = _Meter()
  _KEYED = _record_cache_keys()


_start = 0.0


def pytest_runtest_logstart(nodeid, location):
  del nodeid, location
  global _start
  _meter.take()
  _start = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
  del location
  record = _meter.take()
  record["seconds"] = time.perf_counter() - _start
  _records[nodeid] = record


def _part_path(config, worker: str) -> pathlib.Path:
  return pathlib.Path(config.getoption("--cost-report") + f".{worker}.part")


def _keys_path(worker: str) -> pathlib.Path | None:
  folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  return pathlib.Path(folder) / f"linattn-keys-{worker}.json" if folder else None


def _write_keys(config) -> None:
  """A worker's keys, beside the cache, for the controller's count."""
  worker = getattr(config, "workerinput", {}).get("workerid", "main")
  path = _keys_path(worker)
  if path is not None and _KEYED:
    path.write_text(json.dumps(sorted(_keys)))


OWN_CACHE = False  # Set by conftest.py: whether the session made its cache folder.


def distinct_programs() -> int | None:
  """The session's distinct programs: the union of its processes' cache keys (unknown in
  a cache folder kept from other sessions)."""
  folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if not (_KEYED and OWN_CACHE) or not folder or not os.path.isdir(folder):
    return None
  keys = set(_keys)
  for path in pathlib.Path(folder).glob("linattn-keys-*.json"):
    keys.update(json.loads(path.read_text()))
  return len(keys)


def _whole_suite(config) -> bool:
  """Whether this session ran the default suite: every test file, no selection, the CI
  grid and seeds."""
  option = config.option
  return (not config.args or [str(a) for a in config.args] == ["tests"]) and not (
      option.keyword or option.markexpr or getattr(option, "deselect", None)
      or getattr(option, "lf", False) or getattr(option, "last_failed", False)
      or config.getoption("--full") or config.getoption("--seeds") != 1
      or getattr(option, "exitfirst", False) or getattr(option, "maxfail", 0))


def check_budget(session) -> None:
  """Fails a whole-suite run (controller only) whose distinct compiled programs exceed
  ``tests/compile_budget.json``: the count is that of the session's own compilation cache,
  the same on every machine and however the tests are dealt to the workers. Raise the
  budget on purpose, in the commit that adds the cases."""
  config = session.config
  if hasattr(config, "workerinput") or not OWN_CACHE or not _whole_suite(config):
    return
  count, budget = distinct_programs(), json.loads(BUDGET.read_text())["distinct_programs"]
  reporter = config.pluginmanager.get_plugin("terminalreporter")
  line = f"compilation budget: {count} distinct programs compiled, budget {budget}"
  if count is not None and count > budget:
    line += (f" -- {count - budget} over: compile less (share programs, deal cases), or "
             "raise the budget in tests/compile_budget.json in the commit that adds them")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
  if reporter is not None:
    reporter.write_line(line, red=count is not None and count > budget)


def pytest_sessionfinish(session, exitstatus):
  del exitstatus
  config = session.config
  if hasattr(config, "workerinput"):
    _write_keys(config)
  if config.getoption("--cost-report") is None:
    return
  worker = getattr(config, "workerinput", {}).get("workerid")
  if worker is not None:  # An xdist worker: its part, for the controller.
    parts = {k: dict(v) for k, v in _records.items()}
    _part_path(config, worker).write_text(json.dumps(parts))
    return
  records = {k: dict(v) for k, v in _records.items()}
  for part in pathlib.Path(config.getoption("--cost-report")).parent.glob(
      pathlib.Path(config.getoption("--cost-report")).name + ".*.part"):
    records.update(json.loads(part.read_text()))
    part.unlink()
  write_report(config.getoption("--cost-report"), records)


def _totals(records: dict[str, dict[str, float]], group) -> dict[str, collections.Counter]:
  """The records summed by ``group(nodeid)``, with a count of ``tests``."""
  totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for nodeid, record in records.items():
    total = totals[group(nodeid)]
    total["tests"] += 1
    for field in FIELDS[1:]:
      total[field] += record.get(field, 0)
  return totals


def write_report(path: str, records: dict[str, dict[str, float]]) -> None:
  files = _totals(records, lambda nodeid: nodeid.split("::")[0])
  functions = _totals(records, lambda nodeid: nodeid.split("[")[0])
  slowest = sorted(records.items(), key=lambda item: -item[1].get("seconds", 0))[:25]
  report = {
      "meta": {"cpu_count": os.cpu_count(), "jax": jax.__version__,
               "date": time.strftime("%Y-%m-%d"),
               "xla_flags": os.environ.get("XLA_FLAGS", "")},
      "distinct_programs": distinct_programs(),
      "files": {name: {f: round(v, 2) for f, v in sorted(c.items())}
                for name, c in sorted(files.items())},
      "functions": {name: {f: round(v, 2) for f, v in sorted(c.items())}
                    for name, c in sorted(functions.items(), key=lambda x: -x[1]["seconds"])},
      "slowest": [{"test": nodeid, **{f: round(v, 2) for f, v in r.items()}}
                  for nodeid, r in slowest],
  }
  pathlib.Path(path).write_text(json.dumps(report, indent=1) + "\n")
