"""Train a small Transformer with any registered attention on a built-in task.

    python -m experiments.train                       # char_lm, linear_elu, CPU-sized
    python -m experiments.train --attention=performer --attention_options=num_features=64
    python -m experiments.train --task=mqar --attention=softmax --seq_len=64
    python -m experiments.train --task=mqar --num_layers=4 --attention=softmax \
        --layer_pattern=gated_deltanet,gated_deltanet,gated_deltanet,attention

Data order is a function of (seed, step) (see ``data.py``); orbax checkpoints
in ``--workdir`` make a rerun of the same command after the process died
resume from the last checkpoint, ending with the same parameters bit for bit
(on CPU). The batch is sharded over all local devices (a one-axis ``data``
mesh). ``--workdir`` receives ``config.json``, ``metrics.jsonl`` (one JSON
object per logged or evaluated step), ``curves.png``, ``summary.json`` and,
for char_lm, ``sample.txt`` generated through the layers' decode caches.

A checkpoint that cannot be read (files cut short by a full disk, say) is
moved to ``damaged_checkpoints/`` with a warning and the one before it is
resumed; one that cannot be written ends the run (``CheckpointWriteError``;
exit status 1) in one line. The first step whose loss, gradient norm or
updated parameters are not finite stops the run (``TrainingDivergedError``;
exit status 1) before anything non-finite is logged or saved, so the
checkpoints already written are kept. A SIGTERM (a scheduler's preemption) or
Ctrl-C stops the run at the end of its step with that step saved
(``TrainingStoppedError``; exit status 128 + the signal's number, as if it had
killed the process); a second one acts at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging as std_logging
import math
import os
import pathlib
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app, flags, logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import linattn_jax as la
from experiments import common, data
from experiments.model import Transformer
from linattn_jax import nn, parallel

_ATTENTION = flags.DEFINE_string("attention", "linear_elu", "A registered attention name.")
_ATTENTION_OPTIONS = flags.DEFINE_string(
    "attention_options", "", "Its options: JSON ('{\"window_size\": [64, 0]}') or "
    "key=value,... (values parsed as JSON, e.g. window_size=64 or num_features=64).")
_TASK = flags.DEFINE_enum("task", "char_lm", list(data.TASKS), "Training task.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per example.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Examples per step (over all devices).")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 1000, "Training steps.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 50, "Linear warm-up steps.")
_WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
_CLIP_NORM = flags.DEFINE_float("clip_norm", 1.0, "Global gradient-norm clipping (0: none).")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "Transformer blocks.")
_MODEL_DIM = flags.DEFINE_integer("model_dim", 128, "Model width.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 4, "Query heads N.")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", None, "Key/value heads K (default N).")
_DTYPE = common.DTYPE  # float32 or bfloat16 here.
_SEED = common.SEED
flags.declare_key_flag("dtype")
flags.declare_key_flag("seed")
_WORKDIR = flags.DEFINE_string("workdir", "results/train", "Checkpoints, metrics and plots.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 250, "Evaluate every this many steps.")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 8, "Held-out batches per evaluation.")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 250, "Checkpoint period (steps).")
_LOG_EVERY = flags.DEFINE_integer("log_every", 50, "Progress line period (steps).")
_REDRAW_EVERY = flags.DEFINE_integer(
    "redraw_every", 0, "Redraw random features every this many steps (0: never; "
    "performer and random_fourier only).")
_SAMPLE_LENGTH = flags.DEFINE_integer("sample_length", 96, "Generated characters (char_lm).")
_SHORT_CONV = flags.DEFINE_integer(
    "short_conv", 0, "Width of a causal depthwise convolution before each attention (Based's "
    "short convolution; 0: none). Decoders only.")
_PACK = flags.DEFINE_bool(
    "pack", None, "Tell the documents in a row apart (char_lm: each source file is one): "
    "attention and the short convolution stay inside a document, positions count from its "
    "start, and no target crosses a boundary. Default: on where it can run (char_lm, with an "
    "--attention, and a --context_parallel, that take segment_ids).")
_LAYER_PATTERN = flags.DEFINE_list(
    "layer_pattern", ["attention"], "What each layer mixes tokens with, cycled over the "
    "layers: 'attention' (--attention) or a token mixer's name (linattn_jax.nn."
    "token_mixer_names(): gated_deltanet, kda, gla, simple_gla, retnet, deltanet, rwkv7, "
    "mamba, mamba2, lfm2), e.g. gated_deltanet,gated_deltanet,gated_deltanet,attention for "
    "Qwen3-Next's hybrid, mamba2,mamba2,mamba2,attention for a Nemotron-H-like one. "
    "Mixers are causal (decoders).")
_MIXER_OPTIONS = flags.DEFINE_string(
    "mixer_options", "", "Options of every token mixer, as --attention_options, e.g. "
    "num_v_heads=8 or attention_options={\"chunk_size\":16}.")
_CONTEXT_PARALLEL = flags.DEFINE_integer(
    "context_parallel", 1, "Devices each sequence is split over (ring attention for softmax "
    "and flash, state passing for recurrent variants); the batch is split over the rest.")

# Flags that do not change what is trained: a resumed run may change them.
RUNTIME_ONLY = ("workdir", "eval_every", "eval_batches", "checkpoint_every", "log_every",
                "sample_length", "context_parallel")


@dataclasses.dataclass(frozen=True)
class Config:
  attention: str
  attention_options: dict[str, Any]
  task: str
  seq_len: int
  batch_size: int
  num_steps: int
  learning_rate: float
  warmup_steps: int
  weight_decay: float
  clip_norm: float
  num_layers: int
  model_dim: int
  num_heads: int
  num_kv_heads: int | None
  dtype: str
  seed: int
  workdir: str
  eval_every: int
  eval_batches: int
  checkpoint_every: int
  log_every: int
  redraw_every: int
  sample_length: int
  context_parallel: int = 1
  short_conv: int = 0
  pack: bool = False
  layer_pattern: str = "attention"  # Comma-separated: "attention" or token mixer names.
  mixer_options: dict[str, Any] = dataclasses.field(default_factory=dict)

  def training(self) -> dict[str, Any]:
    """The fields that define what is trained (compared on resume)."""
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in RUNTIME_ONLY}


def parse_options(text: str) -> dict[str, Any]:
  """``--attention_options``: a JSON object or ``key=value,...`` with JSON values."""
  text = text.strip()
  if not text:
    return {}
  if text.startswith("{"):
    options = json.loads(text)
    if not isinstance(options, dict):
      raise ValueError("not a JSON object")
    return options
  options = {}
  for item in _split_top_level(text):
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
      raise ValueError(f"{item!r} is not key=value")
    try:
      options[key.strip()] = json.loads(value)
    except json.JSONDecodeError:
      options[key.strip()] = value.strip()  # A bare word, e.g. kernel=trig.
  return options


def _split_top_level(text: str) -> list[str]:
  """Splits at commas outside brackets, so ``window_size=[64,0],x=1`` has two items."""
  items, depth, start = [], 0, 0
  for i, c in enumerate(text):
    depth += c in "[{("
    depth -= c in "]})"
    if c == "," and depth == 0:
      items.append(text[start:i])
      start = i + 1
  return items + [text[start:]]


def config_from_flags() -> Config:
  """Reads and checks the flags; a bad one raises ``app.UsageError`` naming it."""
  if _ATTENTION.value not in la.available_attentions():
    raise app.UsageError(f"--attention={_ATTENTION.value!r} is unknown; available: "
                         f"{la.available_attentions()}.")
  try:
    options = parse_options(_ATTENTION_OPTIONS.value)
  except (ValueError, json.JSONDecodeError) as e:
    raise app.UsageError(f"--attention_options does not parse: {e}.") from e
  try:
    mixer_options = parse_options(_MIXER_OPTIONS.value)
  except (ValueError, json.JSONDecodeError) as e:
    raise app.UsageError(f"--mixer_options does not parse: {e}.") from e
  pattern = [x.strip() for x in _LAYER_PATTERN.value if x.strip()] or ["attention"]
  for flag in (_SEQ_LEN, _BATCH_SIZE, _NUM_STEPS, _NUM_LAYERS, _MODEL_DIM, _NUM_HEADS,
               _EVAL_EVERY, _EVAL_BATCHES, _CHECKPOINT_EVERY, _LOG_EVERY):
    if flag.value < 1:
      raise app.UsageError(f"--{flag.name} must be positive; got {flag.value}.")
  for flag in (_WARMUP_STEPS, _REDRAW_EVERY, _SAMPLE_LENGTH, _SHORT_CONV):
    if flag.value < 0:
      raise app.UsageError(f"--{flag.name} must be >= 0; got {flag.value}.")
  if _NUM_KV_HEADS.value is not None and _NUM_KV_HEADS.value < 1:
    raise app.UsageError(f"--num_kv_heads must be positive; got {_NUM_KV_HEADS.value}.")
  if _LEARNING_RATE.value <= 0:
    raise app.UsageError(f"--learning_rate must be positive; got {_LEARNING_RATE.value}.")
  if _CLIP_NORM.value < 0:
    raise app.UsageError(f"--clip_norm must be >= 0; got {_CLIP_NORM.value}.")
  if _DTYPE.value not in ("float32", "bfloat16"):
    raise app.UsageError(f"--dtype={_DTYPE.value}: training runs in float32 or bfloat16.")
  devices, split = jax.local_device_count(), _CONTEXT_PARALLEL.value
  if split < 1 or devices % split:
    raise app.UsageError(f"--context_parallel={split} must divide the {devices} local devices.")
  if _BATCH_SIZE.value % (devices // split):
    raise app.UsageError(f"--batch_size={_BATCH_SIZE.value} must divide over the "
                         f"{devices // split} data-parallel device groups.")
  if _SEQ_LEN.value % split:
    raise app.UsageError(f"--seq_len={_SEQ_LEN.value} must be a multiple of "
                         f"--context_parallel={split}.")
  if split > 1:
    try:
      parallel.ContextParallel.check(_ATTENTION.value, options)
    except ValueError as e:
      raise app.UsageError(f"--context_parallel={split}: {e}") from e
  task = data.TASKS[_TASK.value]
  if not task.causal and not la.get_spec(_ATTENTION.value).supports_noncausal:
    raise app.UsageError(f"--task={task.name} classifies with a bidirectional encoder; "
                         f"--attention={_ATTENTION.value} is causal only.")
  if _SHORT_CONV.value and not task.causal:
    raise app.UsageError(f"--short_conv is causal, for decoders; --task={task.name} "
                         "classifies with a bidirectional encoder.")
  pack, cannot = _PACK.value, cannot_pack(task, _ATTENTION.value, split)
  if pack is None:
    pack = cannot is None
  elif pack and cannot is not None:
    raise app.UsageError(f"--pack: {cannot}; pass --nopack.")
  if _REDRAW_EVERY.value and (la.get_spec(_ATTENTION.value).params is None
                              or la.get_spec(_ATTENTION.value).params.trainable):
    raise app.UsageError(f"--redraw_every applies to random-feature attentions; "
                         f"--attention={_ATTENTION.value} has none.")
  config = Config(**{f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(Config)
                     if f.name not in ("attention_options", "pack", "layer_pattern",
                                       "mixer_options")},
                  attention_options=options, pack=pack, layer_pattern=",".join(pattern),
                  mixer_options=mixer_options)
  check_model(config, "--attention_options / sizes")
  return config


def cannot_pack(task: data.Task, attention: str, context_parallel: int) -> str | None:
  """Why ``task``'s rows cannot be packed in this run (a reason, in flags), or None."""
  takes_ids = lambda fn: "segment_ids" in inspect.signature(fn).parameters  # noqa: E731
  if task.packed_batch is None:
    return f"--task={task.name} has no documents to pack"
  if not takes_ids(la.get_spec(attention).function):
    return f"--attention={attention} takes no segment_ids"
  if context_parallel > 1 and not takes_ids(parallel.ContextParallel.attend):
    return f"--context_parallel={context_parallel} takes no segment_ids"
  return None


