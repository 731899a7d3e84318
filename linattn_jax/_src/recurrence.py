"""The one entry pipeline and the one chunk driver of every recurrent variant.

Linear attention (any feature map), Performer, Shen's efficient attention,
Heinsen's attention (and its log-value form), the gated recurrences and the
delta rule are one computation with different maths: keys and values fold
into a fixed-size state, queries read it. Each family says what differs in
its :class:`Family` (how the inputs become a :class:`Chunk`, its carry and
public state, its chunk bodies); everything around that lives here once:

- :func:`recurrent_attention`, the entry every public function calls: the
  static options (``is_causal``, ``implementation``, ``chunk_size``, ``eps``,
  ``scale``) are checked, then one jitted program checks the arrays, the
  per-token inputs and the state, lays the arrays out, runs the family and
  restores the public layout;
- :func:`run_chunks`, the chunk driver: it aligns T and S, pads, cuts the
  inputs into chunks of C positions and scans a ``jax.checkpoint``-ed body
  over them, so the backward pass keeps one carry per chunk; a family's
  ``prepare`` (its feature map) runs inside that body, on one chunk at a time;
- :func:`scan_tokens`, the token recurrence every ``"scan"`` form runs;
- :func:`one_token_step` and :func:`summarize_keys`, the decoding step and the
  summary of a span, both from the public function.

Causal attention is bottom-right aligned (query t sees keys ``j <= t + S - T``;
see ``masks.causal``) for every family.

Packed sequences (``segment_ids``, causal, T == S) reach the families as
``Chunk.reset``, True where a segment starts: inside a chunk a boundary masks the
pairs across it and cuts the carried state off from the positions after it, and
a span's summary holding one means "drop the state before, then this". The
kernel families read ``reset`` in their bodies; the gated and delta-rule ones
see it as a log-decay of ``RESET_LOG_DECAY`` there. One driver serves both.

Internal layout: queries ``[B, K, G, T, ·]`` (grouped query heads share their
key/value head's state), keys and per-token inputs ``[B, K, S, ·]``, values
``[B, K, S, D]``.

References:
  Katharopoulos et al., "Transformers are RNNs", 2020 (the recurrent form).
  Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
  Training", 2024 (chunkwise-parallel form).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax._src import checks
from linattn_jax._src.blocks import merge_blocks, pad_axis, split_blocks
from linattn_jax._src.masks import length_predicate
from linattn_jax._src.registry import (
    AttentionSpec,
    ParamSpec,
    StreamingSpec,
    TokenInput,
    register_attention,
)

# The chunked forms whose default C differs: kernel reads (and the per-head gated form),
# the delta rule's with a decay per head or none, kernel reads of random features
# (Performer: M = 4H and more, the feature projection runs in the chunk body), per-feature
# reads (Shen, Heinsen), and GLA's decay per key feature, the delta rule's (KDA), DPLR's;
# Heinsen's log-values.
ChunkForm = Literal["kernel", "delta", "random_features", "per_feature", "gla", "kda", "dplr",
                    "log_value"]
# C of a form's chunked implementation when ``chunk_size=None``, by
# ``jax.default_backend()`` (None: any other backend, TPU included, unmeasured); each the
# fastest measured (docs/benchmarks.md#chunk-size).
_DEFAULT_CHUNK_SIZES: dict[str, dict[str | None, int]] = {
    "kernel": {"gpu": 256, None: 64},
    "delta": {"gpu": 256, None: 32},
    "random_features": {"gpu": 512, None: 128},
    "per_feature": {None: 64},
    "gla": {"gpu": 256, None: 128},
    "kda": {None: 16},
    "dplr": {None: 16},
    "log_value": {None: 32},
}


class Chunk(NamedTuple):
  """A span of queries and keys in the internal layout.

  As :func:`layout` makes it, ``fq`` / ``fk`` hold the queries and keys
  themselves, ``lk [B, K, S, 1]`` is 0 or -inf (a hidden key) and ``lq`` is
  None; a kernel family's feature map (its ``prepare``) maps a span of that to
  features and log-scales.

  The query fields have their positions on axis 3, the key fields on axis 2.
  A body that reads only queries gets None for the key fields and the other
  way round. ``gates`` holds extra per-key inputs of gated recurrences
  (``[B, K, S, ...]``; a padded key gets 0: no decay, no write).
  """

  fq: Any  # [B, K, G, T, M|1]: query features.
  lq: Any  # [B, K, G, T, M'|1]: query log-scales.
  fk: Any  # [B, K, S, M|1]: key features (0 for hidden keys).
  lk: Any  # [B, K, S, M']: key log-scales (-inf for hidden keys).
  v: Any  # [B, K, S, D]: values (0 for hidden keys).
  gates: tuple[jax.Array, ...] = ()
  reset: Any = None  # [B, 1, S, 1] bool: True where a key starts a new segment (None: none).

  @property
  def num_queries(self) -> int:
    return self.fq.shape[3]

  @property
  def num_keys(self) -> int:
    return self.fk.shape[2]

  def map(self, fn: Callable[[jax.Array, int], jax.Array]) -> Chunk:
    """``fn(array, position_axis)`` on every array (None fields stay None)."""
    return Chunk(*(jax.tree.map(lambda x, a=axis: fn(x, a), field)
                   for field, axis in zip(self, (3, 3, 2, 2, 2, 2, 2), strict=True)))

  def keys(self, start: int, stop: int) -> Chunk:
    """Keys ``start:stop`` and no queries."""
    cut = self._replace(fq=None, lq=None)
    return cut.map(lambda x, axis: lax.slice_in_dim(x, start, stop, axis=axis))

  def queries(self) -> Chunk:
    """The queries and no keys."""
    return Chunk(self.fq, self.lq, None, None, None, None)

  def pad_keys(self, front: int = 0, multiple: int = 1) -> Chunk:
    """``front`` hidden keys first, then hidden keys up to a multiple of ``multiple``."""
    def pad(x, fill):
      widths = [(0, 0)] * x.ndim
      widths[2] = (front, 0)
      return pad_axis(jnp.pad(x, widths, constant_values=fill), 2, multiple, fill)

    pad_or_none = lambda x, fill: None if x is None else pad(x, fill)  # noqa: E731
    return self._replace(fk=pad_or_none(self.fk, 0), lk=pad_or_none(self.lk, -jnp.inf),
                         v=pad_or_none(self.v, 0),
                         gates=jax.tree.map(lambda g: pad(g, 0), self.gates),
                         reset=pad_or_none(self.reset, False))

  def blocks(self, C: int) -> Chunk:
    """Every field cut into ``ceil(L / C)`` blocks of C positions, the block index first."""
    return self.pad_keys(multiple=C).map(lambda x, axis: split_blocks(x, axis, C))


def layout(p: checks.Prepared, lengths: Any, dtype: Any) -> Chunk:
  """The arrays in the internal layout: ``fq [B, K, G, T, H]`` / ``fk [B, K, S, H]`` hold
  q / k, ``v [B, K, S, D]``, ``lk [B, K, S, 1]`` is 0 for keys and -inf for padded ones
  (k = v = 0 there), ``lq`` None."""
  d = p.dims
  q = p.query.astype(dtype).reshape(d.B, d.T, d.K, d.G, d.H).transpose(0, 2, 3, 1, 4)
  k = p.key.astype(dtype).transpose(0, 2, 1, 3)  # [B, K, S, H]
  v = p.value.astype(dtype).transpose(0, 2, 1, 3)  # [B, K, S, D]
  valid = length_predicate(jnp.arange(d.S), lengths)[:, None, :, None]  # [B|1, 1, S, 1]
  hidden = jnp.broadcast_to(jnp.where(valid, 0, -jnp.inf).astype(dtype), (d.B, d.K, d.S, 1))
  return Chunk(q, None, jnp.where(valid, k, 0), hidden, jnp.where(valid, v, 0))


def hide_padded(chunk: Chunk, x: jax.Array) -> jax.Array:
  """``x [B, K, S, ·]`` with 0 at padded keys (``lk = -inf``): a per-token input there is
  an identity step (no decay, no write)."""
  return jnp.where(chunk.lk == -jnp.inf, 0, x)

# Packed sequences --------------------------------------------------------------------
# A recurrence over packed segments drops its state where a segment starts: position t's
# state holds the keys j <= t of t's own segment (and ``initial_state`` only for the first
# segment of each row). Inside a span of positions (a chunk), with ``c_t`` the number of
# segment starts up to t in the span, t and j <= t are in one segment iff ``c_t == c_j``,
# and the state carried into the span reaches t iff ``c_t == 0``.

# A log-decay that drops the state: exp(RESET_LOG_DECAY) is exactly 0 in float32 and float64.
# The gated and delta-rule forms only ever sum log-decays over the steps between two
# positions (never a difference of prefix sums), so a reset cancels nothing after it.
RESET_LOG_DECAY = -1e4


def segment_resets(ids: jax.Array) -> jax.Array:
  """``[B, S]`` bool: True where ``ids [B, S]`` changes, i.e. where a new segment starts
  (never at position 0: the first segment continues the initial state)."""
  return jnp.concatenate([jnp.zeros_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)


def segment_index(reset: jax.Array) -> jax.Array:
  """``c [..., C]``: the segment starts up to each position of a span, from its ``reset
  [..., C, 1]``."""
  return jnp.cumsum(reset[..., 0].astype(jnp.int32), axis=-1)


def same_segment(reset: jax.Array) -> jax.Array:
  """``[..., C, C]``: whether positions i (rows) and j <= i of a span share a segment."""
  c = segment_index(reset)
  return c[..., :, None] == c[..., None, :]


def carried(reset: jax.Array) -> jax.Array:
  """``[..., C]``: whether the state carried into a span reaches each of its positions."""
  return segment_index(reset) == 0


def in_last_segment(reset: jax.Array) -> jax.Array:
  """``[..., C]``: whether a key of the span is in its last segment (it reaches the state
  after the span)."""
  c = segment_index(reset)
  return c == c[..., -1:]


def any_reset(reset: jax.Array) -> jax.Array:
  """``[...]``: whether the span holds a segment start (the state after it drops the one
  before it)."""
  return jnp.any(reset[..., 0], axis=-1)


def check_segment_ids(segment_ids: Any, p: checks.Prepared, *, is_causal: bool,
                      fn: str) -> jax.Array | None:
  """``segment_ids`` of a recurrence as ``[B, S]`` int32 (None: not packed).

  A recurrence carries each key to the queries at and after its own position, so it
  takes one array (T == S) and a causal call; the pair of softmax's cross-attention is
  refused, as are ``is_causal=False`` and T != S, each with a ValueError that says why.
  """
  if segment_ids is None:
    return None
  if isinstance(segment_ids, tuple | list):
    raise ValueError(
        f"{fn}: segment_ids must be one array [B, T]: a recurrence carries each key's "
        "segment to the query at its own position, so queries and keys share one array; got "
        f"a {type(segment_ids).__name__} of {len(segment_ids)} items.")
  if not is_causal:
    raise ValueError(
        f"{fn}: segment_ids needs is_causal=True: the recurrent forms of this variant read "
        "a state of the keys up to each query, not of every key of its segment.")
  if p.dims.T != p.dims.S:
    raise ValueError(
        f"{fn}: segment_ids needs query length T equal to key length S (one packed "
        f"sequence); got T={p.dims.T}, S={p.dims.S}.")
  return checks.check_segment_ids(segment_ids, p, fn=fn)[1]


# A body: (config, carry, chunk) -> (carry, out); an absorb: (config, carry, chunk) -> carry;
# a read: (config, carry, chunk) -> out. See run_chunks.
Body = Callable[[Any, Any, Chunk], tuple[Any, jax.Array]]


class Bodies(NamedTuple):
  """What a recurrence supplies to :func:`run_chunks`.

  Attributes:
    causal: C aligned causal queries and keys (query i sees keys ``<= i``
      and the carry): ``(config, carry, chunk) -> (carry, out)``.
    absorb: keys that every query sees: ``(config, carry, chunk) -> carry``.
    read: queries that see only the carry: ``(config, carry, chunk) -> out``.
    causal_blocks: optional, used instead of scanning ``causal``: every block
      of C aligned causal positions at once, ``(config, carry, blocks) ->
      (carry, out)`` with the block index first (``Chunk.blocks``), featurised.
  """

  causal: Body
  absorb: Callable[[Any, Any, Chunk], Any]
  read: Callable[[Any, Any, Chunk], jax.Array]
  causal_blocks: Callable[[Any, Any, Chunk], tuple[Any, jax.Array]] | None = None


def _scan(fn, carry, chunk: Chunk, C: int, prepare):
  """``fn(carry, prepare(block)) -> (carry, out)`` over blocks of C positions, checkpointed
  per block: ``prepare``'s output (features) exists one block at a time."""
  blocks = chunk.blocks(C)
  if prepare is not None:
    fn = lambda c, x, fn=fn: fn(c, prepare(x))  # noqa: E731
  if next(x for x in jax.tree.leaves(blocks)).shape[0] == 1:
    carry, out = fn(carry, jax.tree.map(lambda x: x[0], blocks))
    return carry, jax.tree.map(lambda x: x[None], out)
  return lax.scan(jax.checkpoint(fn, prevent_cse=False), carry, blocks)


