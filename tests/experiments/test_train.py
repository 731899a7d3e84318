"""The training loop: tasks, smoke runs, exact resume after SIGKILL and SIGTERM, data
parallelism, errors."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import app, flags

from experiments import data, train
from linattn_jax import nn, parallel

# The training loop steps optax (see conftest: standard dtype promotion for it).
pytestmark = pytest.mark.standard_dtype_promotion

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dict(seq_len=16, batch_size=8, num_steps=3, learning_rate=1e-2, warmup_steps=1,
            weight_decay=0.0, clip_norm=1.0, num_layers=1, model_dim=16, num_heads=2,
            num_kv_heads=None, dtype="float32", seed=0, eval_every=3, eval_batches=1,
            checkpoint_every=3, log_every=1, redraw_every=0, sample_length=4, pack=False)
TINY_FLAGS = [f"--{k}={v}" for k, v in TINY.items() if v is not None]


def _config(tmp_path, **changes) -> train.Config:
  fields = dict(TINY, attention="linear_elu", attention_options={}, task="char_lm",
                workdir=str(tmp_path))
  fields.update(changes)
  return train.Config(**fields)


@pytest.mark.parametrize("task, attention, options", [
    ("char_lm", "linear_elu", {}),
    ("mqar", "softmax", {}),
    ("copy", "performer", {"num_features": 8}),
    ("listops", "local", {"window_size": 4}),
])
def test_a_few_steps_of_every_task(tmp_path, task, attention, options):
  summary = train.train(_config(tmp_path, task=task, attention=attention,
                                attention_options=options,
                                redraw_every=2 if attention == "performer" else 0))
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3]
  assert all(np.isfinite(r["train_loss"]) for r in records)
  assert np.isfinite(summary["final"]["eval_loss"])
  assert (tmp_path / "curves.png").exists() and (tmp_path / "summary.json").exists()
  if task == "char_lm":
    assert "eval_bits_per_char" in summary["final"] and (tmp_path / "sample.txt").exists()


def test_batches_are_a_function_of_seed_and_step():
  for task in data.TASKS.values():
    a, b = task.batch(3, 7, data.TRAIN, 4, 32), task.batch(3, 7, data.TRAIN, 4, 32)
    c = task.batch(3, 8, data.TRAIN, 4, 32)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["inputs"], c["inputs"])


def test_mqar_queries_ask_for_earlier_pairs():
  batch = data.mqar_batch(0, 0, data.TRAIN, 3, 32)
  for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"],
                                      strict=True):
    pairs = dict(zip(inputs[0:16:2], inputs[1:16:2], strict=True))
    scored = np.flatnonzero(weights)
    assert len(scored) == 8 and scored.min() >= 16
    assert all(pairs[inputs[t]] == targets[t] for t in scored)


def test_listops_labels():
  assert data.listops_value(("[MAX", [2, 9, ("[MIN", [4, 7])])) == 9
  assert data.listops_value(("[SM", [5, 7, 3])) == 5
  assert data.listops_value(("[MED", [1, 8, 3, 4])) == 3
  batch = data.listops_batch(0, 0, data.TRAIN, 8, 64)
  assert batch["lengths"].max() <= 64 and set(batch["targets"]) <= set(range(10))


# The suite's host devices for a subprocess (conftest sets them in-process only).
_DEVICES_OF_THE_SUITE = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                                      f"--xla_force_host_platform_device_count=8"}


def _run(*flags_, env=None, wait=True):
  command = [sys.executable, "-m", "experiments.train", *flags_]
  env = dict(os.environ, **(env or {}))
  if wait:
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300, check=False)
  return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)


def _assert_same_final_params(workdir: pathlib.Path, other: pathlib.Path | dict) -> None:
  """``other``: a workdir, or the parameters already loaded from one."""
  # Bit for bit on CPU; GPU reductions need not be deterministic run to run.
  same = np.testing.assert_array_equal if jax.default_backend() == "cpu" else functools.partial(
      np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
  if isinstance(other, pathlib.Path):
    other = train.load_final_params(str(other))
  jax.tree.map(same, train.load_final_params(str(workdir)), other)


def _logged_steps(workdir: pathlib.Path) -> list[int]:
  return [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# An uninterrupted run that several tests compare with (one run per test worker): every step
# logged, checkpoints at steps 2 and 4. The runs they compare with it differ from it in the
# settings a resumed run may change only (train.RUNTIME_ONLY), so they compile its programs.
WHOLE = dict(num_steps=4, checkpoint_every=2, log_every=1, eval_every=4, sample_length=0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> pathlib.Path:
  """The workdir of a finished run of ``WHOLE`` on the suite's 8 host devices (read only)."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  with jax.numpy_dtype_promotion("standard"):  # As the module's mark sets it for tests.
    train.train(_config(workdir, **WHOLE))
  return workdir


