"""The weight converter: one weight map per architecture, and the registry of them (here, only here).

A weight map turns a transformers config into a `RewardModelConfig` and a transformers state dict into
our parameter names and shapes (unfolded: norms keep their weights; folding happens afterwards in
`processing.fold_norm_weights`, the same for every architecture).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable

import torch

from reward_lens.model.config import RewardModelConfig

StateDict = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class WeightMap:
    architecture: str
    build_config: Callable[[Any], RewardModelConfig]
    convert: Callable[[StateDict, RewardModelConfig, Any], StateDict]
    notes: str = ""


ARCHITECTURES: Dict[str, WeightMap] = {}


def register(weight_map: WeightMap) -> WeightMap:
    ARCHITECTURES[weight_map.architecture] = weight_map
    return weight_map


def supported_architectures() -> Iterable[str]:
    _load_all()
    return sorted(ARCHITECTURES)


def get_weight_map(hf_config: Any) -> WeightMap:
    _load_all()
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(
        f"unsupported reward-model architecture {names or '(config has no architectures field)'}; "
        f"supported: {', '.join(sorted(ARCHITECTURES))} (OpenRLHF checkpoints load as saved, with architectures "
        "RewardModel or LLMForSequenceRegression). Open an issue to ask for a native weight map."
    )


def _load_all() -> None:
    # Importing a weight-map module registers it.
    from reward_lens.converters import llama, mistral, qwen2, qwen3  # noqa: F401
    from reward_lens.converters import armorm, gemma2  # noqa: F401
    from reward_lens.converters import openrlhf  # noqa: F401
