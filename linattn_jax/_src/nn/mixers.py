"""Token mixers: the layers that released linear-attention models wrap around a recurrence.

A released model never runs the bare recurrence. Its token mixer projects q, k
and v, runs each through a short causal depthwise convolution, projects the
recurrence's gates from the input, and after the recurrence normalises each
head and multiplies it by an output gate. This module holds
:class:`RecurrentMixer`, the mixer of Gated DeltaNet, KDA, GLA, simple GLA, RetNet and
DeltaNet (one class whose :class:`Recipe` says which parts of ``parts.py`` each uses),
and :func:`token_mixer`, every paper's mixer by name (RWKV-7's is ``rwkv7.py``).

Letters: B batch, T length, F model width (``hidden_size``), N query heads, K key heads,
V value heads (V = r·K: grouped value heads), H key head dim, D value head dim,
W convolution width, R a low rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype, Initializer, PrecisionLike, Shape

from linattn_jax._src import checks
from linattn_jax._src.delta_product import delta_product_attention, steps_in_order
from linattn_jax._src.nn import cache as cache_lib
from linattn_jax._src.nn.compiled import compiled_call
from linattn_jax._src.nn.gates import (
    GLA_GATE_NORMALIZER,
    GLA_GATE_RANK,
    l2_normalize,
    lightning_slopes,
    mamba2_decay_init,
)
from linattn_jax._src.nn.parts import (
    DEFAULT_KERNEL_INIT,
    GatedRMSNorm,
    LowRank,
    ShortConvolution,
    check_inputs,
    expand_to,
    rotary,
    segment_positions,
)
from linattn_jax._src.nn.rwkv7 import RWKV7TimeMixer
from linattn_jax._src.nn.state_space import Mamba2Mixer, MambaMixer, ShortConvMixer
from linattn_jax._src.registry import Role, get_spec


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Which parts a paper's token mixer uses (see :class:`RecurrentMixer`); holds no arrays.

  Attributes:
    attention: the registered recurrence.
    reference: the reference layer (flash-linear-attention's class).
    decay: how the decay is projected: ``"lightning"`` (fixed per head, set by the
      layer's depth: MiniMax's), ``"mamba2"`` (per value head,
      ``-exp(A_log) softplus(x W_a + dt_bias)``), ``"kda"`` (per value head and key
      feature, ``-exp(A_log) softplus(x W_down W_up + dt_bias)``), ``"gla"`` (per key
      feature, ``log_sigmoid(x W_down W_up + b) / 16``), ``"logsigmoid"`` (per head,
      ``log_sigmoid(x W + b) / 16``) or None (none, or fixed in the recurrence).
    beta: a write strength ``sigmoid(x W_b)`` per value head (the delta rules).
    short_conv: the paper's default for the short convolutions on q, k and v.
    unit_qk: L2-normalised queries and keys per head.
    output_gate: the paper's default output gate: ``"swish"``, ``"sigmoid"`` or None
      (the norm alone).
    low_rank_gate: the output gate's projection goes through rank D (KDA).
    expand_v: the paper's default D / H.
    householder: the paper's default n, delta-rule steps per token (Gated DeltaProduct's
      n Householder factors; 1 for the others).
    neg_eigval: the paper's default for ``β = 2 σ(x W_b)`` (β in [0, 2], transitions
      with negative eigenvalues) rather than ``σ(x W_b)``.
    rotary: the paper's default for the rotary position embedding of q and k
      (:func:`rotary`, at each token's position in its document: RetNet's).
    qkv_silu: SiLU on q, k and v without a convolution (MiniMax's).
    norm_over_heads: the output norm over every head's channels at once, not per head.
    scale: the recurrence's query scale (default: its own, ``H^-1/2``).

  Examples:
    >>> recipe = nn.RecurrentMixer("kda", 32, 2, rngs=nnx.Rngs(0)).recipe
    >>> recipe.attention, recipe.decay, recipe.output_gate
    ('kda', 'kda', 'sigmoid')
  """

  attention: str
  reference: str
  decay: str | None = None
  beta: bool = False
  short_conv: bool = True
  unit_qk: bool = False
  output_gate: str | None = "swish"
  low_rank_gate: bool = False
  expand_v: float = 1.0
  householder: int = 1
  neg_eigval: bool = False
  rotary: bool = False
  qkv_silu: bool = False
  norm_over_heads: bool = False
  scale: float | None = None


