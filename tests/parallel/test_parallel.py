"""Context parallelism on 8 host CPU devices (see conftest): equal to one device.

Every recurrent variant and ring attention, causal and not, on a length that
8 devices do not divide (the end is padded) with padded examples (one with
no keys at all) and GQA: outputs and gradients are judged against each
variant's float64 oracle by the shared suite's judges, which judge the
single-device functions too (so no single-device program is compiled here to
compare with). Gated variants get their gates and betas from the
key as in the shared suite (``with_derived_inputs``), so the key's gradient
carries theirs.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import (
  Shape,
  assert_output_and_gradients_match_oracle,
  cotangent,
  deriving_inputs,
  kv_lengths,
  largest_intermediate,
  make_qkv,
  suite_options,
  with_derived_inputs,
)
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import linattn_jax as la
from linattn_jax import nn, parallel

DEVICES = 8
SHAPE = Shape(B=3, T=37, S=37, N=4, K=2, H=8, D=6)  # 37 = 8·5 - 3; lengths 12, 0, 37.
# random_fourier's judge (a float64 oracle and each row's conditioning) costs
# memory as the square of the problem: a smaller case, still padded and GQA.
SMALL_SHAPE = Shape(B=3, T=19, S=19, N=2, K=1, H=4, D=3)  # 19 = 8·3 - 5; lengths 6, 0, 19.


@functools.cache
def mesh(shape=(DEVICES,), names=("seq",), types=(AxisType.Auto,)):
  """A mesh of the host CPU devices (also where the default backend is a GPU)."""
  return jax.make_mesh(shape, names, axis_types=types, devices=jax.devices("cpu"))


def test_the_suite_has_eight_host_devices():
  assert len(jax.devices("cpu")) == DEVICES


def _value_and_grads(fn, q, k, v, ct):
  """``(out, (dq, dk, dv))`` of ``Σ ct·fn(q, k, v)``, one compiled program."""
  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out * ct), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("name", parallel.recurrent_attentions())
def test_context_parallel_matches_the_oracle(name, is_causal):
  spec = la.get_spec(name)
  shape = SMALL_SHAPE if name == "random_fourier" else SHAPE
  q, k, v = make_qkv(shape)
  lengths = kv_lengths(shape)
  options = dict(suite_options(spec))
  if not is_causal and (not spec.supports_noncausal or spec.streaming.positional):
    # A recurrence that is causal only, or whose state places the queries (cosFormer).
    with pytest.raises(ValueError, match="is_causal=True only"):
      parallel.context_parallel_attention(q, k, v, attention=name, mesh=mesh(), axis_name="seq",
                                          is_causal=False, **options)
    return
  ct = cotangent(np.zeros((shape.B, shape.T, shape.N, shape.D), np.float32))
  split = with_derived_inputs(spec, functools.partial(
      parallel.context_parallel_attention, attention=name, mesh=mesh(), axis_name="seq",
      is_causal=is_causal, key_value_seq_lengths=lengths, **options))
  spec = deriving_inputs(spec)  # The same gates for the function and its oracle.
  got, got_grads = _value_and_grads(split, q, k, v, ct)
  assert_output_and_gradients_match_oracle(got, got_grads, spec, q, k, v, is_causal=is_causal,
                                           lengths=lengths, ct=ct, options=options)


def test_per_token_inputs_are_checked_by_name_and_shape():
  q, k, v = make_qkv(SHAPE)
  cp = functools.partial(parallel.context_parallel_attention, q, k, v,
                         attention="gated_delta_net", mesh=mesh(), axis_name="seq")
  beta = jnp.full((SHAPE.B, SHAPE.S, SHAPE.K), 0.5)
  with pytest.raises(ValueError, match=r"needs the per-token input\(s\) beta \[B, S, K\], "
                     r"log_decay \[B, S, K\] as keyword arguments; missing \['log_decay'\]"):
    cp(beta=beta)
  with pytest.raises(ValueError, match=r"log_decay must be a float array \[B, S, K\] = "
                     r"\(3, 37, 2\) for key \(3, 37, 2, 8\); got float32 \(3, 37, 2, 8\)"):
    cp(beta=beta, log_decay=jnp.zeros(k.shape))


def test_unbatched_inputs_and_gates_equal_the_batched_call():
  """Unbatched ``[T, N, H]`` queries take unbatched ``[S, K]`` gates and give the batched
  call's first row (the gates are padded and split with the keys either way)."""
  q, k, v = make_qkv(SHAPE)
  beta = jax.nn.sigmoid(k[..., 0])
  log_decay = -jax.nn.softplus(k[..., 1])
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  cp = jax.jit(functools.partial(parallel.context_parallel_attention, attention="gated_delta_net",
                                 mesh=mesh(), axis_name="seq"))
  batched = cp(q, k, v, beta=beta, log_decay=log_decay)
  one = cp(q[0], k[0], v[0], beta=beta[0], log_decay=log_decay[0])
  assert one.shape == (SHAPE.T, SHAPE.N, SHAPE.D)
  chex.assert_trees_all_close(one, batched[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("is_causal, load_balance", [(True, True), (True, False),
                                                     (False, True)],
                         ids=["causal-zigzag", "causal-contiguous", "noncausal"])
def test_ring_attention_matches_the_oracle(is_causal, load_balance):
  spec = la.get_spec("softmax")
  q, k, v = make_qkv(SHAPE)
  lengths = kv_lengths(SHAPE)
  ct = cotangent(np.zeros((SHAPE.B, SHAPE.T, SHAPE.N, SHAPE.D), np.float32))
  got, got_grads = _value_and_grads(
      lambda q, k, v: parallel.ring_attention(
          q, k, v, mesh=mesh(), axis_name="seq", is_causal=is_causal,
          key_value_seq_lengths=lengths, load_balance=load_balance, block_q=2, block_k=3),
      q, k, v, ct)
  assert_output_and_gradients_match_oracle(got, got_grads, spec, q, k, v, is_causal=is_causal,
                                           lengths=lengths, ct=ct)
  np.testing.assert_array_equal(got[1], 0)  # No keys: zeros, not NaN.


# Packed sequences over the 8 devices (contiguous: 5 tokens each; zig-zag: chunks of 3).
# Row 0: segments of 3, 9, 1, 12, 7 and 5 tokens, one starting at a device's first token
# (25), the last wholly past the key length 30, so its rows see no key. Row 1: 15, 6 and
# 16 tokens, one starting at a device's first token (15) where row 0 has none.
PACKED = Shape(B=2, T=37, S=37, N=4, K=2, H=8, D=6)
PACKED_LENGTHS = (30, 37)
PACKED_IDS = np.stack([np.repeat(np.arange(6), [3, 9, 1, 12, 7, 5]),
                       np.repeat(np.arange(3), [15, 6, 16])]).astype(np.int32)


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "noncausal"])
def test_ring_attention_with_segment_ids_equals_one_device(is_causal):
  """Segments crossing devices, whole ring steps of other segments (skipped), rows with
  no key: softmax_attention(segment_ids=...) on one device, output and gradients. Causal
  runs in zig-zag order, so the ids are reordered with the keys."""
  q, k, v = make_qkv(PACKED)
  ids, lengths = jnp.asarray(PACKED_IDS), jnp.asarray(PACKED_LENGTHS, jnp.int32)
  ct = cotangent(np.zeros((PACKED.B, PACKED.T, PACKED.N, PACKED.D), np.float32))
  options = dict(is_causal=is_causal, key_value_seq_lengths=lengths, segment_ids=ids)
  got = _value_and_grads(lambda q, k, v: parallel.ring_attention(
      q, k, v, mesh=mesh(), axis_name="seq", block_q=2, block_k=3, **options), q, k, v, ct)
  want = _value_and_grads(lambda q, k, v: la.softmax_attention(q, k, v, **options), q, k, v, ct)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(got[0][0, 32:], 0)  # No key: zeros, not NaN.


