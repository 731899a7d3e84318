"""Times the state-space mixers' recurrences against the gated core, and checkpoint loading.

Three comparisons, each timed in turns (one call of each per round, so that the
machine's load weighs on both alike), causal, B = 1, forward plus the gradients of every
input:

- ``mamba2``: Mamba-2's SSD as ``nn.Mamba2Mixer`` runs it (``simple_gla`` with grouped
  value heads on ``Δ·x``, log-decay ``Δ·A``, scale 1, plus the ``D`` skip) against
  ``simple_gla`` at the same grouped shapes (``--heads`` value heads, state
  ``--mamba2_state`` × ``--head_dim``, one group of B and C per head);
- ``selective_scan``: Mamba-1's selective scan over ``--inner`` channels with
  ``--d_state`` entries each (every form), against the Mamba-2 SSD of the same inner
  width (``--inner / 64`` heads of 64 channels, one group, the same state size); the
  record holds each program's compiled temporary memory, which must grow linearly in T;
- ``load``: ``nn.load_transformers_layer`` of a Mamba-2 layer of a checkpoint written
  here (``--load_width`` wide, float32) against reading that layer's tensors with
  ``safetensors`` alone.

Writes ``<output_dir>/state_space.json`` (default ``results/state_space``) and prints the
medians and ratios.

Usage (from the repository root)::

  python -m experiments.state_space_benchmark --state_space_lengths=8192 --repeats=5
"""

from __future__ import annotations

import functools
import json
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

import linattn_jax as la
from experiments import benchmark, common
from linattn_jax import nn

# --heads and --head_dim (experiments.common): mamba2's value heads (one group of B and C
# each) and their channels P = D; --repeats: timed rounds; --warmup (benchmark's): untimed.
_LENGTHS = flags.DEFINE_list("state_space_lengths", ["8192"], "Sequence lengths T.")
_MAMBA2_STATE = flags.DEFINE_integer("mamba2_state", 64, "mamba2: the state size N = H.")
_INNER = flags.DEFINE_integer("inner", 1024, "selective_scan: channels E (d_inner).")
_D_STATE = flags.DEFINE_integer("d_state", 16, "selective_scan: state entries per channel.")
_LOAD_WIDTH = flags.DEFINE_integer("load_width", 1024, "load: the checkpoint's hidden size.")
_COMPARISONS = flags.DEFINE_list("comparisons", ["mamba2", "selective_scan", "load"],
                                 "Which comparisons to run.")


def _normal(key, shape, scale=1.0):
  return scale * jax.random.normal(key, shape, jnp.float32)


def mamba2_ssd(x, dt, A, b, c, D):
  """Mamba-2's SSD as ``nn.Mamba2Mixer`` runs it: ``x, dt [B, T, n(, P)]``, ``A, D [n]``,
  ``b, c [B, T, G, S]``."""
  y = la.get_attention("simple_gla")(c, b, x * dt[..., None], is_causal=True, scale=1.0,
                                     log_decay=dt * A[None, None])
  return y + D[None, None, :, None] * x


def _grads(fn: Callable[..., jax.Array], n: int) -> Callable[..., Any]:
  """``(out, grads of Σ ct·out w.r.t. the first n arguments)``: ``fn(*args)`` with the
  cotangent last."""
  def run(*args):
    *inputs, ct = args
    out, vjp = jax.vjp(lambda *a: fn(*a, *inputs[n:]), *inputs[:n])
    return out, vjp(ct)
  return run


def _timed(pairs: Sequence[tuple[str, Callable, Sequence[Any]]], *, warmup: int,
           repeats: int) -> dict[str, Any]:
  """Compiles each ``(name, fn, args)``, records its temporary memory, times them in turns."""
  compiled = [(name, benchmark.compile_function(fn, args)[0], args) for name, fn, args in pairs]
  times = benchmark.time_in_turns([(c, a) for _, c, a in compiled], warmup=warmup,
                                  repeats=repeats)
  out = {}
  for (name, c, _), t in zip(compiled, times, strict=True):
    out[name] = {"median_s": statistics.median(t), "times_s": t,
                 "temp_bytes": benchmark.memory_stats(c)["temp_size_in_bytes"]}
  return out


def mamba2_vs_simple_gla(T: int, *, heads: int, state: int, head_dim: int,
                         **timing: int) -> dict[str, Any]:
  n, S, P = heads, state, head_dim
  k = jax.random.split(jax.random.key(0), 8)
  x, ct = _normal(k[0], (1, T, n, P)), _normal(k[1], (1, T, n, P))
  b, c = _normal(k[2], (1, T, n, S), S ** -0.5), _normal(k[3], (1, T, n, S), S ** -0.5)
  dt = jax.nn.softplus(_normal(k[4], (1, T, n)) - 3.0)
  A, D = -jnp.exp(_normal(k[5], (n,), 0.5)), jnp.ones((n,))
  gla = functools.partial(la.get_attention("simple_gla"), is_causal=True, scale=1.0)
  result = _timed([
      ("mamba2", _grads(mamba2_ssd, 5), (x, dt, A, b, c, D, ct)),
      ("simple_gla", _grads(lambda q, kk, v, g: gla(q, kk, v, log_decay=g), 4),
       (c, b, x, dt * A[None, None], ct)),
  ], **timing)
  result["ratio"] = result["mamba2"]["median_s"] / result["simple_gla"]["median_s"]
  return result


