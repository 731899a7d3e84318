"""Train several attention variants on one task with the same budget and seed.

    python -m experiments.compare --task=mqar --attentions=softmax,linear_elu,performer \\
        --seq_len=64 --num_steps=1500

Every entry of ``--attentions`` runs ``train.py``'s loop with the same flags
(``--attention`` and ``--attention_options`` aside) in ``--workdir/<entry>``.
An entry is a registered name, optionally with a label after ``@`` so one
variant can run with several options (``performer@16,performer@256``); its
options come from ``--options_by_attention``, a JSON object keyed by entry
(an entry without options of its own takes those of its bare name). An entry
``layers:PATTERN`` runs a layer pattern instead (``train.py``'s
``--layer_pattern`` with ``+`` between the layers): ``layers:kda`` is KDA's token
mixer in every layer, ``layers:gated_deltanet+gated_deltanet+gated_deltanet+attention``
Qwen3-Next's hybrid (its attention layers: ``--attention``); its options go to the
mixers (``--mixer_options``' place). Writes
``--workdir/comparison.md`` (final metric, tokens/s, compiled memory of the
train step, size of the decode state), ``--workdir/curves.png`` (every
entry's learning curve) and, for causal tasks, ``--workdir/state.png`` (the
final metric against the decode state's size, a line per variant: the
state-size sweep of Zoology, Arora et al. 2023, when entries repeat a name).
Defaults: ``DEFAULT_ATTENTIONS`` and ``DEFAULT_OPTIONS``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from experiments import common, data, train

# --attentions: entries to compare, registered names each optionally labelled
# name@label; --options_by_attention: JSON {entry or name: {option: value}}.
DEFAULT_ATTENTIONS = ("softmax", "linear_elu", "performer", "local")
DEFAULT_OPTIONS = '{"local": {"window_size": [16, 0]}}'


def entry_options(entries: Sequence[str], written: str | None) -> dict[str, Any]:
  """The options of each entry: ``DEFAULT_OPTIONS`` for the entries that run, then those the
  user ``written`` (JSON). Defaults for entries that do not run are ignored; written options
  for an entry that does not run are an error."""
  names = set(entries) | {attention_name(a) for a in entries}
  try:
    options = json.loads(written or "{}")
  except json.JSONDecodeError as e:
    raise app.UsageError(f"--options_by_attention is not JSON: {e}") from e
  if not isinstance(options, dict) or set(options) - names:
    raise app.UsageError("--options_by_attention must be a JSON object keyed by entries of "
                         f"--attentions; got {written}.")
  defaults = {k: v for k, v in json.loads(DEFAULT_OPTIONS).items() if k in names}
  return {k: {**defaults.get(k, {}), **options.get(k, {})} for k in defaults.keys() | options}


def attention_name(entry: str) -> str:
  """The registered name of a ``name`` or ``name@label`` entry (``layers:PATTERN`` for a
  layer-pattern entry)."""
  return entry.split("@", 1)[0]


def entry_layers(entry: str) -> list[str] | None:
  """The layer pattern of a ``layers:PATTERN[@label]`` entry; None for an attention's."""
  name = attention_name(entry)
  return name.removeprefix("layers:").split("+") if name.startswith("layers:") else None


def cannot_pack(base: train.Config, entry: str) -> str | None:
  """Why the entry's rows cannot be packed (token mixers always can), or None."""
  layers = entry_layers(entry)
  if layers is not None and "attention" not in layers:
    return train.cannot_pack(data.TASKS[base.task], "linear_elu", base.context_parallel)
  attention = base.attention if layers is not None else attention_name(entry)
  return train.cannot_pack(data.TASKS[base.task], attention, base.context_parallel)


def train_step_memory(config: train.Config) -> int | None:
  """Compiled temporary bytes of one training step (``memory_analysis``)."""
  trainer = train.Trainer(config)
  compiled = jax.jit(trainer._train_step).lower(trainer.state, trainer.batch(0, data.TRAIN))
  analysis = compiled.compile().memory_analysis()
  return getattr(analysis, "temp_size_in_bytes", None)


def decode_state_floats(config: train.Config) -> int | None:
  """Floats one example's decode cache holds in one layer after ``seq_len`` tokens.

  The state a causal model recalls from: ``[M, D]`` (plus normaliser) per
  head for the recurrent variants, keys and values for softmax. ``None`` for
  classification (no decoding).
  """
  if not data.TASKS[config.task].causal:
    return None

  def cache():
    model = train.make_model(config)
    model.init_cache(1, config.seq_len)
    return nnx.state(model, nnx.Cache)

  leaves = jax.tree.leaves(jax.eval_shape(cache))
  return sum(x.size for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)) // config.num_layers