RECIPES: Mapping[str, Recipe] = {
    "gated_deltanet": Recipe("gated_delta_net", "GatedDeltaNet", decay="mamba2", beta=True,
                             unit_qk=True, expand_v=2.0),
    # Gated DeltaNet over n steps per token (delta_product.py lays them out in order).
    "gated_deltaproduct": Recipe("gated_delta_net", "GatedDeltaProduct", decay="mamba2",
                                 beta=True, unit_qk=True, expand_v=2.0, householder=2,
                                 neg_eigval=True),
    "kda": Recipe("kda", "KimiDeltaAttention", decay="kda", beta=True, unit_qk=True,
                  output_gate="sigmoid", low_rank_gate=True),
    "gla": Recipe("gla", "GatedLinearAttention", decay="gla", short_conv=False),
    "simple_gla": Recipe("simple_gla", "SimpleGatedLinearAttention", decay="logsigmoid"),
    "retnet": Recipe("retention", "MultiScaleRetention", short_conv=False, expand_v=2.0,
                     rotary=True),
    "deltanet": Recipe("delta_net", "DeltaNet", beta=True, unit_qk=True, output_gate=None),
    # MiniMax-01's lightning attention: fixed decays, no convolution, one norm over heads.
    "lightning": Recipe("simple_gla", "MiniMaxLightningAttention", decay="lightning",
                        short_conv=False, output_gate="sigmoid", qkv_silu=True,
                        norm_over_heads=True, scale=1.0),
}


