"""Context parallelism on host devices: what crosses devices, and the longest sequence.

Causal attention of one layer (``--heads``, ``--kv_heads``, ``--head_dim``,
``--batch``) over P = ``--devices`` host CPU devices, the inputs sharded
along T. Two reports:

- ``communication``: for each total length T of ``--total_lengths``, the
  bytes one device sends in a forward+backward pass, read from the compiled HLO's collectives (each
  counted as often as its loop runs) beside the analytic count. Recurrent
  (``--recurrent``, any of ``parallel.recurrent_attentions()``; a gated
  one gets seeded gates and betas, sharded like the keys):
  ``1 + ceil(log2(P - 1))`` states forward and as many
  backward in the other direction (the busiest device sends 7 of them for
  P = 8), a state being e.g. ``B·K·M·(D + 1)`` floats for linear attention
  or ``B·K·H·(D + H)`` for the delta rule's affine map, whatever T. Ring: keys
  and values ``(P - 1)`` times forward; backward, keys and values ``P - 1``
  times and their float32 gradients P times; plus the zig-zag reorder,
  half of q, k, v and the output's gradient in, half of the output and of
  dq, dk, dv back.
- ``max_length``: doubling T from ``--start_length``, the largest T whose
  forward+backward fits in ``--memory_gib`` (the compiled program's
  arguments, outputs and temporaries, summed over this host's devices), for
  the context-parallel functions and for the same attention on one device
  (``linear_elu`` chunked; exact softmax by XLA and by ``flash``). The
  largest T of each is then run once and timed (up to ``--run_up_to``,
  or ``--run_exact_up_to`` for exact softmax, whose time grows as T²).

    python -m experiments.context_parallel --total_lengths=4096,16384,65536

writes ``context_parallel.json`` to ``--output_dir`` (default
``results/context_parallel``).
"""

from __future__ import annotations

import math
import pathlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import linattn_jax as la
from experiments import common
from linattn_jax import parallel

_DEVICES = flags.DEFINE_integer("devices", 8, "Host CPU devices P (set before JAX starts).")
_LENGTHS = flags.DEFINE_list(
    "total_lengths", ["4096", "16384", "65536"],
    "Total sequence lengths T (over all devices) for the communication report.")
_RECURRENT = flags.DEFINE_string("recurrent", "linear_elu", "The recurrent variant to shard.")
_START = flags.DEFINE_integer("start_length", 4096, "First T of the max_length search.")
_MEMORY_GIB = flags.DEFINE_float("memory_gib", 20.0, "Memory budget of the whole host (GiB).")
_RUN_UP_TO = flags.DEFINE_integer(
    "run_up_to", 1 << 22, "Run (and time) the largest fitting T of linear attention only up "
    "to this length.")
_RUN_EXACT_UP_TO = flags.DEFINE_integer(
    "run_exact_up_to", 1 << 15, "The same for exact softmax (its time grows as T²).")
_REPORTS = flags.DEFINE_list("reports", ["communication", "max_length"], "Reports to make.")
_KV_HEADS = common.KV_HEADS
_BATCH = common.BATCH
flags.adopt_module_key_flags(common)

_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (collective-permute|all-reduce|all-gather|all-to-all|reduce-scatter)"
    r"(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_WHILE = re.compile(r"while\(.*body=%?([\w.\-]+).*?known_trip_count\":\{\"n\":\"(\d+)\"")
_CALLS = re.compile(r"(?:to_apply|calls|body|condition|true_computation|false_computation|"
                    r"branch_computations)=\{?%?([\w.\-]+(?:, ?%[\w.\-]+)*)\}?")


def _bytes(shapes: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shapes):
    bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
    total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
  return total


def _permute(line: str) -> tuple[str, list[tuple[int, int]]]:
  """A collective-permute's pattern (``ring``, ``zigzag`` or ``shift``) and its pairs."""
  found = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
  pairs = [tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)", found.group(0))]
  n = 1 + max(max(p) for p in pairs)
  if len(pairs) == n and all(b == (a + 1) % n for a, b in pairs):
    return "ring", pairs
  if len({b - a for a, b in pairs}) == 1:  # i to i ± d (a scan, or its transpose).
    return "shift", pairs
  return "zigzag", pairs


