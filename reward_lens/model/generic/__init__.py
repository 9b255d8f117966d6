"""The generic component-level path for any transformers *ForSequenceClassification reward model:
`discovery` (which modules carry the hooks), `final_norm`, `wrapper` (the model), `verify` (load-time
exactness checks); its checkpoint files are read by `reward_lens.loading.generic`."""

from reward_lens.model.generic.discovery import GenericLoadError, GenericPathError, GenericRewardModelConfig
from reward_lens.model.generic.wrapper import GenericHookedRewardModel

__all__ = ["GenericHookedRewardModel", "GenericLoadError", "GenericPathError", "GenericRewardModelConfig"]
