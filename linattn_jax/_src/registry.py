"""Attention variants by name, with one uniform call signature.

``get_attention(name, **options)`` returns ``fn(query, key, value, *,
is_causal=False, key_value_seq_lengths=None)``; the options are checked
against the variant's keyword arguments when the function is built, so a
misspelt option fails at once instead of being ignored.

Each entry also records its oracle and which of its options only choose *how*
to compute (implementation, block sizes): the shared test suite runs every
registered variant against its oracle with those options dropped.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from linattn_jax._src import checks


@jax.jit
def _extrema(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(min(x), max(x))`` as one compiled program per shape (run eagerly, the two
  reductions compiled one each)."""
  return jnp.min(x), jnp.max(x)


class AttentionFn(Protocol):
  """The uniform signature every registered attention has, as :func:`get_attention` returns it.

  ``fn(query, key, value, *, is_causal=False, key_value_seq_lengths=None) -> out``
  with query ``[B, T, N, H]``, key ``[B, S, K, H]``, value ``[B, S, K, D]``
  (K divides N; or all three unbatched, without B) and ``out`` ``[B, T, N, D]``
  in the input dtype. ``is_causal``: query t sees keys ``j <= t + S - T``;
  False by default for every entry (as in ``jax.nn``), and a variant that is
  causal only (``AttentionSpec.supports_noncausal`` False) raises a ValueError
  for it. ``key_value_seq_lengths``: optional ``[B]`` ints, keys at or past it
  are masked. The variant's own options are bound when the function is built, so
  experiments and layers swap variants by name alone.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    >>> for name in ("softmax", "linear_elu", "heinsen"):
    ...   print(name, la.get_attention(name)(x, x, x, is_causal=True).shape)
    softmax (1, 8, 2, 4)
    linear_elu (1, 8, 2, 4)
    heinsen (1, 8, 2, 4)
  """

  def __call__(self, query: Any, key: Any, value: Any, *, is_causal: bool = False,
               key_value_seq_lengths: Any = None) -> Any:
    ...


class CacheKind(str, enum.Enum):
  """What a variant's decode cache holds (each equals its string value).

  ``KV``: every key ``[B, K, C, H]`` and value so far (exact softmax, the
  sparse patterns); ``WINDOW``: a ring buffer of local attention's window;
  ``RECURRENT``: a fixed-size state.

  Examples:
    >>> la.get_spec("linear_elu").cache_kind is nn.CacheKind.RECURRENT
    True
    >>> nn.cache_kind("softmax") == "kv"
    True
  """

  KV = "kv"  # Every key and value so far, [B, K, C, H]: exact softmax and the sparse patterns.
  WINDOW = "window"  # A ring buffer of the window's keys and values: local attention.
  RECURRENT = "recurrent"  # A fixed-size state: the recurrent variants.


