"""Context parallelism: attention over a sequence sharded along its length.

A sequence of T tokens is split over the P devices of one mesh axis; device
i holds the L = T / P tokens ``[i·L, (i+1)·L)`` (the sequence is padded at
its end to a multiple of P, and the padding is hidden as keys and dropped
as queries). Both methods run under ``jax.shard_map``, manual over that axis
only: other mesh axes stay automatic, so a batch sharded for data
parallelism stays sharded.

**Recurrent variants** (:func:`context_parallel_attention`). Keys fold into
a fixed-size state and states of consecutive spans combine associatively
(the registry's ``summarize`` and ``combine``). Device i summarises its own
keys, ``s_i``, and needs the exclusive prefix ``s_0 ∘ … ∘ s_{i-1}``: one
``ppermute`` shifts every summary one device on, then a Hillis–Steele scan
(``ceil(log2(P - 1))`` rounds; in round r, device i combines what device
``i - 2^r`` holds into its own) completes it. Each round sends one state,
``[B, K, M, D]`` and its normaliser, so the communication per device does
not depend on T. The gated recurrences summarise a span as the affine map it
applies to the state, ``S ↦ diag(exp(a)) S + B`` (decays) or ``S ↦ A S + B``
(delta rule, ``A [B, K, H, H]``), and compose those; their gates and betas
are split along T with the keys. The device then runs the variant's own
causal pass over its tokens from that prefix (``initial_state``).
Non-causal attention reads the state of all keys: the last device's
inclusive prefix, broadcast with a ``psum``, read by a causal pass with the
local keys hidden (they are in it already). Packed sequences (causal,
``segment_ids``): a summary of a span holding a boundary means "start afresh,
then these keys", so ``combine`` composes across boundaries; a boundary at a
device's first token travels beside the summary as a flag per row (a
segmented scan), and that device starts its own pass from the empty state.

**Exact softmax** (:func:`ring_attention`). Keys and values travel around
the ring (``ppermute`` to device ``i + 1``) in P - 1 steps; each step's
block is attended by flash attention and merged into the running output by
its log-sum-exp (an online softmax over blocks). The backward pass is a
``custom_vjp`` that runs the ring again, recomputing each block (the
FlashAttention-2 backward) with the key/value gradients travelling with
their keys, and one last step home; it saves only the local inputs, the
output and the log-sum-exp, so memory per device is proportional to L.
Causal attention would leave device 0 idle after its first block and the
last device busy at every step. The zig-zag order balances it: the sequence
is cut into 2P chunks and device i holds chunks i and 2P - 1 - i. At the
step where it holds device j's keys, j < i: both its chunks see j's first
chunk in full; j > i: only its second chunk sees both of j's chunks in full.
Either way a step costs two chunk-by-chunk blocks and masks nothing; blocks
that are fully masked are never computed. Packed sequences (``segment_ids``)
keep to this plan: the key ids travel with their keys, and a block whose
queries and keys share no segment (told by the first and last ids of each,
as the ids do not decrease) is skipped.

Both are differentiable; collectives carry states (recurrent) or key/value
blocks (ring), never the queries or outputs.

References:
  Hillis & Steele, "Data parallel algorithms", 1986 (the scan).
  Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for
  Near-Infinite Context", 2023.
  Brandon et al., "Striped Attention: Faster Ring Attention for Causal
  Transformers", 2023; the zig-zag order of Zhu's ring-flash-attention and
  Llama 3's context parallelism (Dubey et al., 2024) is the variant used here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from linattn_jax._src import checks, flash
from linattn_jax._src.online_softmax import (
    SoftmaxCarry,
    from_output,
    init_softmax_carry,
    merge,
    online_softmax_finish,
)
from linattn_jax._src.registry import accepted, available_attentions, get_spec

_RESERVED = ("initial_state", "return_state", "key_value_seq_lengths", "is_causal")


def recurrent_attentions() -> list[str]:
  """Registered variants :func:`context_parallel_attention` runs (those with ``summarize``).

  Takes no arrays. These variants fold keys into a fixed-size state (e.g.
  ``[B, K, M, D]`` and its normaliser) whose ``combine`` is associative, so
  devices exchange states, not keys. Exact softmax runs with
  :func:`ring_attention` instead. The gated and delta-rule recurrences are
  here too: their per-token inputs (``AttentionSpec.token_inputs``) are split
  along T with the keys.

  Returns:
    A sorted list of registered names.

  Examples:
    >>> names = parallel.recurrent_attentions()
    >>> "performer" in names, "gated_delta_net" in names, "softmax" in names
    (True, True, False)
  """
  return [name for name in available_attentions()
          if (s := get_spec(name).streaming) is not None and s.summarize is not None]


def _axis_size(mesh: Any, axis_name: Any, fn: str) -> int:
  if not isinstance(mesh, Mesh):
    raise ValueError(f"{fn}: mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}.")
  if axis_name not in mesh.shape:
    raise ValueError(f"{fn}: axis_name={axis_name!r} is not an axis of the mesh "
                     f"{dict(mesh.shape)}.")
  return mesh.shape[axis_name]


def _prepare(query, key, value, lengths, *, fn: str):
  """Validated, batched arrays and ``lengths [B]`` int32 (T where none were given)."""
  p = checks.prepare_qkv(query, key, value, fn=fn)
  B, T, S = p.dims.B, p.dims.T, p.dims.S
  if T != S:
    raise ValueError(f"{fn}: context parallelism splits one sequence of self-attention; "
                     f"query length T={T} must equal key length S={S}.")
  (lengths,) = checks.check_lengths(p, fn=fn, key_value_seq_lengths=lengths).values()
  lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.minimum(lengths, T)
  return p, lengths


def _sharded(local: Any, p: checks.Prepared, lengths: jax.Array, replicated: Any, *,
             mesh: Mesh, axis_name: Any, zigzag: bool, per_token: Any = (),
             segment_ids: Any = None) -> jax.Array:
  """``local(q, k, v, lengths, replicated, per_token, segment_ids)`` with T split over
  ``axis_name``.

  Returns the output. T is padded at its end to a multiple of P (2P in
  zig-zag order: each device's block is reordered to it by :func:`_reorder`,
  and the output back); ``per_token`` (a pytree of ``[B, T, ...]`` arrays)
  is split and padded with the keys, ``replicated`` goes to every device
  whole. ``segment_ids`` (a pytree of ``[B, T]`` ints: None, one array or the
  pair ``(query_ids, kv_ids)``) are split and reordered like the keys but
  padded with their last id, so that they keep not decreasing (the padding is
  hidden by ``lengths`` anyway).
  ``shard_map`` is manual over ``axis_name`` only: other
  mesh axes stay automatic, so a batch sharded over them stays so. On a mesh
  whose axes are Explicit, this runs under ``jax.sharding.auto_axes``, and
  the output keeps the batch's sharding and is split along T over
  ``axis_name`` where P divides T.
  """
  T, P_ = p.dims.T, mesh.shape[axis_name]
  explicit = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                   if t == AxisType.Explicit)

  def reordered(q, k, v, lengths, replicated, per_token, segment_ids):
    q, k, v, per_token, segment_ids = jax.tree.map(
        lambda x: _reorder(x, axis_name, P_, inverse=False), (q, k, v, per_token, segment_ids))
    return _reorder(local(q, k, v, lengths, replicated, per_token, segment_ids), axis_name, P_,
                    inverse=True)

  def run(q, k, v, lengths, replicated, per_token, segment_ids):
    pad = -T % (2 * P_ if zigzag else P_)
    padded = lambda x, mode: jnp.pad(  # noqa: E731
        x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), mode=mode)
    q, k, v, per_token = jax.tree.map(lambda x: padded(x, "constant"), (q, k, v, per_token))
    segment_ids = jax.tree.map(lambda x: padded(x, "edge"), segment_ids)
    seq = P(None, axis_name)
    out = jax.shard_map(reordered if zigzag else local,
                        mesh=jax.sharding.get_abstract_mesh() if explicit else mesh,
                        in_specs=(seq, seq, seq, P(), P(), seq, seq), out_specs=seq,
                        axis_names={axis_name})(q, k, v, lengths, replicated, per_token,
                                                segment_ids)
    return out[:, :T] if pad else out

  args = (p.query, p.key, p.value, lengths, replicated, per_token, segment_ids)
  if not explicit:
    return run(*args)
  spec = getattr(jax.typeof(p.query).sharding, "spec", ())
  batch = spec[0] if len(spec) else None
  out = P(batch, axis_name if T % P_ == 0 and batch != axis_name else None)
  return jax.sharding.auto_axes(run, axes=explicit, out_sharding=NamedSharding(mesh, out))(*args)


def _zigzag_routes(P_: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
  """How contiguous chunks reach zig-zag order: ``(from_slot, to_slot, pairs)``.

  Contiguously device d holds chunks 2d and 2d + 1 (slots 0 and 1); in
  zig-zag order device i holds chunks i and 2P - 1 - i. Chunk j lies in
  slot ``j % 2`` of device ``j // 2``; four ``ppermute`` s of one chunk
  each move every chunk, and every device sends two (its whole share).
  """
  routes: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for i in range(P_):
    for to_slot, chunk in enumerate((i, 2 * P_ - 1 - i)):
      routes.setdefault((chunk % 2, to_slot), []).append((chunk // 2, i))
  return [(a, b, pairs) for (a, b), pairs in sorted(routes.items())]


def _reorder(x: jax.Array, axis_name: Any, P_: int, inverse: bool) -> jax.Array:
  """A device's ``[B, L, ...]`` block from contiguous to zig-zag order (or back)."""
  c = x.shape[1] // 2
  slots = [lax.slice_in_dim(x, 0, c, axis=1), lax.slice_in_dim(x, c, 2 * c, axis=1)]
  i = lax.axis_index(axis_name)
  out: list[Any] = [None, None]
  for from_slot, to_slot, pairs in _zigzag_routes(P_):
    if inverse:
      from_slot, to_slot, pairs = to_slot, from_slot, [(b, a) for a, b in pairs]
    got = lax.ppermute(slots[from_slot], axis_name, pairs)
    receives = jnp.isin(i, jnp.asarray([b for _, b in pairs]))
    out[to_slot] = got if out[to_slot] is None else jnp.where(receives, got, out[to_slot])
  return jnp.concatenate(out, axis=1)


