"""Settings for the test session.

The tests compile thousands of tiny programs, and for those XLA's backend
optimisation passes cost far more than running the result. Unless the
caller sets ``XLA_FLAGS``, compile with them turned down and (jaxlib 0.10)
with the CPU backend's elemental emitter instead of its newer fusion
emitters, which compile such programs about 2.5x slower (measured on the
suite's shapes), and as one LLVM module per program rather than one split
for parallel code generation (the two test workers already fill two cores).
Every tolerance holds either way; to test the default code generation,
run with e.g. ``XLA_FLAGS=`` (empty) set.

The session's workers, and the processes they start, share one XLA compilation
cache (a temporary folder the first process makes and removes at the end),
which keeps every program: the cases of a parametrized test are spread over
the workers, and the training runs and notebooks compile the same programs
again. JAX reports a program the cache
returns as a compilation (its ``backend_compile_duration`` event spans the
lookup), so ``CompileCounter`` still counts every compilation the in-memory
caches miss. Set ``JAX_COMPILATION_CACHE_DIR`` to use another folder (kept),
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` to keep only slower programs.

The cache's keys also count the session's distinct programs, which a whole-suite
run checks against ``tests/compile_budget.json`` (``support/costs.py``).

Float32 matrix products run at full precision: the parity tolerances are
float32's. (GPUs otherwise multiply float32 in TF32, with 10-bit mantissas.)

The CPU platform has 8 devices, for the context-parallel tests; everything
else runs on the first (the training loop's data mesh spans all 8).
Subprocesses choose their own count.

The registry also holds ``toy_gated`` (``support/toy_gated.py``), a recurrence
defined in the tests: every test that runs over the registry runs it too.

Every test runs with ``jax.numpy_rank_promotion("raise")`` and
``jax.numpy_dtype_promotion("strict")``, as many codebases do: the library
must never rely on implicit rank or dtype promotion. Tests marked
``standard_dtype_promotion`` run optax, whose Adam bias correction and
schedules mix a Python float with int32 step counts (optax 0.2.x), under the
standard dtype rules; rank promotion stays "raise" for them too.
"""

import gc
import os
import pathlib
import shutil
import sys
import tempfile

import jax
import jaxlib.version
import pytest

# Shared helpers (tests/support/_helpers.py) import by name from every test folder.
sys.path.insert(0, str(pathlib.Path(__file__).parent / "support"))

# XLA reads these when its first backend starts (after this import); an unknown flag
# aborts the process, so the CPU flags measured on jaxlib 0.10 are set there only (0.11
# dropped the elemental-emitter switch; the split count is unchecked there). One LLVM
# module per program: with the split, the suite's programs took 15% longer to compile.
_FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if jaxlib.version.__version_info__ < (0, 11):
  _FAST_COMPILE_FLAGS += (" --xla_cpu_use_fusion_emitters=false"
                          " --xla_cpu_parallel_codegen_split_count=1")
os.environ.setdefault("XLA_FLAGS", _FAST_COMPILE_FLAGS)
# Each operation of a lowered program carries its source location as MLIR metadata, by
# default with up to 100 frames of the Python stack that made it. The suite's programs are
# never profiled or dumped, and without the frames they lower and compile faster
# (docs/testing.md). Python's own tracebacks are unchanged.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
jax.config.update("jax_traceback_in_locations_limit",
                  int(os.environ["JAX_TRACEBACK_IN_LOCATIONS_LIMIT"]))
# JAX reads its environment at import, so the precision is set through the config
# here, and through the environment for the subprocesses the tests start.
if "JAX_DEFAULT_MATMUL_PRECISION" not in os.environ:
  os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
  jax.config.update("jax_default_matmul_precision", "highest")
# The first process (the xdist controller, or a lone pytest) makes the folder; the workers
# it starts inherit the variable.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="linattn-jax-xla-cache-")
# Every program, however quick to compile. An entry costs 10-17 ms to write (7-22% of
# tests/ops/test_heinsen.py's and test_linear.py's compile time in one process), but with two
# workers keeping only the programs that took 0.1 s or more was slower (test_shared_suite.py
# and test_contract.py's packed and keyword tests: 70 and 64 s against 66 and 62 s), since
# the workers then compile the quick ones twice. The subprocesses the tests start (training
# runs, notebook kernels) read the same settings from the environment.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# A gated recurrence defined in the tests (support/toy_gated.py) joins the registry before
# collection: the shared suite, the contract test, the layer and context parallelism take
# it by registering alone.
import toy_gated  # noqa: E402

toy_gated.register()

# Python's cyclic garbage collector. Tracing and lowering allocate millions of short-lived
# objects (jaxpr equations, tracers, MLIR operations), and with the default thresholds a full
# collection, which walks every object the JAX caches keep, ran every few seconds: 11% of the
# shared suite's parity and packed tests (17.5 of 132 s, timed with gc.callbacks). Young
# objects are collected after 100,000 allocations instead of 700, and what imports and
# collection made is frozen out of every later collection (pytest_collection_finish).
gc.set_threshold(100_000, 50, 100)

# Each test's seconds and compilations (support/costs.py; ``--cost-report=PATH``), and the
# budget of distinct programs a whole-suite run may compile.
pytest_plugins = ("costs",)


def pytest_addoption(parser):
  parser.addoption(
      "--seeds", type=int, default=1,
      help="input seeds each parity test of the shared suite runs (default 1, the CI "
           "setting). A sweep, e.g. --seeds=20, shows that no tolerance holds by luck; the "
           "compiled programs are reused across seeds.")
  parser.addoption(
      "--full", action="store_true",
      help="run the shared suite's whole grids: every implementation's causal mode on every "
           "parity shape, and in both 16-bit dtypes. Default (the CI setting): each on one "
           "shape and one dtype, every variant on every shape and in both dtypes "
           "(support/_helpers.py, `covering_grid`).")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
  del session
  gc.collect()
  gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
  del exitstatus
  import costs
  costs.check_budget(session)


def pytest_unconfigure(config):
  if _OWN_CACHE and not hasattr(config, "workerinput"):  # The process that made it.
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_configure(config):
  # The parity test's grid is chosen at collection, when its module is imported.
  import _helpers
  import costs
  _helpers.FULL_GRID = config.getoption("--full")
  costs.OWN_CACHE = _OWN_CACHE


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
  if request.node.get_closest_marker("standard_dtype_promotion") is None:
    yield
  else:
    with jax.numpy_dtype_promotion("standard"):
      yield


@pytest.fixture(scope="session")
def seeds(request):
  """``range(--seeds)``: the input seeds of the parity tests."""
  return range(request.config.getoption("--seeds"))
