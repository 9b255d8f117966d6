"""reward-lens: mechanistic interpretability for reward models, along the reward direction w_r."""

from reward_lens.config import RewardModelConfig
from reward_lens.heads import RewardHead
from reward_lens.model import HookedRewardModel
from reward_lens.armorm import ArmoRMHead, read_objective  # registers the "armorm" head type

__version__ = "0.1.0"

__all__ = ["ArmoRMHead", "HookedRewardModel", "RewardHead", "RewardModelConfig", "__version__", "read_objective"]