def test_killed_and_stopped_runs_resume_to_the_same_parameters(tmp_path, monkeypatch,
                                                                uninterrupted):
  """A run killed by SIGKILL (a subprocess) and one stopped by SIGTERM (in-process, during a
  known step) resume, here in-process, to the parameters of an uninterrupted run. All see
  the suite's 8 host devices and XLA flags."""
  whole = train.load_final_params(str(uninterrupted))
  # A checkpoint every step: the kill comes after the second, with steps, two saves, the
  # evaluation and the plot still to run (most of that time is the saves and the plot).
  changes = dict(WHOLE, checkpoint_every=1)
  flags_ = TINY_FLAGS + [f"--{k}={v}" for k, v in changes.items()]
  killed = tmp_path / "killed"
  process = _run(*flags_, f"--workdir={killed}", wait=False, env=_DEVICES_OF_THE_SUITE)
  deadline = time.time() + 240
  while not (killed / "checkpoints" / "2").exists():  # Two checkpoints in, still running.
    assert process.poll() is None and time.time() < deadline, "the run ended before the kill"
    time.sleep(0.02)
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert not (killed / "summary.json").exists()
  resumed = io.StringIO()
  with contextlib.redirect_stdout(resumed):
    train.train(_config(killed, **changes))
  assert "resumed from the checkpoint at step" in resumed.getvalue()
  _assert_same_final_params(killed, whole)
  assert _logged_steps(killed) == sorted(set(_logged_steps(killed)))  # None twice across the kill.

  # Two SIGTERMs while step 3's batch is read: the first stops the run once that step is
  # done and saved (between the checkpoints at 2 and 4), the second reaches the handler from
  # before (a second Ctrl-C interrupts).
  stopped, earlier = tmp_path / "stopped", []
  read_batch = train.Trainer.batch

  def batch(self, step, split):
    if split == data.TRAIN and step == 2:
      os.kill(os.getpid(), signal.SIGTERM)  # Handled before os.kill returns.
      os.kill(os.getpid(), signal.SIGTERM)
    return read_batch(self, step, split)

  record = lambda signum, frame: earlier.append(signum)  # noqa: E731
  interrupt = signal.getsignal(signal.SIGINT)
  previous = signal.signal(signal.SIGTERM, record)
  try:
    with monkeypatch.context() as patch:
      patch.setattr(train.Trainer, "batch", batch)
      with pytest.raises(train.TrainingStoppedError, match=r"^stopped by SIGTERM after step 3, "
                         r"which is saved; run the same command again to resume\.$") as e:
        train.train(_config(stopped, **WHOLE))
    assert earlier == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is record  # Both handlers restored.
    assert signal.getsignal(signal.SIGINT) is interrupt
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert train.Checkpoints(stopped).manager.all_steps() == [2, 3]
  assert not (stopped / "summary.json").exists()
  with pytest.raises(SystemExit) as status, train.exit_status():
    raise e.value
  assert status.value.code == 128 + signal.SIGTERM  # As if SIGTERM had killed it.
  resumed = io.StringIO()
  with contextlib.redirect_stdout(resumed):
    train.train(_config(stopped, **WHOLE))
  assert "resumed from the checkpoint at step 3" in resumed.getvalue()
  _assert_same_final_params(stopped, whole)
  assert _logged_steps(stopped) == sorted(set(_logged_steps(stopped)))


def _truncate_every_file(directory: pathlib.Path) -> dict[pathlib.Path, int]:
  """Cuts each file under ``directory`` to half its size, as a full disk or a bad copy
  leaves them; returns the new sizes."""
  sizes = {}
  for path in sorted(directory.rglob("*")):
    if path.is_file():
      sizes[path.relative_to(directory)] = path.stat().st_size // 2
      os.truncate(path, sizes[path.relative_to(directory)])
  return sizes


