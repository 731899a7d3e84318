"""Feature maps φ for kernel (linear) attention, and random projections.

A feature map is ``phi(x, *, is_query=False) -> [..., M]`` for ``x`` of shape
``[..., H]``. Maps built by the factories are pytrees whose arrays are
leaves: new parameter values of the same shapes reuse compiled programs.
"""

from linattn_jax._src.feature_maps import (
    FavorPlus,
    FeatureMap,
    Projected,
    RandomFourier,
    elu_plus_one,
    exp,
    favor_plus,
    gaussian_random_projection,
    orthogonal_random_projection,
    projected,
    random_fourier,
    relu,
)

__all__ = [
    "FavorPlus",
    "FeatureMap",
    "Projected",
    "RandomFourier",
    "elu_plus_one",
    "exp",
    "favor_plus",
    "gaussian_random_projection",
    "orthogonal_random_projection",
    "projected",
    "random_fourier",
    "relu",
]