def describe(config: Config) -> str:
  """What mixes the tokens: the attention and its options, or the layer pattern."""
  attention = f"attention={config.attention} {config.attention_options or ''}".rstrip()
  if config.layer_pattern == "attention":
    return attention
  mixers = f"layers={config.layer_pattern} {config.mixer_options or ''}".rstrip()
  return f"{mixers}, {attention}" if "attention" in config.layer_pattern.split(",") else mixers


def check_model(config: Config, what: str) -> None:
  """Builds the model abstractly, so bad options or sizes fail before any write."""
  try:
    jax.eval_shape(lambda: nnx.split(make_model(config)))
  except (ValueError, TypeError) as e:  # TypeError: a keyword a layer does not take.
    raise app.UsageError(f"{what}: {e}") from e


# ---------------------------------------------------------------- training ---


def make_mesh(config: Config) -> jax.sharding.Mesh:
  """Devices as ``(data, context)``: the batch splits over data, sequences over context."""
  devices = jax.local_device_count()
  return jax.make_mesh((devices // config.context_parallel, config.context_parallel),
                       ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def make_model(config: Config, seed: int | None = None) -> Transformer:
  task = data.TASKS[config.task]
  split = None
  if config.context_parallel > 1:
    split = parallel.ContextParallel(make_mesh(config), "context")
  return Transformer(
      vocab_size=task.vocab_size, num_classes=task.num_classes, max_len=config.seq_len,
      dim=config.model_dim, num_layers=config.num_layers, num_heads=config.num_heads,
      num_kv_heads=config.num_kv_heads, attention=config.attention,
      attention_options=config.attention_options, dtype=jnp.dtype(config.dtype),
      context_parallel=split, short_conv=config.short_conv,
      layer_pattern=tuple(config.layer_pattern.split(",")),
      mixer_options=config.mixer_options,
      rngs=nnx.Rngs(config.seed if seed is None else seed))


def make_optimizer(config: Config) -> optax.GradientTransformation:
  """AdamW with linear warm-up, cosine decay to 10% and global-norm clipping (if any)."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, max(config.warmup_steps, 1),
      max(config.num_steps, config.warmup_steps + 1), end_value=0.1 * config.learning_rate)
  clip = optax.clip_by_global_norm(config.clip_norm) if config.clip_norm else optax.identity()
  return optax.chain(clip, optax.adamw(schedule, weight_decay=config.weight_decay))


def loss_and_metrics(model: Transformer, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
  """Mean cross-entropy over the scored positions (or examples) and the accuracy."""
  if model.causal:
    logits = model(batch["inputs"], segment_ids=batch.get("segment_ids"))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    w = batch["weights"]
    total = jnp.maximum(w.sum(), 1.0)
    loss = (losses * w).sum() / total
    accuracy = ((logits.argmax(-1) == batch["targets"]).astype(w.dtype) * w).sum() / total
  else:
    logits = model(batch["inputs"], batch["lengths"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    accuracy = (logits.argmax(-1) == batch["targets"]).mean()
  return loss, {"loss": loss, "accuracy": accuracy}


class _StepError(RuntimeError):
  """A fault that ends the run at ``step``, said in one line (exit status 1)."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class TrainingDivergedError(_StepError):
  """A training step's loss, gradient norm or updated parameters were not finite."""


class TrainingStoppedError(Exception):
  """A SIGTERM or SIGINT stopped the run after ``step``, whose checkpoint is saved."""

  def __init__(self, step: int, signum: int):
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}, which is "
                     "saved; run the same command again to resume.")
    self.step, self.signum = step, signum


