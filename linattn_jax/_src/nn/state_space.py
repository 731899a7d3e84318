"""The state-space and convolution token mixers of released hybrids: Mamba-2 and LFM2.

- :class:`Mamba2Mixer`: Mamba-2's mixer. Its SSD is the gated core's ``simple_gla``
  with grouped value heads (``C`` as queries, ``B`` as keys, ``Δ·x`` as values, ``Δ·A``
  as each head's log-decay, scale 1) plus the ``D`` skip, so it decodes, packs and
  splits over devices as every recurrence here does.
- :class:`MambaMixer`: Mamba-1's mixer around the selective scan
  (:func:`~linattn_jax.selective_scan`), a diagonal state per channel.
- :class:`ShortConvMixer`: LFM2's gated short convolution ``C ⊙ conv(B ⊙ x)``.

Letters: B batch, T length, F model width, I the inner width (``nheads·P``; Mamba-1's
``d_inner`` E), G groups of B and C, S the state size per group (d_state), P a head's
channels (head_dim), R Δ's low rank, W the convolution width.

References:
  Gu and Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023.
  Dao and Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms
  Through Structured State Space Duality" (Mamba-2), 2024. Liquid AI, LFM2, 2025.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype, Initializer, PrecisionLike, Shape

from linattn_jax._src import checks
from linattn_jax._src.nn import cache as cache_lib
from linattn_jax._src.nn.compiled import compiled_call
from linattn_jax._src.nn.gates import mamba2_decay_init
from linattn_jax._src.nn.parts import (
    DEFAULT_KERNEL_INIT,
    GatedRMSNorm,
    ShortConvolution,
    check_inputs,
    expand_to,
)
from linattn_jax._src.registry import get_spec
from linattn_jax._src.selective_scan import SelectiveState, check_options, selective_scan


class Mamba2Mixer(nnx.Module):
  """Mamba-2's token mixer: a gated SSD over ``nheads`` heads of P channels.

  From ``x [B, T, F]``: ``in_proj(x) = [z (I) | xBC (I + 2·G·S) | dt (nheads)]``;
  ``xBC ← silu(conv(xBC))`` (causal depthwise, width W, with bias), split into ``u``
  ``[B, T, nheads, P]``, ``B`` and ``C`` ``[B, T, G, S]`` (heads ``h`` read group
  ``h // (nheads / G)``); ``Δ = clip(softplus(dt + dt_bias), *time_step_limit)``,
  ``A = -exp(A_log)`` (per head); then per head::

      h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_tᵀ        [S, P]
      y_t = C_tᵀ h_t + D u_t

  ``y ← RMSNorm(y ⊙ silu(z))`` over G groups of ``I / G`` channels, times ``norm.scale``
  (gate first, as Mamba-2's ``norm_before_gate=False``), and ``out = out_proj(y)``.

  Falcon-H1's mixer scales its input by ``in_multiplier`` and the parts
  ``z | x | B | C | dt`` of ``in_proj``'s output by ``projection_multipliers``, and
  normalises before gating (``gate_first=False``) or not at all (``use_norm=False``:
  ``y ⊙ silu(z)``).

  The parameters, with their names in transformers' ``Mamba2Mixer`` (a PyTorch
  ``Linear``'s ``weight`` is our ``kernel`` transposed, the ``Conv1d``'s
  ``weight [C, 1, W]`` our ``kernel [W, C]`` transposed):

  =================== ================== =====================
  ours                shape              transformers
  =================== ================== =====================
  ``in_proj.kernel``  [F, 2I + 2GS + n]  ``in_proj.weight``
  ``in_proj.bias``    [2I + 2GS + n]     ``in_proj.bias`` (``use_bias``)
  ``conv.kernel``     [W, I + 2GS]       ``conv1d.weight``
  ``conv.bias``       [I + 2GS]          ``conv1d.bias`` (``use_conv_bias``)
  ``dt_bias``         [n]                ``dt_bias``
  ``A_log``           [n]                ``A_log``
  ``D``               [n]                ``D``
  ``norm.scale``      [I]                ``norm.weight`` (``use_norm``)
  ``out_proj.kernel`` [I, F]             ``out_proj.weight``
  ``out_proj.bias``   [F]                ``out_proj.bias`` (``use_bias``)
  =================== ================== =====================

  Args:
    hidden_size: F.
    num_heads: nheads.
    head_dim: P (I = nheads·P).
    state_size: S (d_state).
    n_groups: G; must divide ``num_heads``.
    conv_size: W.
    use_conv_bias: the convolution's bias.
    use_bias: the projections' biases.
    norm_eps: the gated norm's eps.
    time_step_limit: ``(low, high)``, the clip of Δ.
    gate_first: multiply by ``silu(z)`` before normalising (Mamba-2's order); False:
      ``RMSNorm(y) ⊙ scale ⊙ silu(z)``.
    use_norm: the gated norm (else ``y ⊙ silu(z)``, and no ``norm.scale``).
    in_multiplier: a factor on the input (Falcon-H1's ``ssm_in_multiplier``).
    projection_multipliers: five factors on ``in_proj``'s parts ``z, x, B, C, dt``
      (Falcon-H1's ``ssm_multipliers``), or None.
    attention_options: ``simple_gla``'s options, e.g. ``{"chunk_size": 32}``.
    dtype, param_dtype, precision, kernel_init: the projections' settings, as in
      ``flax.nnx.Linear``.
    rngs: ``params`` draws the weights (``A_log`` from ``log U(1, 16)``, ``dt_bias``
      the inverse softplus of a log-uniform Δ in [0.001, 0.1], ``D`` ones).

  Raises:
    ValueError: for sizes that are not positive, ``n_groups`` not dividing
      ``num_heads``, a ``time_step_limit`` that is not ``0 ≤ low ≤ high``, or inputs
      that are not ``[B, T, F]``.

  Examples:
    >>> mixer = nn.Mamba2Mixer(32, num_heads=4, head_dim=16, state_size=8, n_groups=2,
    ...                        rngs=nnx.Rngs(0))
    >>> mixer.in_proj.kernel.shape, mixer.conv.kernel.shape  # [F, 2·64 + 2·2·8 + 4]
    ((32, 164), (4, 96))
    >>> x = jax.random.normal(jax.random.key(0), (1, 6, 32))
    >>> full = mixer(x)
    >>> mixer.init_cache(x.shape)
    >>> steps = jnp.concatenate([mixer(x[:, :5], decode=True), mixer(x[:, 5:], decode=True)], 1)
    >>> bool(jnp.allclose(steps, full, atol=1e-5))
    True
  """

  def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int = 64,
               state_size: int = 128, n_groups: int = 1, conv_size: int = 4,
               use_conv_bias: bool = True, use_bias: bool = False, norm_eps: float = 1e-5,
               time_step_limit: Sequence[float] = (0.0, math.inf),
               gate_first: bool = True, use_norm: bool = True, in_multiplier: float = 1.0,
               projection_multipliers: Sequence[float] | None = None,
               attention_options: Mapping[str, Any] | None = None,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None,
               kernel_init: Initializer = DEFAULT_KERNEL_INIT, rngs: nnx.Rngs):
    fn = "Mamba2Mixer"
    positive = lambda v, name: checks.check_positive_int(v, name=name, fn=fn)  # noqa: E731
    F = self.hidden_size = positive(hidden_size, "hidden_size")
    n = self.num_heads = positive(num_heads, "num_heads")
    P = self.head_dim = positive(head_dim, "head_dim")
    S = self.state_size = positive(state_size, "state_size")
    G = self.n_groups = positive(n_groups, "n_groups")
    if n % G:
      raise ValueError(f"{fn}: n_groups={G} must divide num_heads={n}.")
    low, high = (float(t) for t in time_step_limit)
    if not 0.0 <= low <= high:
      raise ValueError(f"{fn}: time_step_limit must be (low, high) with 0 <= low <= high; got "
                       f"{tuple(time_step_limit)}.")
    self.time_step_limit = (low, high)
    if projection_multipliers is not None and len(projection_multipliers) != 5:
      raise ValueError(f"{fn}: projection_multipliers are five factors (z, x, B, C, dt); got "
                       f"{projection_multipliers!r}.")
    self.in_multiplier = float(in_multiplier)
    self.projection_multipliers = (None if projection_multipliers is None else
                                   tuple(float(m) for m in projection_multipliers))
    I = self.inner_size = n * P  # noqa: E741
    self.conv_features = I + 2 * G * S
    self.dtype = dtype
    self._spec = get_spec("simple_gla")
    self.attention_options = dict(attention_options or {})
    self._spec.build(**self.attention_options)  # Unknown options raise here, naming them.
    self.in_proj = nnx.Linear(F, I + self.conv_features + n, use_bias=use_bias,
                              kernel_init=kernel_init, dtype=dtype, param_dtype=param_dtype,
                              precision=precision, rngs=rngs)
    self.conv = ShortConvolution(self.conv_features, conv_size, use_bias=use_conv_bias,
                                 dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    A_log, dt_bias = mamba2_decay_init(rngs, (n,), (n,), param_dtype)
    self.A_log, self.dt_bias = nnx.Param(A_log), nnx.Param(dt_bias)
    self.D = nnx.Param(jnp.ones((n,), param_dtype))
    self.norm = GatedRMSNorm(I, epsilon=norm_eps, activation="swish",
                             gate_first=bool(gate_first), group_size=I // G, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs) if use_norm else nnx.data(None)
    self.out_proj = nnx.Linear(I, F, use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
                               param_dtype=param_dtype, precision=precision, rngs=rngs)
    self.cache = nnx.data(None)

  def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
    """An empty decode cache for inputs ``(B, C, F)``: the SSD's float32 state
    ``[B, nheads, S, P]`` and the convolution's last ``W - 1`` inputs in ``dtype``."""
    self.cache = nnx.Cache(cache_lib.empty(
        self._spec, batch=input_shape[0], capacity=1, num_heads=self.n_groups,
        num_kv_heads=self.n_groups, head_dim=self.state_size, dtype=jnp.dtype(dtype),
        options=self.attention_options, value_shape=(self.num_heads, self.head_dim)))
    self.conv.init_cache(input_shape, self.dtype or dtype)

  @compiled_call
  def __call__(self, x: jax.Array, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Mixes ``x [B, T, F]`` causally -> ``[B, T, F]``.

    ``segment_ids`` (int ``[B, T]``, non-decreasing): packed documents; the convolution
    and the state restart at each boundary. ``decode`` (after :meth:`init_cache`): the
    next T positions of the sequences in the cache, which advances.
    """
    fn = "Mamba2Mixer"
    ids = check_inputs(x, self.hidden_size, segment_ids, fn=fn)
    if decode and self.cache is None:
      raise ValueError(f"{fn}: decode=True needs a cache: call init_cache first.")
    B, T, _ = x.shape
    n, P, G, S, I = self.num_heads, self.head_dim, self.n_groups, self.state_size, self.inner_size
    if self.in_multiplier != 1.0:
      x = x * jnp.asarray(self.in_multiplier, x.dtype)
    zxbcdt = self.in_proj(x)
    if self.projection_multipliers is not None:
      sizes = (I, I, G * S, G * S, n)
      scale = jnp.concatenate([jnp.full((size,), m, zxbcdt.dtype) for size, m in
                               zip(sizes, self.projection_multipliers, strict=True)])
      zxbcdt = zxbcdt * scale[None, None]
    z, xbc, dt = jnp.split(zxbcdt, [I, I + self.conv_features], axis=-1)
    xbc = self.conv(xbc, decode=decode, segment_ids=ids)  # With its SiLU.
    u, b, c = jnp.split(xbc, [I, I + G * S], axis=-1)
    f32 = jnp.float32
    dt = jax.nn.softplus(dt.astype(f32) + expand_to(self.dt_bias.get_value().astype(f32), dt))
    dt = jnp.clip(dt, *self.time_step_limit)  # [B, T, n]
    A = -jnp.exp(self.A_log.get_value().astype(f32))
    u = u.reshape(B, T, n, P)
    q, k = c.reshape(B, T, G, S), b.reshape(B, T, G, S)
    v = (u.astype(f32) * dt[..., None]).astype(u.dtype)
    gates = {"log_decay": dt * expand_to(A, dt)}
    options = {"scale": 1.0} | self.attention_options
    if decode:
      before = self.cache.get_value()
      cache, y = cache_lib.state_decode(self._spec, before, q, k, v, options=options,
                                        gates=gates, segment_ids=ids)
      self.cache.set_value(cache)
    else:
      packed = {} if ids is None else {"segment_ids": ids}
      y = self._spec.function(q, k, v, is_causal=True, **packed, **options, **gates)
    y = y.astype(f32) + u.astype(f32) * expand_to(self.D.get_value().astype(f32)[:, None], u)
    y = y.reshape(B, T, I).astype(self.dtype or x.dtype)
    y = y * jax.nn.silu(z) if self.norm is None else self.norm(y, z)
    return self.out_proj(y)


class MambaMixer(nnx.Module):
  """Mamba-1's token mixer: the selective scan over E channels, each with a state of S.

  From ``x [B, T, F]``: ``in_proj(x) = [u | z]`` (E each); ``u ← silu(conv(u))`` (causal
  depthwise, width W, with bias); ``x_proj(u) = [δ (R) | B (S) | C (S)]``;
  ``Δ = softplus(dt_proj(δ))`` ``[B, T, E]`` (``dt_proj`` has the bias); ``A = -exp(A_log)``
  ``[E, S]``; ``y = selective_scan(u, Δ, A, B, C, D)``; ``out = out_proj(y ⊙ silu(z))``.

  The parameters, with their names in transformers' ``MambaMixer``:

  =================== ============= ======================
  ours                shape         transformers
  =================== ============= ======================
  ``in_proj.kernel``  [F, 2E]       ``in_proj.weight``
  ``in_proj.bias``    [2E]          ``in_proj.bias`` (``use_bias``)
  ``conv.kernel``     [W, E]        ``conv1d.weight``
  ``conv.bias``       [E]           ``conv1d.bias`` (``use_conv_bias``)
  ``x_proj.kernel``   [E, R + 2S]   ``x_proj.weight``
  ``dt_proj.kernel``  [R, E]        ``dt_proj.weight``
  ``dt_proj.bias``    [E]           ``dt_proj.bias``
  ``A_log``           [E, S]        ``A_log``
  ``D``               [E]           ``D``
  ``out_proj.kernel`` [E, F]        ``out_proj.weight``
  ``out_proj.bias``   [F]           ``out_proj.bias`` (``use_bias``)
  ``dt_norm.scale``   [R]           ``dt_layernorm.weight`` (Jamba)
  ``b_norm.scale``    [S]           ``b_layernorm.weight`` (Jamba)
  ``c_norm.scale``    [S]           ``c_layernorm.weight`` (Jamba)
  =================== ============= ======================

  Jamba and Falcon-Mamba RMS-normalise ``δ``, B and C after ``x_proj``
  (``inner_norm``): Jamba with learned scales, Falcon-Mamba without.

  Args:
    hidden_size: F.
    intermediate_size: E (default 2F).
    state_size: S.
    conv_size: W.
    time_step_rank: R (default ``ceil(F / 16)``).
    use_conv_bias: the convolution's bias.
    use_bias: the in- and out-projections' biases.
    inner_norm: None, ``"learned"`` (Jamba's RMSNorms with scales) or ``"weightless"``
      (Falcon-Mamba's) on ``δ``, B and C.
    inner_norm_eps: their eps.
    chunk_size: the scan's chunk length (:func:`~linattn_jax.selective_scan`).
    implementation: the scan's form.
    dtype, param_dtype, precision, kernel_init: the projections' settings, as in
      ``flax.nnx.Linear``.
    rngs: ``params`` draws the weights (``A_log = log(1..S)`` per channel, ``dt_proj.bias``
      the inverse softplus of a log-uniform Δ in [0.001, 0.1], ``D`` ones).

  Raises:
    ValueError: for sizes that are not positive or inputs that are not ``[B, T, F]``.

  Examples:
    >>> mixer = nn.MambaMixer(16, state_size=4, rngs=nnx.Rngs(0))
    >>> mixer.A_log.shape, mixer.x_proj.kernel.shape  # [E, S], [E, R + 2S]
    ((32, 4), (32, 9))
    >>> x = jax.random.normal(jax.random.key(0), (1, 6, 16))
    >>> full = mixer(x)
    >>> mixer.init_cache(x.shape)
    >>> steps = jnp.concatenate([mixer(x[:, :5], decode=True), mixer(x[:, 5:], decode=True)], 1)
    >>> bool(jnp.allclose(steps, full, atol=1e-5))
    True

  References:
    Gu and Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023.
  """

  def __init__(self, hidden_size: int, *, intermediate_size: int | None = None,
               state_size: int = 16, conv_size: int = 4, time_step_rank: int | None = None,
               use_conv_bias: bool = True, use_bias: bool = False,
               inner_norm: str | None = None, inner_norm_eps: float = 1e-6,
               chunk_size: int | None = None, implementation: str | None = None,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None,
               kernel_init: Initializer = DEFAULT_KERNEL_INIT, rngs: nnx.Rngs):
    fn = "MambaMixer"
    positive = lambda v, name: checks.check_positive_int(v, name=name, fn=fn)  # noqa: E731
    F = self.hidden_size = positive(hidden_size, "hidden_size")
    E = self.intermediate_size = 2 * F if intermediate_size is None else positive(
        intermediate_size, "intermediate_size")
    S = self.state_size = positive(state_size, "state_size")
    R = self.time_step_rank = math.ceil(F / 16) if time_step_rank is None else positive(
        time_step_rank, "time_step_rank")
    self.scan_options = {"chunk_size": chunk_size, "implementation": implementation}
    check_options(chunk_size, implementation, fn=fn)  # A bad option raises here, naming it.
    self.dtype = dtype
    linear = lambda i, o, bias, **kw: nnx.Linear(  # noqa: E731
        i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, precision=precision,
        rngs=rngs, **({"kernel_init": kernel_init} | kw))
    self.in_proj = linear(F, 2 * E, use_bias)
    self.conv = ShortConvolution(E, conv_size, use_bias=use_conv_bias, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)
    self.x_proj = linear(E, R + 2 * S, False)
    _, dt_bias = mamba2_decay_init(rngs, (1,), (E,), param_dtype)
    bound = R ** -0.5
    self.dt_proj = linear(R, E, True, kernel_init=nnx.initializers.uniform(2 * bound),
                          bias_init=lambda *_: dt_bias)
    self.dt_proj.kernel.set_value(self.dt_proj.kernel.get_value() - bound)  # U(±R^-½).
    self.A_log = nnx.Param(jnp.log(jnp.broadcast_to(jnp.arange(1, S + 1, dtype=jnp.float32),
                                                    (E, S))).astype(param_dtype))
    self.D = nnx.Param(jnp.ones((E,), param_dtype))
    self.out_proj = linear(E, F, use_bias)
    self.inner_norm = checks.check_choice(inner_norm, name="inner_norm",
                                          choices=[None, "learned", "weightless"], fn=fn)
    self.dt_norm = self.b_norm = self.c_norm = nnx.data(None)
    if inner_norm is not None:
      norm = lambda n: GatedRMSNorm(  # noqa: E731
          n, epsilon=inner_norm_eps, activation=None, use_scale=inner_norm == "learned",
          param_dtype=param_dtype, rngs=rngs)
      self.dt_norm, self.b_norm, self.c_norm = norm(R), norm(S), norm(S)
    self.cache = self.cache_id = nnx.data(None)

  def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
    """An empty decode cache for inputs ``(B, C, F)``: the scan's float32 state
    ``[B, E, S]``, the last decoded token's document id, and the convolution's last
    ``W - 1`` inputs in ``dtype``."""
    B = input_shape[0]
    self.cache = nnx.Cache(SelectiveState(jnp.zeros((B, self.intermediate_size,
                                                     self.state_size), jnp.float32)))
    self.cache_id = nnx.Cache(jnp.zeros((B,), jnp.int32))
    self.conv.init_cache(input_shape, self.dtype or dtype)

  @compiled_call
  def __call__(self, x: jax.Array, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Mixes ``x [B, T, F]`` causally -> ``[B, T, F]`` (``decode``, ``segment_ids``: as
    :class:`Mamba2Mixer`)."""
    fn = "MambaMixer"
    ids = check_inputs(x, self.hidden_size, segment_ids, fn=fn)
    if decode and self.cache is None:
      raise ValueError(f"{fn}: decode=True needs a cache: call init_cache first.")
    B, T, _ = x.shape
    S, R = self.state_size, self.time_step_rank
    u, z = jnp.split(self.in_proj(x), 2, axis=-1)
    u = self.conv(u, decode=decode, segment_ids=ids)  # With its SiLU.
    delta, b, c = jnp.split(self.x_proj(u), [R, R + S], axis=-1)
    if self.inner_norm is not None:
      delta, b, c = self.dt_norm(delta), self.b_norm(b), self.c_norm(c)
    dt = jax.nn.softplus(self.dt_proj(delta).astype(jnp.float32))
    A = -jnp.exp(self.A_log.get_value().astype(jnp.float32))
    state = None
    if decode:
      state, last = self.cache.get_value(), self.cache_id.get_value()
      if ids is None:  # The tokens continue the last one's document.
        ids = jnp.broadcast_to(last[:, None], (B, T))
      state = SelectiveState(jnp.where((ids[:, 0] == last)[:, None, None], state.h, 0.0))
    y, state = selective_scan(u, dt.astype(u.dtype), A, b[:, :, None], c[:, :, None],
                              self.D.get_value().astype(jnp.float32), segment_ids=ids,
                              initial_state=state, return_state=True, **self.scan_options)
    if decode:
      self.cache.set_value(state)
      self.cache_id.set_value(ids[:, -1])
    return self.out_proj(y * jax.nn.silu(z))


class ShortConvMixer(nnx.Module):
  """LFM2's gated short convolution: ``out_proj(C ⊙ conv(B ⊙ x))``.

  ``in_proj(x) = [B | C | x']`` (each F wide); the input gate ``B ⊙ x'`` runs through a
  causal depthwise convolution of width W (no activation), the output gate C multiplies
  the result. Decoding keeps the convolution's last ``W - 1`` inputs; ``segment_ids``
  restarts it at each packed document.

  The parameters, with their names in transformers' ``Lfm2ShortConv``:

  =================== ========== =====================
  ours                shape      transformers
  =================== ========== =====================
  ``in_proj.kernel``  [F, 3F]    ``in_proj.weight``
  ``conv.kernel``     [W, F]     ``conv.weight``
  ``out_proj.kernel`` [F, F]     ``out_proj.weight``
  =================== ========== =====================

  (``in_proj.bias``, ``conv.bias`` and ``out_proj.bias`` with ``use_bias``, LFM2's
  ``conv_bias``.)

  Args:
    hidden_size: F.
    conv_size: W (LFM2's ``conv_L_cache``, 3).
    use_bias: the projections' and the convolution's biases.
    dtype, param_dtype, precision, kernel_init: as in ``flax.nnx.Linear``.
    rngs: ``params`` draws the weights.

  Examples:
    >>> mixer = nn.ShortConvMixer(16, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    >>> full = mixer(x)
    >>> mixer.init_cache(x.shape)
    >>> steps = jnp.concatenate([mixer(x[:, :2], decode=True), mixer(x[:, 2:], decode=True)], 1)
    >>> bool(jnp.allclose(steps, full, atol=1e-6))
    True

  Reference: Liquid AI, "LFM2" (its short-convolution operator), 2025; Poli et al.,
  "Hyena Hierarchy", 2023 (gated convolutions).
  """

  def __init__(self, hidden_size: int, *, conv_size: int = 3, use_bias: bool = False,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None,
               kernel_init: Initializer = DEFAULT_KERNEL_INIT, rngs: nnx.Rngs):
    F = self.hidden_size = checks.check_positive_int(hidden_size, name="hidden_size",
                                                     fn="ShortConvMixer")
    linear = lambda i, o: nnx.Linear(  # noqa: E731
        i, o, use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
        param_dtype=param_dtype, precision=precision, rngs=rngs)
    self.in_proj, self.out_proj = linear(F, 3 * F), linear(F, F)
    self.conv = ShortConvolution(F, conv_size, activation=None, use_bias=use_bias, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)

  def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
    """An empty decode cache for inputs ``(B, C, F)``: the convolution's last inputs."""
    self.conv.init_cache(input_shape, dtype)

  @compiled_call
  def __call__(self, x: jax.Array, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Mixes ``x [B, T, F]`` causally -> ``[B, T, F]`` (``decode``, ``segment_ids``: as
    :class:`Mamba2Mixer`)."""
    ids = check_inputs(x, self.hidden_size, segment_ids, fn="ShortConvMixer")
    b, c, h = jnp.split(self.in_proj(x), 3, axis=-1)
    return self.out_proj(c * self.conv(b * h, decode=decode, segment_ids=ids))