def compare(base: train.Config, attentions: Sequence[str],
            options: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
  configs = {}
  for entry in attentions:  # Every entry is checked before the first one trains.
    name, layers = attention_name(entry), entry_layers(entry)
    cannot = cannot_pack(base, entry)
    if base.pack and cannot is not None:
      raise app.UsageError(f"--attentions entry {entry}: --pack: {cannot}; pass --nopack.")
    written = options.get(entry, options.get(name, {}))
    if layers is None:
      config = dataclasses.replace(base, attention=name, attention_options=written,
                                   layer_pattern="attention")
    else:
      config = dataclasses.replace(base, layer_pattern=",".join(layers),
                                   mixer_options=written or base.mixer_options)
    configs[entry] = dataclasses.replace(
        config, workdir=str(pathlib.Path(base.workdir) / entry.replace(":", "_")))
    train.check_model(configs[entry], f"--attentions entry {entry}")
  rows = []
  for entry, config in configs.items():
    summary = train.train(config)
    records = [json.loads(line) for line in
               (pathlib.Path(config.workdir) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    rows.append({"attention": entry, "options": (config.attention_options
                                                 if entry_layers(entry) is None
                                                 else config.mixer_options),
                 "final": summary["final"], "tokens_per_s": sorted(rates)[len(rates) // 2],
                 "train_step_temp_bytes": train_step_memory(config),
                 "state_floats": decode_state_floats(config), "records": records})
  return rows


def final_metric(task: str) -> str:
  return "eval_bits_per_char" if task == "char_lm" else "eval_accuracy"


def write_table(rows: list[dict[str, Any]], base: train.Config, path: pathlib.Path) -> str:
  metric = final_metric(base.task)
  lines = [f"task `{base.task}`, seq_len {base.seq_len}, {base.num_steps} steps of "
           f"{base.batch_size}, model_dim {base.model_dim}, {base.num_layers} layers, "
           f"{base.num_heads} heads, seed {base.seed}", "",
           f"| attention | options | {metric} | eval loss | tokens/s (median) | "
           "train-step temp MiB | decode state per layer (floats) |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    mem, state = r["train_step_temp_bytes"], r["state_floats"]
    lines.append(f"| {r['attention']} | `{json.dumps(r['options'])}` | "
                 f"{r['final'][metric]:.4f} | {r['final']['eval_loss']:.4f} | "
                 f"{r['tokens_per_s']:,.0f} | "
                 f"{'-' if mem is None else f'{mem / 2**20:.1f}'} | "
                 f"{'-' if state is None else f'{state:,}'} |")
  text = "\n".join(lines) + "\n"
  path.write_text(text)
  return text


def plot(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
  series = {}
  for r in rows:
    steps = [x for x in r["records"] if "train_loss" in x]
    series[r["attention"]] = ([x["step"] for x in steps], [x["train_loss"] for x in steps])
  common.plot_lines(path, series, xlabel="step", ylabel="train loss (nats)", title=title)


def plot_state(rows: list[dict[str, Any]], metric: str, path: pathlib.Path, title: str) -> bool:
  """Final ``metric`` against decode-state size, a line per registered variant."""
  series: dict[str, tuple[list, list]] = {}
  for r in sorted(rows, key=lambda r: r["state_floats"] or 0):
    if r["state_floats"] is not None:
      xs, ys = series.setdefault(attention_name(r["attention"]), ([], []))
      xs.append(r["state_floats"])
      ys.append(r["final"][metric])
  return bool(series) and common.plot_lines(
      path, series, xlabel="decode state per layer and example (floats)", ylabel=metric,
      title=title, log_x=True)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  entries = common.ATTENTIONS.value or list(DEFAULT_ATTENTIONS)
  options = entry_options(entries, common.OPTIONS_BY_ATTENTION.value)
  base = train.config_from_flags()
  if flags.FLAGS["pack"].value is None:  # Packed where every entry can be: one data for all.
    base = dataclasses.replace(base, pack=all(cannot_pack(base, entry) is None
                                              for entry in entries))
  train.quiet_orbax()
  with train.exit_status():
    rows = compare(base, entries, options)
  out = pathlib.Path(base.workdir)
  print(write_table(rows, base, out / "comparison.md"), flush=True)
  plot(rows, out / "curves.png", f"{base.task}: train loss")
  wrote = [out / "comparison.md", out / "curves.png"]
  if plot_state(rows, final_metric(base.task), out / "state.png", f"{base.task}: state size"):
    wrote.append(out / "state.png")
  print(f"wrote {', '.join(map(str, wrote))}", flush=True)


if __name__ == "__main__":
  common.run(main)
