"""Input validation shared by every attention variant.

Everything here runs in Python at trace time, on static shapes, and raises
``ValueError`` naming the argument and the shapes involved. No ``assert`` is
used for user input.

Letters: B batch, T query length, S key/value length, N query heads,
K key/value heads (G = N // K), H query/key head dim, D value head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


class Dims(NamedTuple):
  """Static sizes of one attention call (batched layout)."""

  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  D: int

  @property
  def G(self) -> int:
    """Query heads per key/value head."""
    return self.N // self.K


class Prepared(NamedTuple):
  """Validated, batched ``[B, T, N, H]`` / ``[B, S, K, H]`` / ``[B, S, K, D]`` arrays."""

  query: jax.Array
  key: jax.Array
  value: jax.Array
  dims: Dims
  batched: bool  # False when the caller passed rank-3 (unbatched) arrays.

  def restore(self, out: jax.Array) -> jax.Array:
    """Drops the batch axis added for unbatched inputs."""
    return out if self.batched else out[0]


def prepare_qkv(query: Any, key: Any, value: Any, *, fn: str) -> Prepared:
  """Checks ranks, dtypes and head counts; adds a batch axis to rank-3 inputs.

  Args:
    query: ``[B, T, N, H]`` or ``[T, N, H]``.
    key: ``[B, S, K, H]`` or ``[S, K, H]``.
    value: ``[B, S, K, D]`` or ``[S, K, D]``.
    fn: name of the public function, used in error messages.

  Returns:
    A :class:`Prepared` with rank-4 arrays and their :class:`Dims`.

  Raises:
    ValueError: on wrong ranks, mixed or unsupported dtypes, a head count N
      that K does not divide, or mismatched B, S or H.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  shapes = f"query {query.shape}, key {key.shape}, value {value.shape}"
  ranks = {query.ndim, key.ndim, value.ndim}
  if len(ranks) != 1 or ranks.pop() not in (3, 4):
    raise ValueError(
        f"{fn}: query, key and value must all be rank 4 [B, T|S, heads, dim] "
        f"or all rank 3 [T|S, heads, dim]; got {shapes}."
    )
  dtypes = {query.dtype, key.dtype, value.dtype}
  if len(dtypes) != 1:
    raise ValueError(
        f"{fn}: query, key and value must share one dtype; got query "
        f"{query.dtype}, key {key.dtype}, value {value.dtype}."
    )
  dtype = query.dtype
  if dtype not in SUPPORTED_DTYPES:
    raise ValueError(
        f"{fn}: dtype {dtype} is not supported; use float32, bfloat16, "
        "float16 (or float64 for checks)."
    )
  batched = query.ndim == 4
  if not batched:
    query, key, value = query[None], key[None], value[None]
  B, T, N, H = query.shape
  Bk, S, K, Hk = key.shape
  Bv, Sv, Kv, D = value.shape
  if not B == Bk == Bv:
    raise ValueError(f"{fn}: batch sizes differ: {shapes}.")
  if S != Sv:
    raise ValueError(
        f"{fn}: key and value lengths differ ({S} vs {Sv}): {shapes}."
    )
  if K != Kv:
    raise ValueError(
        f"{fn}: key and value head counts differ ({K} vs {Kv}): {shapes}."
    )
  if H != Hk:
    raise ValueError(
        f"{fn}: query and key head dims differ ({H} vs {Hk}): {shapes}."
    )
  if K == 0 or N % K != 0:
    raise ValueError(
        f"{fn}: the number of query heads N={N} must be a multiple of the "
        f"number of key/value heads K={K}: {shapes}."
    )
  if min(T, S, H, D) == 0:
    raise ValueError(f"{fn}: zero-sized axis in {shapes}.")
  return Prepared(query, key, value, Dims(B, T, S, N, K, H, D), batched)


