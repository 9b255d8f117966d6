"""Reward heads: the protocol every head follows (`base`), the linear head (`scalar`) and ArmoRM's gated
multi-objective head (`armorm`). Importing this package registers both head types."""

from reward_lens.model.heads.base import (
    HEAD_TYPES,
    RewardHeadBase,
    build_head,
    head_class,
    read_objective,
    register_head,
)
from reward_lens.model.heads.scalar import RewardHead
from reward_lens.model.heads.armorm import ArmoRMHead

__all__ = [
    "ArmoRMHead", "HEAD_TYPES", "RewardHead", "RewardHeadBase", "build_head", "head_class", "read_objective",
    "register_head",
]