# ----------------------------------------------------------- recurrent variants ---


def _full_softmax() -> list[str]:
  """The registered exact softmax variants (ring attention runs them)."""
  return [name for name in available_attentions() if get_spec(name).full_softmax]


def _shift(x: Any, empty: Any, distance: int, axis_name: Any, P_: int) -> Any:
  """What device ``i - distance`` holds (``empty`` on devices ``i < distance``)."""
  i = lax.axis_index(axis_name)
  got = lax.ppermute(x, axis_name, [(j, j + distance) for j in range(P_ - distance)])
  return jax.tree.map(lambda a, e: jnp.where(i >= distance, a, e), got, empty)


def exclusive_prefix(summary: Any, empty: Any, combine: Any, axis_name: Any, P_: int) -> Any:
  """``s_0 ∘ … ∘ s_{i-1}`` on device i (``empty`` on device 0), for an associative ``∘``.

  One shift, then ``ceil(log2(P - 1))`` Hillis–Steele rounds; every round
  sends one state per device.
  """
  if P_ == 1:
    return empty
  x = _shift(summary, empty, 1, axis_name, P_)  # Device i: s_{i-1}.
  distance = 1
  while distance < P_ - 1:  # Device i: the combination of the last 2·distance summaries.
    x = combine(_shift(x, empty, distance, axis_name, P_), x)
    distance *= 2
  return x