def run_chunks(bodies: Bodies, config: Any, carry: Any, chunk: Chunk, *, is_causal: bool,
               chunk_size: int, prepare: Callable[[Chunk], Chunk] | None = None,
               ) -> tuple[jax.Array, Any]:
  """The chunk driver of every recurrence: ``(out [B, K, G, T, ·], final carry)``.

  Non-causal: the keys are absorbed (in blocks of ``chunk_size``), then every
  query reads the result. Causal (bottom-right aligned): for S > T the first
  S - T keys are a prefix every query sees, absorbed first; for T > S the
  first T - S queries see only the carry (T - S hidden keys are put in
  front). The aligned sequence runs through ``bodies.causal`` in chunks of
  ``chunk_size`` under ``lax.scan`` and ``jax.checkpoint``, so the backward
  pass keeps one carry per chunk. ``prepare`` (e.g. :func:`featurizing`) maps
  each block before its body, inside the checkpoint.
  """
  T, S = chunk.num_queries, chunk.num_keys
  seen = max(S - T, 0) if is_causal else S
  if seen:
    keys = chunk.keys(0, seen)
    carry, _ = _scan(lambda c, x: (bodies.absorb(config, c, x), None), carry, keys,
                     min(chunk_size, seen), prepare)
  if not is_causal:
    _, out = _scan(lambda c, x: (c, bodies.read(config, c, x)), carry, chunk.queries(),
                   min(chunk_size, T), prepare)
  else:
    chunk = chunk.keys(seen, S)._replace(fq=chunk.fq, lq=chunk.lq)
    chunk = chunk.pad_keys(front=T - (S - seen))
    if bodies.causal_blocks is None:
      carry, out = _scan(lambda c, x: bodies.causal(config, c, x), carry, chunk,
                         min(chunk_size, T), prepare)
    else:
      blocks = chunk.blocks(min(chunk_size, T))
      carry, out = bodies.causal_blocks(config, carry, blocks if prepare is None else
                                        prepare(blocks))
  return merge_blocks(out, 3, T), carry


