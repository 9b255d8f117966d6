"""transformers models in memory (e.g. `trainer.model` right after TRL training), made safe to convert.

Three things a trained model carries that a saved checkpoint does not:
- a stale `config.architectures` (the base's, e.g. `LlamaForCausalLM`, also after `merge_and_unload()`):
  the module's class is the truth, so the weight map is chosen by `type(model).__name__` (then its bases);
- accelerate's mixed-precision wrapper: with TRL's default `bf16=True`, `model.forward` runs under
  `torch.autocast(bfloat16)` for good; conversion and parity checks run on a copy with that wrapper
  removed and with autocast disabled, in the model's own (fp32) precision;
- PEFT adapters (`PeftModel`): merged into a copy (`merge_and_unload`), the user's model untouched.

Weights are always copied: the hooked model shares no storage with the transformers model.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from typing import Dict, Iterator, List

import torch
import torch.nn as nn


def unwrap(hf_model: nn.Module) -> nn.Module:
    """The model inside torch.compile (`_orig_mod`), (Distributed)DataParallel (`module`) and nnsight
    (`NNsight` / `TransformersModel`, not modules themselves: `_module`) wrappers."""
    while True:
        if not isinstance(hf_model, nn.Module) and isinstance(getattr(hf_model, "_module", None), nn.Module):
            hf_model = hf_model._module
        elif isinstance(getattr(hf_model, "_orig_mod", None), nn.Module):
            hf_model = hf_model._orig_mod
        elif isinstance(hf_model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            hf_model = hf_model.module
        else:
            return hf_model


def is_peft_model(hf_model: nn.Module) -> bool:
    return hasattr(hf_model, "peft_config") and hasattr(hf_model, "merge_and_unload")


def strip_mixed_precision(hf_model: nn.Module) -> nn.Module:
    """Remove accelerate's autocast `forward` wrapper (in place: call it on a copy); the class forward is
    back."""
    if hf_model.__dict__.pop("_original_forward", None) is not None:
        hf_model.__dict__.pop("forward", None)
    return hf_model


def independent_copy(hf_model: nn.Module) -> nn.Module:
    """A deep copy with PEFT adapters merged and no mixed-precision forward wrapper."""
    model = unwrap(hf_model)
    with torch.no_grad():
        model = copy.deepcopy(model)
    if is_peft_model(model):
        model = model.merge_and_unload()
    return strip_mixed_precision(model)


def class_names(hf_model: nn.Module) -> List[str]:
    """Architecture names to look a weight map up by: the module's class, its bases, then
    config.architectures."""
    names = [c.__name__ for c in type(hf_model).__mro__ if issubclass(c, nn.Module) and c is not nn.Module]
    return names + [n for n in (getattr(hf_model.config, "architectures", None) or []) if n not in names]


def copied_state_dict(hf_model: nn.Module) -> Dict[str, torch.Tensor]:
    """The state dict with every tensor cloned (detached), so nothing converted from it aliases the model."""
    with torch.no_grad():
        return {k: v.detach().clone() for k, v in hf_model.state_dict().items()}


@contextmanager
def no_autocast() -> Iterator[None]:
    """Disable any enclosing torch.autocast (CPU and CUDA) so parity checks compare in full precision."""
    with ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield
