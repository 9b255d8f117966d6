"""The registry of weight maps: one `WeightMap` per transformers architecture, registered by the module
that defines it (importing `reward_lens.converters` imports every one)."""

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
    return sorted(ARCHITECTURES)


def get_weight_map(hf_config: Any) -> WeightMap:
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(
        f"unsupported reward-model architecture {names or '(config has no architectures field)'}; "
        f"supported: {', '.join(sorted(ARCHITECTURES))} (OpenRLHF checkpoints load as saved, with architectures "
        "RewardModel or LLMForSequenceRegression). Open an issue to ask for a native weight map."
    )