def _segmented(combine: Any) -> Any:
  """``combine`` over ``(starts, summary)`` pairs, ``starts [B]`` bool: a span that starts a
  new segment in row b (at its first token) drops what came before it there.

  A summary already means "reset, then this" where its span holds a boundary
  inside; a boundary at a device's first token is seen by no device alone, so
  it rides beside the summary (the segmented scan's flag). Associative when
  ``combine`` is. Every leaf of a summary is batch-leading (``[B, ...]``).
  """
  def segmented(earlier, later):
    (starts_a, a), (starts_b, b) = earlier, later
    return starts_a | starts_b, _where_rows(starts_b, b, combine(a, b))
  return segmented


def _shaped_as(empty: Any, summary: Any) -> Any:
  """``empty`` with the fields it leaves None filled as zeros (False) shaped as ``summary``'s.

  A packed summary fills fields an empty state leaves None (a kernel state's
  ``reset``, where None means "no segment start", as False does); the scan
  selects between the two, so they must be one pytree.
  """
  return jax.tree.map(lambda e, s: jnp.zeros_like(s) if e is None else e, empty, summary,
                      is_leaf=lambda x: x is None)


def _where_rows(rows: jax.Array, a: Any, b: Any) -> Any:
  """``a`` where ``rows [B]`` is True, else ``b`` (pytrees of ``[B, ...]`` arrays)."""
  return jax.tree.map(lambda x, y: jnp.where(rows.reshape(rows.shape + (1,) * (x.ndim - 1)),
                                             x, y), a, b)


def _per_token(spec: Any, inputs: dict[str, Any], p: checks.Prepared, key_shape: tuple[int, ...],
               *, fn: str) -> dict[str, jax.Array]:
  """``spec``'s per-token inputs, each checked against its declared shape (e.g.
  ``[B, S, K]``; without B for unbatched keys) and batched."""
  checked = spec.check_token_inputs(inputs, key_shape, fn=fn)
  return {name: jnp.asarray(x) if p.batched else jnp.asarray(x)[None]
          for name, x in checked.items()}


def _split_arrays(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """Options that are arrays (projections, feature-map weights) and the static rest."""
  is_array = lambda x: isinstance(x, (jax.Array, np.ndarray))  # noqa: E731
  arrays = {k: v for k, v in options.items() if is_array(v)}
  return arrays, {k: v for k, v in options.items() if k not in arrays}


def _enters_given_mesh(fn):
  """Runs ``fn`` inside ``jax.set_mesh(mesh)`` (its ``mesh=``) when that mesh has Explicit
  axes (as ``jax.make_mesh`` makes) and no mesh is set: given the mesh, a caller need not
  also enter it. Outside any ``jit``; inside one, the caller's mesh context applies."""
  @functools.wraps(fn)
  def wrapped(*args, mesh: Mesh, **kwargs):
    explicit = isinstance(mesh, Mesh) and AxisType.Explicit in tuple(mesh.axis_types)
    if explicit and jax.sharding.get_abstract_mesh().empty and not _tracing(args):
      with jax.set_mesh(mesh):
        return fn(*args, mesh=mesh, **kwargs)
    return fn(*args, mesh=mesh, **kwargs)
  return wrapped


def _tracing(args) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))


