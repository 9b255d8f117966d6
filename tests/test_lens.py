"""The reward lens: both variants end exactly at the reward; the normed variant is the model's own head
applied to the intermediate residual; the frozen variant's steps are the layers' direct attributions;
crystallization depth on hand-made curves."""

import math

import pytest
import torch
from helpers import one_thread, tiny_tokenizer, token_pairs  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens.data.pairs import bundled_pairs
from reward_lens.instruments import attribute, lens
from reward_lens.instruments.lens import LensResult

PAIRS = token_pairs([(9, 4), (3, 8), (6, 6)], prompt_len=4)


@pytest.mark.parametrize("side", ["right", "left"])
def test_both_variants_end_at_the_reward(llama_model, side):
    res = lens(llama_model, PAIRS, include_mid=True, padding_side=side, batch_size=2, progress=False)
    for variant in ("normed", "frozen"):
        assert torch.allclose(res.get(variant, "chosen")[:, -1], res.reward_chosen, atol=1e-5)
        assert torch.allclose(res.get(variant, "rejected")[:, -1], res.reward_rejected, atol=1e-5)
        assert torch.allclose(
            res.get(variant, "gap")[:, -1], res.reward_chosen - res.reward_rejected, atol=1e-5
        )
    L = llama_model.cfg.n_layers
    assert res.sites == ["resid_L0"] + [s for l in range(L) for s in (f"resid_mid_L{l}", f"resid_L{l + 1}")]
    assert res.depths[0] == 0 and res.depths[-1] == 1 and res.depths == sorted(res.depths)


def test_normed_variant_is_the_head_on_the_intermediate_residual(llama_hf):
    model = HookedRewardModel.from_hf_model(
        llama_hf, fold_ln=False
    )  # a weighted final norm, applied by the model
    res = lens(model, PAIRS[:1], progress=False)
    _, cache = model.run_with_cache(PAIRS[0].chosen[None])
    readout = torch.tensor([0])
    for i, l in enumerate(range(model.cfg.n_layers)):
        resid = cache[f"blocks.{l}.hook_resid_post"][:, -1:]
        expected = model.reward_head(model.ln_final(resid), readout)
        assert res.get("normed", "chosen")[0, i + 1] == pytest.approx(expected.item(), abs=1e-6)


def test_frozen_steps_are_the_direct_attributions(llama_model):
    res = lens(llama_model, PAIRS, include_mid=True, progress=False)
    att = attribute(llama_model, PAIRS, heads=False, progress=False)
    frozen = res.get("frozen", "gap")
    steps = (
        frozen[:, 1:] - frozen[:, :-1]
    )  # resid_L0 -> resid_mid_L0 is attn_L0, resid_mid_L0 -> resid_L1 is mlp_L0, ...
    assert torch.allclose(steps, att.gap[:, 1:], atol=1e-6)
    assert torch.allclose(frozen[:, 0] - (att.bias_chosen - att.bias_rejected), att.gap[:, 0], atol=1e-6)


def synthetic(gaps, depths):
    gaps = torch.tensor(gaps, dtype=torch.float32)
    zeros = torch.zeros_like(gaps)
    values = {(v, "chosen"): gaps for v in ("normed", "frozen")}
    values.update({(v, "rejected"): zeros for v in ("normed", "frozen")})
    n = len(gaps)
    return LensResult(
        [str(i) for i in range(n)],
        [f"s{i}" for i in range(len(depths))],
        list(range(len(depths))),
        depths,
        values,
        gaps[:, -1],
        zeros[:, -1],
    )


def test_crystallization_depth_by_hand():
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    res = synthetic(
        [
            [0.5, -0.2, 0.85, 1.05, 1.0],  # 0.85 is outside 10% of 1.0; from 0.75 on it stays -> 0.75
            [1.0, 0.95, -0.05, 0.97, 1.0],  # a late sign flip -> 0.75
            [0.95, 1.02, 0.99, 1.0, 1.0],  # within tolerance from the start -> 0.0
            [0.3, 0.2, 0.1, 0.2, 0.0],  # a zero final gap has no crystallization depth
            [-2.0, -2.0, -0.5, -1.95, -2.0],  # a negative final gap: same rule with its sign -> 0.75
        ],
        depths,
    )
    d = res.crystallization_depth(rtol=0.1)
    assert d[:3].tolist() == [0.75, 0.75, 0.0] and math.isnan(d[3]) and d[4] == 0.75
    assert res.crystallization_depth(rtol=0.2)[0] == 0.5  # a looser tolerance crystallizes earlier
    assert res.crystallization_depth(rtol=0.0, atol=0.06)[1] == 0.75


def test_text_pairs_frame_and_plot(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf, tokenizer=tiny_tokenizer())
    res = lens(model, bundled_pairs()[:4], progress=False)
    frame = res.to_frame()
    assert list(frame.columns) == ["pair", "site", "layer", "depth", "variant", "chosen", "rejected", "gap"]
    assert len(frame) == 4 * (1 + model.cfg.n_layers) * 2
    depth = res.crystallization_depth()
    gap = res.reward_chosen - res.reward_rejected
    # Responses the tiny vocabulary tokenises alike: no depth (their gap is 0 up to float noise: left padding
    # puts the two rows at different offsets of differently long batches).
    same = gap.abs() < 1e-6
    assert torch.equal(depth.isnan(), same)
    assert ((depth[~same] >= 0) & (depth[~same] <= 1)).all()
    import matplotlib.figure

    assert isinstance(res.plot(), matplotlib.figure.Figure)
    with pytest.raises(ValueError, match="variant"):
        res.get("logit")
