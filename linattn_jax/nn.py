"""Flax NNX layers: multi-head attention over any registered variant, with a decode cache."""

from linattn_jax._src.layers import (
    FeatureProjection,
    KVCache,
    MultiHeadAttention,
    StateCache,
    as_flax_attention_fn,
    cache_kind,
)
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