@contextlib.contextmanager
def _stop_requests():
  """Yields a list that receives the first SIGTERM or SIGINT instead of the handlers before
  (restored on exit). Those handlers are back once one arrived, so a second Ctrl-C raises
  ``KeyboardInterrupt`` and a second SIGTERM kills. Off the main thread, where Python
  cannot set handlers, nothing is installed."""
  received: list[int] = []
  if threading.current_thread() is not threading.main_thread():
    yield received
    return
  previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

  def restore():
    for s, handler in previous.items():
      signal.signal(s, signal.SIG_DFL if handler is None else handler)

  def request(signum, frame):
    del frame
    received.append(signum)
    restore()

  for s in previous:
    signal.signal(s, request)
  try:
    yield received
  finally:
    restore()


class CheckpointWriteError(_StepError):
  """The checkpoint of ``step`` could not be written (a full disk, say)."""


@contextlib.contextmanager
def exit_status():
  """A diverged run, or one that could not write a checkpoint, leaves with its one line and
  status 1; a stopped one prints its line and leaves with 128 + the signal's number (143
  for SIGTERM, 130 for Ctrl-C)."""
  try:
    yield
  except _StepError as e:
    raise SystemExit(str(e)) from None
  except TrainingStoppedError as e:
    print(e, flush=True)
    raise SystemExit(128 + e.signum) from None