@_enters_given_mesh
def context_parallel_attention(
    query: Any, key: Any, value: Any, *, attention: str, mesh: Mesh, axis_name: Any,
    is_causal: bool = True, key_value_seq_lengths: Any = None, segment_ids: Any = None,
    **options: Any,
) -> jax.Array:
  """A recurrent attention over a sequence sharded along its length over ``axis_name``.

  Device i summarises its L keys into the variant's state ``s_i`` (e.g.
  ``Σ_j φ(k_j) v_jᵀ [M, D]`` per key/value head), receives the exclusive
  prefix ``s_0 ∘ … ∘ s_{i-1}`` over the device axis by collectives on
  states alone, and runs the variant's causal pass over its own tokens from
  it. Non-causal: every query reads the state of all keys. Equals
  ``get_attention(attention, **options)(query, key, value, ...)`` on one
  device, up to float rounding.

  Args:
    query: ``[B, T, N, H]`` (or ``[T, N, H]``), sharded or not; the result is
      sharded along T over ``axis_name``.
    key: ``[B, T, K, H]``; K must divide N (GQA / MQA).
    value: ``[B, T, K, D]``.
    attention: a registered recurrent variant (see
      :func:`recurrent_attentions`): linear_elu, linear_relu, linear_learned,
      performer, random_fourier, efficient, heinsen; causal only: retention,
      simple_gla, gla, delta_net, gated_delta_net.
    mesh: the device mesh; ``axis_name`` is one of its axes. On a mesh whose
      axes are Explicit (the default of ``jax.make_mesh``), pass arrays
      sharded on it or call inside ``jax.set_mesh(mesh)``.
    axis_name: the mesh axis that splits the sequence (P devices). T need
      not be a multiple of P: the end is padded and hidden.
    is_causal: query t sees keys ``j <= t`` (default True).
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are hidden.
    segment_ids: packed sequences (causal only): int ids ``[B, T]``, non-decreasing
      along the sequence; token t reads the keys of its own segment only, as the
      variant's own ``segment_ids`` does on one device. They are split along T
      with the keys; a device whose span holds a boundary summarises "start
      afresh, then these keys", and one whose first token starts a segment drops
      the prefix before it. The order is checked on an eager call only.
    **options: the variant's options, as for ``get_attention`` (arrays such
      as a ``projection`` are replicated to every device), and its per-token
      inputs by the names of ``AttentionSpec.token_inputs`` (gates, betas,
      e.g. ``log_decay [B, T, K]``, ``beta [B, T, K]``): split along T with
      the keys, each device summarising with its own.

  Returns:
    ``[B, T, N, D]`` in the input dtype.

  Raises:
    ValueError: for a variant without a recurrent state (use
      :func:`ring_attention` for softmax), a per-token input missing or not
      of its declared shape, ``is_causal=False`` for a causal-only or positional
      variant (``StreamingSpec.positional``) or
      with ``segment_ids``, malformed ``segment_ids`` (not one int array
      ``[B, T]``, or eagerly, decreasing), an unknown or missing option, an
      option context parallelism sets itself (``initial_state``,
      ``return_state``, ``key_value_seq_lengths``, ``is_causal``), a ``mesh``
      that is not a ``jax.sharding.Mesh``, an axis not in the mesh, T != S,
      or bad shapes, dtypes or lengths.

  Examples:
    >>> mesh = jax.make_mesh((jax.device_count(),), ("seq",))
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N, H]
    >>> with jax.set_mesh(mesh):
    ...   out = parallel.context_parallel_attention(x, x, x, attention="linear_elu",
    ...                                             mesh=mesh, axis_name="seq")
    >>> out.shape
    (1, 8, 2, 4)
    >>> single = la.get_attention("linear_elu")(x, x, x, is_causal=True)
    >>> bool(jnp.allclose(out, single, atol=1e-5))
    True

    A gated variant's per-token inputs go by name (here ``log_decay [B, T, K]``):

    >>> g = jnp.full((1, 8, 2), -0.1)
    >>> with jax.set_mesh(mesh):
    ...   out = parallel.context_parallel_attention(x, x, x, attention="simple_gla", mesh=mesh,
    ...                                             axis_name="seq", log_decay=g)
    >>> single = la.get_attention("simple_gla")(x, x, x, is_causal=True, log_decay=g)
    >>> bool(jnp.allclose(out, single, atol=1e-5))
    True

  References:
    Hillis & Steele, "Data Parallel Algorithms", 1986 (the scan over devices).
  """
  fn = "context_parallel_attention"
  recurrent = recurrent_attentions()
  if attention not in recurrent:
    raise ValueError(f"{fn}: attention={attention!r} has no recurrent state to pass between "
                     f"devices; recurrent variants: {recurrent} (exact softmax: ring_attention).")
  spec = get_spec(attention)
  for name in _RESERVED:
    if name in options:
      raise ValueError(f"{fn}: `{name}` is set by context parallelism, not an option.")
  inputs = {x.name: options.pop(x.name) for x in spec.token_inputs if x.name in options}
  spec.build(**options)  # Unknown or missing options fail here.
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  if not is_causal and not spec.supports_noncausal:
    raise ValueError(f"{fn}: attention={attention!r} supports is_causal=True only.")
  if not is_causal and spec.streaming.positional:
    raise ValueError(f"{fn}: attention={attention!r} supports is_causal=True only here: its "
                     "state places queries at its position, so a device's queries cannot read "
                     "the summary of the keys after them.")
  if segment_ids is not None:
    if not is_causal:
      raise ValueError(
          f"{fn}: segment_ids need is_causal=True (attention={attention!r}): a non-causal "
          "recurrent pass reads one state of all keys, which packed sequences do not share.")
    if isinstance(segment_ids, tuple | list):
      raise ValueError(f"{fn}: segment_ids must be one int array [B, T] (self-attention: "
                       f"queries and keys share it); got a {type(segment_ids).__name__}.")
    checks.check_segment_order(segment_ids, fn=fn)
  missing = [x.name for x in spec.token_inputs if x.name not in inputs]
  if missing:
    needs = ", ".join(f"{x.name} {x.layout}" for x in spec.token_inputs)
    raise ValueError(f"{fn}: attention={attention!r} needs the per-token input(s) {needs} "
                     f"as keyword arguments; missing {missing}.")
  _axis_size(mesh, axis_name, fn)
  arrays, static = _split_arrays(options)
  static = tuple(sorted((k, checks.static_option(v, name=k, fn=fn)) for k, v in static.items()))
  return _context_parallel(query, key, value, key_value_seq_lengths, segment_ids, arrays,
                           inputs, attention=attention, mesh=mesh, axis_name=axis_name,
                           is_causal=is_causal, static=static)


@functools.partial(jax.jit, static_argnames=("attention", "mesh", "axis_name", "is_causal",
                                             "static"))