# A kernel feature map and the gated delta rule: a summary that says "start afresh" with a
# reset flag, and one that says it with its decays (an affine map's transition).
PACKED_RECURRENT = ("linear_elu", "gated_delta_net")


@pytest.mark.parametrize("name", PACKED_RECURRENT)
def test_context_parallel_with_segment_ids_equals_one_device(name):
  """Segments crossing devices, boundaries at a device's first token in one row and not the
  other: the variant's own packed call on one device (which the shared suite judges
  against each segment run alone), output and gradients."""
  assert name in parallel.recurrent_attentions()
  spec = la.get_spec(name)
  q, k, v = make_qkv(PACKED)
  ids, lengths = jnp.asarray(PACKED_IDS), jnp.asarray(PACKED_LENGTHS, jnp.int32)
  ct = cotangent(np.zeros((PACKED.B, PACKED.T, PACKED.N, PACKED.D), np.float32))
  options = dict(is_causal=True, key_value_seq_lengths=lengths, segment_ids=ids)
  split = with_derived_inputs(spec, functools.partial(
      parallel.context_parallel_attention, attention=name, mesh=mesh(), axis_name="seq",
      **options))
  single = with_derived_inputs(spec, functools.partial(spec.function, **options))
  got, want = (_value_and_grads(fn, q, k, v, ct) for fn in (split, single))
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)


