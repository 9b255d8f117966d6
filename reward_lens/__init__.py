"""reward-lens: mechanistic interpretability for reward models, along the reward direction w_r."""

from reward_lens.config import RewardModelConfig
from reward_lens.heads import RewardHead
from reward_lens.model import HookedRewardModel

__version__ = "0.1.0"

__all__ = ["HookedRewardModel", "RewardHead", "RewardModelConfig", "__version__"]