def scan_tokens(token: Callable[[Any, Chunk], tuple[Any, jax.Array]], carry: Any,
                chunk: Chunk) -> tuple[Any, jax.Array]:
  """``token(carry, one) -> (carry, out [B, K, G, ·])`` over the chunk's aligned positions,
  on ``lax.scan``: ``one`` is the chunk at one position (its fields without the position
  axis). Returns the last carry and ``out [B, K, G, C, ·]``."""
  tokens = chunk.map(lambda x, axis: jnp.moveaxis(x, axis, 0))
  carry, out = lax.scan(token, carry, tokens)
  return carry, jnp.moveaxis(out, 0, 3)


# State checks and the one-token step ----------------------------------------------


def check_state(state: Any, cls: type, want: Mapping[str, tuple[int, ...]], *, dims: str,
                what: str = "the state", fn: str) -> Any:
  """``state`` as a ``cls`` of float arrays with the ``want`` shapes, or a ValueError.

  Names the function, the state type, the field, and both shapes; ``dims``
  says which sizes the shapes come from (e.g. ``"B=2, K=1, M=4, D=3"``).
  """
  name = cls.__name__
  if not isinstance(state, cls):
    raise ValueError(
        f"{fn}: {what} must be a {name} (fields {', '.join(cls._fields)}); got "
        f"{type(state).__name__}.")
  arrays = {}
  for field, shape in want.items():
    x = jnp.asarray(getattr(state, field))
    if x.shape != tuple(shape):
      raise ValueError(
          f"{fn}: {what} {name}.{field} has shape {x.shape}; expected {tuple(shape)} for {dims}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{fn}: {what} {name}.{field} must be floating point; got {x.dtype}.")
    arrays[field] = x
  return cls(**arrays)