def test_bad_segment_ids_name_the_argument_and_shapes():
  q, k, v = make_qkv(PACKED)
  ids = jnp.asarray(PACKED_IDS)
  ring = functools.partial(parallel.ring_attention, q, k, v, mesh=mesh(), axis_name="seq")
  cp = functools.partial(parallel.context_parallel_attention, q, k, v, attention="linear_elu",
                         mesh=mesh(), axis_name="seq")
  for run, fn in ((ring, "ring_attention"), (cp, "context_parallel_attention")):
    with pytest.raises(ValueError, match=rf"{fn}: segment_ids must have shape "
                       r"\[B, T\] = \(2, 37\); got \(2, 36\)"):
      run(segment_ids=ids[:, 1:])
    with pytest.raises(ValueError, match=rf"{fn}: segment_ids must be integers; got float32 "
                       r"of shape \(2, 37\)"):
      run(segment_ids=ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=rf"{fn}: segment_ids must not decrease.*\(2, 37\)"):
      run(segment_ids=ids[:, ::-1])
  with pytest.raises(ValueError, match=r"segment_ids need is_causal=True \(attention="
                     r"'linear_elu'\)"):
    cp(segment_ids=ids, is_causal=False)
  with pytest.raises(ValueError, match=r"segment_ids must be one int array \[B, T\]"):
    cp(segment_ids=(ids, ids))


def test_replicated_arrays_get_summed_gradients():
  """A learned feature map's weights reach every device; their gradient sums all devices."""
  spec = la.get_spec("linear_learned")
  q, k, v = make_qkv(SHAPE)
  arrays = spec.params.init(jax.random.key(1), SHAPE.H, num_features=5)

  def loss(arrays, fn):
    return jnp.sum(fn(q, k, v, is_causal=True, **arrays) ** 2)

  cp = functools.partial(parallel.context_parallel_attention, attention="linear_learned",
                         mesh=mesh(), axis_name="seq")
  got = jax.jit(jax.grad(functools.partial(loss, fn=cp)))(arrays)
  want = jax.grad(functools.partial(loss, fn=spec.function))(arrays)
  chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("types", [(AxisType.Auto,) * 2, (AxisType.Explicit,) * 2],
                         ids=["auto", "explicit"])
