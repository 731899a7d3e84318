"""RWKV-7's time mixing ("Goose"), a token mixer of its own: token shift, low-rank gates,
the value residual and the group norm around the ``rwkv7`` recurrence (``dplr.py``).

Letters: B batch, T length, F model width, K heads, H head dim (F = K·H), R a low rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Dtype, PrecisionLike, Shape

from linattn_jax._src import checks
from linattn_jax._src.nn import cache as cache_lib
from linattn_jax._src.nn.compiled import compiled_call
from linattn_jax._src.nn.gates import l2_normalize
from linattn_jax._src.nn.parts import LowRank, TokenShift, check_inputs, expand_to
from linattn_jax._src.registry import get_spec


def _rwkv7_rank(hidden_size: int, multiplier: float, factor: float = 1.0) -> int:
  """RWKV-7's default low rank: ``multiplier·sqrt(F)·factor`` rounded to a multiple of 32
  (at least 32)."""
  return max(32, int(round(multiplier * math.sqrt(hidden_size) * factor / 32) * 32))


class RWKV7TimeMixer(nnx.Module):
  """RWKV-7's time mixing ("Goose"): token shift, low-rank gates, the DPLR recurrence.

  From ``x [B, T, F]`` and its token shift ``δ = x_{t-1} - x_t``: six mixes
  ``x_c = x + δ ⊙ μ_c`` (c in r, w, k, v, a, g); ``r = x_r W_r``, ``k = x_k W_k``,
  ``v = x_v W_v``; the decay ``w = -exp(-1/2) sigmoid(lora_w(x_w))`` (a log decay in
  (-0.607, 0)); the in-context rate ``a = sigmoid(lora_a(x_a))``; the removal key
  ``κ̂ = normalize(k ⊙ k_k)`` per head, and the key ``k ← k ⊙ (1 + (a - 1) ⊙ k_a)``.
  Every layer but the first blends its value toward the first layer's (the value
  residual): ``v ← v + (v_first - v) ⊙ sigmoid(lora_v(x_v))``. The recurrence is
  ``rwkv7``: ``S_t = (diag(exp(w_t)) - κ̂_t (a_t ⊙ κ̂_t)ᵀ) S_{t-1} + k_t v_tᵀ``,
  ``o_t = r_tᵀ S_t`` (scale 1), then ``o ← (GroupNorm(o) + (Σ_h r ⊙ k ⊙ r_k) v) ⊙ g``
  with ``g = lora_g(x_g)`` (sigmoid inside) and ``out = o W_o``. One head count K with
  ``H = F / K`` (key and value dims), as the reference.

  ``__call__(x, v_first=None, ...)`` returns ``(out, v_first)``: the first layer
  (``layer_index=0``) returns its values for the later layers, which must be given them.

  Parameters, with flash-linear-attention's ``RWKV7Attention`` names (a ``Linear``'s
  ``weight`` is our ``kernel`` transposed; the ``x_*`` there are ``[1, 1, F]``):

  ========================= ============ ============================ ===============
  ours                      shape        reference                    note
  ========================= ============ ============================ ===============
  ``x_r`` … ``x_g`` (six)   [F]          ``x_r`` … ``x_g``            token-shift mix
  ``k_k``, ``k_a``          [K·H]        ``k_k``, ``k_a``
  ``r_k``                   [K, H]       ``r_k``                      bonus term
  ``r_proj.kernel``         [F, K·H]     ``r_proj.weight``
  ``k_proj.kernel``         [F, K·H]     ``k_proj.weight``
  ``v_proj.kernel``         [F, K·H]     ``v_proj.weight``
  ``w_lora.down.kernel``    [F, Rw]      ``w_lora.lora.0.weight``     tanh inside
  ``w_lora.up.kernel``      [Rw, K·H]    ``w_lora.lora.2.weight``
  ``w_lora.up.bias``        [K·H]        ``w_lora.lora.2.bias``
  ``a_lora.down.kernel``    [F, Ra]      ``a_lora.lora.0.weight``
  ``a_lora.up.kernel``      [Ra, K·H]    ``a_lora.lora.2.weight``
  ``a_lora.up.bias``        [K·H]        ``a_lora.lora.2.bias``
  ``v_lora.down.kernel``    [F, Rv]      ``v_lora.lora.0.weight``     layer_index > 0
  ``v_lora.up.kernel``      [Rv, K·H]    ``v_lora.lora.2.weight``     layer_index > 0
  ``v_lora.up.bias``        [K·H]        ``v_lora.lora.2.bias``       layer_index > 0
  ``g_lora.down.kernel``    [F, Rg]      ``g_lora.lora.0.weight``     sigmoid inside
  ``g_lora.up.kernel``      [Rg, K·H]    ``g_lora.lora.2.weight``
  ``g_norm.scale``          [K·H]        ``g_norm.weight``            eps = H·norm_eps
  ``g_norm.bias``           [K·H]        ``g_norm.bias``
  ``o_proj.kernel``         [K·H, F]     ``o_proj.weight``
  ========================= ============ ============================ ===============

  The ranks default to the reference's: Rw = Ra = 32·round(2.5·sqrt(F)·H/64 / 32),
  Rv with 1.7, Rg = 32·round(5·sqrt(F) / 32), each at least 32. The initial values
  follow the reference's (the mixes, ``k_k``, ``k_a``, ``r_k``, the low-rank biases
  and the norm's scale depend on ``layer_index`` of ``num_layers``; ``o_proj`` starts at
  zero, so a fresh mixer outputs zeros).

  Args:
    hidden_size: F.
    head_dim: H (default 64); K = F / H.
    layer_index: this layer's index (0: the first, which has no ``v_lora``).
    num_layers: the model's layer count (for the initial values).
    decay_rank, a_rank, v_rank, gate_rank: Rw, Ra, Rv, Rg (defaults above).
    norm_eps: the group norm's eps per unit of H.
    attention_options: the ``rwkv7`` recurrence's options, e.g. ``{"chunk_size": 32}``.
    dtype, param_dtype, precision: as in ``flax.nnx.Linear``.
    rngs: ``params`` draws the weights.

  Raises:
    ValueError: for H not dividing F, a ``layer_index`` outside ``[0, num_layers)``,
      a later layer called without ``v_first``, or inputs that are not ``[B, T, F]``.

  Examples:
    >>> first = nn.RWKV7TimeMixer(32, head_dim=8, num_layers=2, rngs=nnx.Rngs(0))
    >>> second = nn.RWKV7TimeMixer(32, head_dim=8, layer_index=1, num_layers=2,
    ...                            rngs=nnx.Rngs(1))
    >>> x = jax.random.normal(jax.random.key(0), (1, 6, 32))
    >>> h, v_first = first(x)
    >>> out, _ = second(x + h, v_first)
    >>> out.shape, second.r_k.shape  # [B, T, F], [K, H]
    ((1, 6, 32), (4, 8))

  Reference: Peng et al., "RWKV-7 'Goose' with Expressive Dynamic State Evolution", 2025.
  """

  def __init__(self, hidden_size: int, *, head_dim: int = 64, layer_index: int = 0,
               num_layers: int = 1, decay_rank: int | None = None, a_rank: int | None = None,
               v_rank: int | None = None, gate_rank: int | None = None,
               norm_eps: float = 1e-5, attention_options: Mapping[str, Any] | None = None,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None, rngs: nnx.Rngs):
    fn = "RWKV7TimeMixer"
    F = self.hidden_size = checks.check_positive_int(hidden_size, name="hidden_size", fn=fn)
    H = self.head_dim = checks.check_positive_int(head_dim, name="head_dim", fn=fn)
    num_layers = checks.check_positive_int(num_layers, name="num_layers", fn=fn)
    if F % H:
      raise ValueError(f"{fn}: head_dim={H} must divide hidden_size={F}.")
    if not 0 <= layer_index < num_layers:
      raise ValueError(f"{fn}: layer_index={layer_index} must be in [0, {num_layers}).")
    K = self.num_heads = F // H
    self.layer_index, self.dtype = layer_index, dtype
    self._spec = get_spec("rwkv7")
    self.attention_options = dict(attention_options or {})
    self._spec.build(**self.attention_options)
    f32 = jnp.float32
    # The reference's initial values, from the layer's depth.
    depth = layer_index / max(num_layers - 1, 1)  # 0 -> 1 over the layers.
    shallow = 1.0 - layer_index / num_layers  # 1 -> nearly 0.
    n = jnp.arange(F, dtype=f32)
    ddd = n / F
    linear = n / max(F - 1, 1) - 0.5
    zigzag = ((n % H) - (H - 1) / 2) / max((H - 1) / 2, 1)
    zigzag = zigzag * jnp.abs(zigzag)
    www = -6 + 6 * (n / max(F - 1, 1)) ** (1 + depth ** 0.3)
    for name, power in (("x_r", 0.2), ("x_w", 0.9), ("x_k", 0.7), ("x_v", 0.7), ("x_a", 0.9),
                        ("x_g", 0.2)):
      setattr(self, name, nnx.Param((1.0 - ddd ** (power * shallow)).astype(param_dtype)))
    self.k_k = nnx.Param((0.71 - linear * 0.1).astype(param_dtype))
    self.k_a = nnx.Param(jnp.full((F,), 1.02, param_dtype))
    self.r_k = nnx.Param(jnp.full((K, H), -0.04, param_dtype))
    init = initializers.lecun_normal()

    def linear_(i, o, kernel_init=init):
      return nnx.Linear(i, o, use_bias=False, kernel_init=kernel_init, dtype=dtype,
                        param_dtype=param_dtype, precision=precision, rngs=rngs)

    self.r_proj, self.k_proj, self.v_proj = linear_(F, F), linear_(F, F), linear_(F, F)
    self.o_proj = linear_(F, F, initializers.zeros_init())

    def lora(rank, activation, bias=None):
      orthogonal = initializers.orthogonal(0.1 * max(1.0, math.sqrt(F / rank)))
      return LowRank(F, rank, F, activation=activation, use_bias=bias is not None,
                     down_init=initializers.zeros_init(),  # QR in float32 (not in bfloat16):
                     up_init=lambda key, shape, dtype: orthogonal(key, shape).astype(dtype),
                     bias_init=(lambda *_: bias.astype(param_dtype)) if bias is not None
                     else initializers.zeros_init(),
                     dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

    factor = H / 64
    self.w_lora = lora(decay_rank or _rwkv7_rank(F, 2.5, factor), "tanh",
                       www + 0.5 + zigzag * 2.5)
    self.a_lora = lora(a_rank or _rwkv7_rank(F, 2.5, factor), None,
                       -0.19 + zigzag * 0.3 + linear * 0.4)
    self.v_lora = (lora(v_rank or _rwkv7_rank(F, 1.7, factor), None, 0.73 - linear * 0.4)
                   if layer_index > 0 else nnx.data(None))
    self.g_lora = lora(gate_rank or _rwkv7_rank(F, 5.0), "sigmoid")
    self.g_norm = nnx.GroupNorm(F, num_groups=K, epsilon=H * norm_eps, dtype=f32,
                                param_dtype=param_dtype, rngs=rngs)
    self.g_norm.scale.set_value(jnp.full((F,), ((layer_index + 1) / num_layers) ** 0.7,
                                         param_dtype))
    self.shift = TokenShift(F)
    self.cache = nnx.data(None)

  def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
    """An empty decode cache for inputs ``(B, C, F)``: the float32 state ``[B, K, H, H]``
    and the last input, in ``dtype`` (C is not needed)."""
    B, K, H = input_shape[0], self.num_heads, self.head_dim
    self.cache = nnx.Cache(cache_lib.empty(
        self._spec, batch=B, capacity=1, num_heads=K, num_kv_heads=K, head_dim=H,
        dtype=jnp.dtype(dtype), options=self.attention_options))
    self.shift.init_cache(input_shape, self.dtype or dtype)

  @compiled_call
  def __call__(self, x: jax.Array, v_first: jax.Array | None = None, *, decode: bool = False,
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Mixes ``x [B, T, F]`` causally: ``(out [B, T, F], v_first [B, T, F])``.

    ``v_first``: the first layer's values (every layer but the first needs them; the
    first returns its own). ``segment_ids`` and ``decode`` as in :class:`RecurrentMixer`.
    """
    fn = "RWKV7TimeMixer"
    ids = check_inputs(x, self.hidden_size, segment_ids, fn=fn)
    if (self.v_lora is not None) != (v_first is not None):
      raise ValueError(f"{fn}: layer_index={self.layer_index} "
                       + ("needs v_first, the first layer's values." if self.v_lora is not None
                          else "is the first layer: it takes no v_first."))
    B, T, F = x.shape
    K, H = self.num_heads, self.head_dim
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    delta = self.shift(x, decode=decode, segment_ids=ids) - x
    mix = {c: x + delta * expand_to(getattr(self, f"x_{c}").get_value().astype(dtype), x)
           for c in "rwkvag"}
    r, k, v = self.r_proj(mix["r"]), self.k_proj(mix["k"]), self.v_proj(mix["v"])
    f32 = jnp.float32
    log_decay = -math.exp(-0.5) * jax.nn.sigmoid(self.w_lora(mix["w"]).astype(f32))
    if self.v_lora is None:
      v_first = v
    else:
      v = v + (v_first.astype(v.dtype) - v) * jax.nn.sigmoid(self.v_lora(mix["v"]))
    a = jax.nn.sigmoid(self.a_lora(mix["a"]).astype(f32))
    g = self.g_lora(mix["g"])
    heads = lambda y: y.reshape(B, T, K, H)  # noqa: E731
    kappa = l2_normalize(heads(k.astype(f32) * expand_to(self.k_k.get_value().astype(f32), k)))
    k = k * (1 + (a.astype(k.dtype) - 1) * expand_to(self.k_a.get_value().astype(k.dtype), k))
    r, k, v = heads(r), heads(k), heads(v)
    gates = {"a": -kappa, "b": kappa * heads(a), "log_decay": heads(log_decay)}
    options = {"scale": 1.0, **self.attention_options}
    if decode:
      if self.cache is None:
        raise ValueError(f"{fn}: decode=True needs a cache: call init_cache first.")
      cache, o = cache_lib.state_decode(self._spec, self.cache.get_value(), r, k, v,
                                        options=options, gates=gates, segment_ids=ids)
      self.cache.set_value(cache)
    else:
      packed = {} if ids is None else {"segment_ids": ids}
      o = self._spec.function(r, k, v, is_causal=True, **packed, **options, **gates)
    o = self.g_norm(o.astype(f32).reshape(B * T, F)).reshape(B, T, K, H)
    bonus = jnp.sum(r * k * expand_to(self.r_k.get_value().astype(r.dtype), r), -1,
                    keepdims=True) * v
    o = ((o + bonus.astype(f32)).reshape(B, T, F) * g.astype(f32)).astype(dtype)
    return self.o_proj(o), v_first