def test_a_damaged_checkpoint_is_moved_aside_and_an_older_one_resumed(tmp_path, caplog,
                                                                     uninterrupted):
  config = functools.partial(_config, **WHOLE)
  whole, damaged = uninterrupted, tmp_path / "damaged"  # Checkpoints at steps 2 and 4.
  shutil.copytree(whole, damaged)  # A run that got as far, whose step 4 is then damaged.
  sizes = _truncate_every_file(damaged / "checkpoints" / "4")
  with caplog.at_level(logging.WARNING):
    train.train(config(damaged))
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1, warnings  # One line; orbax's errors and tracebacks are dropped.
  assert f"checkpoint {damaged / 'checkpoints' / '4'} is unreadable (JSONDecodeError: " in (
      warnings[0])
  assert f"moved it to {damaged / 'damaged_checkpoints' / '4'}" in warnings[0]
  aside = damaged / "damaged_checkpoints" / "4"  # Kept as it was, out of orbax's way.
  assert {p.relative_to(aside): p.stat().st_size for p in aside.rglob("*") if p.is_file()} == sizes
  assert sorted(os.listdir(damaged / "checkpoints")) == ["2", "4"]  # 4 written again.
  _assert_same_final_params(damaged, whole)


def test_a_checkpoint_that_cannot_be_written_stops_the_run_in_one_line(tmp_path, monkeypatch):
  """A failed save (here a full disk, simulated after orbax began the step's directory)
  removes the unfinished directory, keeps the earlier step and names both."""
  save = train.ocp.CheckpointManager.save

  def full_disk(manager, step, *args, **kwargs):
    if step == 2:
      (tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1").mkdir()
      raise ValueError("RESOURCE_EXHAUSTED: Failed to write 900372 bytes to file 17: No space "
                       "left on device [os_error_code='28']")
    return save(manager, step, *args, **kwargs)

  monkeypatch.setattr(train.ocp.CheckpointManager, "save", full_disk)
  # WHOLE's training settings (its programs), saving every step.
  config = _config(tmp_path, **dict(WHOLE, checkpoint_every=1, log_every=2, eval_every=2))
  want = (f"could not write the checkpoint of step 2 in {tmp_path / 'checkpoints'} (ValueError: "
          "RESOURCE_EXHAUSTED: Failed to write 900372 bytes to file 17: No space left on device "
          "[os_error_code='28']); the newest one kept is step 1. Make room there and run the "
          "same command again to resume.")
  with pytest.raises(SystemExit) as status, train.exit_status():
    train.train(config)
  assert status.value.code == want  # One line on stderr, exit status 1.
  assert os.listdir(tmp_path / "checkpoints") == ["1"]


def test_a_diverging_run_stops_without_saving_non_finite_parameters(tmp_path):
  config = _config(tmp_path, num_steps=4, learning_rate=1e6, clip_norm=0.0, checkpoint_every=2,
                   log_every=4, eval_every=4, sample_length=0)
  with pytest.raises(train.TrainingDivergedError, match=r"diverged at step 3 \(loss nan.*"
                     r"checkpoint, step 2, is kept.*--learning_rate .*--clip_norm "):
    train.train(config)
  # Step 3 made the parameters NaN; the loop saw it at step 4 and saved nothing there.
  checkpoints = train.Checkpoints(tmp_path)
  assert checkpoints.manager.all_steps() == [2]
  like = train.Trainer(config).state
  for step in checkpoints.manager.all_steps():
    params = checkpoints.restore(step, like)["params"]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
  assert not (tmp_path / "summary.json").exists()


def test_eight_devices_give_the_losses_of_one(tmp_path, monkeypatch, uninterrupted):
  """The batch sharded over the suite's 8 host devices gives the losses of one device (the
  loop's mesh on the first device alone; both in-process)."""
  assert jax.local_device_count() == 8  # The uninterrupted run's mesh spans them.
  meshes = []

  def one_device(config):
    meshes.append(jax.make_mesh((1, config.context_parallel), ("data", "context"),
                                axis_types=(jax.sharding.AxisType.Auto,) * 2,
                                devices=jax.devices()[:config.context_parallel]))
    return meshes[-1]

  with monkeypatch.context() as patch:
    patch.setattr(train, "make_mesh", one_device)
    train.train(_config(tmp_path / "1", **WHOLE))
  assert meshes and all(mesh.devices.size == 1 for mesh in meshes)
  losses = [[json.loads(line)["train_loss"]
             for line in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (tmp_path / "1", uninterrupted)]
  assert len(losses[0]) == WHOLE["num_steps"]
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


@pytest.mark.skipif(jax.local_device_count() < 8, reason="the training loop's mesh spans the "
                    "default backend's devices: 8 host CPU devices in the suite, 1 on one GPU")
@pytest.mark.parametrize("attention", ["linear_elu", "softmax"])
def test_context_parallel_training_gives_the_losses_of_data_parallel(tmp_path, attention):
  """Sequences split over 4 of the suite's 8 devices (ring attention for softmax)."""
  losses = {}
  for split in (1, 4):
    config = _config(tmp_path / str(split), task="mqar", attention=attention,
                     context_parallel=split, sample_length=0)
    train.train(config)
    records = [json.loads(line) for line in
               (tmp_path / str(split) / "metrics.jsonl").read_text().splitlines()]
    losses[split] = [r[k] for r in records for k in ("train_loss", "eval_loss") if k in r]
  np.testing.assert_allclose(losses[4], losses[1], rtol=1e-5)


@pytest.fixture
def parse_flags():
  """``parse_flags(*argv)`` sets the flags as ``python -m experiments.train *argv`` would;
  they are reset afterwards."""
  def parse(*argv):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train", *argv])
  yield parse
  flags.FLAGS.unparse_flags()


@pytest.mark.parametrize("flag, message", [
    ("--attention=nope", "--attention='nope' is unknown"),
    ("--task=nope", "--task"),
    ("--attention_options=window_size", "--attention_options does not parse"),
    ("--attention_options=window_size=4", "unknown option `window_size`"),
    ("--model_dim=0", "--model_dim must be positive"),
    ("--redraw_every=5", "--redraw_every applies to random-feature attentions"),
    ("--context_parallel=3", "--context_parallel=3 must divide the 8 local devices"),
    ("--task=listops --short_conv=2", "--short_conv is causal"),
    ("--task=mqar --pack", "--pack: --task=mqar has no documents to pack"),
    ("--layer_pattern=mamba3,attention", "['mamba3'] are neither 'attention' nor a token mixer"),
    ("--task=listops --layer_pattern=kda", "token mixers are causal"),
    ("--layer_pattern=kda --mixer_options=chunk_size=4", "unexpected keyword argument"),
])
def test_bad_flags_are_refused_naming_them(parse_flags, flag, message):
  with pytest.raises((app.UsageError, flags.IllegalFlagValueError), match=re.escape(message)):
    parse_flags(*TINY_FLAGS, *flag.split())
    train.config_from_flags()


@pytest.mark.parametrize("argv, pack", [
    (("--attention=softmax",), True), (("--attention=softmax", "--nopack"), False),
    (("--attention=softmax", "--task=mqar"), False),
    (("--attention=softmax", "--context_parallel=2"),
     "segment_ids" in inspect.signature(parallel.ContextParallel.attend).parameters)])
def test_char_lm_packs_by_default(parse_flags, argv, pack):
  """On where it can run: char_lm, with an attention (and context parallelism) taking ids."""
  parse_flags(*[f for f in TINY_FLAGS if not f.startswith("--pack")], *argv)
  assert train.config_from_flags().pack is pack


def test_a_bad_flag_fails_the_run_with_one_line_and_writes_nothing(tmp_path):
  result = _run(*TINY_FLAGS, "--model_dim=0", f"--workdir={tmp_path / 'w'}")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-2:] == [
      "Error: --model_dim must be positive; got 0.",
      "Pass --helpshort or --helpfull to see help on flags."], result.stderr
  assert "--learning_rate" not in result.stdout + result.stderr  # Not the whole flag list.
  assert not (tmp_path / "w").exists()


def test_a_workdir_of_another_configuration_is_left_alone(tmp_path):
  train.train(_config(tmp_path, **dict(WHOLE, checkpoint_every=4)))  # WHOLE's programs.
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  with pytest.raises(app.UsageError, match=r"holds a run with other settings \(model_dim"):
    train.train(_config(tmp_path, **dict(WHOLE, model_dim=32)))
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_compare_writes_a_table_curves_and_a_state_sweep(tmp_path):
  from experiments import compare

  base = _config(tmp_path, task="mqar", sample_length=0)
  entries = ["softmax", "linear_learned@4", "linear_learned@8"]
  rows = compare.compare(base, entries, {"linear_learned@4": {"num_features": 4},
                                         "linear_learned": {"num_features": 8}})
  table = compare.write_table(rows, base, tmp_path / "comparison.md")
  compare.plot(rows, tmp_path / "curves.png", "mqar")
  assert compare.plot_state(rows, "eval_accuracy", tmp_path / "state.png", "mqar")
  for entry in entries:
    assert f"| {entry} |" in table
  assert all(r["train_step_temp_bytes"] > 0 and r["tokens_per_s"] > 0 for r in rows)
  assert (tmp_path / "curves.png").exists() and (tmp_path / "state.png").exists()
  # Decode state per layer and example: keys and values at every position for
  # softmax; [M, H] plus an [M] normaliser per head for linear attention.
  N, H = base.num_heads, base.model_dim // base.num_heads
  assert [r["state_floats"] for r in rows] == [
      2 * base.seq_len * base.model_dim, N * (4 * H + 4), N * (8 * H + 8)]
  assert (tmp_path / "linear_learned@8" / "summary.json").exists()


def test_compare_checks_every_entry_before_training(tmp_path):
  from experiments import compare

  base = _config(tmp_path, task="mqar", sample_length=0)
  with pytest.raises(app.UsageError, match="entry performer@x: .*num_feature"):
    compare.compare(base, ["softmax", "performer@x"], {"performer@x": {"num_feature": 4}})
  with pytest.raises(app.UsageError, match="entry softmax: --pack: --task=mqar has no documents"):
    compare.compare(dataclasses.replace(base, pack=True), ["softmax"], {})
  assert not any(tmp_path.iterdir())


def test_compare_defaults_apply_to_the_entries_that_run():
  """Built-in options (local's window) apply when local runs and are ignored when it does not;
  options the user wrote for an entry that does not run are an error."""
  from experiments import compare

  assert compare.entry_options(["softmax", "linear_elu"], None) == {}
  assert compare.entry_options(["local", "softmax"], None) == {"local": {"window_size": [16, 0]}}
  assert compare.entry_options(["local"], '{"local": {"window_size": [4, 0]}}') == {
      "local": {"window_size": [4, 0]}}
  with pytest.raises(app.UsageError, match="keyed by entries of --attentions"):
    compare.entry_options(["softmax"], '{"local": {"window_size": [4, 0]}}')


@pytest.mark.parametrize("pattern", [("attention",), ("mamba2", "rwkv7", "rwkv7", "attention")],
                         ids=["attention", "hybrid"])
def test_decoding_with_a_short_convolution_equals_the_full_pass(pattern):
  """Through attention layers, and a hybrid of token mixers (RWKV-7's value residual passed
  from its first layer to the next) and an attention layer."""
  from flax import nnx

  from experiments.model import Transformer

  model = Transformer(vocab_size=11, num_classes=None, max_len=12, dim=16,
                      num_layers=len(pattern) if len(pattern) > 1 else 2, num_heads=2,
                      num_kv_heads=1, attention="linear_elu", attention_options={},
                      dtype=None, short_conv=3, layer_pattern=pattern,
                      mixer_options={"attention_options": {"chunk_size": 4}}
                      if len(pattern) > 1 else None, rngs=nnx.Rngs(0))
  if len(pattern) > 1:  # RWKV-7 starts its output projection at zero: draw it.
    for block in model.blocks:
      if isinstance(block.attn, nn.RWKV7TimeMixer):
        block.attn.o_proj.kernel.set_value(0.3 * jnp.ones((16, 16)))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 11, (2, 9)))
  full = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
  model.init_cache(2, 12)
  # A prompt, then one token at a time (one compiled step; the position is traced).
  decode = nnx.jit(lambda model, tokens, position: model(tokens, position=position, decode=True))
  steps = [decode(model, tokens[:, :4], 0)]
  steps += [decode(model, tokens[:, t:t + 1], t) for t in range(4, 9)]
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=2e-5, atol=2e-5)
