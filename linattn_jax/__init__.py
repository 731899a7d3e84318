"""linattn_jax: efficient attention mechanisms as pure JAX functions.

Layout ``[B, T, N, H]`` for queries and ``[B, S, K, H]`` / ``[B, S, K, D]``
for keys and values, as in ``jax.nn.dot_product_attention``. Letters: B
batch, T query length, S key/value length, N query heads, K key/value heads
(G = N // K queries share one), H query/key head dim, D value head dim, M
feature-map size, C chunk size.

The examples in the docstrings assume::

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    import linattn_jax as la
    from linattn_jax import feature_maps, masks, nn, parallel
"""

from linattn_jax import feature_maps, masks, nn, parallel
from linattn_jax._src.cosformer import (
    CosformerState,
    cosformer_attention,
    cosformer_attention_reference,
    cosformer_attention_step,
    init_cosformer_state,
)
from linattn_jax._src.delta import (
    DeltaSummary,
    delta_rule_attention,
    delta_rule_attention_reference,
    delta_rule_attention_step,
)
from linattn_jax._src.delta_product import (
    delta_product_attention,
    delta_product_attention_reference,
    delta_product_attention_step,
)
from linattn_jax._src.dense import softmax_attention_reference
from linattn_jax._src.dplr import dplr_attention, dplr_attention_reference, dplr_attention_step
from linattn_jax._src.efficient import (
    EfficientState,
    efficient_attention,
    efficient_attention_reference,
    efficient_attention_step,
    init_efficient_state,
)
from linattn_jax._src.flash import flash_attention
from linattn_jax._src.gated import (
    GatedState,
    GatedSummary,
    gated_linear_attention,
    gated_linear_attention_reference,
    gated_linear_attention_step,
    init_gated_state,
)
from linattn_jax._src.heinsen import (
    HeinsenState,
    heinsen_attention,
    heinsen_attention_reference,
    heinsen_attention_step,
    init_heinsen_state,
    log_heinsen_attention,
)
from linattn_jax._src.linear import (
    LinearState,
    init_linear_state,
    linear_attention,
    linear_attention_reference,
    linear_attention_step,
)
from linattn_jax._src.linformer import linformer_attention, linformer_attention_reference
from linattn_jax._src.log_linear import (
    LogLinearState,
    init_log_linear_state,
    log_linear_attention,
    log_linear_attention_reference,
    log_linear_attention_step,
)
from linattn_jax._src.performer import (
    PerformerState,
    init_performer_state,
    performer_attention,
    performer_attention_reference,
    performer_attention_step,
)
from linattn_jax._src.registry import (
    AttentionFn,
    AttentionSpec,
    Role,
    StreamingSpec,
    TokenInput,
    available_attentions,
    get_attention,
    get_spec,
    register_attention,
)
from linattn_jax._src.selective_scan import (
    SelectiveState,
    selective_scan,
    selective_scan_reference,
    selective_scan_step,
)
from linattn_jax._src.softmax import softmax_attention
from linattn_jax._src.sparse import (
    LocalState,
    bigbird_attention,
    block_sparse_attention,
    init_local_state,
    local_attention,
    local_attention_step,
    longformer_attention,
    strided_attention,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionFn",
    "AttentionSpec",
    "available_attentions",
    "bigbird_attention",
    "block_sparse_attention",
    "cosformer_attention",
    "cosformer_attention_reference",
    "cosformer_attention_step",
    "CosformerState",
    "delta_product_attention",
    "delta_product_attention_reference",
    "delta_product_attention_step",
    "delta_rule_attention",
    "delta_rule_attention_reference",
    "delta_rule_attention_step",
    "dplr_attention",
    "dplr_attention_reference",
    "dplr_attention_step",
    "DeltaSummary",
    "efficient_attention",
    "efficient_attention_reference",
    "efficient_attention_step",
    "EfficientState",
    "feature_maps",
    "flash_attention",
    "gated_linear_attention",
    "gated_linear_attention_reference",
    "gated_linear_attention_step",
    "GatedState",
    "GatedSummary",
    "get_attention",
    "get_spec",
    "heinsen_attention",
    "heinsen_attention_reference",
    "heinsen_attention_step",
    "HeinsenState",
    "init_cosformer_state",
    "init_efficient_state",
    "init_gated_state",
    "init_heinsen_state",
    "init_linear_state",
    "init_local_state",
    "init_log_linear_state",
    "init_performer_state",
    "linear_attention",
    "linear_attention_reference",
    "linear_attention_step",
    "LinearState",
    "linformer_attention",
    "linformer_attention_reference",
    "local_attention",
    "local_attention_step",
    "LocalState",
    "longformer_attention",
    "log_heinsen_attention",
    "log_linear_attention",
    "log_linear_attention_reference",
    "log_linear_attention_step",
    "LogLinearState",
    "masks",
    "nn",
    "performer_attention",
    "performer_attention_reference",
    "performer_attention_step",
    "parallel",
    "PerformerState",
    "register_attention",
    "Role",
    "selective_scan",
    "selective_scan_reference",
    "selective_scan_step",
    "SelectiveState",
    "softmax_attention",
    "softmax_attention_reference",
    "StreamingSpec",
    "TokenInput",
    "strided_attention",
]