def _context_parallel(query, key, value, lengths, segment_ids, arrays, inputs, *, attention, mesh,
                      axis_name, is_causal, static):
  """:func:`context_parallel_attention` as one compiled program (inlined under jit)."""
  fn = "context_parallel_attention"
  spec = get_spec(attention)
  streaming = spec.streaming
  P_ = mesh.shape[axis_name]
  p, lengths = _prepare(query, key, value, lengths, fn=fn)
  per_token = _per_token(spec, inputs, p, jnp.shape(key), fn=fn)
  segments = checks.check_segment_ids(segment_ids, p, fn=fn)
  ids = None if segments is None else segments[0]  # One array: queries' and keys'.
  L = -(-p.dims.T // P_)

  def local(q, k, v, lengths, arrays, per_token, ids):
    opts = {**dict(static), **arrays}
    packed = {} if ids is None else {"segment_ids": ids}
    i = lax.axis_index(axis_name)
    local_lengths = jnp.clip(lengths - i * L, 0, L)
    summary = streaming.summarize(k, v, key_value_seq_lengths=local_lengths, **per_token,
                                  **packed, **accepted(streaming.summarize, opts))
    empty = streaming.empty_summary(q, k, v, **accepted(streaming.empty_summary, opts))
    if ids is None:
      prefix = exclusive_prefix(summary, empty, streaming.combine, axis_name, P_)
    else:  # Rows whose segment starts at this device's first token drop what came before.
      empty = _shaped_as(empty, summary)
      starts = _shift(ids[:, -1], ids[:, 0], 1, axis_name, P_) != ids[:, 0]  # [B]
      no = jnp.zeros_like(starts)
      _, prefix = exclusive_prefix((starts, summary), (no, empty),
                                   _segmented(streaming.combine), axis_name, P_)
      prefix = _where_rows(starts, empty, prefix)
    if is_causal:
      return spec.function(q, k, v, is_causal=True, key_value_seq_lengths=local_lengths,
                           initial_state=prefix, **packed, **opts, **per_token)
    inclusive = streaming.combine(prefix, summary)
    last = i == P_ - 1  # Broadcast the last device's state: the others add zeros.
    total = lax.psum(jax.tree.map(lambda x: jnp.where(last, x, jnp.zeros_like(x)), inclusive),
                     axis_name)
    total = lax.pcast(total, (axis_name,), to="varying")  # Read with device-varying queries.
    # Every query reads ``total``: a causal pass from it with the local keys
    # hidden (they are in it already).
    return spec.function(q, k, v, is_causal=True, key_value_seq_lengths=jnp.zeros_like(
        local_lengths), initial_state=total, **opts, **per_token)

  out = _sharded(local, p, lengths, arrays, mesh=mesh, axis_name=axis_name, zigzag=False,
                 per_token=per_token, segment_ids=ids)
  return p.restore(out)


# ------------------------------------------------------------------ ring softmax ---


@dataclasses.dataclass(frozen=True)
class _Block:
  """One block a ring step computes: local query rows ``[r0, r1)`` against keys ``[k0, k1)``."""

  rows: tuple[int, int]
  keys: tuple[int, int]
  causal: bool


@dataclasses.dataclass(frozen=True)
class _Ring:
  """Static description of one ring call (a ``custom_vjp`` nondiff argument)."""

  axis_name: Any
  devices: int  # P
  local: int  # L, tokens per device
  zigzag: bool
  is_causal: bool
  scale: float
  block_q: int
  block_k: int

  def key_positions(self, j: jax.Array) -> jax.Array:
    """Global positions ``[L]`` of the keys device j holds."""
    idx = jnp.arange(self.local)
    if not self.zigzag:
      return j * self.local + idx
    c = self.local // 2  # Chunks j and 2P - 1 - j.
    return jnp.where(idx < c, j * c + idx, (2 * self.devices - 1 - j) * c + idx - c)

  def blocks(self, step0: bool) -> tuple[tuple[_Block, ...], tuple[_Block, ...]]:
    """Blocks when device j's keys are earlier than ours (``j < i``) and later.

    At step 0 (``j == i``) both are the causal diagonal (or the full block).
    """
    L, c = self.local, self.local // 2
    if not self.is_causal:
      full = (_Block((0, L), (0, L), False),)
      return full, full
    if step0:
      diag = (_Block((0, L), (0, L), True),)
      return diag, diag
    if not self.zigzag:
      return (_Block((0, L), (0, L), False),), ()
    return (_Block((0, L), (0, c), False),), (_Block((c, L), (0, L), False),)

  def flash_config(self, block: _Block) -> flash.FlashConfig:
    T, S = block.rows[1] - block.rows[0], block.keys[1] - block.keys[0]
    return flash.FlashConfig(T=T, S=S, block_q=min(self.block_q, T), block_k=min(self.block_k, S),
                             is_causal=block.causal, scale=self.scale)


def _rows(x: jax.Array, span: tuple[int, int], axis: int) -> jax.Array:
  return lax.slice_in_dim(x, span[0], span[1], axis=axis)


def _place(x: jax.Array, span: tuple[int, int], size: int, axis: int, fill: float) -> jax.Array:
  """``x`` (covering ``span`` of ``axis``) padded with ``fill`` to ``size``."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (span[0], size - span[1])
  return jnp.pad(x, widths, constant_values=fill)


def _kv_lengths(ring: _Ring, block: _Block, j, lengths) -> jax.Array:
  """Visible keys of ``block`` (a prefix: positions grow along the block)."""
  pos = _rows(ring.key_positions(j), block.keys, 0)
  return jnp.sum(pos[None, :] < lengths[:, None], axis=-1).astype(jnp.int32)


def _block_ids(block: _Block, q_seg, kv_seg):
  """The segment ids ``([B, rows], [B, keys])`` of ``block`` (or ``(None, None)``)."""
  if q_seg is None:
    return None, None
  return _rows(q_seg, block.rows, 1), _rows(kv_seg, block.keys, 1)


def _unless_apart(block: _Block, q_seg, kv_seg, fn, x):
  """``fn(x)``, or ``x`` itself where ``block``'s queries and keys share no segment.

  The ids do not decrease along a block (zig-zag order keeps a device's two chunks
  in order), so the block has no visible pair when, in every row, the ranges
  ``[first, last]`` of its query and key ids are apart: a test on four ids that
  skips the block's flash call (a ring of many short sequences skips most steps).
  """
  if q_seg is None:
    return fn(x)
  q_ids, kv_ids = _block_ids(block, q_seg, kv_seg)
  meet = jnp.any((q_ids[:, 0] <= kv_ids[:, -1]) & (kv_ids[:, 0] <= q_ids[:, -1]))
  return lax.cond(meet, fn, lambda x: x, x)


def _attend(ring: _Ring, blocks: tuple[_Block, ...], j, q, k, v, lengths, q_seg,
            kv_seg) -> SoftmaxCarry:
  """The online-softmax carry ``[B, K, G, L]`` of the local queries against device j's keys
  (``q_seg``, ``kv_seg`` ``[B, L]``: their segment ids, or None)."""
  B, K, G, L, _ = q.shape
  carry = init_softmax_carry((B, K, G, L), v.shape[-1], q.dtype, like=q)  # Device-varying.
  for block in blocks:
    def attend(carry, block=block):
      o, s = flash.forward(ring.flash_config(block), _rows(q, block.rows, 3),
                           _rows(k, block.keys, 2), _rows(v, block.keys, 2), None,
                           _kv_lengths(ring, block, j, lengths),
                           *_block_ids(block, q_seg, kv_seg))
      return merge(carry, from_output(_place(o, block.rows, L, 3, 0),
                                      _place(s, block.rows, L, 3, -jnp.inf)))
    carry = _unless_apart(block, q_seg, kv_seg, attend, carry)
  return carry


class _RingResiduals(NamedTuple):
  """What the ring's forward pass saves for its backward (one device's share)."""

  q: jax.Array  # [B, K, G, L, H]
  k: jax.Array  # [B, K, L, H]: in the backward, the keys of the device a step visits.
  v: jax.Array  # [B, K, L, D]
  out: jax.Array  # [B, K, G, L, D] in the accumulation dtype.
  lse: jax.Array  # [B, K, G, L]
  lengths: jax.Array  # [B] int32: visible keys of the whole sequence.
  q_seg: jax.Array | None  # [B, L] int32 segment ids of the queries, or None.
  kv_seg: jax.Array | None  # [B, L] int32, of the keys ``k`` (travelling with them).


def _gradients(ring: _Ring, blocks: tuple[_Block, ...], j, res: _RingResiduals, d_out):
  """This step's ``(dq, dk, dv)`` against device j's keys ``res.k``, ``res.v``
  (FlashAttention-2 backward with the final out and lse; ``d_out [B, K, G, L, D]``)."""
  q, k, v = res.q, res.k, res.v
  L = q.shape[3]
  grads = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
  for block in blocks:
    def add(grads, block=block):
      dq, dk, dv = grads
      r = block.rows
      q_ids, kv_ids = _block_ids(block, res.q_seg, res.kv_seg)
      block_res = flash.Residuals(
          q=_rows(q, r, 3), k=_rows(k, block.keys, 2), v=_rows(v, block.keys, 2),
          out=_rows(res.out, r, 3), lse=_rows(res.lse, r, 3), q_len=None,
          kv_len=_kv_lengths(ring, block, j, res.lengths), q_seg=q_ids, kv_seg=kv_ids)
      g_q, g_k, g_v = flash.backward(ring.flash_config(block), block_res, _rows(d_out, r, 3))
      return (dq + _place(g_q, r, L, 3, 0), dk + _place(g_k, block.keys, L, 2, 0),
              dv + _place(g_v, block.keys, L, 2, 0))
    grads = _unless_apart(block, res.q_seg, res.kv_seg, add, grads)
  return grads


def _step(ring: _Ring, step0: bool, fn, *args):
  """Runs ``fn(blocks, j, *args)`` for device j = i - s's keys, branching on j < i."""
  i = lax.axis_index(ring.axis_name)
  earlier, later = ring.blocks(step0)
  if earlier == later:
    return lambda j: fn(ring, earlier, j, *args)
  return lambda j: lax.cond(j < i, lambda: fn(ring, earlier, j, *args),
                           lambda: fn(ring, later, j, *args))