@dataclasses.dataclass(frozen=True)
class StreamingSpec:
  """How a variant runs one token at a time (causal decoding): its state protocol.

  Every streaming variant's public function also takes ``is_causal=True,
  return_state=True`` on a prompt: the state it returns continues with
  ``step`` exactly as one causal pass over the whole sequence would.

  Attributes:
    init: ``init(query, key, value, **options) -> state``: an empty state for
      arrays shaped like these ``[B, T, N, H]`` / ``[B, S, K, H]`` /
      ``[B, S, K, D]`` inputs.
    step: ``step(state, query, key, value, **options) -> (state, out)`` for one
      token: ``[B, N, H]``, ``[B, K, H]``, ``[B, K, D]`` in, ``[B, N, D]`` out.
    state_passing: whether the public function takes ``initial_state=``
      (then splitting a sequence anywhere and carrying the state must equal
      one pass).
    summarize: for recurrent variants, ``summarize(key, value, *,
      key_value_seq_lengths=None, **options) -> state``: the state of these
      ``[B, S, K, H]`` / ``[B, S, K, D]`` keys and values (None: not recurrent).
    combine: with ``summarize``, ``combine(earlier, later) -> state``, the
      state of ``earlier``'s keys followed by ``later``'s; associative, so that
      summaries of spans (chunks, devices) combine into the summary of all.
    identity: ``identity(query, key, value, **options) -> state``, the summary
      of no keys (``combine``'s identity), where it holds more than decoding
      needs (the gated recurrences' summaries also hold their spans' decays or
      transitions); None: ``init``'s state is the identity.
    positional: whether the state places the next keys and queries at its position
      (cosFormer's): queries then cannot read a summary of keys after them, so a
      non-causal pass is not split into summaries (context parallelism runs it
      causally only).

  Options are filtered by name to those each function accepts.

  Examples:
    >>> streaming = la.get_spec("linear_elu").streaming
    >>> x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))  # [B, T, N=K, H=D]
    >>> state = streaming.init(x, x, x)
    >>> state, out = streaming.step(state, x[:, 0], x[:, 0], x[:, 0])
    >>> out.shape  # [B, N, D]
    (1, 2, 4)

    Summaries of consecutive spans combine into the summary of both:

    >>> a, b = x[:, :3], x[:, 3:]
    >>> both = streaming.combine(streaming.summarize(a, a), streaming.summarize(b, b))
    >>> bool(jnp.allclose(both.kv, streaming.summarize(x, x).kv, atol=1e-5))
    True
    >>> la.get_spec("softmax").streaming is None  # Exact softmax keeps a KV cache.
    True
  """

  init: Callable[..., Any]
  step: Callable[..., Any]
  state_passing: bool = True
  summarize: Callable[..., Any] | None = None
  combine: Callable[..., Any] | None = None
  identity: Callable[..., Any] | None = None
  positional: bool = False

  @property
  def empty_summary(self) -> Callable[..., Any]:
    """``identity``, or ``init`` where the state is its own summary."""
    return self.identity or self.init


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """Arrays a variant owns: a random projection, or learnable feature-map weights.

  The variant's function, oracle and streaming functions take these arrays as
  keyword options named as ``init``'s result. Left out, they are drawn from
  the variant's ``rng`` seed option (as the registry's users and the tests
  do); a layer draws them once from its own PRNG stream and passes them at
  every call as data, so new values never recompile.

  Attributes:
    init: ``init(rng, head_dim, **options) -> {name: array}`` for a PRNG key
      ``rng`` and head dim H (options filtered by name, see :func:`accepted`).
    names: the keys of ``init``'s result, i.e. the array options.
    trainable: learned by gradient, or drawn at random and only redrawn.
    option: the function's option the arrays become, ``option=build(arrays)``
      (e.g. a feature map); None: each array is passed by its name.
    build: with ``option``, ``build({name: array}) -> value``.
  """

  init: Callable[..., Mapping[str, Any]]
  names: tuple[str, ...]
  trainable: bool
  option: str | None = None
  build: Callable[[Mapping[str, Any]], Any] | None = None

  def bind(self, fn: Callable[..., Any], *, head_dim_at: int = 0) -> Callable[..., Any]:
    """``fn`` taking these arrays as options, drawn by ``init`` when they are left out.

    The result takes the arrays by ``names`` (all or none), ``rng`` (a seed
    or PRNG key for the draw; None: 0) and ``init``'s keyword options. H is
    the last axis of the positional argument at ``head_dim_at`` (the query or
    the key). One function serves every entry point of a variant (function,
    oracle, streaming, weights), so its arrays are built in one place.

    Raises:
      ValueError: (from the result) for some arrays but not all, arrays with
        ``rng``, or arrays whose shapes disagree with the given ``init`` options.
    """
    signature = inspect.signature(fn)
    init_options = [p for p in inspect.signature(self.init).parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY]
    name = getattr(getattr(fn, "func", fn), "__name__", "attention")

    def with_arrays(*args: Any, rng: Any = None, **options: Any) -> Any:
      arrays = {n: options.pop(n) for n in self.names if n in options}
      drawn = {p.name: options.pop(p.name) for p in init_options if p.name in options}
      head_dim = jnp.shape(args[head_dim_at])[-1]
      init = functools.partial(self.init, head_dim=head_dim, **drawn)
      if not arrays:
        arrays = _draw(self.init, head_dim, drawn, rng)
      elif rng is not None or len(arrays) != len(self.names):
        raise ValueError(f"{name}: give all of {list(self.names)} or none (then they are "
                         "drawn from `rng`); not `rng` with them.")
      elif drawn:
        want = {n: x.shape for n, x in jax.eval_shape(init, jax.random.key(0)).items()}
        got = {n: jnp.shape(x) for n, x in arrays.items()}
        if got != want:
          raise ValueError(f"{name}: {drawn} disagrees with the arrays' shapes {got} (it "
                           f"draws {want}); give one of them.")
      if self.option is not None:
        arrays = {self.option: self.build(arrays)}
      return fn(*args, **arrays, **options)

    hidden = set(self.names) | {self.option}
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None)
             for n in ("rng", *self.names)] + init_options
    kept = [p for p in signature.parameters.values() if p.name not in hidden]
    with_arrays.__signature__ = signature.replace(parameters=kept + extra)
    with_arrays.__name__ = name
    return with_arrays


