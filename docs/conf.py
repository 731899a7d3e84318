"""Sphinx configuration of the linattn_jax documentation site.

Build from the repository root::

    pip install -e '.[docs]' && sphinx-build -W -b html docs docs/_build/html

The notebooks are rendered with the outputs they were committed with (never
executed here); the benchmark tables are rendered from the JSON files under
``docs/results/`` by ``render_results.py`` before Sphinx reads the pages.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # linattn_jax, also without an install.
sys.path.insert(0, str(DOCS))  # render_results.

import render_results  # noqa: E402
from sphinx.ext.autodoc import preserve_defaults  # noqa: E402

project = "linattn_jax"
author = "linattn_jax contributors"
copyright = "linattn_jax contributors"  # noqa: A001

extensions = [
    "myst_nb",  # Markdown pages (MyST) and notebooks.
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style docstrings.
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

# Generated at build time, never committed: the notebooks' copies, the tables, the API stubs.
NOTEBOOKS_COPY = DOCS / "notebooks"
GENERATED = DOCS / "_generated"
exclude_patterns = ["_build", "_generated", "results", "**.ipynb_checkpoints"]

# --- MyST and notebooks -----------------------------------------------------
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 4  # `page.md#a-heading` links resolve to the heading's slug, as on GitHub.
nb_execution_mode = "off"  # Render the saved outputs; the test suite runs the notebooks.
nb_merge_streams = True
nb_render_markdown_format = "myst"  # Markdown outputs (the tables notebooks print) as tables.

# --- API reference ------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
# Signatures name jax.typing.ArrayLike rather than spelling out the union it stands for.
autodoc_type_aliases = {"ArrayLike": "jax.typing.ArrayLike"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# One "Parameters" list: an entry may name several arguments ("a, b: as in f").
napoleon_use_param = False
# A NamedTuple's fields are described once, by its docstring's Attributes section.
napoleon_use_ivar = True

# --- HTML -------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "linattn_jax"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "collapse_navbar": True,  # Only the current branch: every page renders less navigation.
}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
templates_path = ["_templates"]


def _skip_tuple_fields(app, what, name, obj, skip, options):
  """NamedTuple fields are documented by the class's Attributes section: skip the
  field accessors autodoc would list again ("Alias for field number 0")."""
  if type(obj).__name__ == "_tuplegetter":
    return True
  return None


# An inline literal must be followed by a space or punctuation in reStructuredText;
# docstrings write plurals such as ``nnx.Param``s. An escaped space joins them.
_LITERAL_THEN_WORD = re.compile(r"(``[^`\s](?:[^`]*[^`\s])?``)(\w)")


def _join_literal_suffixes(app, what, name, obj, options, lines):
  lines[:] = [_LITERAL_THEN_WORD.sub(r"\1\\ \2", line) for line in lines]


def _constructor_signature(app, what, name, obj, options, signature, return_annotation):
  """Flax NNX modules are built through a metaclass whose ``__call__`` takes ``*args,
  **kwargs``; show the constructor's own arguments instead (their types are in the text)."""
  if what == "class" and signature and signature.startswith("(*args"):
    preserve_defaults.update_defvalue(app, obj.__init__, False)  # Defaults as in the source.
    parameters = list(inspect.signature(obj.__init__).parameters.values())[1:]
    bare = [q.replace(annotation=inspect.Parameter.empty) for q in parameters]
    return str(inspect.Signature(bare)), None
  return None


def setup(app):
  app.connect("autodoc-process-signature", _constructor_signature)
  app.connect("autodoc-skip-member", _skip_tuple_fields)
  app.connect("autodoc-process-docstring", _join_literal_suffixes, priority=400)


def _copy_notebooks() -> None:
  """Sphinx reads sources under ``docs/`` only: copy the six notebooks in, as they are."""
  if NOTEBOOKS_COPY.exists():
    shutil.rmtree(NOTEBOOKS_COPY)
  NOTEBOOKS_COPY.mkdir()
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    shutil.copy2(path, NOTEBOOKS_COPY / path.name)


_copy_notebooks()
render_results.render_all(DOCS / "results", GENERATED)