def one_token_step(attention: Callable[..., Any], state, query, key, value, **options):
  """A causal pass of ``attention`` over one token (T = S = 1) from ``state``.

  ``query [B, N, H]``, ``key [B, K, H]``, ``value [B, K, D]`` (no B when
  unbatched) -> ``(state, out [B, N, D])``, with the state in the dtype it
  came in (``lax.scan``-ready); uses the ``"scan"`` recurrence.
  """
  arrays = tuple(jnp.asarray(x) for x in (query, key, value))
  if len({x.ndim for x in arrays}) != 1 or arrays[0].ndim not in (2, 3):
    raise ValueError(
        f"{getattr(attention, '__name__', 'attention')}_step: query [B, N, H], key [B, K, H] "
        "and value [B, K, D] must have the same rank, 3 (or 2 unbatched); got "
        f"{', '.join(str(x.shape) for x in arrays)}.")
  out, new = attention(*(jnp.expand_dims(x, -3) for x in arrays), is_causal=True,
                       implementation="scan", initial_state=state, return_state=True, **options)
  new = jax.tree.map(lambda x, old: x.astype(jnp.result_type(old)), new, state)
  return new, jnp.squeeze(out, -3)


def summarize_keys(attention: Callable[..., Any], key: Any, value: Any, *,
                   segment_ids: Any = None, **options) -> Any:
  """The state of ``key [B, S, K, H]`` / ``value [B, S, K, D]`` under ``attention``.

  A causal pass of one query (bottom-right aligned, it sees every key) from
  no state, with ``return_state``: the same state a prefill leaves. Packed keys
  (``segment_ids [B, S]``) take S queries (a recurrence's ids are its queries' too);
  the state is then that of the last segment, and a state with a ``reset`` field
  records whether the keys held a segment start (a gated summary records it in its
  decays or transition instead).
  """
  key = jnp.asarray(key)
  length = 1 if segment_ids is None or key.ndim < 3 else key.shape[-3]
  query = jnp.zeros(key.shape[:-3] + (length,) + key.shape[-2:], key.dtype)
  if segment_ids is not None:
    options["segment_ids"] = segment_ids
  _, state = attention(query, key, value, is_causal=True, return_state=True, **options)
  if segment_ids is not None and "reset" in getattr(type(state), "_fields", ()):
    ids = jnp.asarray(segment_ids)
    reset = jnp.any(ids[..., 1:] != ids[..., :-1], axis=-1)
    state = state._replace(reset=jnp.reshape(reset, key.shape[:-3]))
  return state