def collective_bytes(hlo: str) -> dict[str, int]:
  """Bytes the busiest device sends, by kind, in a compiled (per-device) HLO module's text.

  Collectives inside a ``while`` body count as often as its known trip
  count. A collective-permute counts for the devices it sends from (not to
  themselves), by pattern: ``ring`` (i to i + 1 mod P), ``shift`` (i to
  i ± d) and ``zigzag`` (the reorder); ``reduction`` is the operand size of
  all-reduces and the other collectives (a ring all-reduce sends about
  twice that).
  """
  computations: dict[str, list[str]] = {}
  name = ""
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      header = _HEADER.match(line)
      name = header.group(1) if header else ""
      computations[name] = []
    elif name:
      computations[name].append(line)
  entry = next((n for n in computations if re.search(rf"^ENTRY %?{re.escape(n)} ", hlo, re.M)),
               None)
  times: dict[str, int] = {}

  def visit(comp: str, count: int) -> None:
    times[comp] = times.get(comp, 0) + count
    for line in computations.get(comp, ()):
      loop = _WHILE.search(line)
      if loop:
        visit(loop.group(1), count * int(loop.group(2)))
        continue
      for callees in _CALLS.findall(line):
        for callee in re.split(r",\s*%?", callees):
          if callee in computations and " while(" not in line:
            visit(callee, count)

  if entry is not None:
    visit(entry, 1)
  sent: dict[str, dict[int, int]] = {}
  for comp, lines in computations.items():
    for line in lines:
      found = _COLLECTIVE.search(line)
      if not found or not times.get(comp):
        continue
      size = _bytes(found.group(1)) * times[comp]
      if found.group(2) != "collective-permute":
        sent.setdefault("reduction", {}).setdefault(0, 0)
        sent["reduction"][0] += size
        continue
      kind, pairs = _permute(line)
      for a, b in pairs:
        if a != b:
          sent.setdefault(kind, {}).setdefault(a, 0)
          sent[kind][a] += size
  return {kind: max(by_device.values()) for kind, by_device in sorted(sent.items())}


def _shape(T: int) -> tuple[int, int, int, int, int, int]:
  N = common.HEADS.value
  K = _KV_HEADS.value or N
  return _BATCH.value, T, N, K, common.HEAD_DIM.value, common.value_dim()


def _shapes(T: int) -> dict[str, tuple[int, ...]]:
  """Shapes of q, k, v and of the ``--recurrent`` variant's per-token inputs (gates, betas)."""
  B, T, N, K, H, D = _shape(T)
  gates = la.get_spec(_RECURRENT.value).token_input_shapes((B, T, K, H))
  return {"q": (B, T, N, H), "k": (B, T, K, H), "v": (B, T, K, D), **gates}


def _inputs(T: int, sharding: Any) -> tuple[Any, ...]:
  """``(q, k, v, gates)`` as ``jax.ShapeDtypeStruct`` s (gates float32, sharded as q, k, v)."""
  dtype = jnp.dtype(common.DTYPE.value)
  shapes = _shapes(T)
  q, k, v = (jax.ShapeDtypeStruct(shapes.pop(x), dtype, sharding=sharding) for x in "qkv")
  return q, k, v, {name: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)
                   for name, s in shapes.items()}


def _forward_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Gradients of ``Σ out²``: the output's gradient is data, not a constant XLA folds."""
  def loss(q, k, v, gates):
    return jnp.sum(jnp.square(fn(q, k, v, gates).astype(jnp.float32)))
  return jax.grad(loss, argnums=(0, 1, 2, 3))


def _methods(mesh: jax.sharding.Mesh) -> dict[str, tuple[Callable[..., Any], bool]]:
  """name -> (``fn(q, k, v, gates)``, sharded over the mesh); only the recurrent variant
  reads ``gates``. Names with "softmax", "ring" or "flash" are exact (quadratic time)."""
  recurrent = _RECURRENT.value
  return {
      f"context_parallel {recurrent}": (lambda q, k, v, g: parallel.context_parallel_attention(
          q, k, v, attention=recurrent, mesh=mesh, axis_name="seq", is_causal=True, **g), True),
      "ring (zig-zag)": (lambda q, k, v, _: parallel.ring_attention(
          q, k, v, mesh=mesh, axis_name="seq", is_causal=True), True),
      f"one device: {recurrent}": (lambda q, k, v, g: la.get_attention(recurrent)(
          q, k, v, is_causal=True, **g), False),
      "one device: flash": (lambda q, k, v, _: la.flash_attention(q, k, v, is_causal=True),
                            False),
      "one device: softmax (XLA)": (lambda q, k, v, _: la.softmax_attention(
          q, k, v, is_causal=True, implementation="xla"), False),
  }


