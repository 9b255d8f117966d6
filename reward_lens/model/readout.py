"""Readout conventions: at which position of each sequence a reward model reads its reward.

Two training stacks, two rules, and they differ whenever the pad id also occurs as a real token
(pad = EOS, TRL's default for Llama-3-style tokenizers) or the last attended token is a pad id:

- "last_non_pad" (transformers' `*ForSequenceClassification`, hence TRL): the rightmost position whose
  id is not `cfg.pad_token_id`. With pad = EOS a trailing EOS is skipped: the reward is read one token
  before it, exactly as transformers does.
- "last_attended" (OpenRLHF's `RewardModel`): the last position with attention_mask 1,
  `T - 1 - mask.fliplr().argmax(1)`, whatever its id (OpenRLHF ends every sequence with EOS and reads there).

`cfg.readout` names the rule; `HookedRewardModel.readout_positions` applies it, so every instrument
reads where the model reads. A head with its own published rule (ArmoRM) keeps it under the default.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from jaxtyping import Int

from reward_lens.model.heads.base import last_position_without_pad

DEFAULT_READOUT = "last_non_pad"


def last_non_pad(
    input_ids: Int[torch.Tensor, "batch pos"],
    attention_mask: Optional[torch.Tensor],
    pad_token_id: Optional[int],
) -> Int[torch.Tensor, " batch"]:
    """transformers' pooling: the rightmost non-pad token (the last position when there is no pad id)."""
    if pad_token_id is None:
        return last_position_without_pad(input_ids)
    idx = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (idx * (input_ids != pad_token_id).long()).argmax(-1)


def last_attended(
    input_ids: Optional[torch.Tensor],
    attention_mask: Optional[torch.Tensor],
    pad_token_id: Optional[int] = None,
) -> Int[torch.Tensor, " batch"]:
    """OpenRLHF's `eos_indices`: the last position whose attention mask is 1 (the ids are not looked at)."""
    if attention_mask is None:
        if input_ids is None:
            raise ValueError("readout_positions needs input_ids or attention_mask")
        return torch.full(
            (input_ids.shape[0],), input_ids.shape[1] - 1, dtype=torch.long, device=input_ids.device
        )
    T = attention_mask.shape[-1]
    return T - 1 - attention_mask.long().fliplr().argmax(-1)


READOUT_RULES: Dict[str, Callable[..., torch.Tensor]] = {
    "last_non_pad": last_non_pad,
    "last_attended": last_attended,
}


def readout_needs_pad_id(cfg) -> bool:
    """Whether a padded batch's readout depends on the pad id (transformers' rule) or only on the mask."""
    return getattr(cfg, "readout", None) in (None, DEFAULT_READOUT)


def check_readout(readout: str) -> str:
    if readout not in READOUT_RULES:
        raise ValueError(
            f"unknown readout {readout!r}; use 'last_non_pad' (transformers / TRL: rightmost non-pad "
            "token) or 'last_attended' (OpenRLHF: last position with attention_mask 1)"
        )
    return readout


def readout_positions(
    model, input_ids: Optional[Int[torch.Tensor, "batch pos"]], attention_mask: Optional[torch.Tensor] = None
) -> Int[torch.Tensor, " batch"]:
    """The readout position of each row under `model.cfg.readout` (see the module docstring).

    Without input ids (a forward started from a residual) every rule falls back to the last attended
    position. A head's own rule (`reward_head.readout_positions`) applies under the default readout.
    """
    rule = getattr(model.cfg, "readout", None) or DEFAULT_READOUT
    if input_ids is None:
        if attention_mask is None:
            raise ValueError("readout_positions needs input_ids or attention_mask")
        idx = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
        return (idx * attention_mask.long()).argmax(-1)
    if rule == DEFAULT_READOUT:  # the head's own rule: transformers' pooling, or ArmoRM's published one
        return model.reward_head.readout_positions(input_ids, attention_mask)
    return READOUT_RULES[check_readout(rule)](input_ids, attention_mask, model.cfg.pad_token_id)


def set_readout(model, readout: Optional[str]):
    """Set `model.cfg.readout` (None leaves the loaded convention); returns the model."""
    if readout is not None:
        model.cfg.readout = check_readout(readout)
    return model