@dataclasses.dataclass(frozen=True)
class Options:
  """A call's static options, checked and resolved (hashable: a key of the compiled program).

  Attributes:
    is_causal: query t sees keys ``j <= t + S - T``.
    implementation: the form that runs (never None here).
    chunk_size: C of the chunked and scanned forms.
    eps: added to a kernel read's normaliser.
    scale: multiplies the queries of the gated families (None: ``1 / sqrt(H)``).
    return_state: whether the state is returned, for the families whose program differs
      by it (:attr:`Family.static_return_state`); False for the others.
  """

  is_causal: bool
  implementation: str
  chunk_size: int
  eps: float = 0.0
  scale: float | None = None
  return_state: bool = False


class Start(NamedTuple):
  """Where a family's run starts (:meth:`Family.start`)."""

  chunk: Chunk  # The arrays as the family's bodies read them.
  prepare: Callable[[Chunk], Chunk] | None  # Each chunk's map inside the checkpoint (None: none).
  carry: Any  # The carry the driver starts from.
  state: Any = None  # The initial state, checked and batched, for finish (None: none given).


class Family:
  """What a recurrent family brings to :func:`recurrent_attention`; everything else is shared.

  Subclasses are frozen dataclasses (static and hashable: part of the compiled program's
  key). The pipeline calls, inside one jitted program, ``start`` (the family's view of
  the laid-out arrays, the map each chunk goes through and the carry, from the public
  ``initial_state`` or empty), ``attend`` (the chunk driver with the family's bodies)
  and ``finish`` (the output and the public state).

  Attributes:
    implementations: the values of ``implementation=`` it offers.
    noncausal_only: implementations that support only ``is_causal=False`` (with
      ``is_causal=True`` they raise).
    supports_noncausal: whether ``is_causal=False`` is supported at all.
    static_return_state: whether ``return_state`` changes the program (it is then part
      of :class:`Options`).
  """

  implementations: tuple[str, ...] = ()
  noncausal_only: frozenset[str] = frozenset()
  supports_noncausal: bool = True
  static_return_state: bool = False

  def token_inputs(self, inputs: Mapping[str, Any], key: Any) -> tuple[TokenInput, ...]:
    """The per-token inputs of a call with these ``inputs`` (by name; one left out, or
    given as None, is absent) and ``key``; each is checked against its declaration."""
    del inputs, key
    return ()

  def chunk_form(self, token_inputs: tuple[TokenInput, ...]) -> ChunkForm:
    """Whose default C ``chunk_size=None`` takes (see :func:`default_chunk_size`)."""
    del token_inputs
    return "kernel"

  def default_implementation(self, is_causal: bool) -> str:
    """``implementation=None``: the chunked form when causal, else one summary."""
    return "chunked" if is_causal else "parallel"

  def start(self, chunk: Chunk, state: Any, params: Any, inputs: Mapping[str, jax.Array],
            p: checks.Prepared, options: Options, *, fn: str) -> Start:
    """The family's chunk, its per-chunk map and the carry to start from (from
    ``state``, a public state it checks, or empty). ``inputs`` are the per-token
    inputs ``[B, K, S, H|1]``."""
    raise NotImplementedError

  def attend(self, carry: Any, chunk: Chunk, prepare: Callable[[Chunk], Chunk] | None,
             options: Options) -> tuple[jax.Array, Any]:
    """``(out [B, K, G, T, ·], final carry)``."""
    raise NotImplementedError

  def finish(self, out: jax.Array, carry: Any, state: Any, chunk: Chunk,
             options: Options) -> tuple[jax.Array, Any]:
    """``(out [B, K, G, T, D], the public final state)`` from the driver's output and carry
    (``state``: :attr:`Start.state`)."""
    raise NotImplementedError


