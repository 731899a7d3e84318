"""Flax NNX layers: multi-head attention over any registered variant, with a decode cache."""

from linattn_jax._src.nn.attention import FeatureProjection, MultiHeadAttention
from linattn_jax._src.nn.cache import KVCache, StateCache, cache_kind
from linattn_jax._src.nn.flax_compat import as_flax_attention_fn
from linattn_jax._src.registry import CacheKind

__all__ = [
    "CacheKind",
    "FeatureProjection",
    "KVCache",
    "MultiHeadAttention",
    "StateCache",
    "as_flax_attention_fn",
    "cache_kind",
]
