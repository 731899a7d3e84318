"""The Flax NNX layer, split as Flax splits its own: ``attention`` (the layer), ``cache``
(decode caches and their kernels), ``gates`` (gate and beta projections), ``weights`` (mask,
dropout and sowing on formed weights), ``flax_compat`` (Flax's calling conventions)."""
