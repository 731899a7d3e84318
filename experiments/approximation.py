"""How well Performer's random features approximate exact softmax attention.

For each feature count M, projection kind (orthogonal or Gaussian) and kernel
(``positive`` = FAVOR+, ``trig`` = random Fourier), draws ``--draws``
projections from fixed seeds and measures the error of
``performer_attention`` against ``softmax_attention`` (scale 1/√H) on the
same random inputs:

  relative error = ‖out_performer − out_softmax‖_F / ‖out_softmax‖_F.

Both estimators are unbiased for the kernel exp(q·k/√H) (Choromanski et al.,
2021), so the error falls as M grows, and orthogonal rows lower the variance
(Yu et al., 2016). The exact softmax is the zero line of the plot.

Writes ``<output_dir>/approximation.json`` (mean, standard error and every
draw's error per setting) and ``approximation.png`` (error vs M).

Usage (from the repository root)::

  python -m experiments.approximation --num_features=16,64,256,1024,4096 --input_scale=0.5
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import linattn_jax
from experiments import common
from linattn_jax import feature_maps

# --help lists the shared flags (--heads, --output_dir, ...) with this script's own.
flags.adopt_module_key_flags(common)
_NUM_FEATURES = flags.DEFINE_list(
    "num_features", ["16", "64", "256", "1024", "4096"], "Feature counts M to try.")
_KINDS = flags.DEFINE_list(
    "kinds", ["orthogonal", "gaussian"], "Projection kinds: orthogonal and/or gaussian.")
_KERNELS = flags.DEFINE_list("kernels", ["positive", "trig"], "Kernels: positive and/or trig.")
_DRAWS = flags.DEFINE_integer("draws", 8, "Projections drawn per setting (fixed seeds).")
_LENGTH = flags.DEFINE_integer("length", 256, "Sequence length T (= S).")
# The estimators' variance grows like exp(‖q‖² / √H + ‖k‖² / √H): with H = 64
# and unit entries that is e^16 and M = 4096 is still far from converged;
# 0.5 shows the 1/√M decay within the default range of M.
_INPUT_SCALE = flags.DEFINE_float(
    "input_scale", 0.5,
    "Standard deviation of the entries of q and k; larger values sharpen the softmax "
    "and raise the random features' variance.")
_SEED = common.SEED

PROJECTIONS = {
    "orthogonal": feature_maps.orthogonal_random_projection,
    "gaussian": feature_maps.gaussian_random_projection,
}


@dataclasses.dataclass(frozen=True)
class Config:
  """One run of the experiment (the flags, parsed)."""

  num_features: tuple[int, ...]
  kinds: tuple[str, ...]
  kernels: tuple[str, ...]
  draws: int
  length: int
  heads: int
  head_dim: int
  value_dim: int
  input_scale: float
  causal: bool
  seed: int
  output_dir: str
  plot: bool


def config_from_flags() -> Config:
  unknown = (set(_KINDS.value) - set(PROJECTIONS)) | (set(_KERNELS.value) - {"positive", "trig"})
  if unknown:
    raise app.UsageError(f"unknown projection kinds or kernels: {sorted(unknown)}")
  return Config(
      num_features=tuple(int(m) for m in _NUM_FEATURES.value), kinds=tuple(_KINDS.value),
      kernels=tuple(_KERNELS.value), draws=_DRAWS.value, length=_LENGTH.value,
      heads=common.HEADS.value, head_dim=common.HEAD_DIM.value, value_dim=common.value_dim(),
      input_scale=_INPUT_SCALE.value, causal=common.CAUSAL.value, seed=_SEED.value,
      output_dir=common.output_dir("approximation"), plot=common.PLOT.value)


def make_inputs(config: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``q, k ~ N(0, input_scale²)`` and ``v ~ N(0, 1)``, shaped ``[1, T, N, ·]``."""
  kq, kk, kv = jax.random.split(jax.random.key(config.seed), 3)
  T, N, H, D = config.length, config.heads, config.head_dim, config.value_dim
  q = config.input_scale * jax.random.normal(kq, (1, T, N, H))
  k = config.input_scale * jax.random.normal(kk, (1, T, N, H))
  return q, k, jax.random.normal(kv, (1, T, N, D))


