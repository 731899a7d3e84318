"""Train several attention variants on one task with the same budget and seed.

    python -m experiments.compare --task=mqar --attentions=softmax,linear_elu,performer \\
        --seq_len=64 --num_steps=1500

Every variant runs ``train.py``'s loop with the same flags (``--attention``
and ``--attention_options`` aside; per-variant options come from
``--options_by_attention``, a JSON object) in ``--workdir/<variant>``. Writes
``--workdir/comparison.md`` (final metric, tokens/s, compiled memory of the
train step) and ``--workdir/curves.png`` (every variant's learning curve).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
from absl import app, flags

import linattn_jax as la
from experiments import common, data, train

_ATTENTIONS = flags.DEFINE_list(
    "attentions", ["softmax", "linear_elu", "performer", "local"], "Variants to compare.")
_OPTIONS_BY_ATTENTION = flags.DEFINE_string(
    "options_by_attention", '{"local": {"window_size": [16, 0]}}',
    "JSON object {attention: {option: value}}.")


def train_step_memory(config: train.Config) -> int | None:
  """Compiled temporary bytes of one training step (``memory_analysis``)."""
  trainer = train.Trainer(config)
  compiled = jax.jit(trainer._train_step).lower(trainer.state, trainer.batch(0, data.TRAIN))
  analysis = compiled.compile().memory_analysis()
  return getattr(analysis, "temp_size_in_bytes", None)


def compare(base: train.Config, attentions: Sequence[str],
            options: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
  rows = []
  for name in attentions:
    config = dataclasses.replace(base, attention=name, attention_options=options.get(name, {}),
                                 workdir=str(pathlib.Path(base.workdir) / name))
    summary = train.train(config)
    records = [json.loads(line) for line in
               (pathlib.Path(config.workdir) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    rows.append({"attention": name, "options": config.attention_options,
                 "final": summary["final"], "tokens_per_s": sorted(rates)[len(rates) // 2],
                 "train_step_temp_bytes": train_step_memory(config), "records": records})
  return rows


def write_table(rows: list[dict[str, Any]], base: train.Config, path: pathlib.Path) -> str:
  metric = "eval_bits_per_char" if base.task == "char_lm" else "eval_accuracy"
  lines = [f"task `{base.task}`, seq_len {base.seq_len}, {base.num_steps} steps of "
           f"{base.batch_size}, model_dim {base.model_dim}, {base.num_layers} layers, "
           f"{base.num_heads} heads, seed {base.seed}", "",
           f"| attention | options | {metric} | eval loss | tokens/s (median) | "
           "train-step temp MiB |", "|---|---|---|---|---|---|"]
  for r in rows:
    mem = r["train_step_temp_bytes"]
    lines.append(f"| {r['attention']} | `{json.dumps(r['options'])}` | "
                 f"{r['final'][metric]:.4f} | {r['final']['eval_loss']:.4f} | "
                 f"{r['tokens_per_s']:,.0f} | "
                 f"{'-' if mem is None else f'{mem / 2**20:.1f}'} |")
  text = "\n".join(lines) + "\n"
  path.write_text(text)
  return text


def plot(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
  series = {}
  for r in rows:
    steps = [x for x in r["records"] if "train_loss" in x]
    series[r["attention"]] = ([x["step"] for x in steps], [x["train_loss"] for x in steps])
  common.plot_lines(path, series, xlabel="step", ylabel="train loss (nats)", title=title)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  unknown = [a for a in _ATTENTIONS.value if a not in la.available_attentions()]
  if unknown:
    raise app.UsageError(f"--attentions {unknown} are unknown; available: "
                         f"{la.available_attentions()}.")
  try:
    options = json.loads(_OPTIONS_BY_ATTENTION.value)
  except json.JSONDecodeError as e:
    raise app.UsageError(f"--options_by_attention is not JSON: {e}") from e
  base = train.config_from_flags()
  rows = compare(base, _ATTENTIONS.value, options)
  out = pathlib.Path(base.workdir)
  print(write_table(rows, base, out / "comparison.md"), flush=True)
  plot(rows, out / "curves.png", f"{base.task}: train loss")
  print(f"wrote {out / 'comparison.md'} and {out / 'curves.png'}", flush=True)


if __name__ == "__main__":
  app.run(main)