def scan_sends(P_: int, state_bytes: int = 1, read_bytes: int | None = None) -> int:
  """What the busiest device sends in the recurrent exclusive scan, forward and backward.

  Forward, device i sends to i + d for the shift (d = 1) and each
  Hillis–Steele round (d = 1, 2, 4, ... < P - 1) while i + d < P; the
  backward pass sends the other way (i to i - d). Every send is one state
  of ``state_bytes`` (default 1: a count of states) but the last round's
  (the shift's for P = 2): only the local pass reads what it builds, and
  where it reads ``read_bytes`` of a state (a gated summary's ``kv``, not its
  decay or transition), the compiled program sends no more.
  """
  read_bytes = state_bytes if read_bytes is None else read_bytes
  distances, d = ([1] if P_ > 1 else []), 1
  while d < P_ - 1:
    distances.append(d)
    d *= 2
  sent = [0] * P_
  for r, d in enumerate(distances):
    size = read_bytes if r == len(distances) - 1 else state_bytes
    sent = [s + size * ((i + d < P_) + (i - d >= 0)) for i, s in enumerate(sent)]
  return max(sent)


def analytic_bytes(method: str, *, P_: int, B: int, T: int, N: int, K: int, H: int, D: int,
                   itemsize: int, state_bytes: int,
                   read_bytes: int | None = None) -> dict[str, int]:
  """The busiest device's bytes sent in one forward+backward pass, by kind (``read_bytes``:
  see :func:`scan_sends`)."""
  if method == "recurrent":
    return {"shift": scan_sends(P_, state_bytes, read_bytes)}
  L = -(-T // (2 * P_)) * 2
  k, v = B * L * K * H * itemsize, B * L * K * D * itemsize
  q, out = B * L * N * H * itemsize, B * L * N * D * itemsize
  # Keys and values go round P - 1 times forward and P - 1 times backward, and
  # their float32 gradients P times (the last step brings them home).
  ring = 2 * (P_ - 1) * (k + v) + P_ * (k + v) // itemsize * 4
  # Zig-zag reorder: q, k, v and the output's gradient in, the output and
  # dq, dk, dv back; the busiest device sends its whole share of each.
  return {"ring": ring, "zigzag": 2 * (q + k + v + out)}


def _analytic(method: str, T: int, P_: int) -> dict[str, int]:
  """The analytic count; a state's size is that of a summary, and what the local pass reads
  of it that of the state a causal pass carries (e.g. a gated summary's ``kv`` alone)."""
  B, T, N, K, H, D = _shape(T)
  dtype = jnp.dtype(common.DTYPE.value)
  spec = la.get_spec(_RECURRENT.value)
  q, k, v, gates = _inputs(8, None)
  summary, (_, state) = jax.eval_shape(lambda q, k, v, g: (
      spec.streaming.summarize(k, v, **g),
      spec.function(q, k, v, is_causal=True, return_state=True, **g)), q, k, v, gates)
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  return analytic_bytes(
      "recurrent" if method.startswith("context_parallel") else "ring", P_=P_, B=B, T=T, N=N,
      K=K, H=H, D=D, itemsize=dtype.itemsize, state_bytes=size(summary),
      read_bytes=size(state))


def communication(mesh: jax.sharding.Mesh) -> list[dict[str, Any]]:
  rows = []
  seq = NamedSharding(mesh, P(None, "seq"))
  for T in map(int, _LENGTHS.value):
    for method, (fn, sharded) in _methods(mesh).items():
      if not sharded:
        continue
      hlo = jax.jit(_forward_backward(fn), out_shardings=seq).lower(
          *_inputs(T, seq)).compile().as_text()
      measured, analytic = collective_bytes(hlo), _analytic(method, T, mesh.shape["seq"])
      rows.append({"method": method, "T": T, "measured": measured, "analytic": analytic})
      print(f"{method:32s} T={T:>8}  HLO {measured}  analytic {analytic}", flush=True)
  return rows


def _memory(fn: Callable[..., Any], T: int, sharding: Any, devices: int) -> int:
  compiled = jax.jit(_forward_backward(fn)).lower(*_inputs(T, sharding)).compile()
  m = compiled.memory_analysis()
  per_device = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
  return per_device * devices


def max_length(mesh: jax.sharding.Mesh) -> list[dict[str, Any]]:
  budget = _MEMORY_GIB.value * 2**30
  rows = []
  P_ = mesh.shape["seq"]
  for method, (fn, sharded) in _methods(mesh).items():
    sharding = NamedSharding(mesh, P(None, "seq")) if sharded else None
    devices = P_ if sharded else 1
    T, fits, tried = _START.value, None, []
    while T <= 1 << 26:
      try:
        used = _memory(fn, T, sharding, devices)
      except Exception as e:  # noqa: BLE001 - an allocation XLA refuses to plan is "too big".
        print(f"{method}: T={T} does not compile ({type(e).__name__})", flush=True)
        break
      tried.append({"T": T, "bytes": used})
      print(f"{method:32s} T={T:>9}  {used / 2**30:8.2f} GiB", flush=True)
      if used > budget:
        break
      fits, T = T, 2 * T
    row: dict[str, Any] = {"method": method, "largest_fitting_T": fits, "tried": tried}
    exact = any(word in method for word in ("softmax", "ring", "flash"))
    limit = _RUN_EXACT_UP_TO.value if exact else _RUN_UP_TO.value
    ran = fits if fits is not None and fits <= limit else limit
    if fits is not None:
      row["run"] = _run(fn, ran, sharding)
      print(f"{method:32s} ran T={ran}: {row['run']['seconds']:.1f} s", flush=True)
    rows.append(row)
  return rows


def _run(fn: Callable[..., Any], T: int, sharding: Any) -> dict[str, Any]:
  """Seeded normal q, v and keys of norm about 1 (a delta rule's writes stay bounded), and
  gates from normal draws (``common.gate_from_normal``)."""
  dtype = jnp.dtype(common.DTYPE.value)
  shapes = _shapes(T)

  def make(seed):
    key = jax.random.key(seed)
    x = {name: jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32)
         for i, (name, s) in enumerate(shapes.items())}
    q, k, v = x.pop("q"), x.pop("k") / math.sqrt(shapes["k"][-1]), x.pop("v")
    declared = {t.name: t for t in la.get_spec(_RECURRENT.value).token_inputs}
    gates = {name: common.gate_from_normal(declared[name], g) for name, g in x.items()}
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), gates

  q, k, v, gates = jax.jit(make, out_shardings=sharding)(common.SEED.value)
  step = jax.jit(_forward_backward(fn)).lower(q, k, v, gates).compile()
  start = time.perf_counter()
  grads = step(q, k, v, gates)
  jax.block_until_ready(grads)
  finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  return {"T": T, "seconds": time.perf_counter() - start, "finite": finite}


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _RECURRENT.value not in parallel.recurrent_attentions():
    raise app.UsageError(f"--recurrent={_RECURRENT.value!r} has no state to pass between "
                         f"devices; choose from {parallel.recurrent_attentions()}.")
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  if jax.device_count() != _DEVICES.value:
    raise app.UsageError(f"--devices={_DEVICES.value}: JAX started with "
                         f"{jax.device_count()} devices.")
  mesh = jax.make_mesh((_DEVICES.value,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  report: dict[str, Any] = {"device": str(jax.devices()[0]), "devices": _DEVICES.value,
                            "shape": dict(zip("BTNKHD", _shape(0), strict=True)),
                            "command": " ".join(sys.argv)}
  if "communication" in _REPORTS.value:
    report["communication"] = communication(mesh)
  if "max_length" in _REPORTS.value:
    report["max_length"] = max_length(mesh)
  out = pathlib.Path(common.output_dir("context_parallel"))
  out.mkdir(parents=True, exist_ok=True)
  common.write_json(out / "context_parallel.json", report)
  print(f"wrote {out / 'context_parallel.json'}", flush=True)


if __name__ == "__main__":
  common.run(main)
