"""One process of the two-process test (tests/parallel/test_distributed.py); not a test itself.

    python tests/support/distributed_worker.py PORT PROCESS_ID OUT_DIR

Joins a 2-process JAX runtime on 127.0.0.1:PORT with 4 host CPU devices per
process (gloo collectives), shards one sequence over all 8 devices, runs
context-parallel linear attention and ring attention (outputs and input
gradients), and has process 0 write them to OUT_DIR as .npy files.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from linattn_jax import parallel

SHAPES = ((2, 40, 4, 8), (2, 40, 2, 8), (2, 40, 2, 8))  # [B, T, N|K, H]; 40 = 8 · 5.
LENGTHS = np.asarray([40, 23], np.int32)


def inputs() -> tuple[np.ndarray, ...]:
  rng = np.random.default_rng(0)
  return tuple(rng.standard_normal(s).astype(np.float32) for s in SHAPES)


def main(port: int, process_id: int, out_dir: pathlib.Path) -> None:
  jax.config.update("jax_num_cpu_devices", 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id)
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = jax.make_mesh((8,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  seq = NamedSharding(mesh, P(None, "seq"))
  q, k, v = (jax.make_array_from_callback(x.shape, seq, lambda index, x=x: x[index])
             for x in inputs())
  lengths = jax.device_put(LENGTHS, NamedSharding(mesh, P()))
  runs = {
      "linear": lambda q, k, v: parallel.context_parallel_attention(
          q, k, v, attention="linear_elu", mesh=mesh, axis_name="seq", is_causal=True,
          key_value_seq_lengths=lengths),
      "ring": lambda q, k, v: parallel.ring_attention(
          q, k, v, mesh=mesh, axis_name="seq", is_causal=True, key_value_seq_lengths=lengths),
  }
  def loss(q, k, v, fn):
    out = fn(q, k, v)
    return jnp.sum(out ** 2), out

  results = {}
  for name, fn in runs.items():
    # The output and the gradients of sum(out²): one compiled program, one gather.
    (_, out), grads = jax.jit(jax.value_and_grad(
        lambda q, k, v, fn=fn: loss(q, k, v, fn), argnums=(0, 1, 2), has_aux=True))(q, k, v)
    gathered = multihost_utils.process_allgather((out, *grads), tiled=True)
    for key, x in zip(("", "_dq", "_dk", "_dv"), gathered, strict=True):
      results[name + key] = x
  if process_id == 0:
    for name, x in results.items():
      np.save(out_dir / f"{name}.npy", np.asarray(x))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3]))