class Trainer:
  """The jitted step functions over ``(params, rest, opt_state)`` pytrees.

  ``health`` (on device) holds the first step whose loss, gradient norm or
  updated parameters were not finite (0: none yet), with that step's loss and
  gradient norm; ``train_step`` updates it without a host sync.
  """

  def __init__(self, config: Config):
    self.config = config
    self.graphdef, params, rest = nnx.split(make_model(config), nnx.Param, ...)
    self.tx = make_optimizer(config)
    mesh = make_mesh(config)
    self.replicated = NamedSharding(mesh, P())
    # Examples over data; token positions over context (one device group per sequence).
    self.sharded = {1: NamedSharding(mesh, P("data")),
                    2: NamedSharding(mesh, P("data", "context"))}
    self.state = jax.device_put(
        {"params": params, "rest": rest, "opt_state": self.tx.init(params)}, self.replicated)
    self.health = jax.device_put({"step": jnp.int32(0), "loss": jnp.float32(0),
                                  "grad_norm": jnp.float32(0), "params_finite": jnp.bool_(True)},
                                 self.replicated)
    self.train_step = jax.jit(self._checked_train_step, donate_argnums=0)
    self.eval_step = jax.jit(self._eval_step)

  def _train_step(self, state, batch):
    def loss_fn(params):
      return loss_and_metrics(nnx.merge(self.graphdef, params, state["rest"]), batch)

    grads, metrics = jax.grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return {"params": params, "rest": state["rest"], "opt_state": opt_state}, metrics

  def _checked_train_step(self, state, health, batch, step):
    """``_train_step``, and ``health`` updated for ``step`` (counted from 1)."""
    state, metrics = self._train_step(state, batch)
    params_finite = jax.tree.reduce(jnp.logical_and, jax.tree.map(
        lambda x: jnp.isfinite(x).all(), state["params"]))
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]) & params_finite
    now = {"step": jnp.asarray(step, jnp.int32), "loss": metrics["loss"].astype(jnp.float32),
           "grad_norm": metrics["grad_norm"].astype(jnp.float32), "params_finite": params_finite}
    first = (health["step"] == 0) & ~finite
    return state, jax.tree.map(lambda a, b: jnp.where(first, a, b), now, health), metrics

  def check_finite(self, checkpoints: Checkpoints) -> None:
    """Raises ``TrainingDivergedError`` if a step so far was not finite (one small device read:
    call it where the loop syncs anyway, and before each save)."""
    health = jax.device_get(self.health)
    if not health["step"]:
      return
    c, last = self.config, checkpoints.latest()
    kept = (f"the last finite checkpoint, step {last}, is kept in {checkpoints.directory}"
            if last else "no checkpoint was written")
    what = f"loss {health['loss']:.4g}, gradient norm {health['grad_norm']:.4g}"
    if not health["params_finite"]:
      what += ", updated parameters not finite"
    clip = f"{c.clip_norm:g}" if c.clip_norm else "0, no clipping"
    raise TrainingDivergedError(
        f"training diverged at step {health['step']} ({what}); {kept}. Lower --learning_rate "
        f"(now {c.learning_rate:g}) or clip gradients with --clip_norm (now {clip}; e.g. 1), "
        "and rerun with another --workdir.", int(health["step"]))

  def _eval_step(self, state, batch):
    return loss_and_metrics(nnx.merge(self.graphdef, state["params"], state["rest"]), batch)[1]

  def batch(self, step: int, split: int) -> dict[str, jax.Array]:
    c = self.config
    task = data.TASKS[c.task]
    batch = (task.packed_batch if c.pack else task.batch)(
        c.seed, step, split, c.batch_size, c.seq_len)
    return {k: jax.device_put(x, self.sharded[x.ndim]) for k, x in batch.items()}

  def model(self) -> Transformer:
    return nnx.merge(self.graphdef, self.state["params"], self.state["rest"])

  def redraw(self, step: int) -> None:
    """New random features for every layer, drawn from (seed, step): deterministic."""
    model = self.model()
    key = jax.random.fold_in(jax.random.key(self.config.seed), step)
    for i, block in enumerate(model.blocks):
      if isinstance(block.attn, nn.MultiHeadAttention):  # Token mixers draw nothing.
        block.attn.redraw(jax.random.fold_in(key, i))
    _, _, rest = nnx.split(model, nnx.Param, ...)
    self.state = {**self.state, "rest": jax.device_put(rest, self.replicated)}

  def evaluate(self) -> dict[str, float]:
    sums: dict[str, float] = {}
    for i in range(self.config.eval_batches):
      metrics = self.eval_step(self.state, self.batch(i, data.VALID))
      for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + float(v) / self.config.eval_batches
    out = {f"eval_{k}": v for k, v in sums.items()}
    if self.config.task == "char_lm":
      out["eval_bits_per_char"] = out["eval_loss"] / math.log(2)
    return out