def check_lengths(
    prepared: Prepared, *, fn: str, **lengths: Any
) -> dict[str, jax.Array | None]:
  """Validates ``[B]`` integer length arrays; returns them as int32 ``[B]``.

  Keyword names are the argument names (``query_seq_lengths=...``). For
  unbatched calls each length is a scalar (shape ``()``, or ``(1,)`` as jax.nn takes it).
  A length above the padded length means "all valid"; None means no padding.
  """
  want = (prepared.dims.B,) if prepared.batched else ()
  out = {}
  for name, x in lengths.items():
    if x is None:
      out[name] = None
      continue
    x = jnp.asarray(x)
    if x.shape != want and not (not prepared.batched and x.shape == (1,)):  # jax.nn's [B=1].
      raise ValueError(
          f"{fn}: {name} must have shape {want} (one length per batch entry); "
          f"got {x.shape}."
      )
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{fn}: {name} must be integers; got {x.dtype}.")
    out[name] = jnp.reshape(x, (prepared.dims.B,)).astype(jnp.int32)
  return out


def check_segment_ids(
    segment_ids: Any, prepared: Prepared, *, fn: str, name: str = "segment_ids"
) -> tuple[jax.Array, jax.Array] | None:
  """Validates packed-sequence ids; returns batched int32 ``(query_ids [B, T], kv_ids [B, S])``.

  ``segment_ids`` is None (nothing packed), one int array ``[B, T]`` that serves
  queries and keys (self-attention: only when T == S), or the pair
  ``(query_segment_ids [B, T], kv_segment_ids [B, S])`` as a tuple (required when
  T != S; with T == S it lets queries and keys carry different ids). Unbatched calls
  drop B (``[T]``; ``[1, T]`` is taken too, as for the lengths). Position t attends
  to key j only where ``query_ids[b, t] == kv_ids[b, j]``.

  What is checked when: shapes and the integer dtype at trace time, always; that the
  ids do not decrease along their axis only for concrete arrays (an eager call; under
  ``jax.jit`` the values are tracers and cannot be read, so decreasing ids there go
  unnoticed: the dense paths still mask by equality, blockwise paths that skip key
  blocks by the segments' ranges may then drop keys).

  Raises:
    ValueError: naming ``name`` and the shapes, for a float (or other non-integer)
      array, a wrong shape, a single array where T != S, a tuple that is not a pair,
      and concrete ids that decrease.
  """
  if segment_ids is None:
    return None
  B, T, S = prepared.dims.B, prepared.dims.T, prepared.dims.S
  lead = "[B, " if prepared.batched else "["
  pair = isinstance(segment_ids, tuple | list)
  if pair and len(segment_ids) != 2:
    raise ValueError(
        f"{fn}: {name} must be one array or a pair (query_segment_ids, kv_segment_ids); "
        f"got a {type(segment_ids).__name__} of {len(segment_ids)} items."
    )
  if not pair and T != S:
    shape = getattr(segment_ids, "shape", None)
    raise ValueError(
        f"{fn}: query length T={T} differs from key length S={S}, so {name} must be the "
        f"pair (query_segment_ids {lead}T], kv_segment_ids {lead}S]) = ({lead}{T}], "
        f"{lead}{S}]) as a tuple; got one array of shape {shape}."
    )
  items = (("query_segment_ids", segment_ids[0], T), ("kv_segment_ids", segment_ids[1], S)
           ) if pair else ((name, segment_ids, T),)
  out = []
  for what, x, length in items:
    x = jnp.asarray(x)
    label = f"{name} ({what})" if pair else name
    want = (B, length) if prepared.batched else (length,)
    if x.shape != want and not (not prepared.batched and x.shape == (1, length)):
      raise ValueError(
          f"{fn}: {label} must have shape {lead}{'T' if length == T else 'S'}] = "
          f"{want}; got {x.shape}."
      )
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{fn}: {label} must be integers; got {x.dtype} of shape {x.shape}.")
    out.append(jnp.reshape(x, (B, length)).astype(jnp.int32))
  check_segment_order(segment_ids, name=name, fn=fn)
  return (out[0], out[-1])


