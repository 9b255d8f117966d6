"""OpenRLHF reward models (`architectures=["RewardModel"]`, older `"LLMForSequenceRegression"`), loaded as
saved.

OpenRLHF builds its reward model class at run time (`openrlhf.models.model._get_reward_model`): the base
decoder of the checkpoint's family under its `base_model_prefix` ("model" for Llama, Qwen2/3, Mistral,
Gemma-2) and a bias-free `nn.Linear(hidden_size, 1)` head named by `value_head_prefix`, "value_head"
(older releases) or "score" (newer). config.json keeps the base family's `model_type`, has no `auto_map`
and usually no `num_labels` (transformers then defaults to 2 labels: ignored here, the head has one row).

    reward = head(last_hidden_state)[b, T - 1 - mask[b].fliplr().argmax()]   (the last ATTENDED token)
    if normalize_reward: reward = (reward - mean) / std                   (eval mode, config mean/std)

Weights: the base family's own native weight map (the decoder under "model."), the head as its score
head. `normalize_reward` is folded into the head exactly: W_R / std and bias -mean / std. The config gets
`readout="last_attended"` (see `reward_lens.model.readout`) and `input_format="openrlhf"` (OpenRLHF's
dataset ends each sequence with EOS and reads the reward there).
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Mapping
from typing import Any, Tuple

import torch

from reward_lens.converters.registry import ARCHITECTURES, StateDict, WeightMap, register
from reward_lens.model.config import RewardModelConfig

HEAD_PREFIXES = ("value_head", "score")
OPENRLHF_ARCHITECTURES = ("RewardModel", "LLMForSequenceRegression")


def base_weight_map(hf_config: Any) -> WeightMap:
    """The native weight map of the checkpoint's base family (`model_type`), e.g. Llama's for "llama"."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    model_type = getattr(hf_config, "model_type", None)
    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)
    if name not in ARCHITECTURES:
        bases = sorted(
            a.replace("ForSequenceClassification", "")
            for a in ARCHITECTURES
            if a.endswith("ForSequenceClassification")
        )
        raise ValueError(
            f"OpenRLHF reward model on a {model_type!r} base: reward-lens has no native weight map for "
            f"that family (OpenRLHF checkpoints load natively on bases: {', '.join(bases)}); open an "
            "issue to ask for one"
        )
    return ARCHITECTURES[name]


def normalization(hf_config: Any) -> Tuple[float, float]:
    """(mean, std) OpenRLHF subtracts and divides by in eval mode; (0, 1) when normalize_reward is off."""
    if not getattr(hf_config, "normalize_reward", False):
        return 0.0, 1.0

    def scalar(name: str, default: float) -> float:
        value = getattr(hf_config, name, None)
        if value is None:
            return default
        flat = value if isinstance(value, (list, tuple)) else [value]
        if len(flat) != 1 or isinstance(flat[0], bool) or not isinstance(flat[0], (int, float)):
            raise ValueError(
                f"config.json has normalize_reward=true with {name}={value!r}; OpenRLHF stores one number "
                "(or a list of one) there: fix it or set normalize_reward to false"
            )
        return float(flat[0])

    mean, std = scalar("mean", 0.0), scalar("std", 1.0)
    if not (math.isfinite(std) and std > 0) or not math.isfinite(mean):
        raise ValueError(
            f"config.json has normalize_reward=true with mean={mean}, std={std}; OpenRLHF computes (reward "
            "- mean) / std, so both must be finite and std > 0: fix them or set normalize_reward to false"
        )
    return mean, std


def missing_head_error(sd: StateDict, key: str, architecture: str) -> ValueError:
    """A transformers-layout map found no `{key}.weight`: say so, and point at OpenRLHF when its head is
    there."""
    if "value_head.weight" in sd:
        hint = (
            "it has 'value_head.weight', OpenRLHF's head: set architectures back to [\"RewardModel\"] in "
            "config.json; reward-lens loads OpenRLHF checkpoints as saved, with their "
            "last-attended-token readout"
        )
    else:
        hint = f"tensors outside model.*: {sorted(k for k in sd if not k.startswith('model.'))[:8]}"
    return ValueError(f"the checkpoint has no '{key}.weight', the reward head of {architecture}; {hint}")


