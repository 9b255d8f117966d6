"""Readout conventions (reward_lens.model.readout) on hand-made batches where they disagree: pad = EOS."""

import pytest
import torch
from helpers import one_thread  # noqa: F401

from reward_lens import HookedRewardModel

PAD = 0
# Row 0 right-padded and ending with EOS = pad; row 1 left-padded, ends with EOS; row 2 no padding.
IDS = torch.tensor([[5, 6, 7, PAD, PAD, PAD], [PAD, PAD, 8, 9, 4, PAD], [3, 4, 5, 6, 7, 8]])
MASK = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize("readout,expected", [("last_non_pad", [2, 4, 5]), ("last_attended", [3, 5, 5])])
def test_rules_on_pad_equals_eos(llama_hf, readout, expected):
    model = HookedRewardModel.from_hf_model(llama_hf, readout=readout)
    assert model.cfg.readout == readout
    assert model.readout_positions(IDS, MASK).tolist() == expected
    # A forward reads there: the reward equals the per-position head output at that position.
    rewards, cache = model.run_with_cache(IDS, attention_mask=MASK)
    per_position = cache["reward_head.hook_rewards"][..., 0]
    assert torch.equal(rewards, per_position[torch.arange(3), torch.tensor(expected)])


def test_default_is_transformers_rule(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf)
    pos = (MASK.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = llama_hf(IDS, attention_mask=MASK, position_ids=pos).logits[:, 0]
    assert model.cfg.readout == "last_non_pad"
    assert (model(IDS, attention_mask=MASK) - ref).abs().max() < 1e-4
