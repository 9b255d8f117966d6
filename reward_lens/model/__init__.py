"""The hooked reward model: `config`, `hooks` (the one source of hook names), `components` (the blocks,
which own their one-token readout step), `recompute` (the readout token recomputed alone: the
readout context and the fast paths' recomputations), `heads/` (the head protocol, scalar, ArmoRM), `base`
(`RewardModelBase`: what both model kinds share), `native` (`NativeRewardModel`), `generic/` (any
transformers sequence classifier), `readout` (where each convention reads the reward), `validation` (model
inputs checked), `tokenization` (input formats), `truncation` (one warning per call), `tl_compat`
(TransformerLens conveniences), `placement` (multi-device), `devices`, `frozen` (the weights frozen while
an instrument runs). Checkpoints are no concern of this layer: the public `reward_lens.HookedRewardModel`
is `NativeRewardModel` with its checkpoint I/O, defined in the layer above."""

from reward_lens.model.native import NativeRewardModel

__all__ = ["NativeRewardModel"]
