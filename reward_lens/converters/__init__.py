"""The weight converter: one weight map per architecture (one module each), and the registry of them
(`registry`). Importing this package registers every weight map.

A weight map turns a transformers config into a `RewardModelConfig` and a transformers state dict into
our parameter names and shapes (unfolded: norms keep their weights; folding happens afterwards in
`processing.fold_norm_weights`, the same for every architecture).
"""

from __future__ import annotations

from reward_lens.converters.registry import (
    ARCHITECTURES,
    StateDict,
    WeightMap,
    get_weight_map,
    register,
    supported_architectures,
)
from reward_lens.converters import llama, mistral, qwen2, qwen3  # noqa: F401,E402  (each registers itself)
from reward_lens.converters import armorm, gemma2  # noqa: F401,E402
from reward_lens.converters import openrlhf  # noqa: F401,E402
from reward_lens.converters import mlp_heads, qrm  # noqa: F401,E402

__all__ = ["ARCHITECTURES", "StateDict", "WeightMap", "get_weight_map", "register", "supported_architectures"]