def test_a_batch_sharded_over_another_axis_stays_sharded(types):
  """Data parallelism over ``data`` and context parallelism over ``seq`` compose."""
  m = mesh((2, 4), ("data", "seq"), types)
  shape = Shape(B=2, T=32, S=32, N=2, K=1, H=4, D=4)
  q, k, v = (jax.device_put(x, NamedSharding(m, P("data"))) for x in make_qkv(shape))
  for run, single in [
      (functools.partial(parallel.context_parallel_attention, attention="linear_elu"),
       la.get_attention("linear_elu")),
      (parallel.ring_attention, la.softmax_attention)]:
    out = jax.jit(functools.partial(run, mesh=m, axis_name="seq", is_causal=True))(q, k, v)
    chex.assert_trees_all_close(out, single(q, k, v, is_causal=True), atol=2e-5, rtol=2e-5)
    # Explicit axes fix the output's sharding; on Auto ones the compiler chooses along T.
    want = ("data", "seq") if types[0] == AxisType.Explicit else ("data",)
    assert out.sharding.spec[:len(want)] == want


def test_communication_is_states_only_for_recurrent_variants_and_blocks_for_ring():
  """Read from the compiled HLO, forward and backward: the analytic counts, exactly.

  Recurrent: ``2 (1 + ceil(log2(P - 1)))`` states, the same at every T; for
  Gated DeltaNet a state is the span's affine map, and its gates and betas
  (sharded like the keys, differentiated too) never cross. Ring: keys and
  values round the ring (and their gradients home), plus the zig-zag reorder
  of each device's share; nothing else crosses.
  """
  from experiments import context_parallel as cp

  m = mesh()
  seq = NamedSharding(m, P(None, "seq"))
  B, N, K, H, D = 1, 4, 2, 8, 6
  for T in (64, 256):
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32, sharding=seq)
               for s in ((B, T, N, H), (B, T, K, H), (B, T, K, D)))
    gates = {name: jax.ShapeDtypeStruct((B, T, K), jnp.float32, sharding=seq)
             for name in ("beta", "log_decay")}
    loss = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3))  # noqa: E731
    linear = loss(lambda q, k, v, _: parallel.context_parallel_attention(
        q, k, v, attention="linear_elu", mesh=m, axis_name="seq"))
    delta = loss(lambda q, k, v, gates: parallel.context_parallel_attention(
        q, k, v, attention="gated_delta_net", mesh=m, axis_name="seq", **gates))
    ring = loss(lambda q, k, v, _: parallel.ring_attention(q, k, v, mesh=m, axis_name="seq",
                                                           is_causal=True))
    sent = {name: cp.collective_bytes(jax.jit(fn, out_shardings=seq).lower(q, k, v, gates)
                                      .compile().as_text())
            for name, fn in (("linear", linear), ("delta", delta), ("ring", ring))}
    sizes = dict(P_=DEVICES, B=B, T=T, N=N, K=K, H=H, D=D, itemsize=4)
    # linear_elu: kv [B, K, M, D], k_sum [B, K, M]. Gated DeltaNet: kv [B, K, H, D] and the
    # transition [B, K, H, H]; the last round's transition is read by no one, so not sent.
    assert sent["linear"] == cp.analytic_bytes("recurrent", **sizes,
                                               state_bytes=4 * B * K * H * (D + 1))
    assert sent["delta"] == cp.analytic_bytes("recurrent", **sizes,
                                              state_bytes=4 * B * K * H * (D + H),
                                              read_bytes=4 * B * K * H * D)
    assert sent["ring"] == cp.analytic_bytes("ring", **sizes, state_bytes=0)
  # P = 4: distances 1, 1, 2; device 1 sends to 2, 2, 3 and back to 0, 0.
  assert [cp.scan_sends(P_) for P_ in (1, 2, 4, 8)] == [0, 1, 5, 7]


def _shard_map_bodies(jaxpr) -> list:
  """The per-device programs of every ``shard_map`` in ``jaxpr`` (at any depth)."""
  found = []
  for eqn in jaxpr.eqns:
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += [sub] if eqn.primitive.name == "shard_map" else _shard_map_bodies(sub)
  return found


