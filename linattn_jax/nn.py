"""Flax NNX layers: multi-head attention over any registered variant, with a decode cache,
and the token mixers of released linear-attention models."""

from linattn_jax._src.nn.attention import FeatureProjection, MultiHeadAttention
from linattn_jax._src.nn.cache import KVCache, StateCache, cache_kind
from linattn_jax._src.nn.flax_compat import as_flax_attention_fn
from linattn_jax._src.nn.loading import load_transformers_layer
from linattn_jax._src.nn.mixers import Recipe, RecurrentMixer, token_mixer, token_mixer_names
from linattn_jax._src.nn.parts import GatedRMSNorm, LowRank, ShortConvolution, TokenShift
from linattn_jax._src.nn.rwkv7 import RWKV7TimeMixer
from linattn_jax._src.nn.state_space import Mamba2Mixer, MambaMixer, ShortConvMixer
from linattn_jax._src.registry import CacheKind

__all__ = [
    "CacheKind",
    "FeatureProjection",
    "GatedRMSNorm",
    "KVCache",
    "LowRank",
    "Mamba2Mixer",
    "MambaMixer",
    "MultiHeadAttention",
    "RWKV7TimeMixer",
    "Recipe",
    "RecurrentMixer",
    "ShortConvMixer",
    "ShortConvolution",
    "StateCache",
    "TokenShift",
    "as_flax_attention_fn",
    "cache_kind",
    "load_transformers_layer",
    "token_mixer",
    "token_mixer_names",
]
