"""The generic component-level path for any transformers *ForSequenceClassification reward model:
`discovery` (which modules carry the hooks), `final_norm`, `wrapper` (the model), `verify` (load-time
exactness checks). Its checkpoint I/O (`GenericHookedRewardModel`) lives in the layer above."""

from reward_lens.model.generic.discovery import GenericLoadError, GenericPathError, GenericRewardModelConfig
from reward_lens.model.generic.wrapper import GenericRewardModel

__all__ = ["GenericRewardModel", "GenericLoadError", "GenericPathError", "GenericRewardModelConfig"]
