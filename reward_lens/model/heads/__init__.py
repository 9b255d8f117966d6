"""Reward heads: the protocol every head follows (`base`), the linear head (`scalar`), ArmoRM's gated
multi-objective head (`armorm`), MLP heads (`mlp`: INF-ORM, Qwen2.5-Math-RM, GRM), process reward heads
(`prm`), generative judges (`judge`) and QRM's quantile head (`qrm`). Importing this package registers
every head type."""

from reward_lens.model.heads.armorm import ArmoRMHead
from reward_lens.model.heads.base import (
    HEAD_TYPES,
    RewardHeadBase,
    build_head,
    head_class,
    read_objective,
    read_step,
    register_head,
)
from reward_lens.model.heads.judge import JudgeHead
from reward_lens.model.heads.mlp import MLPHead
from reward_lens.model.heads.prm import ProcessRewardHead
from reward_lens.model.heads.qrm import QRMHead
from reward_lens.model.heads.scalar import RewardHead

__all__ = [
    "ArmoRMHead",
    "HEAD_TYPES",
    "JudgeHead",
    "MLPHead",
    "ProcessRewardHead",
    "QRMHead",
    "RewardHead",
    "RewardHeadBase",
    "build_head",
    "head_class",
    "read_objective",
    "read_step",
    "register_head",
]
