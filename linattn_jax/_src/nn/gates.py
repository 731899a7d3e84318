"""Gate and beta projections: a gated recurrence's per-token inputs, from the layer's input.

What the layer projects is read off the variant's ``AttentionSpec.token_inputs``
(their roles and shapes), never off its name: a decay per kv head ``[B, S, K]``
gets Mamba2's parameterisation, ``-exp(A_log) softplus(x W_a + dt_bias)``; one
per key feature ``[B, S, K, H]`` GLA's low-rank gate,
``log_sigmoid(x W_1 W_2 + b) / GLA_GATE_NORMALIZER``. A write strength
``[B, S, K]`` (a delta rule's β) is ``sigmoid(x W_b)``, and since its role wants
unit keys (``Role.unit_keys``) queries and keys are L2-normalised per head. The
parameters are the layer's own ``nnx.Param`` attributes, under the names
:attr:`GateProjections.names`.
Letters: B batch, S key length, K key/value heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype, Initializer, PrecisionLike
from jax import lax

from linattn_jax._src.registry import AttentionSpec, Role

# The decay projection for a decay per head (False) or per key feature (True).
_DECAY_PROJECTIONS = {False: "mamba2", True: "low_rank"}
_DECAY_PARAMS = {"mamba2": ("a_kernel", "A_log", "dt_bias"),
                 "low_rank": ("gk_kernel_1", "gk_kernel_2", "gk_bias"), None: ()}
GLA_GATE_RANK = 16  # GLA's low-rank gate: W_1 [in, 16], W_2 [16, K·H].
GLA_GATE_NORMALIZER = 16.0  # GLA divides the log-sigmoid gate by 16: decays near 1.


@dataclasses.dataclass(frozen=True)
class GateProjections:
  """The projections a layer makes for one variant's per-token inputs.

  Attributes:
    decay: ``"mamba2"`` (a decay per head), ``"low_rank"`` (a decay per key feature) or
      None (no decay input).
    beta: whether the variant takes a write strength per head (a delta rule).
    transition: whether it takes a low-rank transition ``b aᵀ`` (DPLR, RWKV-7), made as
      RWKV-7 makes it: a unit removal key ``κ̂ = normalize(x W_κ)`` per head, ``a = -κ̂``
      and ``b = κ̂ ⊙ sigmoid(x W_iclr)`` (the in-context learning rate).
    decay_name: the decay input's keyword.
    beta_name: the write strength's keyword.
    read_name: the transition's ``a``.
    write_name: the transition's ``b``.
  """

  decay: str | None
  beta: bool
  decay_name: str = "log_decay"
  beta_name: str = "beta"
  transition: bool = False
  read_name: str = "a"
  write_name: str = "b"

  @classmethod
  def for_spec(cls, spec: AttentionSpec, fn: str) -> GateProjections | None:
    """The projections for ``spec``'s ``token_inputs`` (by their roles); None for a
    variant without any.

    Raises:
      ValueError: for inputs the layer has no projection for (named, with ``fn``).
    """
    if not spec.token_inputs:
      return None
    by_role: dict[Role, list] = {}
    for x in spec.token_inputs:
      by_role.setdefault(x.role, []).append(x)
    decays, writes = by_role.get(Role.DECAY, []), by_role.get(Role.WRITE_STRENGTH, [])
    reads, backs = by_role.get(Role.TRANSITION_READ, []), by_role.get(Role.TRANSITION_WRITE, [])
    if (len(decays) > 1 or len(writes) > 1 or any(x.per_feature for x in writes)
        or len(reads) != len(backs) or len(reads) > 1
        or not all(x.per_feature for x in reads + backs)):
      given = ", ".join(f"{x.name} {x.layout} ({x.role.value})" for x in spec.token_inputs)
      raise ValueError(f"{fn}: attention={spec.name!r} needs per-token inputs ({given}) that "
                       "this layer has no projection for (it projects one decay [B, S, K] or "
                       "[B, S, K, H], one write strength [B, S, K] and one low-rank "
                       "transition a, b [B, S, K, H]); call the function with them instead.")
    decay = decays[0] if decays else None
    return cls(None if decay is None else _DECAY_PROJECTIONS[decay.per_feature], bool(writes),
               decay.name if decay else "log_decay", writes[0].name if writes else "beta",
               bool(reads), reads[0].name if reads else "a", backs[0].name if backs else "b")

  @property
  def names(self) -> tuple[str, ...]:
    """The names of the parameters, as the layer's attributes."""
    return (_DECAY_PARAMS[self.decay] + (("b_kernel",) if self.beta else ())
            + (("kappa_kernel", "iclr_kernel") if self.transition else ()))

  def init(self, rngs: nnx.Rngs, kernel_init: Initializer, bias_init: Initializer, *,
           in_features: int, num_kv_heads: int, head_dim: int,
           dtype: Dtype) -> dict[str, jax.Array]:
    """The parameters, drawn from ``rngs.params`` in a fixed order (name -> array).

    ``a_kernel`` W_a ``[in, K]``, ``A_log [K]`` = log(U(1, 16)), ``dt_bias [K]``
    the inverse softplus of a log-uniform dt in [0.001, 0.1]; ``gk_kernel_1``
    ``[in, 16]``, ``gk_kernel_2`` ``[16, K·H]``, ``gk_bias [K·H]``; ``b_kernel``
    ``[in, K]``; ``kappa_kernel`` and ``iclr_kernel`` ``[in, K·H]``. Kernels from
    ``kernel_init``, ``gk_bias`` from ``bias_init``.
    """
    F, K, H = in_features, num_kv_heads, head_dim
    params = {}
    if self.decay == "mamba2":
      params["a_kernel"] = kernel_init(rngs.params(), (F, K), dtype)
      params["A_log"], params["dt_bias"] = mamba2_decay_init(rngs, (K,), (K,), dtype)
    elif self.decay == "low_rank":
      params["gk_kernel_1"] = kernel_init(rngs.params(), (F, GLA_GATE_RANK), dtype)
      params["gk_kernel_2"] = kernel_init(rngs.params(), (GLA_GATE_RANK, K * H), dtype)
      params["gk_bias"] = bias_init(rngs.params(), (K * H,), dtype)
    if self.beta:
      params["b_kernel"] = kernel_init(rngs.params(), (F, K), dtype)
    if self.transition:
      params["kappa_kernel"] = kernel_init(rngs.params(), (F, K * H), dtype)
      params["iclr_kernel"] = kernel_init(rngs.params(), (F, K * H), dtype)
    return params

  def __call__(self, params: Mapping[str, jax.Array], x: jax.Array, *, num_kv_heads: int,
               head_dim: int, precision: PrecisionLike = None) -> dict[str, jax.Array]:
    """The per-token inputs from the key/value input ``x [..., S, in_kv]``, by name: a decay
    ``[..., S, K]`` (``[..., S, K, H]`` for the low-rank gate) ≤ 0, a write strength
    ``[..., S, K]`` in (0, 1) and a transition's ``a``, ``b`` ``[..., S, K, H]``, float32."""
    f32 = jnp.float32
    x = jnp.asarray(x, f32)
    param = lambda name: params[name].astype(f32)  # noqa: E731
    per_row = lambda a: a.reshape((1,) * (x.ndim - 1) + a.shape)  # noqa: E731  [K] -> [1.., K]
    dot = lambda a, b: jnp.matmul(a, b, precision=precision)  # noqa: E731
    gates = {}
    if self.decay == "mamba2":
      dt = jax.nn.softplus(dot(x, param("a_kernel")) + per_row(param("dt_bias")))
      gates[self.decay_name] = -jnp.exp(per_row(param("A_log"))) * dt
    elif self.decay == "low_rank":
      logit = dot(dot(x, param("gk_kernel_1")), param("gk_kernel_2")) + per_row(param("gk_bias"))
      gates[self.decay_name] = (jax.nn.log_sigmoid(logit) / GLA_GATE_NORMALIZER).reshape(
          x.shape[:-1] + (num_kv_heads, head_dim))
    if self.beta:
      gates[self.beta_name] = jax.nn.sigmoid(dot(x, param("b_kernel")))
    if self.transition:
      per_head = lambda y: y.reshape(x.shape[:-1] + (num_kv_heads, head_dim))  # noqa: E731
      kappa = l2_normalize(per_head(dot(x, param("kappa_kernel"))))
      gates[self.read_name] = -kappa
      gates[self.write_name] = kappa * jax.nn.sigmoid(per_head(dot(x, param("iclr_kernel"))))
    return gates