# ------------------------------------------------------------- checkpoints ---


def _in_orbax(path: str) -> bool:
  """Whether ``path`` (a source file, or a message that names one) is orbax's."""
  return f"{os.sep}orbax{os.sep}" in path


def _from_orbax(coroutine: Any) -> bool:
  code = getattr(coroutine, "cr_code", None)
  return code is not None and _in_orbax(code.co_filename)


def _drop_orbax_leftovers(hook):
  """``hook``, but silent on what orbax leaves behind after a failed read or write, which
  the one-line errors of ``Checkpoints`` already report: "Event loop is closed" (after a
  restore fails on a damaged file, tensorstore's other reads finish into orbax's closed
  event loop) and orbax's coroutines that a failed save left unfinished, closed at exit."""

  def quiet(unraisable):
    if isinstance(unraisable.exc_value, RuntimeError) and (
        str(unraisable.exc_value) == "Event loop is closed"):
      return
    if _from_orbax(unraisable.object):
      return
    hook(unraisable)

  return quiet


class _OrbaxTasks(std_logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" for orbax's writes (each failed
  write of a failed save logs one, with its traceback)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Task exception was never retrieved") and _in_orbax(message))


def quiet_orbax() -> None:
  """For a command line run: drops orbax's per-save INFO lines from absl's log (its warnings
  still show), and what a failed read or write leaves behind once ``Checkpoints`` has said
  it in one line (:func:`_drop_orbax_leftovers`, :class:`_OrbaxTasks`)."""
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= std_logging.WARNING or not _in_orbax(record.pathname))
  sys.unraisablehook = _drop_orbax_leftovers(sys.unraisablehook)
  std_logging.getLogger("asyncio").addFilter(_OrbaxTasks())


