"""Renders the experiments' result files into Markdown tables for the documentation.

``experiments.benchmark`` writes ``benchmark.json``, ``experiments.model_step``
``model_step.json``, ``experiments.decode`` ``decode.json`` and the test suite's
``--cost-report`` ``test_costs.json``. Each result
folder under ``docs/results/`` holds one of them; this script turns each into
``<folder>.md`` (tables and a line naming the machine and settings) in the
output folder, which the pages include. ``conf.py`` runs it before every
build, so a table always shows the numbers of the file beside it.

    python docs/render_results.py docs/results docs/_generated
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

_MIB = 2**20


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return "\n".join(lines)


def _ms(seconds: float | None) -> str:
  if seconds is None:
    return "–"
  ms = seconds * 1e3
  return f"{ms:#.3g}" if ms < 100 else f"{ms:.0f}"


def _ratio(value: float | None) -> str:
  return "–" if value is None else f"{value:.2f}×"


def _machine(meta: dict[str, Any]) -> str:
  """One sentence on where and when a file was measured."""
  kind = meta.get("device_kind") or meta.get("backend", "?")
  cpus = f", {meta['cpu_count']} CPU cores" if meta.get("cpu_count") else ""
  jax_version = meta.get("jax_version") or meta.get("jax", "?")
  date = str(meta.get("date", ""))[:10]
  when = f", {date}" if date else ""
  return f"Measured on {meta.get('backend', kind)} ({kind}{cpus}), jax {jax_version}{when}."


# --------------------------------------------------------------- benchmark ---


def _label(record: dict[str, Any]) -> str:
  if record["kind"] == "xla":
    return "`jax.nn.dot_product_attention` (XLA)"
  if record["kind"] == "masked":
    return f"XLA softmax with `{record['variant']}`'s dense mask"
  impl = record["implementation"]
  packed = ", packed" if record["kind"] == "packed" else ""
  return f"`{record['variant']}`" + (f" / `{impl}`" if impl else "") + packed


def _cells(records: Sequence[dict[str, Any]], lengths: Sequence[int],
           cell: Callable[[dict[str, Any]], str]) -> list[list[str]]:
  """One row per label (in first-seen order), one cell per length."""
  by_label: dict[str, dict[int, dict[str, Any]]] = {}
  for r in records:
    by_label.setdefault(_label(r), {})[r["length"]] = r
  return [[label, *(cell(row[t]) if t in row else "–" for t in lengths)]
          for label, row in by_label.items()]


def _time_cell(record: dict[str, Any]) -> str:
  if record["status"] != "ok":
    return "not run" if str(record["status"]).startswith("skipped") else "error"
  ratios = [_ratio(record[key]) + suffix for key, suffix in
            (("ratio_vs_xla", ""), ("ratio_vs_masked_xla", " vs mask"),
             ("ratio_vs_unpacked", " vs unpacked"),
             ("ratio_vs_versus", f" vs {record.get('versus')}")) if key in record]
  return _ms(record["median_s"]) + (f" ({'; '.join(ratios)})" if ratios else "")


def _memory_cell(record: dict[str, Any]) -> str:
  temp = (record.get("memory") or {}).get("temp_size_in_bytes")
  return "–" if temp is None else f"{temp / _MIB:.3g}"


def render_benchmark(report: dict[str, Any]) -> str:
  meta, cases = report["metadata"], report["cases"]
  config = meta["config"]
  lengths = sorted({r["length"] for r in cases})
  header = ["", *(f"T = {t:,}" for t in lengths)]
  shape = (f"B = {config['batch']}, N = {config['heads']}, K = {config['kv_heads']}, "
           f"H = {config['head_dim']}, D = {config['value_dim']}, {config['dtype']}, "
           f"{'causal' if config['causal'] else 'non-causal'}; median of {config['repeats']} "
           f"calls after {config['warmup']} warm-up")
  parts = [f"{_machine(meta)} {shape}."]
  attention = [r for r in cases if r["kind"] != "matmul"]
  for mode in config["modes"]:
    rows = [r for r in attention if r["mode"] == mode]
    if not rows:
      continue
    what = {"forward": "Forward", "backward": "Forward + backward (gradients of q, k, v)",
            "step": "One decode step after a prefill of T tokens"}[mode]
    parts.append(f"**{what}**: median ms (× the XLA path's time in the same run).")
    parts.append(_table(header, _cells(rows, lengths, _time_cell)))
  parts.append("**Compiled temporaries** (MiB, from `memory_analysis()`), "
               + " / ".join(m for m in config["modes"] if m != "step") + ":")
  modes = [m for m in config["modes"] if m != "step"]
  memory: dict[str, dict[int, dict[str, str]]] = {}
  for r in attention:
    if r["mode"] in modes:
      memory.setdefault(_label(r), {}).setdefault(r["length"], {})[r["mode"]] = _memory_cell(r)
  parts.append(_table(header, (
      [label, *(" / ".join(row.get(t, {}).get(m, "–") for m in modes) for t in lengths)]
      for label, row in memory.items())))
  matmul = [r for r in cases if r["kind"] == "matmul" and r.get("gflops")]
  if matmul:
    rates = ", ".join(f"{r['gflops']:.1f} GFLOP/s at T = {r['length']:,}" for r in matmul)
    parts.append(f"The batched-matmul baseline (float32) ran at {rates}.")
  return "\n\n".join(parts) + "\n"


# -------------------------------------------------------------- model step ---


def render_model_step(report: dict[str, Any]) -> str:
  meta, records = report["metadata"], report["records"]
  config = meta["config"]
  parts = [f"{_machine(meta)} Width {config['width']}, {config['layers']} blocks, "
           f"{config['heads']} heads, B = {config['batch']}, {config['dtype']}; median of "
           f"{config['repeats']} alternating rounds."]
  header = ["variant (options)", "T", "(a) / (c)", "(a) / (b)", "(a) ms", "(b) ms", "(c) ms"]
  rows = []
  order = list(dict.fromkeys(r["attention"] for r in records))
  for r in sorted(records, key=lambda r: (order.index(r["attention"]), r["length"])):
    shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in r["options"].items())
    label = f"`{r['attention']}`" + (f" ({shown})" if shown else "")
    if r["status"] != "ok":
      rows.append([label, f"{r['length']:,}", "error", "", "", "", ""])
      continue
    rows.append([label, f"{r['length']:,}", _ratio(r.get("ours_vs_identity")),
                 _ratio(r.get("ours_vs_flax")), _ms(r.get("ours_s")), _ms(r.get("flax_s")),
                 _ms(r.get("identity_s"))])
  parts.append(_table(header, rows))
  return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------ decode ---


def _bytes(n: int | None) -> str:
  if n is None:
    return "–"
  return f"{n / _MIB:.3g} MiB" if n >= _MIB else f"{n / 2**10:.3g} KiB"


def render_decode(report: dict[str, Any]) -> str:
  records = report["records"]
  meta = {"backend": report.get("device", "?"), "jax": report.get("jax")}
  parts = [f"Measured on {meta['backend']}, jax {meta['jax']}. One layer, B = "
           f"{report['batch']}, N = {report['heads']}, K = {report['num_kv_heads']}, H = D = "
           f"{report['head_dim']}, float32; {report['steps']} single-token steps per timed "
           "`lax.scan`, median per token."]
  header = ["variant", "cache", "position P", "cache bytes", "step (ms)",
            "step / one read of the cache"]
  rows = []
  for r in records:
    ratio = r.get("step_over_read")
    rows.append([f"`{r['attention']}`", r["cache_kind"], f"{r['position']:,}",
                 _bytes(r.get("cache_bytes")),
                 _ms(r.get("step_s")) if r["status"] == "ok" else r["status"][:40],
                 "–" if ratio is None else f"{ratio:.2f}"])
  parts.append(_table(header, rows))
  return "\n\n".join(parts) + "\n"


# -------------------------------------------------------------- test costs ---


def render_test_costs(report: dict[str, Any]) -> str:
  """The suite's cost per file (``tests/support/costs.py``'s ``--cost-report``)."""
  meta = report["meta"]
  files = report["files"]
  total = {f: sum(c.get(f, 0) for c in files.values())
           for f in ("tests", "seconds", "compiles", "trace_s", "lower_s", "compile_s")}
  parts = [f"Measured with {meta['cpu_count']} CPU cores and two test workers, jax "
           f"{meta['jax']}, {meta['date']}: {total['tests']:,} tests, "
           f"{total['seconds']:,.0f} worker-seconds, {total['compiles']:,} compilations "
           f"({report['distinct_programs']:,} distinct programs). Seconds are per worker "
           "(their sum, not the wall time); compilations count every program a test "
           "traced and compiled (a persistent-cache hit too); trace, lower and compile are "
           "the seconds JAX spent in each stage. The training runs, notebooks and worker "
           "processes the tests start are counted in seconds only."]
  header = ["file", "tests", "worker-s", "compilations", "trace s", "lower s", "compile s"]
  rows = [[f"`{name}`", str(c.get("tests", 0)), f"{c.get('seconds', 0):.1f}",
           str(c.get("compiles", 0)), f"{c.get('trace_s', 0):.1f}",
           f"{c.get('lower_s', 0):.1f}", f"{c.get('compile_s', 0):.1f}"]
          for name, c in sorted(files.items(), key=lambda item: -item[1].get("seconds", 0))]
  rows.append(["all", f"{total['tests']:,}", f"{total['seconds']:.0f}",
               f"{total['compiles']:,}", f"{total['trace_s']:.0f}", f"{total['lower_s']:.0f}",
               f"{total['compile_s']:.0f}"])
  parts.append(_table(header, rows))
  return "\n\n".join(parts) + "\n"


RENDERERS = {
    "benchmark.json": render_benchmark,
    "model_step.json": render_model_step,
    "decode.json": render_decode,
    "test_costs.json": render_test_costs,
}


def render_all(results: pathlib.Path, out: pathlib.Path) -> list[pathlib.Path]:
  """Writes ``<out>/<folder>.md`` for each result file ``<results>/<folder>/<name>.json``."""
  out.mkdir(parents=True, exist_ok=True)
  written = []
  for name, render in RENDERERS.items():
    for path in sorted(results.glob(f"*/{name}")):
      target = out / f"{path.parent.name}.md"
      target.write_text(render(json.loads(path.read_text())))
      written.append(target)
  return written


if __name__ == "__main__":
  if len(sys.argv) != 3:
    sys.exit(__doc__)
  for path in render_all(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])):
    print(f"wrote {path}")
