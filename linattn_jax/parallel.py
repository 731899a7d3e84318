"""Context parallelism: attention over a sequence sharded along its length over devices."""

from linattn_jax._src.parallel import (
    ContextParallel,
    context_parallel_attention,
    recurrent_attentions,
    ring_attention,
)

__all__ = [
    "ContextParallel",
    "context_parallel_attention",
    "recurrent_attentions",
    "ring_attention",
]
