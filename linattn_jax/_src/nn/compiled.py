"""A layer's eager call as one compiled program.

The functions run as one program when called eagerly (``checks.compiled``); this is the
same for the layers' ``__call__``. Called outside any trace, a layer dispatched op by op
compiles each of its dozens of operations for every new input shape (seconds for a
mixer's first call); :func:`compiled_call` runs the call through ``nnx.jit`` instead, so
each set of input shapes and options compiles once and later calls reuse it. Under an
outer ``jax.jit``, ``nnx.jit``, ``vmap`` or ``grad`` (any traced input), or with
``jax.disable_jit()``, the method runs as written; so does a layer split over devices
(``context_parallel``), whose functions place their own programs on the mesh.

Arrays (and pytrees of arrays, ``nnx.Rngs``) are the program's inputs; every other
keyword (``decode``, ``is_causal``, a sharding) is static, and a 0-d boolean array is
read as the bool it holds. The layer's state (parameters, the decode cache, sown
intermediates, RNG counts) is carried in and written back by ``nnx.jit``. Checks of
array *values* that need a concrete array run before the program: ``segment_ids`` that
decrease raise here, as they do eagerly in every function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from linattn_jax._src import checks

_ARRAY = (jax.Array, np.ndarray, np.generic)


def _is_input(x: Any) -> bool:
  """An array, a non-empty pytree of arrays, or an RNG graph node: traced by ``nnx.jit``."""
  if isinstance(x, nnx.Rngs | nnx.RngStream):
    return True
  leaves = jax.tree.leaves(x)
  return bool(leaves) and all(isinstance(leaf, _ARRAY) for leaf in leaves)


def _static(x: Any) -> Any:
  """``x`` as a static option: a 0-d boolean array as its bool."""
  if isinstance(x, _ARRAY) and np.ndim(x) == 0 and np.asarray(x).dtype == np.bool_:
    return bool(x)
  return x


def _traced(tree: Any) -> bool:
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Rngs | nnx.RngStream))
  return any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)


def compiled_call(method: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a layer's ``__call__(self, *arrays, **options)`` (see the module docstring)."""
  programs: dict[tuple[tuple[str, Any], ...], Callable[..., Any]] = {}

  @functools.wraps(method)
  def wrapper(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    kwargs = {k: _static(v) for k, v in kwargs.items()}
    static = {k: v for k, v in kwargs.items() if not _is_input(v)}
    inputs = {k: v for k, v in kwargs.items() if k not in static}
    if (jax.config.jax_disable_jit or _traced((args, inputs))
        or getattr(self, "context_parallel", None) is not None
        or not all(x is None or _is_input(x) for x in args)):
      return method(self, *args, **kwargs)
    key = tuple(sorted(static.items()))
    try:
      hash(key)
    except TypeError:  # An option that cannot key a program: run as written.
      return method(self, *args, **kwargs)
    checks.check_segment_order(inputs.get("segment_ids"), fn=type(self).__name__)
    run = programs.get(key)
    if run is None:
      run = programs[key] = nnx.jit(
          lambda layer, args, inputs: method(layer, *args, **inputs, **static))
    return run(self, args, inputs)

  return wrapper
