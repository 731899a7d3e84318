"""Dense boolean attention patterns (True = attend).

Every builder returns a ``[..., T, S]`` boolean array; combine them with
``&`` / ``|``. With T != S, patterns are bottom-right aligned: query i sits
at key position ``i + S - T``.
"""

from linattn_jax._src.masks import block_sparse, causal, local, padding, strided

__all__ = ["block_sparse", "causal", "local", "padding", "strided"]