def _rotate(x: Any, ring: _Ring) -> Any:
  """Every device's ``x`` to the next device on the ring."""
  P_ = ring.devices
  return lax.ppermute(x, ring.axis_name, [(j, (j + 1) % P_) for j in range(P_)])


def _ring_forward(ring: _Ring, q, k, v, lengths, q_seg, kv_seg):
  """``(out [B, K, G, L, D], lse [B, K, G, L])`` of the local queries against every key."""
  acc = checks.accumulation_dtype(q.dtype)
  i = lax.axis_index(ring.axis_name)
  qa = q.astype(acc)
  blocks = ring.blocks(step0=True)[0]
  carry = _attend(ring, blocks, i, qa, k.astype(acc), v.astype(acc), lengths, q_seg, kv_seg)

  def step(carry, s):
    carry, k, v, kv_seg = carry
    k, v, kv_seg = _rotate((k, v, kv_seg), ring)  # The ids travel with their keys.
    j = (i - s) % ring.devices
    other = _step(ring, False, _attend, qa, k.astype(acc), v.astype(acc), lengths, q_seg,
                  kv_seg)(j)
    return (merge(carry, other), k, v, kv_seg), None

  if ring.devices > 1:
    (carry, *_), _ = lax.scan(step, (carry, k, v, kv_seg), jnp.arange(1, ring.devices))
  return online_softmax_finish(carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, lengths, q_seg, kv_seg):
  out, _ = _ring_forward(ring, q, k, v, lengths, q_seg, kv_seg)
  return out.astype(q.dtype)


