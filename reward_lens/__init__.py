"""reward-lens: mechanistic interpretability for reward models, along the reward direction w_r."""

from reward_lens.config import RewardModelConfig
from reward_lens.heads import RewardHead
from reward_lens.model import HookedRewardModel
from reward_lens.armorm import ArmoRMHead, read_objective  # registers the "armorm" head type

__version__ = "0.1.0"

__all__ = ["ArmoRMHead", "HookedRewardModel", "RewardHead", "RewardModelConfig", "__version__", "read_objective"]

# Theory-grounded extensions and cross-model comparison (issue 7).
from reward_lens.compare import ComparisonResult, ModelProfile, compare_models  # noqa: E402
from reward_lens.theory import (  # noqa: E402
    CascadeResult,
    ConflictResult,
    DistortionResult,
    detect_cascades,
    distortion_index,
    reward_conflicts,
)

__all__ += [
    "CascadeResult", "ComparisonResult", "ConflictResult", "DistortionResult", "ModelProfile", "compare_models",
    "detect_cascades", "distortion_index", "reward_conflicts",
]