def default_chunk_size(form: ChunkForm = "kernel") -> int:
  """The chunk size C that ``chunk_size=None`` means for a chunked ``form`` (see above), by
  the default backend (not the devices a call's arrays are on)."""
  sizes = _DEFAULT_CHUNK_SIZES[form]
  return sizes.get(jax.default_backend(), sizes[None])


def check_chunk_size(chunk_size: int | None, *, form: ChunkForm = "kernel", fn: str) -> int:
  """``chunk_size``, or the form's default for None; a ValueError if not a positive int."""
  if chunk_size is None:
    return default_chunk_size(form)
  return checks.check_positive_int(chunk_size, name="chunk_size", fn=fn)


def recurrent_attention(
    family: Family, query: Any, key: Any, value: Any, params: Any = (), *,
    inputs: Mapping[str, Any] | None = None, is_causal: bool, key_value_seq_lengths: Any,
    segment_ids: Any = None, eps: float = 0.0, scale: float | None = None,
    implementation: str | None, chunk_size: int | None, initial_state: Any,
    return_state: bool = False, fn: str,
) -> jax.Array | tuple[jax.Array, Any]:
  """The entry of every recurrent variant: ``out [B, T, N, D]``, or with ``return_state``
  the pair ``(out, final state)``.

  Checks the static options and the per-token ``inputs`` here (their bounds where they
  are concrete), then runs one jitted function (inlined under an outer jit; eager calls
  reuse its compiled program) that validates the arrays and the state, lays them out,
  runs the family (:class:`Family`) and restores the public layout (and the missing
  batch axis of unbatched calls).

  ``segment_ids`` (packed sequences, :func:`check_segment_ids`) drop the state where
  a segment starts, inside the family's chunks (``Chunk.reset``).

  Raises:
    ValueError: for a non-bool ``is_causal`` or one the family does not support, an
      unknown or unsupported implementation, a bad ``chunk_size``, ``eps`` or ``scale``,
      bad arrays, per-token inputs or ``segment_ids``, or a state that does not match them.
  """
  is_causal = checks.check_static_bool(is_causal, name="is_causal", fn=fn)
  if not is_causal and not family.supports_noncausal:
    raise ValueError(f"{fn}: is_causal=False is not supported: this is a recurrence, each "
                     "output reads the state of the keys up to its own position; pass "
                     "is_causal=True.")
  implementation = checks.check_implementation(
      implementation, choices=family.implementations, is_causal=is_causal,
      noncausal_only=family.noncausal_only, fn=fn) or family.default_implementation(is_causal)
  inputs = {name: x for name, x in (inputs or {}).items() if x is not None}
  declared = family.token_inputs(inputs, key)
  missing = [f"{x.name} {x.layout}" for x in declared if x.name not in inputs]
  if missing:
    raise ValueError(f"{fn}: missing the per-token input(s) {', '.join(missing)}.")
  if declared or segment_ids is not None:  # The arrays first: their errors come first.
    p = checks.prepare_qkv(query, key, value, fn=fn)
    check_segment_ids(segment_ids, p, is_causal=is_causal, fn=fn)  # Their order, if concrete.
  if declared:
    inputs = {x.name: x.check(inputs[x.name], jnp.shape(key), fn=fn) for x in declared}
  chunk_size = check_chunk_size(chunk_size, form=family.chunk_form(declared), fn=fn)
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or eps < 0:
    raise ValueError(f"{fn}: eps must be a non-negative float; got {eps!r}.")
  options = Options(is_causal, implementation, chunk_size, float(eps),
                    checks.check_scale(scale, fn=fn),
                    bool(return_state) and family.static_return_state)
  out, state = _attention(query, key, value, key_value_seq_lengths, segment_ids, initial_state,
                          params, inputs, family=family, options=options, fn=fn)
  return (out, state) if return_state else out


