"""Times the gated recurrences' training step: forward against forward + backward.

For each variant (``--backward_variants``): its forward pass, and its forward pass with
the gradients of a loss ``Σ ct·out`` with respect to every input (queries, keys, values
and the per-token gates, as training needs them), compiled once each and timed in turns
(one call of each per round, each round starting one later, so that the machine's load
weighs on all alike; one variant at a time); causal,
``--batch`` rows, ``--heads`` heads of ``--head_dim`` query/key and value channels,
float32, each variant at its default implementation and chunk size. The record holds the
medians over ``--repeats`` rounds (each round's time the least of
``--calls_per_round`` calls), the ratio of forward + backward to forward, and each
program's compiled temporary memory.

With ``--jla_path`` (a folder holding jax-linear-attention's ``jla`` package, e.g. its
wheel unpacked: ``pip download --no-deps --python-version 3.12 --only-binary=:all:
jax-linear-attention`` then ``unzip`` it there; it is not a dependency of this project),
its plain-JAX chunked ops (``jla.ops.chunked``: ``gated_delta_rule``, ``kda``,
``simple_gla``, ``gla``, ``delta_rule``) are timed in the same turns on the same inputs
(their layout ``[B, T, heads, ·]`` is ours), and the record quotes our time and
temporary memory as ratios of theirs, and the largest difference of the two outputs.

Writes ``<output_dir>/backward.json`` (default ``results/backward``) and prints a table.

Usage (from the repository root)::

  python -m experiments.backward_benchmark --backward_lengths=8192,16384 --repeats=5 \\
      --jla_path=/tmp/jla
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import flags

import linattn_jax as la
from experiments import benchmark, common

_LENGTHS = flags.DEFINE_list("backward_lengths", ["8192"], "Sequence lengths T.")
_VARIANTS = flags.DEFINE_list(
    "backward_variants",
    ["gated_delta_net", "kda", "delta_net", "gla", "simple_gla", "dplr", "rwkv7",
     "delta_product"],
    "Registry names, or delta_product (Gated DeltaProduct, two steps per token).")
_CALLS = flags.DEFINE_integer(
    "calls_per_round", 3, "Calls of each program per round; the least is its round's time.")
_JLA_PATH = flags.DEFINE_string(
    "jla_path", None, "A folder holding jax-linear-attention's jla package (see above).")

# Our variant -> jla.ops.chunked's function and the gates it takes, by position.
_JLA = {"gated_delta_net": ("gated_delta_rule", ("log_decay", "beta")),
        "kda": ("kda", ("log_decay", "beta")), "delta_net": ("delta_rule", ("beta",)),
        "simple_gla": ("simple_gla", ("log_decay",)), "gla": ("gla", ("log_decay",))}


def inputs(name: str, T: int, *, batch: int, heads: int, dim: int) -> dict[str, jax.Array]:
  """Unit queries and keys, values, and the variant's gates ``[B, T, N(, H)]``: β in (0, 1),
  log-decays ``-softplus(·) / 10``; DPLR's and RWKV-7's ``a = -k̂``, ``b = β k̂``; Gated
  DeltaProduct's two steps per token on axis 2 of its keys, values and β."""
  k = jax.random.split(jax.random.key(0), 6)
  steps = (2,) if name == "delta_product" else ()
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  normal = lambda key, *shape: jax.random.normal(key, (batch, T, *shape))  # noqa: E731
  x = {"query": unit(normal(k[0], heads, dim)), "key": unit(normal(k[1], *steps, heads, dim)),
       "value": normal(k[2], *steps, heads, dim)}
  beta = jax.nn.sigmoid(normal(k[3], *steps, heads))
  per_feature = name in ("kda", "gla", "dplr", "rwkv7")
  log_decay = -jax.nn.softplus(normal(k[4], heads, *((dim,) if per_feature else ()))) / 10
  if name in ("dplr", "rwkv7"):
    return {**x, "a": -x["key"], "b": x["key"] * beta[..., None], "log_decay": log_decay}
  if name in ("gla", "simple_gla"):
    return {**x, "log_decay": log_decay}
  if name == "delta_net":
    return {**x, "beta": beta}
  return {**x, "beta": beta, "log_decay": log_decay}


def ours(name: str) -> Callable[..., jax.Array]:
  if name == "delta_product":
    return functools.partial(la.delta_product_attention, is_causal=True, scale=1.0)
  return functools.partial(la.get_attention(name), is_causal=True, scale=1.0)