def test_memory_per_device_is_proportional_to_the_local_length():
  """The backward pass's largest value inside shard_map is O(L), not O(T) or O(L²)."""
  shape = Shape(B=1, T=DEVICES * 64, S=DEVICES * 64, N=2, K=1, H=8, D=8)
  q, k, v = make_qkv(shape)
  L = shape.T // DEVICES
  for fn in (functools.partial(parallel.ring_attention, is_causal=True, block_q=16, block_k=16),
             functools.partial(parallel.context_parallel_attention, attention="linear_elu",
                               chunk_size=16)):
    grad = jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v, mesh=mesh(), axis_name="seq")),
                    argnums=(0, 1, 2))
    bodies = _shard_map_bodies(jax.make_jaxpr(grad)(q, k, v).jaxpr)
    assert len(bodies) >= 2  # Forward and backward.
    local = shape.B * L * shape.N * max(shape.H, shape.D, 16)
    assert max(map(largest_intermediate, bodies)) <= 2 * local


def test_bad_input_names_the_problem():
  q, k, v = make_qkv(SHAPE)
  with pytest.raises(ValueError, match="no recurrent state.*ring_attention"):
    parallel.context_parallel_attention(q, k, v, attention="softmax", mesh=mesh(),
                                        axis_name="seq")
  with pytest.raises(ValueError, match="axis_name='x' is not an axis"):
    parallel.ring_attention(q, k, v, mesh=mesh(), axis_name="x")
  with pytest.raises(ValueError, match="T=37 must equal key length S=5"):
    parallel.ring_attention(q, k[:, :5], v[:, :5], mesh=mesh(), axis_name="seq")
  with pytest.raises(ValueError, match="`initial_state` is set by context parallelism"):
    parallel.context_parallel_attention(q, k, v, attention="linear_elu", mesh=mesh(),
                                        axis_name="seq", initial_state=None)
  with pytest.raises(ValueError, match="unknown option `window`"):
    parallel.context_parallel_attention(q, k, v, attention="linear_elu", mesh=mesh(),
                                        axis_name="seq", window=3)
  with pytest.raises(ValueError, match="no context-parallel form"):
    nn.MultiHeadAttention(2, 8, attention="local", attention_options={"window_size": 2},
                          context_parallel=parallel.ContextParallel(mesh(), "seq"),
                          rngs=nnx.Rngs(0))


@pytest.mark.parametrize("attention", ["softmax", "performer", "gated_delta_net"])
def test_a_layer_with_context_parallelism_equals_the_plain_layer(attention):
  """Gated DeltaNet's gates and betas, projected from the input, are split with the keys."""
  split = parallel.ContextParallel(mesh(), "seq")
  options = {"num_features": 8} if attention == "performer" else {}
  plain = nn.MultiHeadAttention(4, 16, num_kv_heads=2, attention=attention,
                                attention_options=options, rngs=nnx.Rngs(0))
  sharded = nn.MultiHeadAttention(4, 16, num_kv_heads=2, attention=attention,
                                  attention_options=options, context_parallel=split,
                                  rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 24, 16)), jnp.float32)
  out = nnx.jit(lambda m, x: m(x, is_causal=True))(sharded, x)
  chex.assert_trees_all_close(out, plain(x, is_causal=True), atol=2e-5, rtol=2e-5)


def test_a_mesh_with_explicit_axes_need_not_be_entered():
  """``jax.make_mesh`` gives Explicit axes; the functions were given the mesh, so unplaced
  arrays work without ``jax.set_mesh`` (and inside it, as before)."""
  mesh = jax.make_mesh((4,), ("seq",), devices=jax.devices("cpu")[:4])
  assert AxisType.Explicit in tuple(mesh.axis_types)
  q, k, v = make_qkv(Shape(B=1, T=16, S=16, N=2, K=1, H=4, D=3))
  cp = parallel.ContextParallel(mesh, "seq")
  for name, run in (
      ("softmax", functools.partial(parallel.ring_attention, mesh=mesh, axis_name="seq")),
      ("linear_elu", functools.partial(parallel.context_parallel_attention, mesh=mesh,
                                       axis_name="seq", attention="linear_elu")),
      ("linear_elu", functools.partial(cp.attend, "linear_elu"))):
    want = la.get_attention(name)(q, k, v, is_causal=True)
    np.testing.assert_allclose(run(q, k, v, is_causal=True), want, atol=2e-5, rtol=2e-5)
