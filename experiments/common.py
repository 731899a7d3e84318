"""Flags and helpers shared by the experiment scripts.

absl flags live in one process-wide registry, so a flag both scripts take is
defined here once; each script reads it through these holders.
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags

import linattn_jax as la
from linattn_jax import nn

# JAX logs at INFO that it found no TPU; absl prints INFO, so without this it would be the
# first line of every script on a machine without one.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

HEADS = flags.DEFINE_integer("heads", 8, "Query heads N.")
HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Query/key head dim H.")
VALUE_DIM = flags.DEFINE_integer("value_dim", None, "Value head dim D (default: --head_dim).")
KV_HEADS = flags.DEFINE_integer("kv_heads", None, "Key/value heads K (default: --heads).")
BATCH = flags.DEFINE_integer("batch", 1, "Batch size B.")
REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per case; medians are reported.")
DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                          "Dtype of the inputs (benchmarks) or of the computation (training).")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the inputs, parameters and data order.")
CAUSAL = flags.DEFINE_bool("causal", True, "Pass is_causal=True.")
OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Where the JSON and plots go (default: results/<script name>).")
PLOT = flags.DEFINE_bool("plot", True, "Write PNG plots (needs matplotlib).")
ATTENTIONS = flags.DEFINE_list(
    "attentions", None, "Registered variants to run (compare: also name@label entries, and "
    "layers:PATTERN entries, token mixers and attention layers joined by '+'). "
    "Default: the script's own list (its module docstring names it).")


@flags.validator("attentions")
def _registered(entries: list[str] | None) -> bool:
  """Each entry (``name`` or ``name@label``) names a registered variant; a bad one stops the
  script with this one line (and a pointer to ``--help``), not the whole flag list."""
  names = {e.split("@", 1)[0] for e in entries or ()}
  layers = {x for n in names if n.startswith("layers:")
            for x in n.removeprefix("layers:").split("+")}
  unknown = sorted({n for n in names if not n.startswith("layers:")}
                   - set(la.available_attentions())
                   | layers - {"attention", *nn.token_mixer_names()})
  if unknown:
    raise flags.ValidationError(
        f"unknown attention(s) {unknown}; available: {la.available_attentions()}")
  return True


OPTIONS_BY_ATTENTION = flags.DEFINE_string(
    "options_by_attention", None, "JSON object {variant (or compare entry): {option: value}}. "
    "Default: the script's own options.")


def run(main: Callable[[Sequence[str]], None]) -> None:
  """``app.run(main)``, except that a bad value ``main`` finds (``app.UsageError``) stops the
  script with one line and a pointer to the help, as absl's own flag errors do, not with the
  whole flag list."""
  def main_in_one_line(argv: Sequence[str]) -> None:
    try:
      main(argv)
    except app.UsageError as e:
      raise SystemExit(f"Error: {e}\n"
                       "Pass --helpshort or --helpfull to see help on flags.") from None
  app.run(main_in_one_line)


def gate_from_normal(token_input: la.TokenInput, x: Any) -> Any:
  """A per-token input from standard normal draws ``x``, by its role: a log-decay
  ``log σ(x) / 16`` (GLA's scale, about 0.96 per step), a write strength ``β = σ(x)``, or a
  low-rank transition's ``a = -x̂`` and ``b = x̂ / 2`` (unit ``x̂``, as RWKV-7's removal key)."""
  if token_input.role is la.Role.DECAY:
    return jax.nn.log_sigmoid(x) / 16
  if token_input.role in (la.Role.TRANSITION_READ, la.Role.TRANSITION_WRITE):
    unit = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return -unit if token_input.role is la.Role.TRANSITION_READ else unit / 2
  return jax.nn.sigmoid(x)


def value_dim() -> int:
  """--value_dim, defaulting to --head_dim."""
  return VALUE_DIM.value if VALUE_DIM.value is not None else HEAD_DIM.value


def output_dir(script: str) -> str:
  """--output_dir, defaulting to ``results/<script>``."""
  return OUTPUT_DIR.value if OUTPUT_DIR.value is not None else f"results/{script}"


def write_json(path: pathlib.Path, report: dict[str, Any]) -> None:
  """Writes ``report`` to ``path`` (via a temporary file, so it is never half written)."""
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(report, indent=1))
  tmp.replace(path)


def plot_lines(path: pathlib.Path, series: dict[str, tuple[list, list]], *, xlabel: str,
               ylabel: str, title: str, log_x: bool = False, log_y: bool = False) -> bool:
  """One line per ``label -> (xs, ys)`` in a PNG at ``path``; False without matplotlib.

  ``log_x`` puts x on a base-2 log scale, ``log_y`` y on a base-10 one.
  """
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"matplotlib is not installed: {path} not written.", flush=True)
    return False
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for label, (xs, ys) in series.items():
    ax.plot(xs, ys, marker="o" if log_x or len(xs) < 20 else None, label=label)
  if log_x:
    ax.set_xscale("log", base=2)
  if log_y:
    ax.set_yscale("log")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize="medium")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True
