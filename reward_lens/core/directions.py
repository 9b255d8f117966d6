"""Per-sequence reward directions: the linear readout every instrument decomposes along,

    reward = direction . (resid_final[readout] / ln_final.hook_scale) + bias,

one direction per sequence (ArmoRM's is prompt-conditioned; every other head's is the same for all).
"""

from __future__ import annotations

from typing import Tuple

import torch

from reward_lens.core.batching import Tokenized


def check_scalar_reward(model) -> None:
    if model.cfg.n_outputs != 1:
        raise ValueError(
            f"this reward head has {model.cfg.n_outputs} outputs; the instruments decompose one scalar "
            "reward. Slice the head to the output you study (reward_head.W_R[:, [j]], b_R[[j]], "
            "cfg.n_outputs = 1)"
        )


@torch.no_grad()
def readout_direction(model, tok: Tokenized) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (direction [batch, d_model], bias [batch]), float32, such that
    reward = direction . (resid_final[readout] / ln_final.hook_scale) + bias, exactly.

    A gated head (ArmoRM's score) has a prompt-conditioned direction (`model.reward_direction_for`, one
    extra forward pass); every other head has the single `model.reward_direction`.
    """
    check_scalar_reward(model)
    B = tok.input_ids.shape[0]
    if model.reward_head.is_gated:  # per-sequence: a gate or ReLU masks frozen (bias per sequence too)
        direction, bias = model.reward_readout_for(tok.input_ids, tok.attention_mask)
        return direction.detach().float(), bias.detach().float().to(direction.device)
    direction = model.reward_direction.expand(B, -1)
    bias = torch.as_tensor(model.reward_bias).float().reshape(()).expand(B)
    return direction.detach().float(), bias.detach().to(direction.device)


def reward_from_final_resid(
    model, resid: torch.Tensor, direction: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """The reward read from final residual vectors [..., d_model] with the final norm recomputed on them,
    as the model does at its readout: direction . resid / scale(resid) + bias; a head that is not linear
    given its frozen direction (an MLP head: its ReLU masks) is applied to the normalised vectors itself."""
    normalized = model.ln_final.normalized(resid)
    if model.reward_head.nonlinear_readout:
        gain = model.ln_final.gain
        h = normalized if gain is None else normalized * gain.float().to(normalized.device)
        return model.reward_head.reward_from_final(h).to(direction.device)
    return (normalized * direction).sum(-1) + bias