@functools.partial(jax.jit, static_argnames=("family", "options", "fn"))
def _attention(query, key, value, lengths, segment_ids, state, params, inputs, *,
               family: Family, options: Options, fn: str):
  p = checks.prepare_qkv(query, key, value, fn=fn)
  (lengths,) = checks.check_lengths(p, fn=fn, key_value_seq_lengths=lengths).values()
  dtype = checks.accumulation_dtype(p.query.dtype)
  chunk = layout(p, lengths, dtype)
  ids = check_segment_ids(segment_ids, p, is_causal=options.is_causal, fn=fn)
  if ids is not None:
    chunk = chunk._replace(reset=segment_resets(ids)[:, None, :, None])
  inputs = {x.name: _input_layout(x.check(inputs[x.name], jnp.shape(key), fn=fn), p, chunk, dtype)
            for x in family.token_inputs(inputs, key)}
  start = family.start(chunk, state, params, inputs, p, options, fn=fn)
  out, carry = family.attend(start.carry, start.chunk, start.prepare, options)
  out, state = family.finish(out, carry, start.state, start.chunk, options)
  d = p.dims
  out = out.transpose(0, 3, 1, 2, 4).reshape(d.B, d.T, d.N, d.D).astype(p.query.dtype)
  return p.restore(out), state if p.batched else jax.tree.map(lambda x: x[0], state)


