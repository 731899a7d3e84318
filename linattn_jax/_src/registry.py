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
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol


class AttentionFn(Protocol):
  """The uniform signature every registered attention has."""

  def __call__(self, query: Any, key: Any, value: Any, *, is_causal: bool = False,
               key_value_seq_lengths: Any = None) -> Any:
    ...


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

  Options are filtered by name to those each function accepts.
  """

  init: Callable[..., Any]
  step: Callable[..., Any]
  state_passing: bool = True
  summarize: Callable[..., Any] | None = None
  combine: Callable[..., Any] | None = None


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
  """

  init: Callable[..., Mapping[str, Any]]
  names: tuple[str, ...]
  trainable: bool


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """One registered variant.

  Attributes:
    name: registry name.
    function: the public function ``(query, key, value, *, is_causal,
      key_value_seq_lengths, **options)``.
    reference: its oracle, taking the same keywords minus ``how_options``.
    how_options: options that choose how the result is computed, not what
      it is (e.g. ``implementation``, block sizes); not passed to the oracle.
    implementations: values of ``implementation=`` the function offers
      (``(None,)`` when it has no such option).
    suite_implementations: the subset the shared suite runs (None: all).
      A variant that only swaps one ingredient of an engine another
      registered variant already covers in full (e.g. a different feature
      map) lists fewer, to keep the suite's cost proportional to the code.
    test_options: options the shared suite uses on its small shapes (e.g.
      small blocks, so that several blocks and a partial one are exercised).
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
    params: the arrays the variant owns (see :class:`ParamSpec`), or None.
    weights: for kernel variants, ``weights(query, key, *, is_causal,
      key_value_seq_lengths, **options) -> ImpliedWeights`` (``how_options``
      are not passed): the unnormalised weights ``[B, N, T, S]`` the variant
      implies, the magnitudes of the terms forming them, and the normaliser
      ``[B, N, T]``. Where the features are signed the normaliser can cancel;
      the shared suite then judges parity by each row's conditioning.
  """

  name: str
  function: Callable[..., Any]
  reference: Callable[..., Any]
  how_options: frozenset[str] = frozenset({"implementation"})
  implementations: tuple[str | None, ...] = (None,)
  suite_implementations: tuple[str | None, ...] | None = None
  test_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  supports_causal: bool = True
  supports_noncausal: bool = True
  noncausal_only: frozenset[str] = frozenset()
  streaming: StreamingSpec | None = None
  dense_mask: Callable[..., Any] | None = None
  weights: Callable[..., Any] | None = None
  params: ParamSpec | None = None

  def __post_init__(self):
    extra = set(self.suite_implementations or ()) - set(self.implementations)
    if extra:
      raise ValueError(f"AttentionSpec {self.name!r}: suite_implementations {sorted(extra)} "
                       f"are not among implementations {self.implementations}.")

  def supports(self, implementation: str | None, is_causal: bool) -> bool:
    """Whether ``implementation`` supports this causal mode."""
    if is_causal:
      return self.supports_causal and implementation not in self.noncausal_only
    return self.supports_noncausal

  def build(self, **options: Any) -> AttentionFn:
    """The function with ``options`` bound, after checking their names."""
    _check_options(self.name, self.function, options)
    return functools.partial(self.function, **options)

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


def _check_options(name: str, function: Callable[..., Any], options: Mapping[str, Any]) -> None:
  params = inspect.signature(function).parameters
  allowed = sorted(p for p, v in params.items()
                   if v.kind is inspect.Parameter.KEYWORD_ONLY and p not in _UNIFORM)
  for option in options:
    if option in _UNIFORM:
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
  """Adds ``spec`` to the registry (a name can be registered once)."""
  if spec.name in _REGISTRY:
    raise ValueError(f"register_attention: {spec.name!r} is already registered.")
  _REGISTRY[spec.name] = spec
  return spec


def get_spec(name: str) -> AttentionSpec:
  """The :class:`AttentionSpec` registered as ``name``."""
  if name not in _REGISTRY:
    raise ValueError(
        f"unknown attention {name!r}; available: {available_attentions()}."
    )
  return _REGISTRY[name]


def get_attention(name: str, **options: Any) -> AttentionFn:
  """Returns the attention called ``name`` with ``options`` bound.

  The result has the uniform signature ``fn(query, key, value, *,
  is_causal=False, key_value_seq_lengths=None)``.

  Raises:
    ValueError: for an unknown name, an option the variant does not take, or
      a required option (e.g. ``window_size`` of ``"local"``) left out.

  Examples:
    >>> attn = get_attention("flash", block_q=128)
    >>> out = attn(q, k, v, is_causal=True)  # doctest: +SKIP
  """
  return get_spec(name).build(**options)


def available_attentions() -> list[str]:
  """Names accepted by :func:`get_attention`, sorted."""
  return sorted(_REGISTRY)