def _ring_fwd(ring: _Ring, q, k, v, lengths, q_seg, kv_seg):
  out, lse = _ring_forward(ring, q, k, v, lengths, q_seg, kv_seg)
  return out.astype(q.dtype), _RingResiduals(q, k, v, out, lse, lengths, q_seg, kv_seg)


def _ring_bwd(ring: _Ring, residuals: _RingResiduals, d_out):
  q, k, v = residuals.q, residuals.k, residuals.v
  acc = residuals.out.dtype
  i = lax.axis_index(ring.axis_name)
  do = d_out.astype(acc)
  # In the accumulation dtype; each step puts in the keys (and their ids) it visits.
  res = residuals._replace(q=q.astype(acc))
  visiting = lambda k, v, kv_seg: res._replace(  # noqa: E731
      k=k.astype(acc), v=v.astype(acc), kv_seg=kv_seg)
  blocks = ring.blocks(step0=True)[0]
  dq, dk, dv = _gradients(ring, blocks, i, visiting(k, v, res.kv_seg), do)

  def step(carry, s):
    dq, k, v, kv_seg, dk, dv = carry
    # The gradients (and the ids) travel with their keys.
    k, v, kv_seg, dk, dv = _rotate((k, v, kv_seg, dk, dv), ring)
    j = (i - s) % ring.devices
    g_q, g_k, g_v = _step(ring, False, _gradients, visiting(k, v, kv_seg), do)(j)
    return (dq + g_q, k, v, kv_seg, dk + g_k, dv + g_v), None

  if ring.devices > 1:
    (dq, _, _, _, dk, dv), _ = lax.scan(step, (dq, k, v, res.kv_seg, dk, dv),
                                        jnp.arange(1, ring.devices))
    dk, dv = _rotate((dk, dv), ring)  # Home: device j + P - 1 holds j's, one more step.
  # Lengths and segment ids are integers: no gradient.
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


@_enters_given_mesh
@checks.compiled("mesh", "axis_name", "is_causal", "scale", "block_q", "block_k",
                 "load_balance", concrete_checks={"segment_ids": checks.check_segment_order})
def ring_attention(
    query: Any, key: Any, value: Any, *, mesh: Mesh, axis_name: Any, is_causal: bool = False,
    key_value_seq_lengths: Any = None, scale: float | None = None,
    block_q: int = flash.DEFAULT_BLOCK_Q, block_k: int = flash.DEFAULT_BLOCK_K,
    load_balance: bool = True, segment_ids: Any = None,
) -> jax.Array:
  """Exact softmax attention over a sequence sharded along its length: ring attention.

  ``softmax(Q Kᵀ · scale, masked) V`` where device i holds L queries and
  keys; the key/value blocks pass around the ring of ``axis_name`` in P - 1
  ``ppermute`` steps, each block attended blockwise (flash attention) and
  merged by log-sum-exp. The backward pass (``custom_vjp``) runs the ring
  again and keeps memory per device proportional to L. Causal attention
  skips fully masked blocks and, with ``load_balance``, uses the zig-zag
  order (device i holds chunks i and 2P - 1 - i of 2P), so every device does
  the same work at every step; the inputs are reordered to it and the output
  back, inside this function.

  Args:
    query: ``[B, T, N, H]`` (or ``[T, N, H]``), sharded or not.
    key: ``[B, T, K, H]``; K must divide N (GQA / MQA).
    value: ``[B, T, K, D]``.
    mesh: the device mesh; ``axis_name`` is one of its axes (P devices). On
      a mesh whose axes are Explicit (the default of ``jax.make_mesh``), pass
      arrays sharded on it or call inside ``jax.set_mesh(mesh)``.
    axis_name: the mesh axis that splits the sequence. T need not be a
      multiple of P (or 2P): the end is padded and hidden.
    is_causal: query t sees keys ``j <= t``.
    key_value_seq_lengths: optional ``[B]`` ints; keys at or past it are hidden.
    scale: logit scale, default ``1 / sqrt(H)``.
    block_q, block_k: flash tile sizes within a block (static).
    load_balance: for causal attention, use the zig-zag order (default);
      False keeps contiguous blocks, so device i computes i + 1 blocks.
    segment_ids: packed sequences, as in :func:`softmax_attention`: int ids
      ``[B, T]``, non-decreasing along the sequence; query t sees key j only if
      their ids are equal (on top of ``is_causal`` and the lengths). The pair
      ``(query_segment_ids, kv_segment_ids)``, both ``[B, T]``, is taken too. The
      key ids travel around the ring with their keys; a block whose queries and
      keys share no segment is skipped, and within a block flash skips the tiles
      of other segments. Shapes and dtype are checked at trace time, the order
      only on an eager call.

  Returns:
    ``[B, T, N, D]`` in the input dtype; rows with no visible key are zero.

  Raises:
    ValueError: for a ``mesh`` that is not a ``jax.sharding.Mesh``, an axis
      not in the mesh, T != S, block sizes that are not positive ints, bad
      shapes, dtypes or lengths, or malformed ``segment_ids`` (not integers, not
      ``[B, T]``, or eagerly, decreasing).

  Examples:
    >>> mesh = jax.make_mesh((jax.device_count(),), ("seq",))
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N, H]
    >>> with jax.set_mesh(mesh):
    ...   out = parallel.ring_attention(x, x, x, mesh=mesh, axis_name="seq", is_causal=True)
    >>> out.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(out, la.softmax_attention(x, x, x, is_causal=True), atol=1e-5))
    True

    Packed sequences (here of 3 and 5 tokens) attend only within their own:

    >>> ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    >>> with jax.set_mesh(mesh):
    ...   out = parallel.ring_attention(x, x, x, mesh=mesh, axis_name="seq", is_causal=True,
    ...                                 segment_ids=ids)
    >>> want = la.softmax_attention(x, x, x, is_causal=True, segment_ids=ids)
    >>> bool(jnp.allclose(out, want, atol=1e-5))
    True

  References:
    Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for
    Near-Infinite Context", 2023; Brandon et al., "Striped Attention: Faster
    Ring Attention for Causal Transformers", 2023 (causal load balancing; the
    zig-zag order used here is a variant of it).
  """
  fn = "ring_attention"
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  load_balance = checks.check_static_bool(load_balance, name="load_balance", fn=fn)
  P_ = _axis_size(mesh, axis_name, fn)
  zigzag = is_causal and load_balance and P_ > 1
  p, lengths = _prepare(query, key, value, key_value_seq_lengths, fn=fn)
  segments = checks.check_segment_ids(segment_ids, p, fn=fn)
  multiple = 2 * P_ if zigzag else P_
  ring = _Ring(axis_name=axis_name, devices=P_, local=-(-p.dims.T // multiple) * multiple // P_,
               zigzag=zigzag, is_causal=is_causal, scale=checks.resolve_scale(scale, p.dims.H),
               block_q=checks.check_positive_int(block_q, name="block_q", fn=fn),
               block_k=checks.check_positive_int(block_k, name="block_k", fn=fn))
  N, K = p.dims.N, p.dims.K

  def local(q, k, v, lengths, _, __, segments):
    B, L, _, H = q.shape
    D = v.shape[-1]
    qi = q.reshape(B, L, K, N // K, H).transpose(0, 2, 3, 1, 4)  # [B, K, G, L, H]
    q_seg, kv_seg = (None, None) if segments is None else segments
    out = _ring(ring, qi, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), lengths, q_seg,
                kv_seg)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, L, N, D)

  out = _sharded(local, p, lengths, (), mesh=mesh, axis_name=axis_name, zigzag=zigzag,
                 segment_ids=segments)
  return p.restore(out)


