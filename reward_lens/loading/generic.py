"""Loading for the generic path: the checkpoint's transformers sequence-classification model (refused when
it has none, or when its weights are incomplete), the marker file that makes a saved generic model reload
on this path, and `GenericHookedRewardModel`, the generic model
(`reward_lens.model.generic.wrapper.GenericRewardModel`) with its checkpoint I/O."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import torch.nn as nn

from reward_lens.converters import supported_architectures
from reward_lens.loading.checkpoint import (
    has_native_weight_map,
    load_hf_config,
    load_tokenizer,
    resolve_checkpoint_dir,
)
from reward_lens.loading.checks import sequence_classification_class
from reward_lens.model.devices import resolve_device, resolve_dtype
from reward_lens.model.generic.discovery import GenericLoadError
from reward_lens.model.generic.wrapper import GenericRewardModel

GENERIC_MARKER = "reward_lens_generic.json"  # written by save_pretrained: reload on the generic path


def load_sequence_classifier(
    directory: Path,
    hf_config: Any,
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
) -> nn.Module:
    """The checkpoint loaded with its transformers sequence-classification class, on `device`."""
    cls = sequence_classification_class(hf_config)
    if cls is None:
        names = list(getattr(hf_config, "architectures", None) or [])
        if has_native_weight_map(hf_config):
            raise ValueError(
                f"generic=True needs a transformers *ForSequenceClassification class, and {names} is "
                "none; this architecture has a native weight map: load it without generic=True"
            )
        raise ValueError(
            f"unsupported reward-model architecture {names or '(config has no architectures field)'}; "
            f"natively supported: {', '.join(supported_architectures())}. Generic loading was tried too, "
            "but it needs a transformers *ForSequenceClassification architecture (a scalar reward head), "
            "and this checkpoint names none. OpenRLHF checkpoints load natively with architectures "
            "RewardModel / LLMForSequenceRegression, as OpenRLHF saves them. Open an issue to ask for a "
            "native weight map."
        )
    hf, info = cls.from_pretrained(
        str(directory), config=hf_config, dtype=resolve_dtype(dtype), output_loading_info=True
    )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise GenericLoadError(
            f"{directory} lacks weights {missing[:6]}{' ...' if len(missing) > 6 else ''} that "
            f"{cls.__name__} needs; transformers would initialise them at random, so the rewards would be "
            "meaningless"
        )
    return hf.to(resolve_device(device))


def saved_module_map(directory: Path) -> Optional[Dict[str, Optional[str]]]:
    """The module map a saved generic model was wrapped with (None when the directory has no marker)."""
    marker = directory / GENERIC_MARKER
    if not marker.exists():
        return None
    return json.loads(marker.read_text()).get("module_map") or None


def save_generic(
    hf_model: nn.Module, tokenizer: Any, module_map: Dict[str, Optional[str]], path: Union[str, Path]
) -> None:
    """The transformers checkpoint (+ tokenizer) and the marker that reloads it on the generic path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    (path / GENERIC_MARKER).write_text(json.dumps({"module_map": module_map}, indent=1))


class GenericHookedRewardModel(GenericRewardModel):
    """A transformers sequence-classification reward model with component-level TransformerLens hooks,
    loaded from and saved to checkpoints."""

    @classmethod
    def from_checkpoint_dir(
        cls,
        directory: Path,
        hf_config: Any,
        *,
        tokenizer: Any = None,
        device=None,
        dtype=None,
        fold_ln: bool = True,
        module_map: Optional[Dict[str, Optional[str]]] = None,
    ) -> "GenericHookedRewardModel":
        """Wrap the checkpoint in `directory` (its transformers config given); a saved generic model's
        module map is reused unless `module_map` is given."""
        hf = load_sequence_classifier(directory, hf_config, device=device, dtype=dtype)
        module_map = module_map if module_map is not None else saved_module_map(directory)
        return cls(hf, tokenizer, module_map=module_map, fold_ln=fold_ln)

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: Union[str, Path],
        *,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        fold_ln: bool = True,
        tokenizer: Any = None,
        module_map: Optional[Dict[str, Optional[str]]] = None,
        **overrides: Any,
    ) -> "GenericHookedRewardModel":
        """A transformers checkpoint (directory or hub id) on the generic path, as
        `HookedRewardModel.from_pretrained(..., generic=True)`."""
        directory = resolve_checkpoint_dir(path_or_id)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(directory)
        return cls.from_checkpoint_dir(
            directory,
            load_hf_config(directory, overrides),
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            fold_ln=fold_ln,
            module_map=module_map,
        )

    def save_pretrained(self, path: Union[str, Path]) -> None:
        """Save the transformers checkpoint (+ tokenizer) and a marker so `from_pretrained` reloads it
        here."""
        save_generic(self.hf_model, self.tokenizer, self.cfg.module_map, path)
