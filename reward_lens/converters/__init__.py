"""The weight converter: one weight map per architecture (one module each), and the registry of them
(`registry`). Importing this package registers every weight map.

A weight map turns a transformers config into a `RewardModelConfig` and a transformers state dict into
our parameter names and shapes (unfolded: norms keep their weights; folding happens afterwards in
`processing.fold_norm_weights`, the same for every architecture).
"""

from __future__ import annotations

from reward_lens.converters import (  # noqa: F401,E402  (each registers itself)  # noqa: F401,E402  # noqa: F401,E402
    armorm,
    gemma2,
    llama,
    mistral,
    mlp_heads,
    openrlhf,  # noqa: F401,E402
    qrm,
    qwen2,
    qwen3,
)
from reward_lens.converters.registry import (
    ARCHITECTURES,
    StateDict,
    WeightMap,
    get_weight_map,
    register,
    supported_architectures,
)

__all__ = ["ARCHITECTURES", "StateDict", "WeightMap", "get_weight_map", "register", "supported_architectures"]
