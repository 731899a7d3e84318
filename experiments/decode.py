"""Decode cost of `linattn_jax.nn.MultiHeadAttention` layers against position.

For each variant and position P the layer's cache is brought to position P
and ``--steps`` single-token decode steps run in one ``lax.scan`` under
``jax.jit`` with the cache donated (as a decode loop would run it): the
median over ``--repeats`` calls, per token, with the positions timed in
alternation. Next to each step, in the same rounds, a jitted sum over the
cache's arrays times one read of its bytes (``cache_read_s``), the memory
floor of a step that reads the whole cache; ``step_over_read`` is their
ratio. Recurrent and
ring-buffer caches are reached by a real prefill of P tokens. A KV cache is
allocated with capacity P + steps and filled with random keys and values
directly: a step's cost depends on the capacity it reads, not on the values,
and a prefill of 65536 tokens of exact attention would take minutes on a CPU.
The report lists each cache's bytes (every array it holds) at each position.
``--attentions`` defaults to ``DEFAULT_ATTENTIONS``; ``--options_by_attention``
(JSON ``{variant: {option: value}}``) overrides ``DEFAULT_OPTIONS``.

    python -m experiments.decode --positions=1024,65536

writes ``decode.json`` and ``decode_step.png`` (log-log time per token
against position) to ``--output_dir`` (default ``results/decode``).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from experiments import common
from linattn_jax import nn

# --attentions: the variants to decode with; --options_by_attention overrides DEFAULT_OPTIONS.
DEFAULT_ATTENTIONS = ("softmax", "flash", "local", "longformer", "linear_elu", "linear_relu",
                      "linear_learned", "performer", "random_fourier", "efficient", "heinsen")
_POSITIONS = flags.DEFINE_list("positions", ["1024", "65536"], "Positions P to decode at.")
_KV_HEADS = common.KV_HEADS
_BATCH = common.BATCH
_STEPS = flags.DEFINE_integer("steps", 16, "Decode steps per timed call (one lax.scan).")
_REPEATS = common.REPEATS
flags.adopt_module_key_flags(common)


def recent_blocks(num_q_blocks: int, num_k_blocks: int) -> np.ndarray:
  """A block-sparse layout for any length: each block, the two before it and the first."""
  a = np.arange(num_q_blocks)[:, None] + (num_k_blocks - num_q_blocks)
  b = np.arange(num_k_blocks)[None, :]
  return ((b <= a) & (b >= a - 2)) | (b == 0)


DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "local": {"window_size": [256, 0]},
    "longformer": {"window_size": [256, 0], "global_positions": [0]},
    "strided": {"stride": 128, "window_size": [128, 0]},
    "block_sparse": {"layout": recent_blocks, "block_size": 64},
    "bigbird": {"block_size": 64},
}


def make_layer(attention: str, options: dict[str, Any]) -> nn.MultiHeadAttention:
  heads, head_dim = common.HEADS.value, common.HEAD_DIM.value
  return nn.MultiHeadAttention(heads, heads * head_dim, num_kv_heads=_KV_HEADS.value,
                               attention=attention, attention_options=options,
                               rngs=nnx.Rngs(0))


def bring_to(layer: nn.MultiHeadAttention, position: int, steps: int, batch: int) -> None:
  """Leaves ``layer``'s cache at ``position`` (see the module docstring)."""
  features = layer.in_features
  layer.init_cache((batch, position + steps, features))
  if nn.cache_kind(layer.attention) == "kv":
    cache = layer.cache.get_value()
    keys = jax.random.normal(jax.random.key(1), cache.key.shape, cache.key.dtype)
    values = jax.random.normal(jax.random.key(2), cache.value.shape, cache.value.dtype)
    layer.cache.set_value(cache._replace(key=keys, value=values,
                                         index=jnp.asarray(position, jnp.int32)))
    return
  prompt = jax.random.normal(jax.random.key(3), (batch, position, features))
  nnx.jit(lambda m, x: m(x, is_causal=True, decode=True))(layer, prompt)


class Runner:
  """Compiled, warm zero-argument calls on ``layer``'s cache: ``step`` decodes ``steps``
  tokens (one ``lax.scan``), ``read`` reads every array of the cache once.

  ``step`` donates the cache and gets it back with its position as it was (the
  integer leaves), so every call decodes the same positions and a step's time
  holds no copy of the cache that a decode loop under ``jit`` with donation
  would not make. ``read`` is a jitted sum over the cache's arrays: the time
  of one read of its bytes, the memory floor of a step that reads them all.
  """

  def __init__(self, layer: nn.MultiHeadAttention, steps: int, batch: int):
    graphdef, cache, rest = nnx.split(layer, nnx.Cache, ...)
    tokens = jax.random.normal(jax.random.key(4), (steps, batch, 1, layer.in_features))

    def run(cache, rest, tokens):
      def body(cache, token):
        model = nnx.merge(graphdef, cache, rest)
        out = model(token, is_causal=True, decode=True)
        return nnx.state(model, nnx.Cache), out

      new, outs = jax.lax.scan(body, cache, tokens)
      same_position = lambda n, o: o if jnp.issubdtype(o.dtype, jnp.integer) else n  # noqa: E731
      return jax.tree.map(same_position, new, cache), outs

    self._run = jax.jit(run, donate_argnums=0)
    self._sum = jax.jit(lambda cache: sum(jnp.sum(x, dtype=jnp.float32)
                                          for x in jax.tree.leaves(cache)))
    self._cache, self._rest, self._tokens = cache, rest, tokens
    self.step()  # Compile and warm up.
    self.read()

  def step(self) -> None:
    self._cache, outs = self._run(self._cache, self._rest, self._tokens)
    jax.block_until_ready((self._cache, outs))

  def read(self) -> None:
    jax.block_until_ready(self._sum(self._cache))