class RecurrentMixer(nnx.Module):
  """The token mixer of a gated or delta-rule paper (Gated DeltaNet, KDA, ...), by ``name``.

  ``out = o_proj(GatedRMSNorm(recurrence(q, k, v, gates), g))`` with, from the input
  ``x [B, T, F]``: ``q = conv_q(x W_q)`` ``[B, T, N, H]``, ``k = conv_k(x W_k)``
  ``[B, T, K, H]``, ``v = conv_v(x W_v)`` ``[B, T, V, D]`` (short causal convolutions
  with SiLU; without them, SiLU alone for the delta rules and nothing for the
  others, as the papers), q and k L2-normalised per head for the delta rules, the
  gates below, and the output gate ``g = x W_g`` per output head. ``name`` is one of
  the recipes below; each recipe names its recurrence and reference layer:

  ================== ==================== ========================== =====================
  name               recurrence           reference layer            decay
  ================== ==================== ========================== =====================
  gated_deltanet     ``gated_delta_net``  GatedDeltaNet              Mamba2, per head
  gated_deltaproduct ``gated_delta_net``  GatedDeltaProduct          Mamba2, per head
  kda                ``kda``              KimiDeltaAttention         KDA, per key feature
  gla                ``gla``              GatedLinearAttention       low-rank, per feature
  simple_gla         ``simple_gla``       SimpleGatedLinearAttention log-sigmoid, per head
  retnet             ``retention``        MultiScaleRetention        fixed per head
  deltanet           ``delta_net``        DeltaNet                   none
  lightning          ``simple_gla``       MiniMaxLightningAttention  fixed per head, by depth
  ================== ==================== ========================== =====================

  MiniMax-01's lightning attention (``lightning``) runs SiLU on q, k and v (no
  convolution), reads with scale 1, decays head h by ``exp(-s_h)`` with
  ``s_h = 2^(-8(h+1)/N) (1 - l / (L - 1 + 10⁻⁵) + 10⁻⁵)`` for layer l of L
  (``layer_index``, ``num_layers``; the non-trainable ``slope [N]``), and normalises the
  output over all heads' channels at once before its sigmoid gate.

  Gated DeltaProduct writes n keys per token (``num_householder``, default 2): k, v and
  β are projected n times over, and the token's decay, then its n delta-rule writes, then
  its query run as :func:`~linattn_jax.delta_product_attention` (decoding: as n steps of
  Gated DeltaNet, laid out as that function lays them; the decode state is Gated
  DeltaNet's). Its β is ``2 σ(x W_b)`` by default (``allow_neg_eigval``), as the
  reference layer's.

  The parameters, with their names and shapes in the reference layers
  (flash-linear-attention's ``fla.layers``; a PyTorch ``Linear``'s ``weight`` is our
  ``kernel`` transposed, a ``ShortConvolution``'s ``weight [C, 1, W]`` our
  ``kernel [W, C]`` transposed). O = max(N, V) output heads, n steps per token (1 but
  for gated_deltaproduct):

  ======================== ============ =================================== =================
  ours                     shape        reference                           mixers
  ======================== ============ =================================== =================
  ``q_proj.kernel``        [F, N·H]     ``q_proj.weight``                   all
  ``k_proj.kernel``        [F, n·K·H]   ``k_proj.weight``                   all
  ``v_proj.kernel``        [F, n·V·D]   ``v_proj.weight``                   all
  ``q_conv.kernel``        [W, N·H]     ``q_conv1d.weight``                 with short_conv
  ``k_conv.kernel``        [W, n·K·H]   ``k_conv1d.weight``                 with short_conv
  ``v_conv.kernel``        [W, n·V·D]   ``v_conv1d.weight``                 with short_conv
  ``a_proj.kernel``        [F, V]       ``a_proj.weight``                   Mamba2 decays
  ``A_log``                [V]          ``A_log``                           Mamba2 decays, kda
  ``dt_bias``              [V]          ``dt_bias``                         Mamba2 decays
  ``dt_bias``              [V·H]        ``dt_bias``                         kda
  ``f_proj.down.kernel``   [F, D]       ``f_proj.0.weight``                 kda
  ``f_proj.up.kernel``     [D, V·H]     ``f_proj.1.weight``                 kda
  ``f_proj.kernel``        [F, V·H]     ``f_proj.weight`` (Bailing's)       kda, full rank
  ``gk_proj.down.kernel``  [F, 16]      ``gk_proj.0.weight``                gla
  ``gk_proj.up.kernel``    [16, V·H]    ``gk_proj.1.weight``                gla
  ``gk_proj.up.bias``      [V·H]        ``gk_proj.1.bias``                  gla
  ``gk_proj.kernel``       [F, V]       ``gk_proj.weight``                  simple_gla
  ``gk_proj.bias``         [V]          ``gk_proj.bias``                    simple_gla
  ``b_proj.kernel``        [F, n·V]     ``b_proj.weight``                   delta rules
  ``g_proj.kernel``        [F, O·D]     ``g_proj.weight``                   with output_gate
  ``g_proj.down.kernel``   [F, D]       ``g_proj.0.weight``                 kda
  ``g_proj.up.kernel``     [D, O·D]     ``g_proj.1.weight``                 kda
  ``g_proj.up.bias``       [O·D]        ``g_proj.1.bias``                   kda
  ``o_norm.scale``         [D]          ``o_norm.weight`` /                 all but lightning
                                        ``g_norm_swish_gate.weight``
  ``o_norm.scale``         [O·D]        ``norm.weight`` (MiniMax's)         lightning
  ``o_proj.kernel``        [O·D, F]     ``o_proj.weight``                   all
  ``slope``                [N]          ``slope_rate`` (MiniMax's)          lightning
  ======================== ============ =================================== =================

  The decays: ``-exp(A_log) softplus(x W_a + dt_bias)`` ``[B, T, V]`` (Gated
  DeltaNet, Mamba2's); ``-exp(A_log_v) softplus(x W_down W_up + dt_bias)``
  ``[B, T, V, H]`` (KDA); ``log_sigmoid(x W_down W_up + b) / 16`` ``[B, T, V, H]``
  (GLA); ``log_sigmoid(x W + b) / 16`` ``[B, T, V]`` (simple GLA); RetNet's fixed
  decays ``log(1 - 2^(-5 - h))`` live in its recurrence. The write strength of the
  delta rules is ``sigmoid(x W_b)`` ``[B, T, V]`` (``2 sigmoid(x W_b)`` with
  ``allow_neg_eigval``). ``A_log`` starts at ``log U(1, 16)``
  and ``dt_bias`` at the inverse softplus of a log-uniform dt in [0.001, 0.1].

  RetNet turns q and k by their positions (``rotary``: :func:`rotary`, base 10,000,
  halves layout, as the reference layer's ``RotaryEmbedding``); a position counts from
  its document's start, and from the cache's position when decoding.

  Not here: the reference GLA's ``feature_map`` and ``clamp_min`` options (off in its
  default configuration).

  Args:
    name: a recipe (the table above).
    hidden_size: F.
    num_heads: N (and K unless ``num_kv_heads``).
    head_dim: H (default F // N).
    num_kv_heads: K (default N): fewer key/value heads than query heads (GQA; gla,
      simple_gla, retnet).
    num_v_heads: V (default K): more value heads than key heads (grouped value heads,
      V = r·K with N = K; the gated family and the delta rules).
    expand_v: D / H (default the paper's: 2 for gated_deltanet and retnet, else 1).
    short_conv: short convolutions on q, k and v (default the paper's: off for gla and
      retnet).
    conv_size: their width W.
    num_householder: n, delta-rule steps per token (default the recipe's: 2 for
      gated_deltaproduct, else 1; more than 1 for the delta rules only).
    allow_neg_eigval: ``β = 2 σ(x W_b)`` in [0, 2] (default the recipe's: on for
      gated_deltaproduct; the delta rules only).
    rotary: the rotary position embedding of q and k (default the recipe's: on for
      retnet; H must be even).
    output_gate: multiply the normed output by its gate (default the paper's: off for
      deltanet only; on, its activation is the recipe's, swish unless kda).
    gate_bias: the low-rank output gate's bias ``g_proj.up.bias`` (kda only; default on,
      as flash-linear-attention's layer; Kimi Linear's checkpoints have none).
    low_rank_gate: the output gate through rank D (default the recipe's: kda's); off, a
      full-rank ``g_proj.kernel [F, O·D]`` (Bailing's KDA).
    low_rank_decay: KDA's decay projection through rank D (default on); off, a full-rank
      ``f_proj.kernel [F, V·H]`` (Bailing's).
    decay_bound: KDA's bounded gate ``g = bound · σ(exp(A_log) (x W_f + dt_bias))`` in
      ``(bound, 0)`` (Bailing's ``kda_lower_bound``, e.g. -5) instead of
      ``-exp(A_log) softplus(x W_f + dt_bias)``.
    norm_eps: the output norm's eps.
    layer_index, num_layers: l and L, which set lightning's decays (lightning only).
    attention_options: the recurrence's options, e.g. ``{"chunk_size": 32}``.
    dtype, param_dtype, precision, kernel_init: the projections' settings, as in
      ``flax.nnx.Linear``.
    rngs: ``params`` draws the weights.

  Raises:
    ValueError: for an unknown ``name`` or recurrence option, head counts that do not
      divide, a D that is not an integer, ``num_householder`` or ``allow_neg_eigval``
      for a mixer without the delta rule, ``rotary`` with an odd H, or inputs that are
      not ``[B, T, F]``.

  Examples:
    >>> mixer = nn.RecurrentMixer("gated_deltanet", 32, num_heads=2, num_v_heads=4,
    ...                           rngs=nnx.Rngs(0))
    >>> mixer.v_proj.kernel.shape, mixer.A_log.shape  # [F, V·D] (D = 2·H = 32), [V]
    ((32, 128), (4,))
    >>> x = jax.random.normal(jax.random.key(0), (1, 6, 32))
    >>> full = mixer(x)
    >>> mixer.init_cache(x.shape)
    >>> steps = jnp.concatenate([mixer(x[:, :4], decode=True), mixer(x[:, 4:5], decode=True),
    ...                          mixer(x[:, 5:], decode=True)], axis=1)
    >>> bool(jnp.allclose(steps, full, atol=1e-5))
    True

  References:
    Yang et al., "Gated Delta Networks: Improving Mamba2 with Delta Rule", 2025.
    Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture", 2025.
    Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient
    Training", 2024. Sun et al., "Retentive Network", 2023. Yang et al.,
    "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", 2024.
    Qwen Team, Qwen3-Next, 2025 (grouped value heads). Siems et al., "DeltaProduct:
    Improving State-Tracking in Linear RNNs via Householder Products", 2025. Grazzi et
    al., "Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues", 2025.
  """

  def __init__(self, name: str, hidden_size: int, num_heads: int, *,
               head_dim: int | None = None, num_kv_heads: int | None = None,
               num_v_heads: int | None = None, expand_v: float | None = None,
               short_conv: bool | None = None, conv_size: int = 4,
               num_householder: int | None = None, allow_neg_eigval: bool | None = None,
               rotary: bool | None = None, output_gate: bool | None = None,
               gate_bias: bool | None = None, low_rank_gate: bool | None = None,
               low_rank_decay: bool | None = None, decay_bound: float | None = None,
               norm_eps: float = 1e-5,
               layer_index: int | None = None, num_layers: int | None = None,
               attention_options: Mapping[str, Any] | None = None,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None,
               kernel_init: Initializer = DEFAULT_KERNEL_INIT, rngs: nnx.Rngs):
    fn = "RecurrentMixer"
    recipe = RECIPES[checks.check_choice(name, name="name", choices=list(RECIPES), fn=fn)]
    self.name, self.recipe = name, recipe
    F = self.hidden_size = checks.check_positive_int(hidden_size, name="hidden_size", fn=fn)
    N = checks.check_positive_int(num_heads, name="num_heads", fn=fn)
    K = N if num_kv_heads is None else checks.check_positive_int(num_kv_heads,
                                                                 name="num_kv_heads", fn=fn)
    V = K if num_v_heads is None else checks.check_positive_int(num_v_heads,
                                                                name="num_v_heads", fn=fn)
    H = F // N if head_dim is None else checks.check_positive_int(head_dim, name="head_dim",
                                                                  fn=fn)
    expand_v = recipe.expand_v if expand_v is None else expand_v
    D = int(round(H * expand_v))
    if N % K or V % K:
      raise ValueError(f"{fn}: num_heads={N} and num_v_heads={V} must be multiples of "
                       f"num_kv_heads={K}." if N % K else
                       f"{fn}: num_v_heads={V} must be a multiple of num_kv_heads={K}.")
    if V > K and N != K:
      raise ValueError(f"{fn}: grouped value heads (num_v_heads={V} > num_kv_heads={K}) "
                       f"take as many query heads as key heads; got num_heads={N}.")
    if D < 1 or not math.isclose(D, H * expand_v):
      raise ValueError(f"{fn}: the value head dim head_dim·expand_v = {H}·{expand_v} must "
                       "be a positive integer.")
    n = recipe.householder if num_householder is None else checks.check_positive_int(
        num_householder, name="num_householder", fn=fn)
    neg = recipe.neg_eigval if allow_neg_eigval is None else bool(allow_neg_eigval)
    if (n > 1 or neg) and not recipe.beta:
      raise ValueError(f"{fn}: num_householder={n} and allow_neg_eigval={neg} act on the "
                       f"delta rule's writes; {name!r} has none.")
    self.num_householder, self.allow_neg_eigval = n, neg
    self.rotary = recipe.rotary if rotary is None else bool(rotary)
    if self.rotary and H % 2:
      raise ValueError(f"{fn}: rotary turns pairs of features; head_dim={H} is odd.")
    self.num_heads, self.num_kv_heads, self.num_v_heads = N, K, V
    self.head_dim, self.value_dim = H, D
    O = max(N, V)  # Output heads: the queries' (GQA) or the values' (grouped values).
    self.dtype = dtype
    self._spec = spec = get_spec(recipe.attention)
    self.attention_options = dict(attention_options or {})
    spec.build(**self.attention_options)  # Unknown options raise here, naming them.
    # The recipe's query scale (lightning's 1), unless the options give one.
    self._options = ({} if recipe.scale is None else {"scale": recipe.scale}
                     ) | self.attention_options
    roles = {x.role: x.name for x in spec.token_inputs}
    self._decay_name, self._beta_name = roles.get(Role.DECAY), roles.get(Role.WRITE_STRENGTH)
    self.short_conv = recipe.short_conv if short_conv is None else bool(short_conv)
    gate = recipe.output_gate if output_gate is None else (
        (recipe.output_gate or "swish") if output_gate else None)

    def linear(i, o, *, use_bias=False, dtype=dtype):
      return nnx.Linear(i, o, use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
                        param_dtype=param_dtype, precision=precision, rngs=rngs)

    self.q_proj, self.k_proj = linear(F, N * H), linear(F, n * K * H)
    self.v_proj = linear(F, n * V * D)
    conv = lambda c: ShortConvolution(c, conv_size, dtype=dtype,  # noqa: E731
                                      param_dtype=param_dtype, rngs=rngs)
    self.q_conv = conv(N * H) if self.short_conv else nnx.data(None)
    self.k_conv = conv(n * K * H) if self.short_conv else nnx.data(None)
    self.v_conv = conv(n * V * D) if self.short_conv else nnx.data(None)
    f32 = jnp.float32
    low_rank = lambda i, r, o, **kw: LowRank(  # noqa: E731
        i, r, o, down_init=kernel_init, up_init=kernel_init, dtype=f32,
        param_dtype=param_dtype, precision=precision, rngs=rngs, **kw)
    self.a_proj = self.f_proj = self.gk_proj = self.b_proj = nnx.data(None)
    self.A_log = self.dt_bias = nnx.data(None)
    if recipe.decay in ("mamba2", "kda"):
      dt_shape = (V,) if recipe.decay == "mamba2" else (V * H,)
      A_log, dt_bias = mamba2_decay_init(rngs, (V,), dt_shape, param_dtype)
      self.A_log, self.dt_bias = nnx.Param(A_log), nnx.Param(dt_bias)
    if recipe.decay == "mamba2":
      self.a_proj = linear(F, V, dtype=f32)
    elif recipe.decay == "kda":
      self.f_proj = (low_rank(F, D, V * H, use_bias=False) if low_rank_decay in (None, True)
                     else linear(F, V * H, dtype=f32))
    elif recipe.decay == "gla":
      self.gk_proj = low_rank(F, GLA_GATE_RANK, V * H)
    elif recipe.decay == "logsigmoid":
      self.gk_proj = linear(F, V, use_bias=True, dtype=f32)
    if recipe.beta:
      self.b_proj = linear(F, n * V, dtype=f32)
    if (low_rank_decay is not None or decay_bound is not None) and recipe.decay != "kda":
      raise ValueError(f"{fn}: low_rank_decay and decay_bound shape KDA's decay; {name!r} has "
                       "none of its own.")
    if decay_bound is not None and not decay_bound < 0:
      raise ValueError(f"{fn}: decay_bound must be negative; got {decay_bound!r}.")
    self.decay_bound = decay_bound
    low_rank_gate = recipe.low_rank_gate if low_rank_gate is None else bool(low_rank_gate)
    if gate_bias is not None and not (low_rank_gate and gate is not None):
      raise ValueError(f"{fn}: gate_bias is the low-rank output gate's bias; {name!r} "
                       f"{'has a full-rank gate' if gate is not None else 'has no output gate'}.")
    self.g_proj = nnx.data(None)
    if gate is not None:
      self.g_proj = (LowRank(F, D, O * D, down_init=kernel_init, up_init=kernel_init,
                             use_bias=True if gate_bias is None else bool(gate_bias),
                             dtype=dtype, param_dtype=param_dtype, precision=precision,
                             rngs=rngs)
                     if low_rank_gate else linear(F, O * D))
    self.o_norm = GatedRMSNorm(O * D if recipe.norm_over_heads else D, epsilon=norm_eps,
                               activation=gate, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.slope = nnx.data(None)
    if recipe.decay == "lightning":
      L = 1 if num_layers is None else checks.check_positive_int(num_layers, name="num_layers",
                                                                 fn=fn)
      l = 0 if layer_index is None else layer_index  # noqa: E741
      if not isinstance(l, int) or not 0 <= l < L:
        raise ValueError(f"{fn}: layer_index={layer_index!r} must be in [0, num_layers={L}).")
      self.slope = nnx.Variable(lightning_slopes(N, l, L).astype(param_dtype))
    elif layer_index is not None or num_layers is not None:
      raise ValueError(f"{fn}: layer_index and num_layers set lightning's decays; {name!r} "
                       "takes neither.")
    self.o_proj = linear(O * D, F)
    self.cache = self.position = nnx.data(None)

  def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
    """An empty decode cache for inputs ``(B, C, F)``: the recurrence's float32 state
    ``[B, V, H, D]``, the convolutions' last inputs in ``dtype`` and, with ``rotary``,
    each row's next position in its document (``position [B]`` int32; C is not needed)."""
    B = input_shape[0]
    self.cache = nnx.Cache(cache_lib.empty(
        self._spec, batch=B, capacity=1, num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=jnp.dtype(dtype),
        options=self.attention_options, value_shape=(self.num_v_heads, self.value_dim)))
    for conv in (self.q_conv, self.k_conv, self.v_conv):
      if conv is not None:
        conv.init_cache(input_shape, self.dtype or dtype)
    if self.rotary:  # The next position in each row's document.
      self.position = nnx.Cache(jnp.zeros((B,), jnp.int32))

  def gates(self, x: jax.Array) -> dict[str, jax.Array]:
    """The recurrence's per-token inputs from ``x [B, T, F]``, by keyword, in float32
    (β ``[B, T, n, V]`` for n > 1 steps per token)."""
    recipe, V, H = self.recipe, self.num_v_heads, self.head_dim
    x = x.astype(jnp.float32)
    lead = x.shape[:-1]
    out = {}
    if recipe.decay == "mamba2":
      a = self.a_proj(x)
      dt = jax.nn.softplus(a + expand_to(self.dt_bias.get_value().astype(jnp.float32), a))
      A = jnp.exp(self.A_log.get_value().astype(jnp.float32))
      out[self._decay_name] = -expand_to(A, dt) * dt
    elif recipe.decay == "kda":
      f = self.f_proj(x)
      f = (f + expand_to(self.dt_bias.get_value().astype(jnp.float32), f)).reshape(lead + (V, H))
      a = jnp.exp(self.A_log.get_value().astype(jnp.float32))[:, None]  # [V, 1]
      if self.decay_bound is None:
        out[self._decay_name] = -expand_to(a, f) * jax.nn.softplus(f)
      else:  # The bounded ("safe") gate: g in (decay_bound, 0).
        out[self._decay_name] = self.decay_bound * jax.nn.sigmoid(expand_to(a, f) * f)
    elif recipe.decay == "gla":
      out[self._decay_name] = (jax.nn.log_sigmoid(self.gk_proj(x)) / GLA_GATE_NORMALIZER
                               ).reshape(lead + (V, H))
    elif recipe.decay == "logsigmoid":
      out[self._decay_name] = jax.nn.log_sigmoid(self.gk_proj(x)) / GLA_GATE_NORMALIZER
    elif recipe.decay == "lightning":
      slope = -self.slope.get_value().astype(jnp.float32)
      out[self._decay_name] = jnp.broadcast_to(expand_to(slope, x[..., :1]), lead + (V,))
    if recipe.beta:
      beta = jax.nn.sigmoid(self.b_proj(x)) * (2.0 if self.allow_neg_eigval else 1.0)
      n = self.num_householder
      out[self._beta_name] = beta if n == 1 else beta.reshape(lead + (n, V))
    return out

  @compiled_call
  def __call__(self, x: jax.Array, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Mixes ``x [B, T, F]`` causally -> ``[B, T, F]``.

    ``segment_ids`` (int ``[B, T]``, non-decreasing): packed documents; the
    convolutions and the recurrence restart at each boundary, so each document mixes
    as if alone. ``decode`` (after :meth:`init_cache`): the next T positions of the
    sequences in the cache, which advances (ids omitted: they continue the last
    decoded position's document).
    """
    fn = "RecurrentMixer"
    ids = check_inputs(x, self.hidden_size, segment_ids, fn=fn)
    B, T, _ = x.shape
    if decode and self.cache is None:
      raise ValueError(f"{fn}: decode=True needs a cache: call init_cache first.")
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if self.short_conv:
      q, k, v = (conv(y, decode=decode, segment_ids=ids)
                 for conv, y in ((self.q_conv, q), (self.k_conv, k), (self.v_conv, v)))
    elif self.recipe.unit_qk or self.recipe.qkv_silu:  # SiLU, without the convolution.
      q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
    n = self.num_householder
    steps = () if n == 1 else (n,)  # Keys, values and β: [B, T, n, ·] for n steps.
    q = q.reshape(B, T, self.num_heads, self.head_dim)
    k = k.reshape((B, T) + steps + (self.num_kv_heads, self.head_dim))
    v = v.reshape((B, T) + steps + (self.num_v_heads, self.value_dim))
    if self.recipe.unit_qk:
      q, k = l2_normalize(q), l2_normalize(k)
    if self.rotary:
      if decode:
        positions = segment_positions(ids, (B, T), last_id=self.cache.get_value().segment_id,
                                      offset=self.position.get_value())
        self.position.set_value(positions[:, -1] + 1)
      else:
        positions = segment_positions(ids, (B, T))
      q, k = rotary(q, positions), rotary(k, positions)
    gates = self.gates(x)
    packed = lambda ids: {} if ids is None else {"segment_ids": ids}  # noqa: E731
    if n > 1 and not decode:  # DeltaProduct's chunked form reads each token's last step only.
      o = delta_product_attention(q, k, v, gates[self._beta_name],
                                  log_decay=gates.get(self._decay_name), is_causal=True,
                                  **packed(ids), **self._options)
    else:
      if n > 1:  # The n·T steps in order: each token's decay on its first, query on its last.
        beta, g = gates[self._beta_name], gates.get(self._decay_name)
        q, k, v, beta, g, _, ids, _ = steps_in_order(q, k, v, beta, g, None, ids, fn=fn)
        gates = {self._beta_name: beta} | ({} if g is None else {self._decay_name: g})
      if decode:
        before = self.cache.get_value()
        cache, o = cache_lib.state_decode(self._spec, before, q, k, v,
                                          options=self._options, gates=gates,
                                          segment_ids=ids)
        self.cache.set_value(cache._replace(index=before.index + T))  # Tokens, not steps.
      else:
        o = self._spec.function(q, k, v, is_causal=True, **packed(ids),
                                **self._options, **gates)
      if n > 1:
        o = o.reshape((B, T, n) + o.shape[2:])[:, :, -1]  # Each token's last step.
    g = None
    if self.recipe.norm_over_heads:
      o = o.reshape(B, T, -1)
    if self.g_proj is not None:
      g = self.g_proj(x).reshape(o.shape)
    o = self.o_norm(o, g)
    return self.o_proj(o.reshape(B, T, -1))


def token_mixer(name: str, hidden_size: int, num_heads: int, *, layer_index: int = 0,
                num_layers: int = 1, **options: Any) -> nnx.Module:
  """A paper's token mixer by name (one of :func:`token_mixer_names`), for inputs ``[B, T, F]``.

  A :class:`RecurrentMixer` recipe; ``"rwkv7"`` (:class:`RWKV7TimeMixer`, with
  ``head_dim = hidden_size // num_heads``); ``"mamba2"`` (:class:`Mamba2Mixer` with
  ``num_heads`` heads of ``2·hidden_size // num_heads`` channels, Mamba-2's expand of 2);
  ``"mamba"`` (:class:`MambaMixer`) and ``"lfm2"`` (:class:`ShortConvMixer`), which have
  no heads: ``num_heads`` must still be given (the models' layer signature) and sizes
  nothing there. ``layer_index`` and ``num_layers`` reach RWKV-7 (its value residual and
  initial values) and ``lightning`` (its decays); ``options`` go to the class.

  Raises:
    ValueError: for an unknown name.

  Examples:
    >>> mixer = nn.token_mixer("gla", 32, 4, rngs=nnx.Rngs(0))
    >>> type(mixer).__name__, mixer.recipe.attention
    ('RecurrentMixer', 'gla')
    >>> nn.token_mixer("mamba2", 32, 4, rngs=nnx.Rngs(0)).head_dim  # 2·32 / 4
    16
  """
  checks.check_choice(name, name="name", choices=list(MIXERS), fn="token_mixer")
  if name == "rwkv7":
    return RWKV7TimeMixer(hidden_size, head_dim=hidden_size // num_heads,
                          layer_index=layer_index, num_layers=num_layers, **options)
  if name == "mamba2":
    return Mamba2Mixer(hidden_size, **({"num_heads": num_heads,
                                        "head_dim": 2 * hidden_size // num_heads} | options))
  if name == "mamba":
    return MambaMixer(hidden_size, **options)
  if name == "lfm2":
    return ShortConvMixer(hidden_size, **options)
  if name == "lightning":
    options = {"layer_index": layer_index, "num_layers": num_layers} | options
  return RecurrentMixer(name, hidden_size, num_heads, **options)


MIXERS: tuple[str, ...] = tuple(RECIPES) + ("rwkv7", "mamba", "mamba2", "lfm2")


def token_mixer_names() -> tuple[str, ...]:
  """The names :func:`token_mixer` takes, the recurrent and state-space mixers.

  The :class:`RecurrentMixer` recipes, ``"rwkv7"``, and the state-space and convolution
  mixers ``"mamba"``, ``"mamba2"`` and ``"lfm2"``.

  Takes no arrays.

  Examples:
    >>> print(*nn.token_mixer_names())
    gated_deltanet gated_deltaproduct kda gla simple_gla retnet deltanet lightning rwkv7 mamba
    mamba2 lfm2
  """
  return MIXERS