def relative_errors(config: Config, kernel: str, kind: str, M: int,
                    inputs: tuple[jax.Array, ...], exact: jax.Array) -> np.ndarray:
  """``[draws]`` relative Frobenius errors, one per projection drawn for (kind, M)."""
  draw = PROJECTIONS[kind]
  q, k, v = inputs

  def one(rng: jax.Array) -> jax.Array:
    projection = draw(rng, M, config.head_dim)
    out = linattn_jax.performer_attention(q, k, v, projection=projection, kernel=kernel,
                                          is_causal=config.causal)
    return jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact)

  rngs = jax.random.split(jax.random.fold_in(jax.random.key(config.seed), M), config.draws)
  return np.asarray(jax.lax.map(jax.jit(one), rngs))


def run_approximation(config: Config) -> dict[str, Any]:
  """Measures every (kernel, kind, M); writes and returns the report."""
  inputs = make_inputs(config)
  exact = linattn_jax.softmax_attention(*inputs, is_causal=config.causal)
  results = []
  print(f"{'kernel':>8} {'kind':>10} {'M':>5} {'mean rel. error':>16} {'std. error':>11}",
        flush=True)
  for kernel in config.kernels:
    for kind in config.kinds:
      for M in config.num_features:
        errors = relative_errors(config, kernel, kind, M, inputs, exact)
        finite = errors[np.isfinite(errors)]
        mean = float(finite.mean()) if finite.size else float("nan")
        stderr = float(finite.std(ddof=1) / np.sqrt(finite.size)) if finite.size > 1 else None
        results.append({"kernel": kernel, "kind": kind, "num_features": M, "mean": mean,
                        "stderr": stderr, "non_finite": int(errors.size - finite.size),
                        "errors": errors.tolist()})
        print(f"{kernel:>8} {kind:>10} {M:>5} {mean:>16.4f} "
              f"{'' if stderr is None else f'{stderr:.4f}':>11}", flush=True)
  report = {"metadata": {"jax_version": jax.__version__, "backend": jax.default_backend(),
                         "config": dataclasses.asdict(config)},
            "results": results}
  output_dir = pathlib.Path(config.output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  common.write_json(output_dir / "approximation.json", report)
  print(f"wrote {output_dir / 'approximation.json'}", flush=True)
  if config.plot:
    path = write_plot(output_dir / "approximation.png", results, config)
    if path is not None:
      print(f"wrote {path}", flush=True)
  return report


def write_plot(path: pathlib.Path, results: Sequence[dict[str, Any]],
               config: Config) -> pathlib.Path | None:
  """Mean relative error (± 2 standard errors) vs M; exact softmax is the 0 line."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot written.", flush=True)
    return None
  fig, ax = plt.subplots(figsize=(7, 5))
  for kernel in config.kernels:
    for kind in config.kinds:
      rows = [r for r in results if r["kernel"] == kernel and r["kind"] == kind]
      ax.errorbar([r["num_features"] for r in rows], [r["mean"] for r in rows],
                  yerr=[2 * (r["stderr"] or 0.0) for r in rows], marker="o", capsize=3,
                  linestyle="-" if kind == "orthogonal" else "--", label=f"{kernel}, {kind}")
  ax.axhline(0.0, color="black", linewidth=1, label="exact softmax")
  ax.set_xscale("log", base=2)
  # Linear near 0 (where the exact softmax sits), logarithmic above: trig
  # features' errors are orders of magnitude above the positive ones'.
  ax.set_yscale("symlog", linthresh=0.1)
  ax.set_ylim(bottom=-0.02)  # Errors are >= 0: show 0, not the negative half.
  ax.set_xlabel("random features M")
  ax.set_ylabel("relative error vs softmax_attention")
  ax.set_title(f"Performer vs exact softmax: T={config.length} H={config.head_dim} "
               f"scale={config.input_scale} causal={config.causal}, {config.draws} draws",
               fontsize="medium")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  run_approximation(config_from_flags())


if __name__ == "__main__":
  common.run(main)
