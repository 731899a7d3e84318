"""Settings for the test session.

The tests compile thousands of tiny programs, and for those XLA's backend
optimisation passes cost far more than running the result. Unless the
caller sets ``XLA_FLAGS``, compile with them turned down: this halves the
suite's time on CPU. Every tolerance holds at either level; to test the
optimised code, run with e.g. ``XLA_FLAGS=`` (empty) set.
"""

import os

os.environ.setdefault(
    "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
