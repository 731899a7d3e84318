"""Every public name is documented with shapes and an example, and its examples run.

Every public function also says what it raises and, unless it is a utility
listed in ``NO_PAPER``, cites the paper whose method it implements.

The public names are the ``__all__`` entries of ``linattn_jax`` and of its
public namespaces (``nn``, ``parallel``, ``masks``, ``feature_maps``); a
namespace listed in another's ``__all__`` is covered by its own names. Each
docstring's ``>>>`` examples run with the standard ``doctest`` module, with
the names below already imported, so an example that drifts from the code
fails here.
"""

from __future__ import annotations

import doctest
import inspect
import io
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linattn_jax as la
from linattn_jax import feature_maps, masks, nn, parallel

NAMESPACES = (la, nn, parallel, masks, feature_maps)


def _public_names() -> dict[str, object]:
  """``{"module.name": object}`` for every non-module entry of the five ``__all__``."""
  names = {}
  for module in NAMESPACES:
    for name in module.__all__:
      obj = getattr(module, name)
      if not isinstance(obj, types.ModuleType):
        names[f"{module.__name__}.{name}"] = obj
  return names


PUBLIC = _public_names()
# What the examples may use without importing it (as a reader's session would have).
GLOBS = dict(jax=jax, jnp=jnp, np=np, la=la, nn=nn, nnx=nnx, parallel=parallel, masks=masks,
             feature_maps=feature_maps)
# A shape in the letters of the design's table: [B, T, N, H], [..., M], [M, H], [B].
SHAPE = re.compile(r"\[(?:\.\.\.|[BTSNKHDMCGW]\b)[^\]\n]*\]")
NO_ARRAYS = re.compile(r"\bno arrays\b", re.IGNORECASE)


def test_every_public_namespace_is_covered():
  """A namespace listed in an ``__all__`` is one whose names are checked here."""
  for module in NAMESPACES:
    assert module.__all__, module.__name__
    for name in module.__all__:
      obj = getattr(module, name)
      if isinstance(obj, types.ModuleType):
        assert obj in NAMESPACES, f"{module.__name__}.{name}: add it to NAMESPACES"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_docstring_has_summary_shapes_and_example(name):
  """A one-line summary, a ``>>>`` example, and shapes (or that it takes no arrays)."""
  doc = inspect.getdoc(PUBLIC[name])
  assert doc, f"{name} has no docstring"
  lines = doc.splitlines()
  assert lines[0].strip() and (len(lines) == 1 or not lines[1].strip()), (
      f"{name}: the docstring must open with a one-line summary and a blank line")
  assert ">>>" in doc, f"{name}: no example (a `>>>` line)"
  if callable(PUBLIC[name]):
    assert SHAPE.search(doc) or NO_ARRAYS.search(doc), (
        f"{name}: name the shapes in the letters B, T, S, N, K, H, D, M, C (e.g. "
        "`[B, T, N, H]`), or say that it takes no arrays")


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_docstring_examples_run(name):
  """The examples of ``name`` (and of its methods) give the output they show."""
  tests = doctest.DocTestFinder().find(PUBLIC[name], name, globs=dict(GLOBS))
  runner = doctest.DocTestRunner(
      verbose=False, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  report = io.StringIO()
  failed = attempted = 0
  for test in tests:
    result = runner.run(test, out=report.write)
    failed, attempted = failed + result.failed, attempted + result.attempted
  assert attempted > 0, f"{name}: no example ran"
  assert failed == 0, f"{name}: {failed} of {attempted} example(s) failed:\n{report.getvalue()}"


FUNCTIONS = sorted(name for name, obj in PUBLIC.items() if inspect.isfunction(obj))
# Utilities that implement no paper's method: the registry, empty states, plain masks, glue.
NO_PAPER = {
    "linattn_jax.available_attentions", "linattn_jax.get_attention", "linattn_jax.get_spec",
    "linattn_jax.register_attention", "linattn_jax.masks.causal", "linattn_jax.masks.padding",
    "linattn_jax.nn.as_flax_attention_fn", "linattn_jax.nn.cache_kind",
    "linattn_jax.nn.token_mixer", "linattn_jax.nn.token_mixer_names",
    "linattn_jax.nn.load_transformers_layer",
    "linattn_jax.parallel.recurrent_attentions",
    *(name for name in FUNCTIONS if name.rsplit(".", 1)[1].startswith("init_")),
}


# Functions that raise nothing (elementwise maps, registry listings): they have no Raises
# section; every other public function says what it raises.
RAISE_NOTHING = {
    "linattn_jax.available_attentions", "linattn_jax.parallel.recurrent_attentions",
    "linattn_jax.nn.token_mixer_names",
    *(f"linattn_jax.feature_maps.{name}" for name in ("elu_plus_one", "relu", "exp")),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_says_what_it_raises_and_cites_its_paper(name):
  doc = inspect.getdoc(PUBLIC[name])
  says = re.search(r"^Raises:\n +\S", doc, flags=re.M)
  assert bool(says) == (name not in RAISE_NOTHING), (
      f"{name}: no Raises section" if not says else f"{name}: raises nothing; drop its Raises")
  block = re.search(r"^References:\n((?: +\S.*(?:\n|$))+)", doc, flags=re.M)
  cites = block and re.search(r"\b(19|20)\d\d\b", block.group(1))  # author, title, year
  assert bool(cites) == (name not in NO_PAPER), (
      f"{name}: cite the paper it implements (author, title, year) in a References section"
      if not cites else f"{name}: cites a paper; remove it from NO_PAPER")
