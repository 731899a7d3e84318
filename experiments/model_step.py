"""Times one training step of a small causal LM per attention, against the identity.

For each length T of ``--seq_lengths`` and each variant of ``--attentions``,
three versions of ``experiments.model.Transformer`` (``--width``,
``--layers``, ``--heads``; B = ``--batch``, ``--dtype``; byte vocabulary)
take one training step: forward, backward and an AdamW update, one program
under ``jax.jit`` on the split state (``nnx.split``):

* ``ours``: ``linattn_jax.nn.MultiHeadAttention(attention=name)``;
* ``flax``: ``flax.nnx.MultiHeadAttention`` whose ``attention_fn`` is
  ``nn.as_flax_attention_fn(get_attention(name, **options))`` (a variant's
  random projection is the one layer (a) drew, passed as (a) passes it). Not for
  the gated and delta-rule variants: their per-token gates are projected by our
  layer, and Flax's ``attention_fn`` has no argument to take them;
* ``identity``: the same projections with the attention replaced by
  ``v + q ⊙ k`` (elementwise), the cost floor of a layer. The product keeps
  the query and key projections alive and gives the three projections
  different gradients: with ``q + k + v`` they would be equal and XLA would
  compute the weight gradient once for all three (2 matmuls fewer per layer).

The three steps are timed in alternation, round by round and in rotating order
(so the load of a shared machine falls on all alike), with
``benchmark.time_executable``:
``--warmup`` untimed calls each, then ``--repeats`` rounds; medians are
reported, with the ratios ``ours_vs_identity`` (a)/(c), ``flax_vs_identity``
(b)/(c) and ``ours_vs_flax`` (a)/(b) (the last two absent for the gated variants,
which have no (b)). The JSON also has each model's compiled temporaries
(``temp_bytes``) and, per step (medians), the minor page faults and system CPU
seconds of the process (``page_faults_per_step``, ``system_s_per_step``): on
Linux, XLA:CPU's temporaries are mapped afresh for each call, and first touching
them is work the kernel does inside the step. Defaults: ``DEFAULT_ATTENTIONS`` with
``DEFAULT_OPTIONS``; ``--options_by_attention`` (JSON ``{variant: {option:
value}}``) overrides them, e.g. a ``chunk_size``. ``--heads`` defaults to
``--width / --head_dim``.

    python -m experiments.model_step --seq_lengths=2048,8192

writes ``model_step.json`` (after every variant), ``model_step.png`` (ours /
identity against T) and ``model_step_vs_flax.png`` (ours / flax against T)
to ``--output_dir`` (default ``results/model_step``); with ``--dump_hlo``,
every compiled step's HLO text to its ``hlo/`` folder.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import resource
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx

import linattn_jax as la
from experiments import benchmark, common, train
from experiments.model import Transformer
from linattn_jax import nn

DEFAULT_ATTENTIONS = ("linear_elu", "efficient", "heinsen", "performer", "random_fourier",
                      "local")
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "performer": {"num_features": 256},
    "random_fourier": {"num_features": 256},
    "local": {"window_size": [256, 0]},
}
MODELS = ("ours", "flax", "identity")
VOCAB = 256  # Bytes.

_SEQ_LENGTHS = flags.DEFINE_list("seq_lengths", ["2048", "8192"], "Sequence lengths T.")
_WIDTH = flags.DEFINE_integer("width", 256, "Model width (N·H).")
_LAYERS = flags.DEFINE_integer("layers", 2, "Pre-norm blocks.")
_DUMP_HLO = flags.DEFINE_bool("dump_hlo", False, "Write each compiled step's HLO text.")
flags.adopt_module_key_flags(common)


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on (the flags, validated and defaulted)."""

  attentions: tuple[str, ...]
  options: Mapping[str, Mapping[str, Any]]
  lengths: tuple[int, ...]
  width: int
  layers: int
  heads: int
  batch: int
  dtype: str
  repeats: int
  warmup: int
  seed: int
  output_dir: str
  plot: bool
  dump_hlo: bool = False