def mamba2_decay_init(rngs: nnx.Rngs, a_shape: tuple[int, ...], dt_shape: tuple[int, ...],
                      dtype: Dtype) -> tuple[jax.Array, jax.Array]:
  """Mamba2's ``(A_log, dt_bias)``: ``A_log = log U(1, 16)`` and ``dt_bias`` the inverse
  softplus of a log-uniform dt in [0.001, 0.1] (``softplus(dt_bias) = dt``), drawn in that
  order from ``rngs.params``."""
  A_log = jnp.log(jax.random.uniform(rngs.params(), a_shape, jnp.float32, 1.0, 16.0))
  dt = jnp.exp(jax.random.uniform(rngs.params(), dt_shape, jnp.float32, math.log(1e-3),
                                  math.log(1e-1)))
  return A_log.astype(dtype), (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def lightning_slopes(num_heads: int, layer_index: int, num_layers: int) -> jax.Array:
  """MiniMax-01's decay rates ``s_h = 2^(-8(h+1)/N) (1 - l / (L - 1 + 10⁻⁵) + 10⁻⁵)``
  ``[N]`` (float32) for layer l of L: head h keeps ``exp(-s_h)`` of its state per token;
  deeper layers forget more slowly."""
  base = 2.0 ** (-8.0 / num_heads)  # The first head's rate, as ALiBi's slopes.
  slopes = jnp.asarray([base ** (h + 1) for h in range(num_heads)], jnp.float32)
  return slopes * (1.0 - layer_index / (num_layers - 1 + 1e-5) + 1e-5)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """``x / sqrt(Σ_h x_h² + eps)`` over the last axis H, computed in float32."""
  x32 = x.astype(jnp.float32)
  return (x32 * lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