def check_segment_order(segment_ids: Any, *, name: str = "segment_ids", fn: str) -> None:
  """Raises ``ValueError`` if concrete integer ``segment_ids`` (one array or a pair)
  decrease along their last axis; traced arrays and other malformed input pass (the
  trace-time checks of :func:`check_segment_ids` judge those)."""
  if segment_ids is None:
    return
  arrays = segment_ids if isinstance(segment_ids, tuple | list) else (segment_ids,)
  for x in arrays:
    if isinstance(x, jax.core.Tracer):
      continue
    try:
      x = np.asarray(x)
    except Exception:  # noqa: BLE001 (a non-array is judged at trace time).
      continue
    if x.ndim == 0 or not np.issubdtype(x.dtype, np.integer):
      continue
    steps = np.diff(x.astype(np.int64), axis=-1)
    if np.any(steps < 0):
      where = tuple(int(i) for i in np.argwhere(steps < 0)[0])
      raise ValueError(
          f"{fn}: {name} must not decrease along the sequence (packing gives "
          f"non-decreasing ids); the array of shape {x.shape} decreases after index "
          f"{where}."
      )


def check_broadcast(
    x: Any, *, name: str, target: Sequence[int], fn: str, dtype_kind: str
) -> jax.Array | None:
  """Checks that ``x`` broadcasts to ``target`` and has the right dtype kind.

  Returns ``x`` reshaped to the rank of ``target`` (leading 1s added).
  ``dtype_kind`` is ``"bool"`` (masks) or ``"float"`` (biases).
  """
  if x is None:
    return None
  x = jnp.asarray(x)
  if dtype_kind == "bool" and x.dtype != jnp.bool_:
    raise ValueError(
        f"{fn}: {name} must be boolean (True = attend); got {x.dtype}. Pass "
        "additive masks as `bias`."
    )
  if dtype_kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{fn}: {name} must be floating point; got {x.dtype}.")
  target = tuple(target)
  try:
    ok = x.ndim <= len(target) and np.broadcast_shapes(x.shape, target) == target
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
        f"{fn}: {name} of shape {x.shape} does not broadcast to "
        f"[B, N, T, S] = {target}."
    )
  return jnp.reshape(x, (1,) * (len(target) - x.ndim) + x.shape)


def accumulation_dtype(dtype: Any) -> jnp.dtype:
  """float32 for float32/bfloat16/float16 inputs; float64 for float64 inputs.

  Spelled out rather than ``jnp.promote_types(dtype, jnp.float32)``, which raises
  under ``jax_numpy_dtype_promotion="strict"``.
  """
  return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def resolve_scale(scale: float | None, head_dim: int) -> float:
  """The logit scale: ``scale`` if given, else ``1 / sqrt(H)``."""
  return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_scale(scale: Any, *, fn: str) -> float | None:
  """A static logit scale: None (the variant's default) or a finite real, as a Python float.

  Like ``jax.nn.dot_product_attention``'s, it is part of the program, not an array: a
  traced value raises (mark it static or bind it with ``functools.partial``).
  """
  if scale is None:
    return None
  _reject_traced(scale, name="scale", fn=fn, what="a static Python float")
  if isinstance(scale, bool) or np.ndim(scale) != 0:
    raise ValueError(f"{fn}: scale must be a real number or None; got {scale!r}.")
  try:
    value = float(scale)
  except (TypeError, ValueError):
    raise ValueError(f"{fn}: scale must be a real number or None; got {scale!r}.") from None
  if not math.isfinite(value):
    raise ValueError(f"{fn}: scale must be finite; got {scale!r}.")
  return value


def _reject_traced(value: Any, *, name: str, fn: str, what: str = "static") -> None:
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
        f"{fn}: {name} must be {what}, but it is traced; under jax.jit mark it static "
        f"(static_argnames=('{name}',)) or bind it with functools.partial."
    )


def check_static_bool(value: Any, *, name: str, fn: str) -> bool:
  """A static flag (``is_causal``): a Python or numpy bool, never a traced value."""
  _reject_traced(value, name=name, fn=fn, what="a static Python bool")
  return bool(value)