def warn_if_relabelled(hf_config: Any, architecture: str) -> None:
    """OpenRLHF always writes `normalize_reward` into config.json: under a transformers class name it means a
    hand-edited OpenRLHF checkpoint, read with transformers' rule (one token early when pad = EOS)."""
    if architecture not in OPENRLHF_ARCHITECTURES and hasattr(hf_config, "normalize_reward"):
        import warnings

        warnings.warn(
            f"config.json says {architecture} but carries OpenRLHF's normalize_reward: if this is an "
            "OpenRLHF reward "
            'model, set architectures back to ["RewardModel"] (and the head name back) so it loads with '
            "OpenRLHF's "
            "readout (last attended token) and normalisation; as labelled, transformers' readout is used",
            stacklevel=4,
        )


def openrlhf_config(hf_config: Any) -> RewardModelConfig:
    cfg = base_weight_map(hf_config).build_config(hf_config)
    cfg.n_outputs = (
        1  # one value-head row; num_labels (absent, so transformers' default 2) means nothing here
    )
    cfg.readout = "last_attended"
    cfg.input_format = "openrlhf"
    return cfg


def convert_openrlhf_rest(sd: StateDict, cfg: RewardModelConfig, hf_config: Any) -> StateDict:
    prefix = next((p for p in HEAD_PREFIXES if f"{p}.weight" in sd), None)
    if prefix is None:
        found = sorted(k for k in sd if not k.startswith("model."))
        raise ValueError(
            "OpenRLHF checkpoint without a reward head: expected 'value_head.weight' or 'score.weight', "
            f"found {found[:8] or 'only model.* tensors'}; was it saved with a custom value_head_prefix?"
        )
    W = sd[f"{prefix}.weight"]
    if W.shape != (1, cfg.d_model):
        raise ValueError(
            f"{prefix}.weight has shape {tuple(W.shape)}, expected (1, {cfg.d_model}) (one reward per "
            "sequence)"
        )
    head = {"score.weight": W}
    if f"{prefix}.bias" in sd:
        head["score.bias"] = sd[f"{prefix}.bias"]
    # The head under the transformers name, the rest read through (lazily) from `sd`.
    out = base_weight_map(hf_config).convert_rest(ChainMap(head, _WithoutPrefix(sd, prefix)), cfg, hf_config)
    mean, std = normalization(hf_config)
    # (h.w + b - mean) / std = h.(w / std) + (b - mean) / std: the normalisation is the head itself.
    dtype = torch.promote_types(W.dtype, torch.float32)  # a bf16 checkpoint's head is not rounded twice
    out["reward_head.W_R"] = (out["reward_head.W_R"].double() / std).to(dtype)
    out["reward_head.b_R"] = ((out["reward_head.b_R"].double() - mean) / std).to(dtype)
    return out


def convert_openrlhf_layer(sd: StateDict, cfg: RewardModelConfig, hf_config: Any, l: int) -> StateDict:
    return base_weight_map(hf_config).convert_layer(sd, cfg, hf_config, l)


class _WithoutPrefix(Mapping):
    """`sd` without the tensors under `prefix.` (the OpenRLHF head, renamed), read through lazily."""

    def __init__(self, sd: Mapping, prefix: str):
        self.sd, self.prefix = sd, prefix + "."

    def __getitem__(self, key: str):
        if key.startswith(self.prefix):
            raise KeyError(key)
        return self.sd[key]

    def __iter__(self):
        return (k for k in self.sd if not k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


for _name in OPENRLHF_ARCHITECTURES:
    register(
        WeightMap(
            architecture=_name,
            build_config=openrlhf_config,
            convert_layer=convert_openrlhf_layer,
            convert_rest=convert_openrlhf_rest,
            notes="OpenRLHF RewardModel: its base family's decoder map, head value_head/score, "
            "normalize_reward folded into the head, readout at the last attended token, input format "
            "'openrlhf'.",
        )
    )
