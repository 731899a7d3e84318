"""``nn.load_transformers_layer``: every recurrent layer of the committed tiny checkpoints
(``tests/fixtures/transformers``, written by transformers' own PyTorch layers, see
``make_transformers_fixtures.py``) loads and returns the output transformers captured, from
float32 and from bfloat16 tensors; the loaded layers decode and pack; a checkpoint that
does not fit its table is refused, naming what is wrong."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import TOLERANCE
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from linattn_jax import nn

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "transformers"
MODULES = {"qwen3_next": "RecurrentMixer", "qwen3_5": "RecurrentMixer",
           "olmo_hybrid": "RecurrentMixer", "kimi_linear": "RecurrentMixer",
           "bailing_hybrid": "RecurrentMixer",
           "mamba": "MambaMixer", "falcon_mamba": "MambaMixer", "jamba": "MambaMixer",
           "mamba2": "Mamba2Mixer", "bamba": "Mamba2Mixer", "granitemoehybrid": "Mamba2Mixer",
           "nemotron_h": "Mamba2Mixer", "zamba2": "Mamba2Mixer", "falcon_h1": "Mamba2Mixer",
           "minimax": "RecurrentMixer", "lfm2": "ShortConvMixer"}
MODEL_TYPES = tuple(MODULES)
# Decoding and packing once per module kind (and Jamba's inner norms, Zamba2's hybrid layers).
DECODED = ("qwen3_next", "kimi_linear", "jamba", "mamba2", "zamba2", "lfm2")


def _layers(folder: str) -> list[int]:
  """The decoder layers whose recurrent mixers the fixture captured."""
  return [int(str(m).split(".")[2]) for m in np.load(FIXTURES / folder / "io.npz")["modules"]]


def test_the_fixtures_store_float32_and_bfloat16_tensors():
  for t in MODEL_TYPES:
    for folder, dtype in ((t, jnp.float32), (f"{t}_bf16", jnp.bfloat16)):
      with safe_open(FIXTURES / folder / "model.safetensors", framework="flax") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {jnp.dtype(dtype)}, folder


@jax.jit
def _apply(graph, state, x):
  return nnx.merge(graph, state)(x)


def _jitted(layer, x):
  """``layer(x)`` under ``jax.jit`` (one program per layer)."""
  graph, state = nnx.split(layer)
  return _apply(graph, state, x)


@pytest.mark.parametrize("folder", [f"{t}{s}" for t in MODEL_TYPES for s in ("", "_bf16")])
def test_each_recurrent_layer_returns_what_transformers_returned(folder):
  """float32 tensors, and bfloat16 tensors whose captured outputs came from a float32
  model holding the same rounded values: both to float32 accuracy."""
  io = np.load(FIXTURES / folder / "io.npz")
  model_type = folder.removesuffix("_bf16")
  # MiniMax keeps its block decays as buffers beside slope_rate, each rounded to bfloat16
  # on its own: transformers' blockwise form with those differs from the decay it rounds
  # from by 1e-3 of the output's scale (the float32 checkpoint agrees to 1e-6).
  tol = 2e-3 if folder == "minimax_bf16" else 1e-5
  for i in _layers(folder):
    layer = nn.load_transformers_layer(FIXTURES / folder, i, param_dtype=jnp.float32)
    assert type(layer).__name__ == MODULES[model_type]
    want = io[f"layer{i}_output"]
    got = _jitted(layer, jnp.asarray(io[f"layer{i}_input"]))
    np.testing.assert_allclose(np.asarray(got), want, atol=tol * np.abs(want).max(), rtol=0,
                               err_msg=f"{folder} layer {i}")


def test_bfloat16_tensors_stay_bfloat16_by_default_and_compute_in_the_given_dtype():
  folder = FIXTURES / "lfm2_bf16"
  layer = nn.load_transformers_layer(folder, 0, dtype=jnp.bfloat16)
  assert layer.in_proj.kernel.get_value().dtype == jnp.bfloat16
  io = np.load(folder / "io.npz")
  x = jnp.asarray(io["layer0_input"], jnp.bfloat16)
  got = layer(x)  # Eagerly.
  assert got.dtype == jnp.bfloat16
  atol, rtol = TOLERANCE[jnp.dtype(jnp.bfloat16)]
  want = io["layer0_output"]
  np.testing.assert_allclose(np.asarray(got, np.float32), want,
                             atol=4 * atol * np.abs(want).max(), rtol=rtol)
  same = nn.load_transformers_layer(folder, 0, param_dtype=jnp.float32, rngs=nnx.Rngs(7))
  assert same.in_proj.kernel.get_value().dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(same.in_proj.kernel.get_value()),
                                np.asarray(layer.in_proj.kernel.get_value(), np.float32))


# A prompt, a step, a chunk; row 0 packs two documents (the second from position 5).
PIECES = (4, 1, 4)
IDS = np.array([[0] * 5 + [1] * 4, [3] * 9], np.int32)


@pytest.mark.parametrize("model_type", DECODED)
def test_a_loaded_layer_decodes_and_packs_as_its_full_pass(model_type):
  i = _layers(model_type)[-1]
  layer = nn.load_transformers_layer(FIXTURES / model_type, i)
  x = jnp.asarray(np.load(FIXTURES / model_type / "io.npz")[f"layer{i}_input"])
  ids = jnp.asarray(IDS)

  @nnx.jit
  def run(layer, x, ids):
    full = layer(x, segment_ids=ids)
    layer.init_cache(x.shape)
    bounds = np.cumsum((0,) + PIECES)
    pieces = jnp.concatenate([layer(x[:, a:b], decode=True, segment_ids=ids[:, a:b])
                              for a, b in zip(bounds[:-1], bounds[1:], strict=True)], 1)
    return full, pieces, layer(x[:1, 5:]), layer(x[:1, :5])

  full, pieces, second, first = run(layer, x, ids)
  atol, rtol = TOLERANCE[jnp.dtype(jnp.float32)]
  np.testing.assert_allclose(pieces, full, atol=atol, rtol=rtol)
  np.testing.assert_allclose(full[:1], jnp.concatenate([first, second], 1), atol=atol, rtol=rtol)


def _copy(tmp_path, folder="mamba2") -> pathlib.Path:
  out = tmp_path / folder
  shutil.copytree(FIXTURES / folder, out)
  return out


def _rewrite(folder: pathlib.Path, edit) -> None:
  tensors = load_file(folder / "model.safetensors")
  edit(tensors)
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_sharded_checkpoint_loads_as_the_single_file(tmp_path):
  folder = _copy(tmp_path)
  tensors = load_file(folder / "model.safetensors")
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  for file, part in shards.items():
    save_file({n: tensors[n] for n in part}, folder / file, metadata={"format": "pt"})
  (folder / "model.safetensors").unlink()
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
  sharded = nn.load_transformers_layer(folder, 1)
  single = nn.load_transformers_layer(FIXTURES / "mamba2", 1)
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(sharded, nnx.Param)),
                               nnx.to_flat_state(nnx.state(single, nnx.Param)), strict=True):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                  err_msg=str(path))


def test_what_does_not_fit_the_table_is_refused_by_name(tmp_path):
  load = nn.load_transformers_layer
  with pytest.raises(ValueError, match=r"layer_index=3 is out of range for the 2 layers"):
    load(FIXTURES / "mamba2", 3)
  with pytest.raises(ValueError, match=r"layer 1 of this qwen3_next checkpoint is a "
                     r"'full_attention' layer.*recurrent layers: \[0, 2\]"):
    load(FIXTURES / "qwen3_next", 1)
  with pytest.raises(ValueError, match=r"layer 2 of this kimi_linear checkpoint is not a KDA "
                     r"layer; its KDA layers \(from 0\): \[0, 1\]"):
    load(FIXTURES / "kimi_linear", 2)
  with pytest.raises(ValueError, match=r"part='attention': lfm2's layers load their recurrent"):
    load(FIXTURES / "lfm2", 0, part="attention")
  with pytest.raises(ValueError, match=r"part must be 'recurrent' or 'attention'; got 'conv'"):
    load(FIXTURES / "lfm2", 0, part="conv")
  with pytest.raises(ValueError, match=r"no config.json"):
    load(tmp_path, 0)

  unknown = _copy(tmp_path, "lfm2")
  config = json.loads((unknown / "config.json").read_text())
  (unknown / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
  with pytest.raises(ValueError, match=r"model type 'llama' is not one it loads; it loads "
                     r"\['bailing_hybrid', 'bamba', .*, 'zamba2'\]"):
    load(unknown, 0)

  missing = _copy(tmp_path / "missing")
  _rewrite(missing, lambda t: t.pop("backbone.layers.0.mixer.D"))
  with pytest.raises(ValueError, match=r"lacks \['backbone.layers.0.mixer.D'\]"):
    load(missing, 0)
  load(missing, 1)  # The other layer is whole.

  wrong = _copy(tmp_path / "wrong")
  _rewrite(wrong, lambda t: t.update({"backbone.layers.0.mixer.in_proj.weight":
                                      np.zeros((99, 32), np.float32)}))
  with pytest.raises(ValueError, match=r"in_proj.weight has shape \(99, 32\); the mamba2 "
                     r"config implies \(100, 32\)"):
    load(wrong, 0)

  extra = _copy(tmp_path / "extra")
  _rewrite(extra, lambda t: t.update({"backbone.layers.0.mixer.in_proj.bias":
                                      np.zeros((100,), np.float32)}))
  with pytest.raises(ValueError, match=r"\['backbone.layers.0.mixer.in_proj.bias'\] are not "
                     r"read by the mamba2 table"):
    load(extra, 0)


def test_a_multimodal_qwen3_5_checkpoint_loads_its_text_model(tmp_path):
  """A released Qwen3.5 nests the text config in ``text_config`` and its tensors under
  ``model.language_model``: made here from the flat fixture, it loads the same layer."""
  nested = _copy(tmp_path, "qwen3_5")
  text = json.loads((nested / "config.json").read_text())
  (nested / "config.json").write_text(json.dumps({"model_type": "qwen3_5",
                                                  "text_config": text}))
  _rewrite(nested, lambda t: t.update({n.replace("model.", "model.language_model.", 1): t.pop(n)
                                       for n in list(t) if n.startswith("model.")}))
  io = np.load(FIXTURES / "qwen3_5" / "io.npz")
  layer = nn.load_transformers_layer(nested, 0)
  want = io["layer0_output"]
  np.testing.assert_allclose(_jitted(layer, jnp.asarray(io["layer0_input"])), want,
                             atol=1e-5 * np.abs(want).max(), rtol=0)
