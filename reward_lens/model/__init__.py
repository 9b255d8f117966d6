"""The hooked reward model: config, hook names, components, heads, the native and generic model kinds,
loading and tokenisation. `reward_lens.model.HookedRewardModel` is the main class."""

from reward_lens.model.native import QUERY_AXIS_2_HOOKS, HookedRewardModel

__all__ = ["HookedRewardModel", "QUERY_AXIS_2_HOOKS"]
