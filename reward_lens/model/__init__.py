"""The hooked reward model: `config`, `hooks` (the one source of hook names), `components` (the blocks,
which own their one-token readout step), `recompute` (the readout token recomputed alone: the
readout context and the fast paths' recomputations), `heads/` (the head protocol, scalar, ArmoRM), `base`
(`RewardModelBase`: what both model kinds share), `native` (`HookedRewardModel`), `generic/` (any
transformers sequence classifier), `readout` (where each convention reads the reward), `validation` (model
inputs checked), `tokenization` (input formats), `truncation` (one warning per call), `tl_compat`
(TransformerLens conveniences), `placement` (multi-device), `devices`, `loaders` (the table the loading
layer, `reward_lens.loading`, installs its entry points into), `frozen` (the weights frozen while an
instrument runs). `reward_lens.model.HookedRewardModel` is the
main class."""

from reward_lens.model.native import HookedRewardModel

__all__ = ["HookedRewardModel"]
