"""The registry of weight maps: one `WeightMap` per transformers architecture, registered by the module
that defines it (importing `reward_lens.converters` imports every one).

A map converts in two parts, so that a checkpoint can be streamed one layer at a time (peak memory: one
layer, not the model): `convert_rest` (embedding, final norm, head, rotary frequencies) and
`convert_layer(..., l)` (the `blocks.{l}.*` weights of layer l). Each reads only the tensors it needs from
the state dict it is given (a dict, or a lazy mapping that reads each tensor when asked). `convert` is both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Mapping

import torch

from reward_lens.model.config import RewardModelConfig

StateDict = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class WeightMap:
    architecture: str
    build_config: Callable[[Any], RewardModelConfig]
    convert_layer: Callable[[Mapping[str, torch.Tensor], RewardModelConfig, Any, int], StateDict]
    convert_rest: Callable[[Mapping[str, torch.Tensor], RewardModelConfig, Any], StateDict]
    notes: str = ""

    def convert(self, sd: Mapping[str, torch.Tensor], cfg: RewardModelConfig, hf_config: Any) -> StateDict:
        """The whole converted (unfolded) state dict: the rest, then every layer."""
        out = self.convert_rest(sd, cfg, hf_config)
        for l in range(cfg.n_layers):
            out.update(self.convert_layer(sd, cfg, hf_config, l))
        return out


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
        f"supported: {', '.join(sorted(ARCHITECTURES))} (OpenRLHF checkpoints load as saved, with "
        "architectures RewardModel or LLMForSequenceRegression). Open an issue to ask for a native "
        "weight map."
    )