@contextlib.contextmanager
def _orbax_silenced(level: int = std_logging.NOTSET):
  """Drops orbax's log records at ``level`` and above (default: all of them), while loading
  or saving: a damaged step or a failed write makes it log errors and tracebacks, where
  ``Checkpoints`` says in one line which step and why."""
  logger = std_logging.getLogger("absl")  # orbax logs through absl.
  drop = lambda record: not _in_orbax(record.pathname) or record.levelno < level  # noqa: E731
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


def _short(error: BaseException) -> str:
  """``Type: message`` of the innermost cause, in one line of at most 300 characters."""
  while error.__cause__ is not None:
    error = error.__cause__
  name = type(error).__name__
  text = " ".join(str(error).split(" [tensorstore_spec")[0].split())
  keep = 300 - len(name) - 5
  if len(text) > keep:  # tensorstore's chained messages end with the cause: keep the end.
    text = "..." + text[-keep:]
  return f"{name}: {text}"


class Checkpoints:
  """orbax checkpoints of the flattened state, under ``workdir/checkpoints``.

  A step that cannot be read is moved to ``workdir/damaged_checkpoints`` (kept
  for inspection, out of the manager's way). Each array is written from one of
  its replicas: orbax's default splits a replicated array into a slice per
  device, which for this loop's small, replicated state cost one dispatched
  op per leaf and device (a save took 0.3 s, and 1.9 s for a process's first,
  against 0.16 s).
  """

  def __init__(self, workdir: pathlib.Path):
    self.directory = (workdir / "checkpoints").absolute()
    self.damaged = (workdir / "damaged_checkpoints").absolute()
    one_replica = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)))
    with _orbax_silenced():  # It reads every step's metadata here.
      self.manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False),
          item_handlers=ocp.PyTreeCheckpointHandler(type_handler_registry=one_replica))

  @staticmethod
  def _flat(state) -> dict[str, Any]:
    return {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(state))}

  def save(self, step: int, state) -> None:
    """Writes ``step``. If that fails (a full disk, say), its unfinished directory is removed
    and ``CheckpointWriteError`` says in one line which step, where, why and what is kept."""
    try:
      with _orbax_silenced(std_logging.ERROR):  # Its warnings still show.
        self.manager.save(step, args=ocp.args.PyTreeSave(self._flat(state)))
        self.manager.wait_until_finished()
    except MemoryError:
      raise
    except Exception as e:  # orbax and tensorstore raise many types on a failed write.
      for unfinished in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
        shutil.rmtree(unfinished, ignore_errors=True)
      with _orbax_silenced():
        self.manager.reload()
      last = self.latest()
      kept = f"the newest one kept is step {last}" if last else "none was written before"
      raise CheckpointWriteError(
          f"could not write the checkpoint of step {step} in {self.directory} ({_short(e)}); "
          f"{kept}. Make room there and run the same command again to resume.", step) from None

  def latest(self) -> int | None:
    return self.manager.latest_step()

  def restore(self, step: int, like):
    """The state saved at ``step``, with the structure and shardings of ``like``."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._flat(like))
    flat = self.manager.restore(step, args=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    return jax.tree.unflatten(jax.tree.structure(like), [flat[str(i)] for i in range(len(flat))])

  def restore_latest(self, like) -> tuple[int, Any]:
    """``(step, state)`` of the newest readable checkpoint; ``(0, like)`` if there is none.

    Each unreadable step (a file cut short by a full disk or a bad copy, say)
    is logged in one warning line and moved aside, and the step before it is
    tried.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        with _orbax_silenced():
          return step, self.restore(step, like)
      except Exception as e:  # orbax and tensorstore raise many types on bad files.
        if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e):
          raise  # Out of memory: the checkpoint may be fine.
        moved = self._move_aside(step)
        logging.warning("checkpoint %s is unreadable (%s); moved it to %s.",
                        self.directory / str(step), _short(e), moved)
    if steps:  # All of them were unreadable.
      logging.warning("no readable checkpoint in %s: training from step 0.", self.directory)
    return 0, like

  def _move_aside(self, step: int) -> pathlib.Path:
    """Renames step ``step``'s directory into ``damaged_checkpoints/`` (never deletes it)."""
    self.damaged.mkdir(exist_ok=True)
    target, n = self.damaged / str(step), 1
    while target.exists():  # Damaged again after an earlier move: keep both.
      target, n = self.damaged / f"{step}.{n}", n + 1
    (self.directory / str(step)).rename(target)
    with _orbax_silenced():
      self.manager.reload()
    return target


