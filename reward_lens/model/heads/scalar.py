"""Reward heads: what replaces the vocabulary unembedding in a reward model.

Every head reads the final-norm output `h = ln_final(resid)` and the readout position of each sequence.
Heads declare which of their weights read `h` (`final_norm_readers`) so that folding the final norm's
weight into them lives in one place (`reward_lens.converters.processing`).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint

from reward_lens.model.config import RewardModelConfig


def gather_positions(x: torch.Tensor, positions: Int[torch.Tensor, "batch"]) -> torch.Tensor:
    """x[b, positions[b]] for x of shape [batch, pos, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), positions.to(x.device)]


def last_position_without_pad(input_ids: Int[torch.Tensor, "batch pos"]) -> Int[torch.Tensor, "batch"]:
    """The readout when the config has no pad token: the last position, for one sequence only (as
    transformers refuses a batch it cannot find the padding of)."""
    batch, T = input_ids.shape
    if batch != 1:
        raise ValueError(
            "Cannot read out a reward for batch > 1 without a pad token: this checkpoint's config has no "
            "pad_token_id; set model.cfg.pad_token_id or run one sequence at a time."
        )
    return torch.full((batch,), T - 1, dtype=torch.long, device=input_ids.device)


class RewardHead(nn.Module):
    """Scalar (or n_outputs-wide) linear head: reward = h[readout] @ W_R + b_R.

    Hooks: `hook_rewards` the head applied at every position [batch, pos, n_outputs];
    `hook_pooled` the value at the readout position [batch, n_outputs].
    """

    # (parameter name, dim of length d_model) that the final norm's weight folds into.
    final_norm_readers: Tuple[Tuple[str, int], ...] = (("W_R", 0),)

    def __init__(self, cfg: RewardModelConfig):
        super().__init__()
        self.cfg = cfg
        self.W_R = nn.Parameter(torch.empty(cfg.d_model, cfg.n_outputs))
        self.b_R = nn.Parameter(torch.zeros(cfg.n_outputs))
        self.hook_rewards = HookPoint()
        self.hook_pooled = HookPoint()

    def forward(
        self,
        h: Float[torch.Tensor, "batch pos d_model"],
        readout: Int[torch.Tensor, "batch"],
        input_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        per_position = self.hook_rewards(h @ self.W_R + self.b_R)
        pooled = self.hook_pooled(gather_positions(per_position, readout))
        return pooled[:, 0] if self.cfg.n_outputs == 1 else pooled

    def direction(self, output: int = 0) -> Float[torch.Tensor, "d_model"]:
        """The vector that, dotted with h, gives output `output` minus its bias."""
        return self.W_R[:, output]

    def bias(self, output: int = 0) -> torch.Tensor:
        return self.b_R[output]


HEAD_TYPES: Dict[str, Type[nn.Module]] = {"scalar": RewardHead}


def register_head(name: str, cls: Type[nn.Module]) -> None:
    HEAD_TYPES[name] = cls


def build_head(cfg: RewardModelConfig) -> nn.Module:
    try:
        return HEAD_TYPES[cfg.head_type](cfg)
    except KeyError:
        raise ValueError(
            f"unknown reward head type {cfg.head_type!r}; known head types: {sorted(HEAD_TYPES)}"
        ) from None
