"""Weight processing shared by every architecture: folding norm weights into the maps that read them.

RMSNorm(x) = w * x / scale(x). Any linear map W that reads it satisfies W(w * u) = (diag(w) W)(u), so w
moves into W's input rows and the norm keeps only its scale. Folded: ln1 -> W_Q/W_K/W_V, ln2 -> W_in/
W_gate, ln_final -> the reward head's readers. Never centred: a reward head has one column, and
centring it (TransformerLens's default for W_U) would zero it. Norms whose weight acts after a
nonlinearity of their own output (Gemma-2 post-norms, Qwen3 q/k norms) are left as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

from reward_lens.converters.registry import StateDict
from reward_lens.model.config import RewardModelConfig


def _scale_rows(W: torch.Tensor, gain: torch.Tensor, dim: int) -> torch.Tensor:
    shape = [1] * W.dim()
    shape[dim] = -1
    return W * gain.to(W.dtype).view(shape)


def fold_layer_norms(sd: StateDict, cfg: RewardModelConfig, l: int) -> StateDict:
    """A new state dict with layer l's ln1/ln2 weights folded into W_Q/W_K/W_V and W_in/W_gate (other keys
    passed through)."""
    sd = dict(sd)
    offset, p = cfg.norm_weight_offset, f"blocks.{l}."
    g1 = offset + sd.pop(p + "ln1.w").float()
    for name in ("W_Q", "W_K", "W_V"):
        sd[p + "attn." + name] = _scale_rows(sd[p + "attn." + name].float(), g1, 1)
    g2 = offset + sd.pop(p + "ln2.w").float()
    for name in ("W_in", "W_gate"):
        sd[p + "mlp." + name] = _scale_rows(sd[p + "mlp." + name].float(), g2, 0)
    return sd


def fold_final_norm(sd: StateDict, cfg: RewardModelConfig, head_readers) -> StateDict:
    """A new state dict with ln_final's weight folded into the head's readers (other keys passed through)."""
    sd = dict(sd)
    gf = cfg.norm_weight_offset + sd.pop("ln_final.w").float()
    for name, dim in head_readers:
        key = "reward_head." + name
        sd[key] = _scale_rows(sd[key].float(), gf, dim)
    return sd


def folded_config(cfg: RewardModelConfig) -> RewardModelConfig:
    return dataclasses.replace(cfg, normalization_type="RMSPre")


def fold_norm_weights(
    sd: StateDict, cfg: RewardModelConfig, head_readers
) -> Tuple[StateDict, RewardModelConfig]:
    """A new state dict with ln1/ln2/ln_final weights folded, and a copy of `cfg` with normalization_type
    "RMSPre" (neither argument is changed)."""
    for l in range(cfg.n_layers):
        sd = fold_layer_norms(sd, cfg, l)
    return fold_final_norm(sd, cfg, head_readers), folded_config(cfg)
