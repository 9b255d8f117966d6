"""The one place that chooses the model kind: native (a weight map in `reward_lens.converters` handles the
architecture) or generic (any other transformers *ForSequenceClassification model, or when asked).

`HookedRewardModel.from_pretrained` / `from_hf_model` call these with their own class, so this module
never imports the native model (no cycle); the generic model is built here from what loading returns.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import torch.nn as nn

from reward_lens.model.base import RewardModelBase
from reward_lens.model.generic.load import GENERIC_MARKER
from reward_lens.model.generic.wrapper import GenericHookedRewardModel
from reward_lens.model.loading import (
    HOOKED_CONFIG,
    convert_weights,
    has_native_weight_map,
    load_hf_config,
    load_hf_state_dict,
    load_hooked_weights,
    load_tokenizer,
    resolve_checkpoint_dir,
)


def load_pretrained(
    native_cls,
    path_or_id: Union[str, Path],
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
    fold_ln: bool = True,
    tokenizer: Any = None,
    generic: bool = False,
    module_map: Optional[Dict[str, Optional[str]]] = None,
    **overrides: Any,
) -> RewardModelBase:
    """A saved hooked checkpoint or a transformers checkpoint directory (hub ids are downloaded) as a
    hooked model: native (`native_cls`) when a weight map handles it, else generic. `overrides` are set
    on the transformers config before conversion."""
    directory = resolve_checkpoint_dir(path_or_id)
    if tokenizer is None:
        tokenizer = load_tokenizer(directory)
    build = dict(tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln)
    if (directory / HOOKED_CONFIG).exists():
        cfg, sd = load_hooked_weights(directory)
        return native_cls.from_state_dict(cfg, sd, **build)
    hf_config = load_hf_config(directory, overrides)
    marked = (directory / GENERIC_MARKER).exists()
    if generic or module_map is not None or marked or not has_native_weight_map(hf_config):
        return GenericHookedRewardModel.from_checkpoint_dir(directory, hf_config, module_map=module_map, **build)
    cfg, sd = convert_weights(hf_config, load_hf_state_dict(directory))
    return native_cls.from_state_dict(cfg, sd, **build)


def from_hf_model(
    native_cls,
    hf_model: nn.Module,
    tokenizer: Any = None,
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
    fold_ln: bool = True,
    generic: bool = False,
    module_map: Optional[Dict[str, Optional[str]]] = None,
) -> RewardModelBase:
    """A transformers model in memory converted (native) or a copy of it wrapped (generic)."""
    config = copy.deepcopy(hf_model.config)
    if not getattr(config, "architectures", None):  # set by save_pretrained, absent in memory
        config.architectures = [type(hf_model).__name__]
    if generic or module_map is not None or not has_native_weight_map(config):
        return GenericHookedRewardModel.from_hf_model(
            hf_model, tokenizer, device=device, dtype=dtype, fold_ln=fold_ln, module_map=module_map
        )
    cfg, sd = convert_weights(config, hf_model.state_dict())
    return native_cls.from_state_dict(cfg, sd, tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln)