def compiled(
    *static_argnames: str,
    concrete_checks: dict[str, Callable[..., None]] | None = None,
    name: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Runs a public function as one compiled program, eager calls included.

  Arrays are traced arguments and the named options are static: a list
  becomes a tuple (so ``window_size=[4, 1]`` hashes), and a traced value
  raises ``ValueError`` saying to mark it static. Under an outer
  ``jax.jit`` the program is inlined; eagerly, each set of static options
  and shapes compiles once instead of dispatching op by op.

  ``concrete_checks`` maps a keyword to ``check(value, name=, fn=)``, run on the
  value before tracing: the place for checks of array *values* (``segment_ids``
  that decrease), which can only be made while the array is concrete. ``name``: the
  function its errors name (default the decorated function's own name).
  """
  concrete_checks = dict(concrete_checks or {})

  def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
    jitted = jax.jit(fn, static_argnames=static_argnames)
    fn_name = name or fn.__name__

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      for name in static_argnames:
        if name in kwargs:
          kwargs[name] = static_option(kwargs[name], name=name, fn=fn_name)
      for name, check in concrete_checks.items():
        if kwargs.get(name) is not None:
          check(kwargs[name], name=name, fn=fn_name)
      return jitted(*args, **kwargs)

    return wrapper

  return decorate


def static_option(value: Any, *, name: str, fn: str) -> Any:
  if name == "is_causal":
    return check_static_bool(value, name=name, fn=fn)
  _reject_traced(value, name=name, fn=fn)
  if isinstance(value, list | tuple):
    return tuple(static_option(x, name=name, fn=fn) for x in value)
  if isinstance(value, np.ndarray | jax.Array):
    return StaticArray.of(value)
  return value


@dataclasses.dataclass(frozen=True, eq=False)
class StaticArray:
  """A concrete array given as a static option (a block layout, a PRNG key).

  Hashed and compared by value, so equal patterns share one compiled
  program; ``np.asarray`` gives the array back. A typed PRNG key is held as
  its ``jax.random.key_data``.
  """

  array: np.ndarray

  @classmethod
  def of(cls, value: np.ndarray | jax.Array) -> StaticArray:
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
      with jax.ensure_compile_time_eval():  # A concrete key, also inside a trace.
        value = jax.random.key_data(value)
    array = np.array(value)  # A private copy, so later edits of `value` cannot alias.
    array.flags.writeable = False
    return cls(array)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.array.shape

  @property
  def dtype(self) -> np.dtype:
    return self.array.dtype

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    return self.array if dtype is None else self.array.astype(dtype)

  def __hash__(self) -> int:
    return hash((self.array.shape, self.array.dtype.str, self.array.tobytes()))

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, StaticArray) and self.array.dtype == other.array.dtype
            and np.array_equal(self.array, other.array))


def prng_key(rng: Any) -> Any:
  """A PRNG key from ``rng``: an int seed (None means 0) or a key, returned as is."""
  if rng is None or (isinstance(rng, int | np.integer) and not isinstance(rng, bool)):
    return jax.random.key(0 if rng is None else int(rng))
  return rng


def check_positive_int(value: Any, *, name: str, fn: str) -> int:
  """Checks a static positive integer option (block or chunk sizes)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{fn}: {name} must be a positive int; got {value!r}.")
  return int(value)


def positive_sizes(*, fn: str, **sizes: Any) -> tuple[int, ...]:
  """``check_positive_int`` on each named size, in order: a state's ``batch``, heads, dims."""
  return tuple(check_positive_int(value, name=name, fn=fn) for name, value in sizes.items())


def check_choice(value: Any, *, name: str, choices: Sequence[Any], fn: str) -> Any:
  """Checks that a static option is one of ``choices``."""
  if value not in choices:
    raise ValueError(
        f"{fn}: unknown {name}={value!r}; expected one of {list(choices)}."
    )
  return value


def check_implementation(implementation: str | None, *, choices: Sequence[str],
                         is_causal: bool, noncausal_only: Sequence[str] = (),
                         fn: str) -> str | None:
  """Checks ``implementation`` (None: the caller's default) against ``choices``
  and the causal mode: a ``noncausal_only`` form with ``is_causal=True`` raises."""
  check_choice(implementation, name="implementation", choices=(None, *choices), fn=fn)
  if is_causal and implementation in noncausal_only:
    causal = [c for c in choices if c not in noncausal_only and c != "reference"]
    raise ValueError(
        f"{fn}: implementation={implementation!r} supports only is_causal=False; use one of "
        f"{causal} for is_causal=True."
    )
  return implementation


def reject_unsupported(implementation: str, *, fn: str, **options: Any) -> None:
  """Raises for every option that is set but the implementation cannot honour."""
  for name, value in options.items():
    if value is not None and value is not False:
      raise ValueError(
          f"{fn}: implementation={implementation!r} does not support `{name}`; "
          "choose another implementation or drop the option."
      )
