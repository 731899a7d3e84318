"""Dense boolean attention patterns (True = attend).

Every builder returns a ``[..., T, S]`` boolean array; combine them with
``&`` / ``|``. With T != S, patterns are bottom-right aligned: query i sits
at key position ``i + S - T``.
"""

from linattn_jax._src.masks import (
    bigbird,
    bigbird_layout,
    block_sparse,
    causal,
    local,
    longformer,
    padding,
    strided,
)

__all__ = [
    "bigbird",
    "bigbird_layout",
    "block_sparse",
    "causal",
    "local",
    "longformer",
    "padding",
    "strided",
]