# ------------------------------------------------------------ for layers ---

_RING_OPTIONS = ("scale", "block_q", "block_k", "load_balance")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """Where a layer splits its sequence: the ``axis_name`` axis of ``mesh``.

  :meth:`attend` runs a registered variant with context parallelism on
  query ``[B, T, N, H]``, key ``[B, T, K, H]`` and value ``[B, T, K, D]``
  (one sequence, T = S), returning ``[B, T, N, D]``:
  :func:`ring_attention` for ``"softmax"`` and ``"flash"``,
  :func:`context_parallel_attention` for the recurrent variants (a gated
  one's per-token inputs, ``[B, T, K(, H)]``, by name among the options).
  Give it to ``linattn_jax.nn.MultiHeadAttention(context_parallel=...)``.

  Attributes:
    mesh: a ``jax.sharding.Mesh``.
    axis_name: the mesh axis that splits the sequence.

  Raises:
    ValueError: at construction, for a ``mesh`` that is not a
      ``jax.sharding.Mesh`` or an ``axis_name`` that is not one of its axes;
      in :meth:`check` and :meth:`attend`, for a variant without a
      context-parallel form or ring options other than ``scale``,
      ``block_q``, ``block_k`` and ``load_balance``.

  Examples:
    >>> mesh = jax.make_mesh((jax.device_count(),), ("seq",))
    >>> cp = parallel.ContextParallel(mesh, "seq")
    >>> layer = nn.MultiHeadAttention(2, 16, attention="linear_elu", context_parallel=cp,
    ...                               rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (1, 12, 16))  # [B, T, in]
    >>> with jax.set_mesh(mesh):
    ...   out = layer(x, is_causal=True)
    >>> single = nn.MultiHeadAttention(2, 16, attention="linear_elu", rngs=nnx.Rngs(0))
    >>> out.shape, bool(jnp.allclose(out, single(x, is_causal=True), atol=1e-5))
    ((1, 12, 16), True)
  """

  mesh: Mesh
  axis_name: Any

  def __post_init__(self):
    _axis_size(self.mesh, self.axis_name, "ContextParallel")

  @staticmethod
  def check(attention: str, options: dict[str, Any]) -> None:
    """Raises ValueError if ``attention`` with ``options`` has no context-parallel form."""
    if get_spec(attention).full_softmax:
      extra = sorted(set(options) - set(_RING_OPTIONS))
      if extra:
        raise ValueError(f"ContextParallel: ring attention (for {attention!r}) takes the "
                         f"options {list(_RING_OPTIONS)}; got {extra}.")
    elif attention not in recurrent_attentions():
      raise ValueError(
          f"ContextParallel: attention={attention!r} has no context-parallel form; it runs "
          f"{_full_softmax()} (ring attention) and {recurrent_attentions()}.")

  def attend(self, attention: str, query, key, value, *, is_causal: bool,
             key_value_seq_lengths: Any = None, segment_ids: Any = None,
             **options: Any) -> jax.Array:
    """``attention`` over ``query``/``key``/``value`` split along T over the axis
    (``segment_ids [B, T]``: packed sequences, as the function it runs takes them)."""
    self.check(attention, options)
    if get_spec(attention).full_softmax:
      return ring_attention(query, key, value, mesh=self.mesh, axis_name=self.axis_name,
                            is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                            segment_ids=segment_ids, **options)
    return context_parallel_attention(
        query, key, value, attention=attention, mesh=self.mesh, axis_name=self.axis_name,
        is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
        segment_ids=segment_ids, **options)
