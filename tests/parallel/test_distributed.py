"""Two real processes on this machine meet through ``jax.distributed``.

Each has 4 host CPU devices; the sequence is sharded over all 8 and the
collectives cross processes (gloo over loopback). Context-parallel linear
attention and ring attention, outputs and gradients, equal this (single)
process's functions.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la

WORKER = pathlib.Path(__file__).resolve().parents[1] / "support" / "distributed_worker.py"
ROOT = WORKER.parents[2]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
  sys.path.insert(0, str(WORKER.parent))
  import distributed_worker as worker

  port = _free_port()
  # Each process sets its own device count; the suite's compile flags carry over.
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(i), str(tmp_path)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      p.kill()
  assert all(p.returncode == 0 for p in procs), "\n\n".join(log[-3000:] for log in logs)

  q, k, v = (jnp.asarray(x) for x in worker.inputs())
  lengths = jnp.asarray(worker.LENGTHS)
  single = {
      "linear": lambda q, k, v: la.linear_attention(q, k, v, is_causal=True,
                                                    key_value_seq_lengths=lengths),
      "ring": lambda q, k, v: la.softmax_attention(q, k, v, is_causal=True,
                                                   key_value_seq_lengths=lengths),
  }
  def loss(q, k, v, fn):
    out = fn(q, k, v)
    return jnp.sum(out ** 2), out

  for name, fn in single.items():
    (_, out), grads = jax.jit(jax.value_and_grad(
        lambda q, k, v, fn=fn: loss(q, k, v, fn), argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want = {name: out, **{f"{name}_d{x}": g for x, g in zip("qkv", grads, strict=True)}}
    got = {key: np.load(tmp_path / f"{key}.npy") for key in want}
    chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)
