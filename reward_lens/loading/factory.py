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

from reward_lens.loading import inmemory
from reward_lens.loading.checkpoint import (
    HOOKED_CONFIG,
    convert_weights,
    has_native_weight_map,
    load_hf_config,
    load_hooked_config,
    load_tokenizer,
    resolve_checkpoint_dir,
)
from reward_lens.loading.checks import check_finite_weights, check_hf_tensors, check_tokenizer_vocab
from reward_lens.loading.generic import GENERIC_MARKER
from reward_lens.loading.peft_adapter import is_peft_adapter_dir
from reward_lens.loading.streaming import LazyStateDict, converted_source, hooked_source
from reward_lens.model.base import RewardModelBase
from reward_lens.model.devices import resolve_dtype
from reward_lens.model.generic.wrapper import GenericHookedRewardModel


def _dtype_alias(dtype: Any, overrides: Dict[str, Any]) -> Any:
    """`dtype`, or transformers' `torch_dtype=` / `dtype` spelling taken from `overrides` (never set on the
    config, where it would be ignored); both, differing, are refused."""
    alias = overrides.pop("torch_dtype", None)
    if alias is None or (isinstance(alias, str) and alias == "auto" and dtype is None):
        return dtype
    if dtype is not None and resolve_dtype(dtype) != resolve_dtype(alias):
        raise TypeError(
            f"dtype={dtype!r} and torch_dtype={alias!r} disagree; pass one (dtype= is reward-lens' name)"
        )
    return alias


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
    n_devices: Optional[int] = None,
    device_map: Any = None,
    **overrides: Any,
) -> RewardModelBase:
    """A saved hooked checkpoint or a transformers checkpoint directory (hub ids are downloaded) as a
    hooked model: native (`native_cls`) when a weight map handles it, else generic. `overrides` are set
    on the transformers config before conversion. Native checkpoints stream: read, converted, checked,
    folded, cast and placed one block at a time (`reward_lens.loading.streaming`). `torch_dtype=`
    (transformers' spelling) is honoured as `dtype=`."""
    dtype = _dtype_alias(dtype, overrides)
    if (
        overrides.get("gguf_file") is not None
    ):  # a llama.cpp file: transformers dequantises it (model/gguf.py)
        from reward_lens.loading.gguf import load_gguf

        return load_gguf(
            native_cls,
            path_or_id,
            overrides.pop("gguf_file"),
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            fold_ln=fold_ln,
            generic=generic,
            module_map=module_map,
            **overrides,
        )
    directory = resolve_checkpoint_dir(path_or_id)
    if tokenizer is None:
        tokenizer = load_tokenizer(directory)
    build = dict(tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln)
    placed = dict(n_devices=n_devices, device_map=device_map)
    if (directory / HOOKED_CONFIG).exists():
        src = hooked_source(directory, load_hooked_config(directory, overrides))
        return native_cls.from_source(src, source=str(directory), **build, **placed)
    if is_peft_adapter_dir(directory):  # a LoRA RM as trainer.save_model writes it: base + adapter, merged
        from reward_lens.loading.peft_adapter import load_peft_adapter

        refuse_placement("PEFT adapter directories", **placed)
        return load_peft_adapter(
            native_cls,
            directory,
            tokenizer=tokenizer,
            base_model=overrides.pop("base_model", None),
            device=device,
            dtype=dtype,
            fold_ln=fold_ln,
            generic=generic,
            module_map=module_map,
        )
    hf_config = load_hf_config(directory, overrides)
    marked = (directory / GENERIC_MARKER).exists()
    if generic or module_map is not None or marked or not has_native_weight_map(hf_config):
        refuse_placement("the generic path", **placed)
        model = GenericHookedRewardModel.from_checkpoint_dir(
            directory, hf_config, module_map=module_map, **build
        )
        check_finite_weights(
            model.state_dict().items(), str(directory)
        )  # transformers loaded these: same checks
        check_tokenizer_vocab(tokenizer, model.cfg.d_vocab, str(directory))
        return model
    lazy = LazyStateDict.from_directory(directory)
    check_hf_tensors(hf_config, lazy.meta(), directory)  # names, shapes, dtypes from the headers only
    return native_cls.from_source(
        converted_source(hf_config, lazy, str(directory)), source=str(directory), **build, **placed
    )


def refuse_placement(what: str, n_devices: Optional[int] = None, device_map: Any = None) -> None:
    """Multi-device placement is for native models; elsewhere asking for it is an error, not ignored."""
    if device_map is not None or (n_devices is not None and int(n_devices) != 1):
        raise ValueError(
            f"n_devices / device_map are supported for native architectures only, not {what}; load on one "
            "device (device=...) or convert the model to a native architecture"
        )


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
    n_devices: Optional[int] = None,
    device_map: Any = None,
) -> RewardModelBase:
    """A transformers model in memory converted (native) or a copy of it wrapped (generic); weights always
    copied. The weight map is chosen by the module's class (`config.architectures` may be stale after
    training); PEFT adapters are merged into a copy; autocast and accelerate's mixed-precision wrapper are
    left out (see `reward_lens.loading.inmemory`)."""
    source, owned = inmemory.unwrap(hf_model), False
    if not isinstance(source, nn.Module):
        raise TypeError(
            f"from_hf_model needs a transformers model (an nn.Module), got {type(hf_model).__name__}"
        )
    meta = next((n for n, p in source.named_parameters() if p.device.type == "meta"), None)
    if meta is not None:
        raise ValueError(
            f"the model's weights are on the meta device ({meta}, ...): it was built without its weights "
            "(init_empty_weights, device='meta', an offloaded device_map, or nnsight before its first "
            "trace); load it with real weights (from_pretrained without device_map; nnsight: dispatch=True) "
            "or pass its checkpoint to from_pretrained"
        )
    if inmemory.is_peft_model(source):
        source, owned = inmemory.independent_copy(source), True
    config = copy.deepcopy(source.config)
    config.architectures = inmemory.class_names(source)
    with inmemory.no_autocast():
        if generic or module_map is not None or not has_native_weight_map(config):
            refuse_placement("the generic path", n_devices, device_map)
            return GenericHookedRewardModel.from_hf_model(
                source if owned else inmemory.independent_copy(source),
                tokenizer,
                device=device,
                dtype=dtype,
                fold_ln=fold_ln,
                module_map=module_map,
                copy=False,
            )
        cfg, sd = convert_weights(config, inmemory.copied_state_dict(source))
        return native_cls.from_state_dict(
            cfg,
            sd,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            fold_ln=fold_ln,
            n_devices=n_devices,
            device_map=device_map,
        )