def load_final_params(workdir: str) -> Any:
  """The parameters of the latest checkpoint in ``workdir`` (for tests and analysis)."""
  workdir = pathlib.Path(workdir)
  config = Config(**json.loads((workdir / "config.json").read_text()))
  trainer = Trainer(config)
  checkpoints = Checkpoints(workdir)
  return checkpoints.restore(checkpoints.latest(), trainer.state)["params"]


def prepare_workdir(config: Config) -> pathlib.Path:
  """Creates ``workdir`` or checks that its checkpoint is of this configuration.

  Raises ``app.UsageError`` (before anything is written) when it holds a
  different one.
  """
  workdir = pathlib.Path(config.workdir)
  saved = workdir / "config.json"
  if saved.exists():
    old = json.loads(saved.read_text())
    old_training = {k: v for k, v in old.items() if k not in RUNTIME_ONLY}
    changed = sorted(k for k in set(old_training) | set(config.training())
                     if old_training.get(k) != config.training().get(k))
    if changed:
      raise app.UsageError(
          f"--workdir={workdir} holds a run with other settings ({', '.join(changed)}: "
          f"{[old_training.get(k) for k in changed]}); use another --workdir or the same flags.")
  workdir.mkdir(parents=True, exist_ok=True)
  saved.write_text(json.dumps(dataclasses.asdict(config), indent=1))
  return workdir


# ------------------------------------------------------------------ output ---


def generate(model: Transformer, prompt: np.ndarray, length: int, seed: int) -> np.ndarray:
  """Samples ``length`` tokens after ``prompt [L]``: one prefill, then token by token,
  through the layers' decode caches (temperature 0.8)."""
  model.init_cache(1, len(prompt) + length)
  decode = nnx.jit(lambda m, tokens, position: m(tokens, position=position, decode=True))
  logits = decode(model, jnp.asarray(prompt)[None], 0)
  key = jax.random.key(seed)
  out = []
  for i in range(length):
    token = jax.random.categorical(jax.random.fold_in(key, i), logits[0, -1] / 0.8)
    out.append(int(token))
    logits = decode(model, token.reshape(1, 1), len(prompt) + i)
  return np.asarray(out, np.int32)


def plot_curves(workdir: pathlib.Path, records: list[dict[str, Any]], title: str) -> None:
  train_records = [r for r in records if "train_loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  common.plot_lines(workdir / "curves.png", {
      "train loss": ([r["step"] for r in train_records], [r["train_loss"] for r in train_records]),
      "eval loss": ([r["step"] for r in evals], [r["eval_loss"] for r in evals]),
  }, xlabel="step", ylabel="cross-entropy (nats)", title=title)


def _read_metrics(path: pathlib.Path, upto: int) -> list[dict[str, Any]]:
  """The records of steps ``<= upto``: a killed run may have logged past its last
  checkpoint, and may have been killed in the middle of a line."""
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:  # A line cut short by the kill.
      continue
  return [r for r in records if r["step"] <= upto]


