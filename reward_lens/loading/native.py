"""HookedRewardModel: the native hooked reward model (`reward_lens.model.native.NativeRewardModel`) with
its checkpoint I/O: loading from transformers / OpenRLHF / PEFT-adapter / GGUF checkpoints, hooked
checkpoints, judges and models in memory, and saving.

The I/O lives here, beside the loading code it calls, so every dependency points down: the model layer
knows nothing of checkpoints, and the loaders build whichever class they are called on (`cls`).
`from_pretrained` and `from_hf_model` are the one place that chooses the model kind: native (a weight map
in `reward_lens.converters` handles the architecture) or generic (any other transformers
*ForSequenceClassification model, or when asked).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import torch
import torch.nn as nn

from reward_lens.loading import checkpoint, inmemory, judge, streaming
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
from reward_lens.loading.generic import GENERIC_MARKER, GenericHookedRewardModel
from reward_lens.loading.peft_adapter import is_peft_adapter_dir
from reward_lens.loading.streaming import LazyStateDict, converted_source, hooked_source
from reward_lens.model.base import RewardModelBase
from reward_lens.model.config import RewardModelConfig
from reward_lens.model.devices import resolve_dtype
from reward_lens.model.heads.prm import resolve_step_tag
from reward_lens.model.native import NativeRewardModel
from reward_lens.model.placement import resolve_devices
from reward_lens.model.readout import set_readout
from reward_lens.model.tokenization import check_input_format
from reward_lens.model.validation import checked_arguments


class HookedRewardModel(NativeRewardModel):
    """The native hooked reward model: every TransformerLens hook down to single heads and neurons, loaded
    from and saved to checkpoints."""

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: Union[str, Path],
        *,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        fold_ln: bool = True,
        generic: bool = False,
        input_format: str = "auto",
        readout: Optional[str] = None,
        tokenizer: Any = None,
        module_map: Optional[Dict[str, Optional[str]]] = None,
        n_devices: Optional[int] = None,
        device_map: Any = None,
        **overrides: Any,
    ) -> RewardModelBase:
        """Load an HF reward checkpoint (local dir or hub id), an OpenRLHF or PEFT-adapter directory, or a
        saved hooked checkpoint.

        An architecture without a native weight map (or `generic=True`) loads on the generic
        component-level path (`reward_lens.GenericHookedRewardModel`; option `module_map=`).
        `input_format`: how `to_tokens` renders pairs by default (`reward_lens.model.tokenization`).
        `readout` overrides the checkpoint's readout convention ("last_non_pad" / "last_attended").
        `device` defaults to CUDA when available, else CPU (as TransformerLens). Native checkpoints stream
        (one block in host memory at a time, `reward_lens.loading.streaming`); `n_devices=k` (cuda:0..k-1) or
        `device_map=[devices]` / `"auto"` spreads the blocks over several devices, balanced by bytes
        (`reward_lens.model.placement`).
        `gguf_file="x.gguf"` loads a llama.cpp file in `path_or_id` as transformers does (dequantised to
        float32;
        needs `pip install gguf`); a GGUF holds no reward head, so the score head is random until set
        (`reward_lens.loading.gguf`). Other keyword arguments override config fields (e.g. `pad_token_id`).
        """
        check_input_format(input_format)
        step_tag = overrides.pop("step_tag", None)

        dtype = dtype_alias(dtype, overrides)  # transformers' torch_dtype= spelling too

        def load() -> RewardModelBase:  # the model kind chosen here: native, or generic
            if (
                overrides.get("gguf_file") is not None
            ):  # a llama.cpp file: transformers dequantises it (model/gguf.py)
                from reward_lens.loading.gguf import load_gguf

                return load_gguf(
                    cls,
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
            tok = tokenizer if tokenizer is not None else load_tokenizer(directory)
            build = dict(tokenizer=tok, device=device, dtype=dtype, fold_ln=fold_ln)
            placed = dict(n_devices=n_devices, device_map=device_map)
            if (directory / HOOKED_CONFIG).exists():
                src = hooked_source(directory, load_hooked_config(directory, overrides))
                return cls.from_source(src, source=str(directory), **build, **placed)
            if is_peft_adapter_dir(directory):  # a LoRA RM as trainer.save_model writes it: base + adapter
                from reward_lens.loading.peft_adapter import load_peft_adapter

                refuse_placement("PEFT adapter directories", **placed)
                return load_peft_adapter(
                    cls,
                    directory,
                    tokenizer=tok,
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
                check_tokenizer_vocab(tok, model.cfg.d_vocab, str(directory))
                return model
            lazy = LazyStateDict.from_directory(directory)
            check_hf_tensors(hf_config, lazy.meta(), directory)  # names, shapes, dtypes from the headers only
            return cls.from_source(
                converted_source(hf_config, lazy, str(directory)), source=str(directory), **build, **placed
            )

        model = load()
        model.input_format = input_format
        resolve_step_tag(model, step_tag)
        return set_readout(model, readout)

    @classmethod
    def from_judge(
        cls,
        path_or_id: Any,
        positive: Union[str, int] = "Yes",
        negative: Union[str, int] = "No",
        *,
        input_format: str = "auto",
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        gguf_file: Optional[str] = None,
        tokenizer: Any = None,
        fold_ln: bool = True,
        **overrides: Any,
    ) -> "HookedRewardModel":
        """A generative judge read as a reward model: any causal LM (a checkpoint directory or hub id, a
        directory with `gguf_file=`, or a transformers causal LM in memory), reward = logit(positive) -
        logit(negative) at the last attended position of the rendered text. That is exactly linear in the
        final residual along W_U[positive] - W_U[negative] (tied embeddings: W_E's rows), so every instrument
        decomposes it exactly. `positive` / `negative`: one token each (a string of one token, or an id).
        `input_format` renders (prompt, response) pairs (`to_tokens`): e.g. a template asking the question,
        "...{prompt}...{response}... Is this response correct? Answer Yes or No.<|im_end|>\n<|im_start|>
        assistant\n" (newlines as in the chat format).
        """
        check_input_format(input_format)
        model = judge.load_judge(
            cls,
            path_or_id,
            positive=positive,
            negative=negative,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            fold_ln=fold_ln,
            gguf_file=gguf_file,
            **overrides,
        )
        model.input_format = input_format
        if input_format != "auto":  # the judge's question is part of the model: saved with it
            model.cfg.input_format = input_format
        return model

    @classmethod
    def from_hf_model(
        cls,
        hf_model: nn.Module,
        tokenizer: Any = None,
        *,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        fold_ln: bool = True,
        generic: bool = False,
        module_map: Optional[Dict[str, Optional[str]]] = None,
        readout: Optional[str] = None,
        n_devices: Optional[int] = None,
        device_map: Any = None,
    ) -> RewardModelBase:
        """Convert a transformers model already in memory, e.g. `trainer.model` right after TRL training.

        Weights are copied, never shared. The weight map is chosen by the module's class (its
        `config.architectures` may be stale); PEFT adapters are merged into a copy; accelerate's
        mixed-precision wrapper and any enclosing autocast are ignored (see `reward_lens.loading.inmemory`).
        No native weight map (or `generic=True`): a copy wrapped on the generic component-level path.
        `device` defaults to CUDA when available, else CPU.
        """
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
                "trace); load it with real weights (from_pretrained without device_map; nnsight: "
                "dispatch=True) or pass its checkpoint to from_pretrained"
            )
        if inmemory.is_peft_model(source):
            source, owned = inmemory.independent_copy(source), True
        config = copy.deepcopy(source.config)
        config.architectures = inmemory.class_names(source)
        with inmemory.no_autocast():
            if generic or module_map is not None or not has_native_weight_map(config):
                refuse_placement("the generic path", n_devices, device_map)
                model = GenericHookedRewardModel.from_hf_model(
                    source if owned else inmemory.independent_copy(source),
                    tokenizer,
                    device=device,
                    dtype=dtype,
                    fold_ln=fold_ln,
                    module_map=module_map,
                    copy=False,
                )
            else:
                cfg, sd = convert_weights(config, inmemory.copied_state_dict(source))
                model = cls.from_state_dict(
                    cfg,
                    sd,
                    tokenizer=tokenizer,
                    device=device,
                    dtype=dtype,
                    fold_ln=fold_ln,
                    n_devices=n_devices,
                    device_map=device_map,
                )
        return set_readout(model, readout)

    @classmethod
    def from_state_dict(
        cls,
        cfg: RewardModelConfig,
        sd: Mapping[str, torch.Tensor],
        *,
        tokenizer: Any = None,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        fold_ln: bool = True,
        source: str = "the checkpoint",
        n_devices: Optional[int] = None,
        device_map: Any = None,
    ) -> "HookedRewardModel":
        """The model holding converted weights `sd` (our names, unfolded or folded as `cfg` says); norms
        folded when `fold_ln`. Neither argument is changed (weights are copied). Names, shapes, finite
        values and the tokenizer's vocabulary are checked first, block by block; errors name `source`.
        `n_devices` / `device_map`: spread the blocks over several devices (`reward_lens.model.placement`)."""
        return cls.from_source(
            streaming.partitioned_source(cfg, sd),
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            fold_ln=fold_ln,
            source=source,
            n_devices=n_devices,
            device_map=device_map,
        )

    @classmethod
    def from_source(
        cls,
        src: Any,
        *,
        tokenizer: Any = None,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        fold_ln: bool = True,
        source: str = "the checkpoint",
        n_devices: Optional[int] = None,
        device_map: Any = None,
    ) -> "HookedRewardModel":
        """The model built from a `reward_lens.loading.streaming.WeightSource`, one block at a time."""
        devices = resolve_devices(device, n_devices, device_map)
        return streaming.build_model(
            cls,
            src,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            fold_ln=fold_ln,
            source=source,
            devices=devices,
        )

    @checked_arguments(flags=("overwrite",))
    def save_pretrained(self, path: Union[str, Path], *, overwrite: bool = False) -> None:
        """Save as a hooked checkpoint (config JSON + safetensors + tokenizer files). A directory holding
        another checkpoint (e.g. the transformers one this model was loaded from) is refused unless
        `overwrite=True`; an earlier hooked save there is replaced."""
        checkpoint.save_hooked(self, path, overwrite=overwrite)


def dtype_alias(dtype: Any, overrides: Dict[str, Any]) -> Any:
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


def refuse_placement(what: str, n_devices: Optional[int] = None, device_map: Any = None) -> None:
    """Multi-device placement is for native models; elsewhere asking for it is an error, not ignored."""
    if device_map is not None or (n_devices is not None and int(n_devices) != 1):
        raise ValueError(
            f"n_devices / device_map are supported for native architectures only, not {what}; load on one "
            "device (device=...) or convert the model to a native architecture"
        )