def _draw(init: Callable[..., Mapping[str, Any]], head_dim: int, options: dict[str, Any],
          rng: Any) -> Mapping[str, Any]:
  """``init(key, head_dim, **options)`` for the key ``rng`` makes (:func:`checks.prng_key`).

  A seed or a concrete key draws now, by one compiled program shared by every call with
  these sizes, even inside a caller's trace: the caller's program then holds the arrays
  as constants instead of drawing them (a random normal and a QR factorisation for
  FAVOR+) at every run, and costs no compilation of the draw. A traced key (drawn anew
  per step, say) draws inside the caller's program, as do options that cannot be keys
  of the cache.
  """
  with jax.ensure_compile_time_eval():  # A seed's key, concrete inside a trace too.
    key = checks.prng_key(rng)
  if isinstance(key, jax.core.Tracer):
    return init(key, head_dim=head_dim, **options)
  try:
    draw = _compiled_init(init, head_dim, tuple(sorted(options.items())), key.shape, key.dtype,
                          jax.sharding.get_abstract_mesh())
  except TypeError:  # An unhashable option.
    return init(key, head_dim=head_dim, **options)
  return draw(key)


@functools.cache
def _compiled_init(init: Callable[..., Mapping[str, Any]], head_dim: int,
                   options: tuple[tuple[str, Any], ...], key_shape: tuple[int, ...],
                   key_dtype: Any, mesh: Any) -> Callable[[Any], Mapping[str, Any]]:
  """``init``'s draw for keys of this shape and type, compiled ahead of any caller; for
  the caller's mesh context (its arrays are typed by it: inside ``shard_map``, manual)."""
  del mesh  # Part of the cache's key only.
  draw = functools.partial(init, head_dim=head_dim, **dict(options))
  return jax.jit(draw).lower(jax.ShapeDtypeStruct(key_shape, key_dtype)).compile()


class Role(str, enum.Enum):
  """What a per-token input does in a recurrence, and so how a layer makes it.

  ``DECAY``: a log-decay ``g ≤ 0`` (``[B, S, K]``, one per head, or ``[B, S, K, H]``,
  one per key feature); the state is multiplied by ``exp(g)`` before the token
  writes (``-inf`` or a large negative value resets it). A layer projects it from
  its input: Mamba2's parameterisation per head, GLA's low-rank gate per feature.
  ``WRITE_STRENGTH``: ``β ∈ [0, 2]`` (``[B, S, K]``), how much of the value
  replaces what the key already stores (the delta rule). For a unit key the
  transition ``I - β k kᵀ`` has the eigenvalue ``1 - β`` along k and 1 elsewhere, so
  every β in [0, 2] keeps the state from growing, and β > 1 gives the negative
  eigenvalues that let a linear RNN track state (Grazzi et al., 2025); only for
  unit keys, so a layer L2-normalises queries and keys (:attr:`unit_keys`) and
  projects ``σ(x w)``, or ``2 σ(x w)`` for the whole range.
  ``TRANSITION_READ`` and ``TRANSITION_WRITE``: the vectors ``a`` and ``b`` ``[B, S, K, H]``
  of the low-rank part of a diagonal-plus-low-rank transition ``diag(exp(g_t)) +
  b_t a_tᵀ`` (DPLR, RWKV-7): ``a`` reads from the state, ``b`` writes what it read back;
  any real values (a layer makes RWKV-7's ``a = -κ̂`` and ``b = κ̂ ⊙ iclr``).

  Examples:
    >>> la.Role.WRITE_STRENGTH.bounds, la.Role.WRITE_STRENGTH.unit_keys
    ((0.0, 2.0), True)
  """

  DECAY = "decay"
  WRITE_STRENGTH = "write_strength"
  TRANSITION_READ = "transition_read"
  TRANSITION_WRITE = "transition_write"

  @property
  def bounds(self) -> tuple[float, float]:
    """The closed range of the input's entries."""
    inf = float("inf")
    return {Role.DECAY: (-inf, 0.0), Role.WRITE_STRENGTH: (0.0, 2.0)}.get(self, (-inf, inf))

  @property
  def unit_keys(self) -> bool:
    """Whether the recurrence wants L2-normalised queries and keys with this input."""
    return self is Role.WRITE_STRENGTH


