"""The scalar (or n_outputs-wide) linear reward head: reward = h[readout] @ W_R + b_R.

Every head reads the final-norm output `h = ln_final(resid)` and the readout position of each sequence
(see `reward_lens.model.heads.base` for the protocol all heads share). Heads declare which of their
weights read `h` (`final_norm_readers`) so that folding the final norm's weight into them lives in one
place (`reward_lens.converters.processing`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint

from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.base import (
    RewardHeadBase,
    gather_positions,
    register_head,
)


class RewardHead(RewardHeadBase):
    """Scalar (or n_outputs-wide) linear head: reward = h[readout] @ W_R + b_R.

    Hooks: `hook_rewards` the head applied at every position [batch, pos, n_outputs];
    `hook_pooled` the value at the readout position [batch, n_outputs].
    """

    final_norm_readers: Tuple[Tuple[str, int], ...] = (("W_R", 0),)

    def __init__(self, cfg: RewardModelConfig):
        super().__init__(cfg)
        self.W_R = nn.Parameter(torch.empty(cfg.d_model, cfg.n_outputs))
        self.b_R = nn.Parameter(torch.zeros(cfg.n_outputs))
        self.hook_rewards = HookPoint()
        self.hook_pooled = HookPoint()

    def forward(
        self,
        h: Float[torch.Tensor, "batch pos d_model"],
        readout: Int[torch.Tensor, " batch"],
        input_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        per_position = self.hook_rewards(h @ self.W_R + self.b_R)
        pooled = self.hook_pooled(gather_positions(per_position, readout))
        return pooled[:, 0] if self.cfg.n_outputs == 1 else pooled

    def direction(self, output: int = 0) -> Float[torch.Tensor, " d_model"]:
        return self.W_R[:, output]

    def bias(self, output: int = 0) -> torch.Tensor:
        return self.b_R[output]


register_head("scalar", RewardHead)
