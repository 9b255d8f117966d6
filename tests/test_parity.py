"""Parity with transformers on tiny random checkpoints: rewards and every layer's hidden states (fp32)."""

import pytest
import torch
from conftest import ARCHS
from helpers import assert_hf_parity, padded_batch

from reward_lens import HookedRewardModel

TOL = 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fold_ln", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_rewards_and_hidden_states_match_transformers(hf_models, arch, fold_ln, side):
    model = HookedRewardModel.from_hf_model(hf_models[arch], fold_ln=fold_ln)
    ids, mask = padded_batch([12, 7, 10, 3], side)
    assert_hf_parity(model, hf_models[arch], ids, mask, TOL)


def test_padding_does_not_change_rewards(llama_model):
    ids_r, mask_r = padded_batch([9, 5], "right")
    ids_l, mask_l = padded_batch([9, 5], "left")
    single = torch.stack([llama_model(ids_r[i : i + 1, : int(mask_r[i].sum())])[0] for i in range(2)])
    assert torch.allclose(llama_model(ids_r, attention_mask=mask_r), single, atol=1e-5)
    assert torch.allclose(llama_model(ids_l, attention_mask=mask_l), single, atol=1e-5)


def test_readout_positions_match_transformers_pooling(llama_model):
    ids, mask = padded_batch([6, 3], "right")
    assert llama_model.readout_positions(ids).tolist() == [5, 2]
    ids, mask = padded_batch([6, 3], "left")
    assert llama_model.readout_positions(ids, mask).tolist() == [5, 5]


def test_no_pad_token_and_batch_is_a_clear_error(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf)
    model.cfg.pad_token_id = None
    ids, _ = padded_batch([4, 4], "right")
    with pytest.raises(ValueError, match="pad"):
        model(ids)
    assert model(ids[:1]).shape == (1,)


def test_fold_ln_false_and_true_agree(llama_hf):
    ids, mask = padded_batch([8, 5], "right")
    a = HookedRewardModel.from_hf_model(llama_hf, fold_ln=False)(ids, attention_mask=mask)
    b = HookedRewardModel.from_hf_model(llama_hf, fold_ln=True)(ids, attention_mask=mask)
    assert torch.allclose(a, b, atol=1e-5)