def selective_scan_vs_mamba2(T: int, *, inner: int, d_state: int,
                             **timing: int) -> dict[str, Any]:
  E, N = inner, d_state
  n, P = E // 64, 64
  k = jax.random.split(jax.random.key(1), 8)
  x, ct = _normal(k[0], (1, T, E)), _normal(k[1], (1, T, E))
  dt = jax.nn.softplus(_normal(k[2], (1, T, E)) - 3.0)
  b, c = _normal(k[3], (1, T, 1, N), N ** -0.5), _normal(k[4], (1, T, 1, N), N ** -0.5)
  A = -jnp.exp(_normal(k[5], (E, N), 0.5))
  pairs = [(f"selective_scan_{form}", _grads(functools.partial(
      la.selective_scan, implementation=form), 5), (x, dt, A, b, c, jnp.ones((E,)), ct))
      for form in ("associative_scan", "scan")]
  heads = lambda a: a.reshape(1, T, n, P)  # noqa: E731
  pairs.append(("mamba2", _grads(mamba2_ssd, 5),
                (heads(x), dt[..., ::P], A[::P, 0], b, c, jnp.ones((n,)), heads(ct))))
  result = _timed(pairs, **timing)
  for form in ("associative_scan", "scan"):
    result[f"ratio_{form}"] = (result[f"selective_scan_{form}"]["median_s"]
                               / result["mamba2"]["median_s"])
  return result


def _mamba2_checkpoint(folder: pathlib.Path, width: int) -> None:
  """A one-layer Mamba-2 checkpoint (float32): 64-channel heads, 8 groups of 128 states."""
  from safetensors.numpy import save_file

  I, n, S, W = 2 * width, 2 * width // 64, 128, 4  # noqa: E741
  G = 8 if n % 8 == 0 else 1
  rng = np.random.default_rng(0)
  draw = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  p = "backbone.layers.0.mixer."
  tensors = {p + "in_proj.weight": draw(2 * I + 2 * G * S + n, width),
             p + "conv1d.weight": draw(I + 2 * G * S, 1, W),
             p + "conv1d.bias": draw(I + 2 * G * S), p + "dt_bias": draw(n),
             p + "A_log": draw(n), p + "D": draw(n), p + "norm.weight": draw(I),
             p + "out_proj.weight": draw(width, I)}
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  config = {"model_type": "mamba2", "hidden_size": width, "num_heads": n, "head_dim": 64,
            "expand": 2, "state_size": S, "n_groups": G, "conv_kernel": W,
            "use_conv_bias": True, "use_bias": False, "layer_norm_epsilon": 1e-5,
            "num_hidden_layers": 1, "hidden_act": "silu"}
  (folder / "config.json").write_text(json.dumps(config))


def load_vs_read(*, width: int, repeats: int) -> dict[str, Any]:
  from safetensors import safe_open

  with tempfile.TemporaryDirectory() as tmp:
    folder = pathlib.Path(tmp)
    _mamba2_checkpoint(folder, width)

    def read():
      with safe_open(folder / "model.safetensors", framework="flax") as f:
        return jax.block_until_ready([f.get_tensor(k) for k in f.keys()])

    def load():
      layer = nn.load_transformers_layer(folder, 0)
      return jax.block_until_ready(jax.tree.leaves(nnx.state(layer, nnx.Param)))

    for fn in (read, load):  # Warm up: imports, the first programs.
      fn()
    times = {"read": [], "load": []}
    for _ in range(repeats):
      for name, fn in (("read", read), ("load", load)):
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
    size = (folder / "model.safetensors").stat().st_size
  med = {k: statistics.median(v) for k, v in times.items()}
  return {"bytes": size, "read_median_s": med["read"], "load_median_s": med["load"],
          "times_s": times, "ratio": med["load"] / med["read"]}


def main(argv: Sequence[str]) -> None:
  del argv
  records: dict[str, Any] = {"meta": {"jax": jax.__version__, "devices": str(jax.devices())}}
  timing = {"warmup": benchmark._WARMUP.value, "repeats": common.REPEATS.value}
  for T in (int(t) for t in _LENGTHS.value):
    if "mamba2" in _COMPARISONS.value:
      r = records[f"mamba2_T{T}"] = mamba2_vs_simple_gla(
          T, heads=common.HEADS.value, state=_MAMBA2_STATE.value,
          head_dim=common.HEAD_DIM.value, **timing)
      print(f"T={T} mamba2 SSD {r['mamba2']['median_s'] * 1e3:.1f} ms, simple_gla "
            f"{r['simple_gla']['median_s'] * 1e3:.1f} ms: ratio {r['ratio']:.3f}")
    if "selective_scan" in _COMPARISONS.value:
      r = records[f"selective_scan_T{T}"] = selective_scan_vs_mamba2(
          T, inner=_INNER.value, d_state=_D_STATE.value, **timing)
      for form in ("associative_scan", "scan"):
        s = r[f"selective_scan_{form}"]
        print(f"T={T} selective_scan {form} {s['median_s'] * 1e3:.1f} ms "
              f"({s['temp_bytes'] / 2 ** 20:.1f} MiB temp), mamba2 "
              f"{r['mamba2']['median_s'] * 1e3:.1f} ms: ratio {r[f'ratio_{form}']:.3f}")
  if "load" in _COMPARISONS.value:
    r = records["load"] = load_vs_read(width=_LOAD_WIDTH.value, repeats=common.REPEATS.value)
    print(f"load {r['load_median_s'] * 1e3:.1f} ms, read {r['read_median_s'] * 1e3:.1f} ms "
          f"({r['bytes'] / 2 ** 20:.1f} MiB): ratio {r['ratio']:.2f}")
  out = pathlib.Path(common.output_dir("state_space"))
  out.mkdir(parents=True, exist_ok=True)
  (out / "state_space.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
  common.run(main)