@dataclasses.dataclass(frozen=True)
class TokenInput:
  """A per-token input of a recurrence besides query, key and value (a gate, a β).

  Attributes:
    name: its keyword (``log_decay``, ``beta``).
    role: what it does (:class:`Role`): its range and what a layer does for it.
    per_feature: one entry per key feature, ``[B, S, K, H]``; else one per head,
      ``[B, S, K]``.

  Examples:
    >>> gate = la.TokenInput("log_decay", la.Role.DECAY, per_feature=True)
    >>> gate.shape((2, 16, 4, 8)), gate.shape((2, 4, 8))  # A sequence's key; one token's.
    ((2, 16, 4, 8), (2, 4, 8))
  """

  name: str
  role: Role
  per_feature: bool = False

  @property
  def layout(self) -> str:
    """Its shape in letters."""
    return "[B, S, K, H]" if self.per_feature else "[B, S, K]"

  def shape(self, key_shape: Sequence[int]) -> tuple[int, ...]:
    """Its shape for a key of shape ``key_shape`` (``[B, S, K, H]``, without B, or one
    token's ``[B, K, H]``): the key's, without H unless ``per_feature``."""
    key_shape = tuple(key_shape)
    return key_shape if self.per_feature else key_shape[:-1]

  def check(self, x: Any, key_shape: Sequence[int], *, fn: str) -> Any:
    """``x`` if it is a float array of :meth:`shape` within the role's bounds; a
    ValueError naming the input, the shapes or the bounds otherwise.

    The shape and dtype are checked first, then the bounds, as :meth:`check_bounds` can.
    """
    want = self.shape(key_shape)
    try:
      shape, dtype = jnp.shape(x), jnp.result_type(x)
    except (TypeError, ValueError):  # Not an array at all.
      shape, dtype = None, None
    if shape != want or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      got = type(x).__name__ if dtype is None else f"{dtype} {shape}"
      raise ValueError(f"{fn}: {self.name} must be a float array {self.layout} = {want} for "
                       f"key {tuple(key_shape)}; got {got}.")
    return self.check_bounds(x, fn=fn)

  def check_bounds(self, x: Any, *, fn: str) -> Any:
    """``x`` if its entries lie within the role's bounds; a ValueError naming the input and
    the range of its values otherwise.

    Checked where ``x`` is concrete and on this host (an eager call): its minimum and
    maximum are computed where it lives and read back, two scalars. A traced value
    (under ``jax.jit``) or an array spread over other hosts cannot be read, and is used
    as it is.
    """
    if isinstance(x, jax.core.Tracer):
      return x
    with jax.ensure_compile_time_eval():  # A constant inside a trace is read too.
      values = jnp.asarray(x)
      if isinstance(values, jax.core.Tracer) or not values.is_fully_addressable:
        return x
      smallest, largest = (float(e) for e in _extrema(values))
    low, high = self.bounds
    if smallest < low or largest > high:
      raise ValueError(f"{fn}: {self.name} ({self.role.value}) must lie in [{low}, {high}]; "
                       f"got values from {smallest} to {largest}.")
    return x

  @property
  def bounds(self) -> tuple[float, float]:
    """The closed range of its entries (its role's)."""
    return self.role.bounds


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """One registered variant: its function, its oracle and what it supports.

  The registry maps a name to one of these (:func:`get_spec`);
  :func:`get_attention` binds options to ``function``, whose uniform
  signature is :class:`AttentionFn` (query ``[B, T, N, H]``, key
  ``[B, S, K, H]``, value ``[B, S, K, D]``, out ``[B, T, N, D]``). The shared
  test suite, the layers and context parallelism read the other fields.

  Attributes:
    name: registry name.
    function: the public function ``(query, key, value, *, is_causal,
      key_value_seq_lengths, **options)``.
    reference: its oracle, taking the same keywords minus ``how_options``.
    how_options: options that choose how the result is computed, not what
      it is (e.g. ``implementation``, block sizes); not passed to the oracle.
    implementations: values of ``implementation=`` the function offers
      (``(None,)`` when it has no such option).
    supports_causal: whether ``is_causal=True`` is supported.
    supports_noncausal: whether ``is_causal=False`` is supported.
    noncausal_only: implementations that support only ``is_causal=False``
      (e.g. a "parallel" summary form); with ``is_causal=True`` they must
      raise ValueError, and the shared suite checks that they do.
    streaming: how to run it token by token, or None.
    dense_mask: for sparse patterns, ``dense_mask(T, S, *, is_causal,
      **options) -> [.., T, S]`` bool: the mask with which softmax attention
      equals this variant (``how_options`` are not passed). Benchmarks time
      the masked dense path against it.
    decode_rows: for sparse patterns, ``decode_rows(S, *, num_heads, **options) ->
      RowKeys``: the keys each row of the causal pattern on S keys visits, as a
      decode step gathers them at traced positions (None: a decoded row reads the
      dense pattern's row of the cache).
    params: the arrays the variant owns (see :class:`ParamSpec`), or None.
    full_softmax: whether the variant is exact softmax attention over every
      visible key (no pattern tied to positions): a prefill from position 0
      is its plain causal call, and ring attention runs it across devices.
    token_inputs: per-token inputs the function needs besides query, key and
      value (:class:`TokenInput`: name, role, shape); they are keyword arguments of
      every call, and the function :func:`get_attention` builds rejects a call
      without them. A layer computes them from its input by their roles.
    forms_weights: whether the variant is softmax attention over a pattern,
      so that its ``[B, N, T, S]`` weights can be formed: a layer then
      honours a general ``mask`` (with the pattern), attention dropout and
      ``sow_weights`` through the dense softmax path. False for variants
      that never form them (flash's O(T) path, the recurrent families).
    weights: for kernel variants, ``weights(query, key, *, is_causal,
      key_value_seq_lengths, **options) -> ImpliedWeights`` (``how_options``
      are not passed): the unnormalised weights ``[B, N, T, S]`` the variant
      implies, the magnitudes of the terms forming them, and the normaliser
      ``[B, N, T]``. Where the features are signed the normaliser can cancel;
      the shared suite then judges parity by each row's conditioning.
    packed_causal_only: whether ``segment_ids`` (packed sequences; the function takes
      them where its signature has them) are taken only with ``is_causal=True`` and
      T == S, as one array: a recurrence carries each key's segment to the query at
      its own position. False: any mode, and the pair ``(query_segment_ids,
      kv_segment_ids)`` for T != S. Otherwise a ValueError says which.

  Examples:
    >>> spec = la.get_spec("performer")
    >>> spec.name, spec.streaming is not None, spec.params.names
    ('performer', True, ('projection',))
    >>> sorted(spec.how_options), spec.supports("parallel", is_causal=True)
    (['chunk_size', 'implementation'], False)

    A new variant is a function with the uniform keywords (plus its own
    options) and an oracle to judge it by:

    >>> def halved(query, key, value, *, is_causal=False, key_value_seq_lengths=None):
    ...   return la.softmax_attention(query, key, value, scale=0.5, is_causal=is_causal,
    ...                               key_value_seq_lengths=key_value_seq_lengths)
    >>> mine = la.AttentionSpec(name="halved_softmax", function=halved, reference=halved)
    >>> x = jnp.ones((1, 8, 2, 4))
    >>> mine.build()(x, x, x, is_causal=True).shape
    (1, 8, 2, 4)
  """

  name: str
  function: Callable[..., Any]
  reference: Callable[..., Any]
  how_options: frozenset[str] = frozenset({"implementation"})
  implementations: tuple[str | None, ...] = (None,)
  supports_causal: bool = True
  supports_noncausal: bool = True
  noncausal_only: frozenset[str] = frozenset()
  streaming: StreamingSpec | None = None
  dense_mask: Callable[..., Any] | None = None
  decode_rows: Callable[..., Any] | None = None
  weights: Callable[..., Any] | None = None
  params: ParamSpec | None = None
  forms_weights: bool = False
  full_softmax: bool = False
  token_inputs: tuple[TokenInput, ...] = ()
  packed_causal_only: bool = False

  def supports(self, implementation: str | None, is_causal: bool) -> bool:
    """Whether ``implementation`` supports this causal mode."""
    if is_causal:
      return self.supports_causal and implementation not in self.noncausal_only
    return self.supports_noncausal

  @property
  def cache_kind(self) -> CacheKind:
    """What the variant's decode cache holds, from its streaming protocol."""
    if self.streaming is None:
      return CacheKind.KV
    return CacheKind.RECURRENT if self.streaming.state_passing else CacheKind.WINDOW

  @property
  def unit_keys(self) -> bool:
    """Whether a layer L2-normalises queries and keys for this variant (its inputs' roles)."""
    return any(x.role.unit_keys for x in self.token_inputs)

  def token_input_shapes(self, key_shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The shape of each of ``token_inputs`` for a key of shape ``key_shape``
    (``[B, S, K, H]``, or ``[B, K, H]`` for one token).

    >>> la.get_spec("gated_delta_net").token_input_shapes((2, 16, 4, 8))
    {'beta': (2, 16, 4), 'log_decay': (2, 16, 4)}
    """
    return {x.name: x.shape(key_shape) for x in self.token_inputs}

  def check_token_inputs(self, inputs: Mapping[str, Any], key_shape: Sequence[int], *,
                         fn: str | None = None) -> dict[str, Any]:
    """``inputs``' arrays for ``token_inputs``, each checked by :meth:`TokenInput.check`;
    a ValueError names a missing input."""
    fn = fn or self.name
    missing = [f"{x.name} {x.layout}" for x in self.token_inputs if x.name not in inputs]
    if missing:
      raise ValueError(f"{fn}: missing the per-token input(s) {', '.join(missing)}.")
    return {x.name: x.check(inputs[x.name], key_shape, fn=fn) for x in self.token_inputs}

  def build(self, **options: Any) -> AttentionFn:
    """The function with ``options`` bound, after checking their names."""
    inputs = {x.name: x.layout for x in self.token_inputs}
    _check_options(self.name, self.function, options, per_call=(*_UNIFORM, *inputs))
    fn = functools.partial(self.function, **options)
    if not inputs:
      return fn

    def with_inputs(*args: Any, **kwargs: Any) -> Any:
      missing = [f"{name} {layout}" for name, layout in inputs.items() if name not in kwargs]
      if missing:
        raise ValueError(f"{self.name}: each call needs the per-token input(s) "
                         f"{', '.join(missing)} as keyword arguments.")
      return fn(*args, **kwargs)
    return with_inputs

  def build_reference(self, **options: Any) -> AttentionFn:
    """The oracle with the non-``how`` options bound."""
    what = self.what_options(options)
    _check_options(self.name, self.reference, what)
    return functools.partial(self.reference, **what)

  def what_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` without the ``how_options``: those that define the result."""
    return {k: v for k, v in options.items() if k not in self.how_options}


_UNIFORM = ("is_causal", "key_value_seq_lengths")
_REGISTRY: dict[str, AttentionSpec] = {}


def _check_options(name: str, function: Callable[..., Any], options: Mapping[str, Any], *,
                   per_call: tuple[str, ...] = _UNIFORM) -> None:
  params = inspect.signature(function).parameters
  allowed = sorted(p for p, v in params.items()
                   if v.kind is inspect.Parameter.KEYWORD_ONLY and p not in per_call)
  for option in options:
    if option in per_call:
      raise ValueError(
          f"get_attention({name!r}): `{option}` is passed at call time, not as an option."
      )
    if option not in allowed:
      raise ValueError(
          f"get_attention({name!r}): unknown option `{option}`; options are {allowed}."
      )
  missing = [p for p in allowed
             if params[p].default is inspect.Parameter.empty and p not in options]
  if missing:
    raise ValueError(
        f"get_attention({name!r}): missing required option(s) {missing}; options are "
        f"{allowed}."
    )


def accepted(function: Callable[..., Any], options: Mapping[str, Any]) -> dict[str, Any]:
  """The entries of ``options`` that ``function`` takes as keyword arguments (all of
  them if it takes ``**kwargs``)."""
  params = inspect.signature(function).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return dict(options)
  return {k: v for k, v in options.items() if k in params}


def register_attention(spec: AttentionSpec) -> AttentionSpec:
  """Adds ``spec`` to the registry (a name can be registered once).

  Afterwards ``get_attention(spec.name, **options)`` builds it, the layers
  (``linattn_jax.nn``) accept its name, and the shared test suite runs it
  against ``spec.reference``. Takes no arrays: the spec's function takes
  query ``[B, T, N, H]``, key ``[B, S, K, H]`` and value ``[B, S, K, D]``
  when it is called.

  Args:
    spec: the :class:`AttentionSpec` to register.

  Returns:
    ``spec``, so that the call can wrap its construction.

  Raises:
    ValueError: if ``spec.name`` is already registered.

  Examples:
    >>> la.register_attention(la.get_spec("softmax"))
    Traceback (most recent call last):
    ...
    ValueError: register_attention: 'softmax' is already registered.
  """
  if spec.name in _REGISTRY:
    raise ValueError(f"register_attention: {spec.name!r} is already registered.")
  _REGISTRY[spec.name] = spec
  return spec


def get_spec(name: str) -> AttentionSpec:
  """The :class:`AttentionSpec` registered as ``name``.

  Takes no arrays; the spec describes the variant: its function
  (``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, D]`` in,
  ``[B, T, N, D]`` out), oracle, options, streaming protocol and arrays.

  Raises:
    ValueError: for a name that is not registered (the message lists the
      available ones).

  Examples:
    >>> la.get_spec("performer").streaming is not None
    True
    >>> la.get_spec("local").streaming.state_passing  # A ring buffer, not a state.
    False
    >>> la.get_spec("no_such_attention")
    Traceback (most recent call last):
    ...
    ValueError: unknown attention 'no_such_attention'; available: [...].
  """
  if name not in _REGISTRY:
    raise ValueError(
        f"unknown attention {name!r}; available: {available_attentions()}."
    )
  return _REGISTRY[name]


def get_attention(name: str, **options: Any) -> AttentionFn:
  """Returns the attention called ``name`` with ``options`` bound.

  The result has the uniform signature ``fn(query, key, value, *,
  is_causal=False, key_value_seq_lengths=None)`` (:class:`AttentionFn`):
  query ``[B, T, N, H]``, key ``[B, S, K, H]``, value ``[B, S, K, D]`` in,
  ``[B, T, N, D]`` out, and
  ``get_attention(name, **options)(q, k, v, ...)`` is
  ``get_spec(name).function(q, k, v, ..., **options)``. The option names are
  checked here, so a misspelt option fails at once.

  Args:
    name: a name from :func:`available_attentions`.
    **options: the variant's keyword options (e.g. ``window_size`` for
      ``"local"``, ``num_features`` and ``rng`` for ``"performer"``).

  Returns:
    The function with ``options`` bound.

  Raises:
    ValueError: for an unknown name, an option the variant does not take,
      ``is_causal`` or ``key_value_seq_lengths`` given as an option, or a
      required option (e.g. ``window_size`` of ``"local"``) left out.

  Examples:
    >>> attn = la.get_attention("flash", block_q=128)
    >>> x = jnp.ones((1, 8, 2, 4))
    >>> attn(x, x, x, is_causal=True).shape
    (1, 8, 2, 4)
    >>> la.get_attention("local")
    Traceback (most recent call last):
    ...
    ValueError: get_attention('local'): missing required option(s) ['window_size']; ...
  """
  return get_spec(name).build(**options)


def available_attentions() -> list[str]:
  """Names accepted by :func:`get_attention`, sorted.

  Takes no arrays. Every name's function has the uniform signature of
  :class:`AttentionFn` (``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, D]``
  in, ``[B, T, N, D]`` out).

  Returns:
    A new sorted list of the registered names.

  Examples:
    >>> names = la.available_attentions()
    >>> "performer" in names, "softmax" in names, names == sorted(names)
    (True, True, True)
  """
  return sorted(_REGISTRY)