def config_from_flags() -> Config:
  """Reads and checks the flags (the only place they are read)."""
  attentions = tuple(common.ATTENTIONS.value or DEFAULT_ATTENTIONS)
  try:
    overrides = json.loads(common.OPTIONS_BY_ATTENTION.value or "{}")
    lengths = tuple(int(t) for t in _SEQ_LENGTHS.value)
  except ValueError as e:
    raise app.UsageError(f"--options_by_attention (JSON) or --seq_lengths (ints): {e}") from e
  if not isinstance(overrides, dict) or set(overrides) - set(attentions):
    raise app.UsageError("--options_by_attention must be a JSON object keyed by entries of "
                         f"--attentions; got {common.OPTIONS_BY_ATTENTION.value}.")
  width = _WIDTH.value
  heads = common.HEADS.value if common.HEADS.present else width // common.HEAD_DIM.value
  config = Config(
      attentions=attentions,
      options={a: {**DEFAULT_OPTIONS.get(a, {}), **overrides.get(a, {})} for a in attentions},
      lengths=lengths, width=width, layers=_LAYERS.value, heads=heads,
      batch=common.BATCH.value, dtype=common.DTYPE.value, repeats=common.REPEATS.value,
      warmup=benchmark._WARMUP.value, seed=common.SEED.value,
      output_dir=common.output_dir("model_step"), plot=common.PLOT.value,
      dump_hlo=_DUMP_HLO.value)
  validate(config)
  return config


def validate(config: Config) -> None:
  """Fails fast, before anything is compiled, on an impossible configuration."""
  if config.heads < 1 or config.width % config.heads:
    raise app.UsageError(f"--heads={config.heads} must divide --width={config.width}.")
  if config.repeats < 1 or config.warmup < 0 or min(config.lengths, default=0) < 2:
    raise app.UsageError("need --repeats >= 1, --warmup >= 0 and --seq_lengths >= 2.")
  for name in config.attentions:
    try:
      la.get_attention(name, **config.options[name])  # Checks the option names.
    except ValueError as e:
      raise app.UsageError(str(e)) from e
    if not la.get_spec(name).supports_causal:
      raise app.UsageError(f"{name} has no causal form.")


# ------------------------------------------------------------------ models ---


class FlaxAttention(nnx.Module):
  """``flax.nnx.MultiHeadAttention`` running ``layer``'s variant as its ``attention_fn``.

  Called as ``Block`` calls its attention (training only: no decoding, no lengths).
  The variant's arrays (a random projection) are ``layer``'s variables, bound into
  ``attention_fn`` at each call: as in ``layer`` they reach the program as arguments
  (bound once, as constants, XLA would fold them into the program and the comparison
  would time that, not the layers).
  """

  def __init__(self, layer: nn.MultiHeadAttention, *, rngs: nnx.Rngs):
    self.attention, self.options = layer.attention, dict(layer.attention_options)
    params = la.get_spec(layer.attention).params
    self.array_names = params.names if params else ()
    for name in self.array_names:
      setattr(self, name, getattr(layer, name))
    self.layer = nnx.MultiHeadAttention(
        layer.num_heads, layer.in_features, attention_fn=self._attention_fn(), decode=False,
        dtype=layer.dtype, rngs=rngs)

  def _attention_fn(self):
    arrays = {name: getattr(self, name).get_value() for name in self.array_names}
    return nn.as_flax_attention_fn(la.get_attention(self.attention, **self.options, **arrays))

  def __call__(self, x: jax.Array, *, is_causal: bool, decode: bool,
               key_value_seq_lengths: Any, segment_ids: Any = None) -> jax.Array:
    del decode, key_value_seq_lengths
    _unpacked(segment_ids, "FlaxAttention")
    if self.array_names:
      self.layer.attention_fn = self._attention_fn()
    return self.layer(x, is_causal=is_causal)


def _unpacked(segment_ids: Any, name: str) -> None:
  """The stand-ins time unpacked rows only: ``segment_ids`` would be ignored, so it raises."""
  if segment_ids is not None:
    raise ValueError(f"{name}: the model-step stand-ins take no segment_ids (unpacked rows).")