def time_interleaved(calls: dict[Any, Any], repeats: int) -> dict[Any, float]:
  """Median seconds of each call, timed in alternation (round by round), so that the
  load of a shared machine falls on every call alike."""
  times: dict[Any, list[float]] = {key: [] for key in calls}
  for _ in range(repeats):
    for key, call in calls.items():
      start = time.perf_counter()
      call()
      times[key].append(time.perf_counter() - start)
  return {key: statistics.median(t) for key, t in times.items()}


def cache_bytes(layer: nn.MultiHeadAttention) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(layer.cache.get_value()))


def run(attentions: Sequence[str], positions: Sequence[int],
        overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
  records = []
  for name in attentions:
    options = {**DEFAULT_OPTIONS.get(name, {}), **overrides.get(name, {})}
    calls = {}
    for position in positions:
      layer = make_layer(name, options)
      shown = {k: getattr(v, "__name__", v) for k, v in options.items()}  # JSON: a layout by name.
      record = {"attention": name, "options": shown, "position": position,
                "cache_kind": nn.cache_kind(name).value}
      try:
        bring_to(layer, position, _STEPS.value, _BATCH.value)
        record["cache_bytes"] = cache_bytes(layer)
        runner = Runner(layer, _STEPS.value, _BATCH.value)
        calls[position, "step"], calls[position, "read"] = runner.step, runner.read
        record["status"] = "ok"
      except ValueError as e:  # E.g. a sparse pattern past MAX_PATTERN_CAPACITY: reported.
        record["status"] = f"not run: {e}"
      records.append(record)
    seconds = time_interleaved(calls, _REPEATS.value)
    for record in records[-len(positions):]:
      if (record["position"], "step") in seconds:
        record["step_s"] = seconds[record["position"], "step"] / _STEPS.value
        record["cache_read_s"] = seconds[record["position"], "read"]
        record["step_over_read"] = record["step_s"] / record["cache_read_s"]
      print(f"{name:>15} P={record['position']:>6} {record['cache_kind']:>9} "
            f"cache={record.get('cache_bytes', float('nan')) / 2**10:>10.1f} KiB "
            f"step={record.get('step_s', float('nan')) * 1e6:>9.1f} us "
            f"read={record.get('cache_read_s', float('nan')) * 1e6:>9.1f} us "
            f"step/read={record.get('step_over_read', float('nan')):>6.2f}  "
            f"{record['status'][:60]}", flush=True)
  for name in attentions:
    ok = [r for r in records if r["attention"] == name and r["status"] == "ok"]
    if len(ok) > 1:
      ratio = ok[-1]["step_s"] / ok[0]["step_s"]
      print(f"{name}: step at P={ok[-1]['position']} / step at P={ok[0]['position']} = "
            f"{ratio:.2f}x", flush=True)
  return {"device": str(jax.devices()[0]), "jax": jax.__version__, "heads": common.HEADS.value,
          "num_kv_heads": _KV_HEADS.value or common.HEADS.value,
          "head_dim": common.HEAD_DIM.value, "batch": _BATCH.value, "steps": _STEPS.value,
          "records": records}


def plot(report: dict[str, Any], path: Any) -> None:
  series = {}
  for name in dict.fromkeys(r["attention"] for r in report["records"]):
    ok = [r for r in report["records"] if r["attention"] == name and r["status"] == "ok"]
    series[name] = ([r["position"] for r in ok], [r["step_s"] for r in ok])
  common.plot_lines(path, series, xlabel="position P",
                    ylabel="seconds per decoded token (median)", log_x=True, log_y=True,
                    title=f"decode step, N={report['heads']} K={report['num_kv_heads']} "
                    f"H={report['head_dim']} B={report['batch']}")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  attentions = common.ATTENTIONS.value or list(DEFAULT_ATTENTIONS)
  try:
    overrides = json.loads(common.OPTIONS_BY_ATTENTION.value or "{}")
    positions = [int(p) for p in _POSITIONS.value]
  except ValueError as e:
    raise app.UsageError(f"--options_by_attention (JSON) or --positions (ints): {e}") from e
  report = run(attentions, positions, overrides)
  out = pathlib.Path(common.output_dir("decode"))
  out.mkdir(parents=True, exist_ok=True)
  common.write_json(out / "decode.json", report)
  print(f"wrote {out / 'decode.json'}", flush=True)
  if common.PLOT.value:
    plot(report, out / "decode_step.png")
    print(f"wrote {out / 'decode_step.png'}", flush=True)
  failed = [r for r in report["records"] if r["status"] != "ok"
            and "MAX_PATTERN_CAPACITY" not in r["status"]]
  if failed:
    sys.exit(f"{len(failed)} decode case(s) failed.")


if __name__ == "__main__":
  common.run(main)
