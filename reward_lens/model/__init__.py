"""The hooked reward model: `config`, `hooks` (the one source of hook names), `components` (the blocks,
which own their one-token readout step), `recompute` (the readout token recomputed alone: the
readout context and the fast paths' recomputations), `heads/` (the head protocol, scalar, ArmoRM), `base`
(`RewardModelBase`: what both model kinds share), `native` (`HookedRewardModel`), `generic/` (any
transformers sequence classifier), `loading` (checkpoints -> config and weights), `factory` (chooses
native or generic), `checks` (named checkpoint damage), `inmemory` (models handed over in memory),
`peft_adapter` (LoRA directories merged), `readout` (where each convention reads the reward),
`tokenization` (input formats), `truncation` (one warning per call), `tl_compat` (TransformerLens
conveniences). `reward_lens.model.HookedRewardModel` is the main class."""

from reward_lens.model.native import QUERY_AXIS_2_HOOKS, HookedRewardModel

__all__ = ["HookedRewardModel", "QUERY_AXIS_2_HOOKS"]