class IdentityAttention(nnx.Module):
  """``layer``'s projections with the attention replaced by ``v + q ⊙ k`` (needs K = N, D = H)."""

  def __init__(self, layer: nn.MultiHeadAttention):
    self.layer = layer

  def __call__(self, x: jax.Array, *, is_causal: bool, decode: bool,
               key_value_seq_lengths: Any, segment_ids: Any = None) -> jax.Array:
    del is_causal, decode, key_value_seq_lengths
    _unpacked(segment_ids, "IdentityAttention")
    mha = self.layer
    return mha.out(mha.value(x) + mha.query(x) * mha.key(x))


def make_model(config: Config, kind: str, attention: str, length: int) -> Transformer:
  """The ``kind`` model (one of ``MODELS``) of ``attention`` for sequences of ``length``."""
  model = Transformer(
      vocab_size=VOCAB, num_classes=None, max_len=length, dim=config.width,
      num_layers=config.layers, num_heads=config.heads, num_kv_heads=None, attention=attention,
      attention_options=config.options.get(attention, {}), dtype=jnp.dtype(config.dtype),
      rngs=nnx.Rngs(config.seed))
  rngs = nnx.Rngs(config.seed + 1)
  for block in model.blocks:
    if kind == "flax":
      block.attn = FlaxAttention(block.attn, rngs=rngs)
    elif kind == "identity":
      block.attn = IdentityAttention(block.attn)
  return model


def make_batch(config: Config, length: int) -> dict[str, jax.Array]:
  """Seeded random bytes: inputs, next-token targets and unit weights ``[B, T]``."""
  rng = np.random.default_rng(config.seed)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (config.batch, length + 1)), jnp.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "weights": jnp.ones((config.batch, length), jnp.float32)}