def theirs(jla: Any, name: str) -> Callable[..., jax.Array]:
  function, gates = _JLA[name]
  fn = getattr(jla, function)
  return lambda query, key, value, **g: fn(query, key, value, *(g[n] for n in gates),
                                           scale=1.0)[0]


def training_step(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
  """``(out, gradients of Σ ct·out w.r.t. every input)`` of ``fn(**inputs)``."""
  def run(named, ct):
    out, vjp = jax.vjp(lambda named: fn(**named), named)
    return out, vjp(ct)[0]
  return run


def compare(T: int, names: Sequence[str], jla: Any, *, batch: int, heads: int, dim: int,
            warmup: int, repeats: int, calls_per_round: int = 1) -> dict[str, Any]:
  record: dict[str, Any] = {}
  for name in names:  # One variant at a time: a large program slows the call after it.
    x = inputs(name, T, batch=batch, heads=heads, dim=dim)
    ct = jax.random.normal(jax.random.key(1), (batch, T, heads, dim))
    fns = [("linattn_jax", ours(name))]
    if jla is not None and name in _JLA:
      fns.append(("jla", theirs(jla, name)))
    cases = []  # (who, step, fn)
    for who, fn in fns:
      cases += [(who, "forward", lambda x, ct, fn=fn: fn(**x)),
                (who, "forward+backward", training_step(fn))]
    compiled = [benchmark.compile_function(fn, (x, ct))[0] for *_, fn in cases]
    times = benchmark.time_in_turns([(c, (x, ct)) for c in compiled], warmup=warmup,
                                    repeats=repeats, rotate=True,
                                    calls_per_round=calls_per_round)
    for (who, step, _), c, t in zip(cases, compiled, times, strict=True):
      record.setdefault(name, {}).setdefault(who, {})[step] = {
          "median_s": statistics.median(t), "times_s": t,
          "temp_bytes": benchmark.memory_stats(c)["temp_size_in_bytes"]}
  for name, by_who in record.items():
    for steps in by_who.values():
      steps["ratio"] = (steps["forward+backward"]["median_s"]
                        / steps["forward"]["median_s"])
    if "jla" in by_who:
      mine, other = by_who["linattn_jax"], by_who["jla"]
      x = inputs(name, T, batch=batch, heads=heads, dim=dim)
      diff = jnp.max(jnp.abs(ours(name)(**x) - theirs(jla, name)(**x)))
      by_who["versus_jla"] = {
          step: {"time": mine[step]["median_s"] / other[step]["median_s"],
                 "temp_memory": mine[step]["temp_bytes"] / other[step]["temp_bytes"]}
          for step in ("forward", "forward+backward")} | {"max_abs_difference": float(diff)}
  return record


def _jla(path: str | None) -> Any:
  if path is None:
    return None
  sys.path.insert(0, str(pathlib.Path(path).resolve()))
  return importlib.import_module("jla.ops.chunked")


def main(argv: Sequence[str]) -> None:
  del argv
  jla = _jla(_JLA_PATH.value)
  records: dict[str, Any] = {"meta": {"jax": jax.__version__, "devices": str(jax.devices())}}
  for T in (int(t) for t in _LENGTHS.value):
    r = records[f"T{T}"] = compare(
        T, _VARIANTS.value, jla, batch=common.BATCH.value, heads=common.HEADS.value,
        dim=common.HEAD_DIM.value, warmup=benchmark._WARMUP.value,
        repeats=common.REPEATS.value, calls_per_round=_CALLS.value)
    for name, by_who in r.items():
      for who in ("linattn_jax", "jla"):
        if who in by_who:
          s = by_who[who]
          print(f"T={T} {name:16s} {who:11s} forward {s['forward']['median_s'] * 1e3:8.1f} ms"
                f"  forward+backward {s['forward+backward']['median_s'] * 1e3:8.1f} ms"
                f"  ratio {s['ratio']:.2f}  temp "
                f"{s['forward+backward']['temp_bytes'] / 2**20:7.1f} MiB")
      if "versus_jla" in by_who:
        v = by_who["versus_jla"]
        print(f"T={T} {name:16s} versus jla: forward {v['forward']['time']:.2f}x, "
              f"forward+backward {v['forward+backward']['time']:.2f}x, temporary memory "
              f"{v['forward+backward']['temp_memory']:.2f}x (max |diff| "
              f"{v['max_abs_difference']:.1e})")
  out = pathlib.Path(common.output_dir("backward"))
  out.mkdir(parents=True, exist_ok=True)
  common.write_json(out / "backward.json", records)


if __name__ == "__main__":
  common.run(main)
