"""The effect decomposition (fp32): direct + norm + Σ via_L{k} = total to 1e-5 by construction, total equals
`patch`'s naive effect (one full hooked forward per component) to 1e-5, direct equals the frozen-scale
attribution of the component's output difference, layers at or before a component carry none of its
effect, and the default (each layer's change read off patching's shared readout sweep) equals the
reference loop (every row through every sub-layer on its own) term by term to 1e-5 on four architectures."""

import pytest
import torch
from helpers import one_thread  # noqa: F401

import reward_lens
from reward_lens import EffectDecompositionResult, effect_decomposition, patch


@pytest.fixture(scope="module")
def demo():
    return reward_lens.load_demo_model(device="cpu"), reward_lens.demo.demo_pairs()[:8]


@pytest.mark.parametrize("mode", ["noising", "denoising"])
def test_terms_add_up_to_the_patching_effect(demo, mode):
    model, pairs = demo
    dec = effect_decomposition(model, pairs, mode=mode)
    ref = patch(model, pairs, mode=mode, level="component", method="naive", progress=False)
    assert dec.components == ref.components
    assert (dec.stacked().sum(-1) - dec.total).abs().max() < 1e-5
    assert (dec.total - ref.effect(mode)).abs().max() < 1e-5
    assert (dec.total - dec.direct).abs().max() > 0.1  # the disagreement being explained is there
    assert dec.norm.abs().max() > 1e-2 and dec.via.abs().max() > 1e-2  # both parts of it occur
    L = model.cfg.n_layers
    for j, c in enumerate(dec.components):
        if c.startswith("mlp_L"):  # an MLP is read only by later layers
            assert dec.via[:, j, : int(c[5:]) + 1].abs().max() == 0
    last = dec.components.index(f"mlp_L{L - 1}")
    assert torch.allclose(dec.total[:, last], dec.direct[:, last] + dec.norm[:, last], atol=1e-6)


def test_direct_is_the_frozen_scale_attribution(demo):
    model, pairs = demo
    dec = effect_decomposition(model, pairs[:3])
    # Independent: w . Δ / s_t from raw captures of the two runs' final norm scales and outputs.
    from reward_lens.core.batching import pair_batches
    from reward_lens.core.readout import capture
    from reward_lens.model.hooks import act_name

    batch = next(pair_batches(model, pairs[:3], 8))
    name, scale = act_name("attn_out", 1), "ln_final.hook_scale"
    c = capture(model, batch.chosen, [name, scale])
    r = capture(model, batch.rejected, [name])
    w = model.reward_direction
    want = ((r.at_readout[name] - c.at_readout[name]) @ w.reshape(-1)) / c.at_readout[scale].reshape(-1)
    assert torch.allclose(dec.direct[:, dec.components.index("attn_L1")], want.float(), atol=1e-5)


def test_frame_summary_disagreement_plot(demo):
    model, pairs = demo
    dec = effect_decomposition(model, pairs[:4])
    assert isinstance(dec, EffectDecompositionResult)
    frame = dec.to_frame()
    assert list(frame.columns) == ["pair", "component", "term", "value"]
    assert len(frame) == 4 * len(dec.components) * (len(dec.terms) + 1)
    one = frame[(frame.pair == dec.pair_ids[0]) & (frame.component == "attn_L0")].set_index("term").value
    assert one.drop("total").sum() == pytest.approx(one["total"], abs=1e-5)
    table = dec.disagreement(top=3)
    shares = table[[c for c in table.columns if c.startswith("share_")]].sum(1)
    assert ((shares - 1).abs() < 1e-4).all()  # the shares account for the whole gap
    assert (table.gap.abs().diff().dropna() <= 0).all()
    assert -1 <= dec.direct_total_rho() <= 1
    import matplotlib.figure

    assert isinstance(dec.plot(), matplotlib.figure.Figure)
    with pytest.raises(ValueError, match="mode must be one of"):
        effect_decomposition(model, pairs, mode="zero")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", ["noising", "denoising"])
def test_the_shared_sweep_equals_the_reference_loop(hf_models, arch, mode):
    from helpers import token_pairs

    from reward_lens import HookedRewardModel

    model = HookedRewardModel.from_hf_model(hf_models[arch])
    pairs = token_pairs([(5, 3), (2, 6), (7, 7), (4, 1)])
    for side in ("right", "left"):
        fast = effect_decomposition(model, pairs, mode=mode, padding_side=side)
        ref = effect_decomposition(model, pairs, mode=mode, padding_side=side, method="loop")
        for term in ("direct", "norm", "via", "total"):
            assert (getattr(fast, term) - getattr(ref, term)).abs().max() < 1e-5, (term, side)
        assert ref.via.abs().max() > 1e-3  # the layers' responses being compared are there


def test_method_is_checked():
    from reward_lens.instruments.circuits.decomposition import EffectSpec

    with pytest.raises(ValueError, match="'sweep' or 'loop'"):
        EffectSpec("noising", method="fast")