def _input_layout(x: Any, p: checks.Prepared, chunk: Chunk, dtype: Any) -> jax.Array:
  """A per-token input ``[B, S, K(, H)]`` (checked; no B when unbatched) as ``[B, K, S, H|1]``
  in ``dtype``, 0 at padded keys."""
  x = jnp.asarray(x).astype(dtype)
  x = x if p.batched else x[None]
  return hide_padded(chunk, (x[..., None] if x.ndim == 3 else x).transpose(0, 2, 1, 3))


# Registration --------------------------------------------------------------------


def register_recurrent(name: str, *, family: Family, function: Callable[..., Any],
                       reference: Callable[..., Any], init: Callable[..., Any],
                       step: Callable[..., Any], summarize: Callable[..., Any],
                       combine: Callable[..., Any],
                       weights: Callable[..., Any] | None = None,
                       params: ParamSpec | None = None,
                       bind: Callable[..., Any] | None = None,
                       token_inputs: tuple[TokenInput, ...] = (),
                       identity: Callable[..., Any] | None = None,
                       positional: bool = False) -> AttentionSpec:
  """Registers a variant on this core: how it is chosen, streamed and combined.

  What it supports (implementations, causal modes) is read off ``family``.
  ``bind(fn, head_dim_at=0)`` turns each entry point into the registered one
  (a fixed feature map or kernel, ``params``' arrays); ``head_dim_at`` is the
  axis of H in ``step``'s one-token inputs. Every entry point is bound alike.
  ``combine`` composes the states ``summarize`` returns; ``token_inputs`` are the
  per-token inputs (gates) that every entry point takes as keyword arguments,
  ``step`` one token's worth (see ``AttentionSpec.token_inputs``); ``identity``
  builds the summary of no keys where it is not ``init``'s decoding state; ``positional``:
  the state places the next queries at its position (``StreamingSpec.positional``).
  """
  bind = bind or (lambda fn, head_dim_at=0: fn)
  return register_attention(AttentionSpec(
      name=name,
      function=bind(function),
      reference=bind(reference),
      how_options=frozenset({"implementation", "chunk_size"}),
      implementations=family.implementations,
      noncausal_only=family.noncausal_only,
      supports_noncausal=family.supports_noncausal,
      streaming=StreamingSpec(init=bind(init), step=bind(step, 1), summarize=bind(summarize),
                              combine=combine,
                              identity=None if identity is None else bind(identity),
                              positional=positional),
      weights=None if weights is None else bind(weights),
      params=params,
      token_inputs=token_inputs,
      packed_causal_only=True,
  ))