def compiled_step(model: Transformer, batch: dict[str, jax.Array]) -> tuple[Any, tuple, float]:
  """One AdamW training step of ``model`` on ``batch``: compiled, its arguments, compile seconds."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adamw(1e-3)

  def step(params, rest, opt_state, batch):
    def loss_fn(params):
      return train.loss_and_metrics(nnx.merge(graphdef, params, rest), batch)

    grads, metrics = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics["loss"]

  args = (params, rest, tx.init(params), batch)
  compiled, compile_s = benchmark.compile_function(step, args)
  return compiled, args, compile_s


# ------------------------------------------------------------- measuring ---


class Timed(NamedTuple):
  """Per call of each model: wall seconds, and what the process cost the kernel meanwhile
  (``resource.getrusage``, every thread): minor page faults and system CPU seconds."""

  seconds: dict[str, list[float]]
  page_faults: dict[str, list[int]]
  system_s: dict[str, list[float]]


def time_alternating(calls: Mapping[str, tuple[Any, tuple]], *, warmup: int,
                     repeats: int) -> Timed:
  """``repeats`` calls of each ``(compiled, args)``, one of each per round.

  Each round starts one call later than the one before, so that no call always runs
  first (after the Python loop) or right after the same other.
  """
  for compiled, args in calls.values():
    benchmark.time_executable(compiled, args, warmup=warmup, repeats=0)
  names = list(calls)
  timed = Timed(*({name: [] for name in names} for _ in Timed._fields))
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      before = resource.getrusage(resource.RUSAGE_SELF)
      timed.seconds[name].extend(benchmark.time_executable(*calls[name], warmup=0, repeats=1))
      after = resource.getrusage(resource.RUSAGE_SELF)
      timed.page_faults[name].append(after.ru_minflt - before.ru_minflt)
      timed.system_s[name].append(after.ru_stime - before.ru_stime)
  return timed


def models_of(attention: str) -> tuple[str, ...]:
  """The ``MODELS`` that can run ``attention``: Flax's layer has no per-token gate inputs
  (the gated and delta-rule variants' ``token_inputs``), so those run ours and identity."""
  return ("ours", "identity") if la.get_spec(attention).token_inputs else MODELS


def add_ratios(record: dict[str, Any]) -> None:
  """Medians and the ratios (a)/(c), (b)/(c), (a)/(b) of a timed record (those it has)."""
  for model, times in record["times_s"].items():
    record[f"{model}_s"] = statistics.median(times)
  record["ours_vs_identity"] = record["ours_s"] / record["identity_s"]
  if "flax_s" in record:
    record["flax_vs_identity"] = record["flax_s"] / record["identity_s"]
    record["ours_vs_flax"] = record["ours_s"] / record["flax_s"]


def dump_hlo(config: Config, compiled: Any, name: str) -> None:
  if config.dump_hlo:
    folder = pathlib.Path(config.output_dir) / "hlo"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.txt").write_text(compiled.as_text())


_ROW = "{:>15} {:>6} {:>10} {:>10} {:>11} {:>8} {:>8} {:>8}  {}"


def run(config: Config) -> dict[str, Any]:
  """Times every (length, variant), printing the table and writing the JSON."""
  out = pathlib.Path(config.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  report: dict[str, Any] = {"metadata": benchmark.run_metadata(config), "records": []}
  print(_ROW.format("attention", "T", "ours_ms", "flax_ms", "identity_ms", "a/c", "b/c", "a/b",
                    "status"), flush=True)
  for length in config.lengths:
    batch = make_batch(config, length)
    identity = compiled_step(make_model(config, "identity", "softmax", length), batch)
    dump_hlo(config, identity[0], f"identity_T{length}")
    for name in config.attentions:
      record: dict[str, Any] = {"attention": name, "options": config.options[name],
                                "length": length, "status": "ok"}
      try:
        calls, memory, compile_s = {}, {}, {}
        for kind in models_of(name):
          logging.info("compiling %s %s T=%d", name, kind, length)
          step = (identity if kind == "identity"
                  else compiled_step(make_model(config, kind, name, length), batch))
          calls[kind] = step[:2]
          compile_s[kind] = step[2]
          memory[kind] = benchmark.memory_stats(step[0]).get("temp_size_in_bytes")
          if kind != "identity":
            dump_hlo(config, step[0], f"{name}_{kind}_T{length}")
        timed = time_alternating(calls, warmup=config.warmup, repeats=config.repeats)
        record.update(compile_s=compile_s, temp_bytes=memory, times_s=timed.seconds,
                      page_faults_per_step={m: statistics.median(x)
                                            for m, x in timed.page_faults.items()},
                      system_s_per_step={m: statistics.median(x)
                                         for m, x in timed.system_s.items()})
        add_ratios(record)
      except Exception as e:  # One failed variant must not end the sweep.
        first_line = next(iter(str(e).splitlines()), "")
        record["status"] = f"error: {type(e).__name__}: {first_line[:200]}"
      report["records"].append(record)
      print(_ROW.format(name, length, *(_fmt(record.get(f"{m}_s"), 1e3, ".1f") for m in MODELS),
                        *(_fmt(record.get(r), 1, ".3f") for r in
                          ("ours_vs_identity", "flax_vs_identity", "ours_vs_flax")),
                        record["status"]), flush=True)
      common.write_json(out / "model_step.json", report)
    jax.clear_caches()
  print(f"wrote {out / 'model_step.json'}", flush=True)
  if config.plot:
    plot(report, out, config)
  return report


def _fmt(value: float | None, factor: float, spec: str) -> str:
  return "-" if value is None else format(value * factor, spec)


def plot(report: dict[str, Any], out: pathlib.Path, config: Config) -> None:
  """``model_step.png`` (ours / identity) and ``model_step_vs_flax.png`` (ours / flax)."""
  shape = (f"width={config.width} layers={config.layers} N={config.heads} B={config.batch} "
           f"{config.dtype}")
  for key, path, ylabel in (("ours_vs_identity", "model_step.png", "step time / identity"),
                            ("ours_vs_flax", "model_step_vs_flax.png", "step time / flax")):
    series: dict[str, tuple[list, list]] = {}
    for r in report["records"]:
      if key in r:
        xs, ys = series.setdefault(r["attention"], ([], []))
        xs.append(r["length"])
        ys.append(r[key])
    if series and common.plot_lines(out / path, series, xlabel="sequence length T",
                                    ylabel=ylabel, log_x=True,
                                    title=f"training step, {shape}"):
      print(f"wrote {out / path}", flush=True)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  report = run(config_from_flags())
  failed = [r for r in report["records"] if r["status"] != "ok"]
  if failed:
    sys.exit(f"{len(failed)} case(s) failed.")


if __name__ == "__main__":
  common.run(main)