def train(config: Config) -> dict[str, Any]:
  """Runs (or resumes) training; returns the summary written to ``summary.json``."""
  workdir = prepare_workdir(config)
  trainer = Trainer(config)
  checkpoints = Checkpoints(workdir)
  start, trainer.state = checkpoints.restore_latest(trainer.state)
  if start:
    print(f"resumed from the checkpoint at step {start}", flush=True)
  metrics_path = workdir / "metrics.jsonl"
  records = _read_metrics(metrics_path, start)
  metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))
  task = data.TASKS[config.task]
  params = sum(x.size for x in jax.tree.leaves(trainer.state["params"]))
  print(f"{task.name} ({task.describe}{', packed' if config.pack else ''}); "
        f"{describe(config)}; {params / 1e6:.2f}M parameters; "
        f"{jax.local_device_count()} {jax.default_backend()} device(s)", flush=True)
  tokens_per_step = config.batch_size * config.seq_len
  began, last_time, last_step = time.perf_counter(), time.perf_counter(), start
  with _stop_requests() as stop:
    for step in range(start, config.num_steps):
      if config.redraw_every and step % config.redraw_every == 0 and step > 0:
        trainer.redraw(step)
      trainer.state, trainer.health, metrics = trainer.train_step(
          trainer.state, trainer.health, trainer.batch(step, data.TRAIN), step + 1)
      done = step + 1
      # Read once per step: a SIGTERM or Ctrl-C from here on is this step's to save, and
      # one arriving later in the step waits for the next (or the check after the loop).
      stopping = bool(stop)
      if stopping or done == config.num_steps or any(done % every == 0 for every in (
          config.log_every, config.eval_every, config.checkpoint_every)):
        trainer.check_finite(checkpoints)  # Nothing non-finite is logged, evaluated or saved.
      record = None
      if done % config.log_every == 0 or done == config.num_steps:
        metrics = {k: float(v) for k, v in metrics.items()}
        now = time.perf_counter()
        rate = (done - last_step) * tokens_per_step / (now - last_time)
        elapsed = now - began
        left = elapsed / (done - start) * (config.num_steps - done)
        print(f"step {done:>6}/{config.num_steps}  loss {metrics['loss']:.4f}  "
              f"acc {metrics['accuracy']:.3f}  {rate:,.0f} tokens/s  elapsed {elapsed:.0f}s  "
              f"left {left:.0f}s", flush=True)
        record = {"step": done, "train_loss": metrics["loss"],
                  "train_accuracy": metrics["accuracy"], "tokens_per_s": rate}
        last_time, last_step = now, done
      if done % config.eval_every == 0 or done == config.num_steps:
        record = {"step": done, **(record or {}), **trainer.evaluate()}
        print("  eval: " + "  ".join(f"{k} {v:.4f}" for k, v in record.items()
                                      if k.startswith("eval_")), flush=True)
      if record is not None:
        records.append(record)
        with metrics_path.open("a") as f:
          f.write(json.dumps(record) + "\n")
      if stopping or done % config.checkpoint_every == 0 or done == config.num_steps:
        checkpoints.save(done, trainer.state)
      if stopping:
        raise TrainingStoppedError(done, stop[0])
    if stop:  # It arrived during the last step, which is saved.
      raise TrainingStoppedError(config.num_steps, stop[0])
  summary = finish(config, workdir, trainer, records)
  return summary


def finish(config: Config, workdir: pathlib.Path, trainer: Trainer,
           records: list[dict[str, Any]]) -> dict[str, Any]:
  evals = [r for r in records if "eval_loss" in r]
  summary = {"config": dataclasses.asdict(config), "final": evals[-1] if evals else None}
  if config.task == "char_lm":
    summary["unigram_entropy_bits"] = data.unigram_entropy_bits()
  plot_curves(workdir, records, f"{config.task}, {describe(config)}")
  if evals:
    print("final eval: " + "  ".join(f"{k} {v:.4f}" for k, v in evals[-1].items()
                                     if k.startswith("eval_")), flush=True)
  if config.task == "char_lm":
    print(f"unigram entropy of the corpus: {summary['unigram_entropy_bits']:.3f} bits/char",
          flush=True)
    if config.sample_length:
      _, valid = data.stdlib_corpus()
      prompt_len = max(1, min(32, config.seq_len - config.sample_length))
      length = min(config.sample_length, config.seq_len - prompt_len)
      prompt = valid[1000:1000 + prompt_len].astype(np.int32)
      sample = generate(trainer.model(), prompt, length, config.seed)
      text = bytes(prompt.astype(np.uint8)).decode("utf-8", "replace") + " ▶ " + bytes(
          sample.astype(np.uint8)).decode("utf-8", "replace")
      (workdir / "sample.txt").write_text(text)
      summary["sample"] = text
      print("sample (prompt ▶ generated):\n" + text, flush=True)
  (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
  print(f"wrote {workdir}/metrics.jsonl, curves.png, summary.json", flush=True)
  return summary


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  quiet_orbax()
  with exit_status():
    train(config_from_flags())


if __name__ == "__main__":
  common.run(main)
