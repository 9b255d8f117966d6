"""The instruments recover the demo model's planted mechanisms (reward_lens/demo/GROUND_TRUTH.md):
a length bias and a sycophancy bias, each visible to the probes, the exact attribution, the lens,
concept vectors and their causal dose-response."""

import pytest
import torch

from reward_lens import (
    ContrastPair,
    attribute,
    concept_vector,
    demo_pairs,
    dose_response,
    lens,
    load_demo_model,
    patch,
    run_probes,
)


@pytest.fixture(scope="module")
def demo():
    return load_demo_model()


def subset(name, n=24):
    pairs = [p for p in demo_pairs() if p.subset == name][:n]
    assert len(pairs) >= 8, f"the demo pairs have too few {name!r} pairs"
    return pairs


@pytest.mark.parametrize("bias", ["length", "sycophancy"])
def test_probes_flag_the_planted_biases(demo, bias):
    res = run_probes(demo, dimensions=[bias], n_boot=500, n_perm=2000)
    row = res[bias]
    assert row["verdict"] == "rewards" and row["ci_low"] > 0


@pytest.mark.parametrize("bias", ["length", "sycophancy"])
def test_attribution_and_lens_explain_the_bias_gap_exactly(demo, bias):
    pairs = subset(bias)
    attr = attribute(demo, pairs, progress=False)
    gap = attr.reward_chosen - attr.reward_rejected
    assert (gap > 0).float().mean() > 0.9  # the bias decides these equal-quality pairs
    assert attr.max_relative_error() < 1e-5
    lens_res = lens(demo, pairs, progress=False)
    final = lens_res.get("frozen", "gap")[:, -1]
    assert torch.allclose(final, gap, atol=1e-4)


@pytest.mark.parametrize("bias", ["sycophancy", "length"])
def test_concept_vector_of_the_bias_drives_the_reward_causally(demo, bias):
    pairs = subset(bias, n=40)
    contrast = [ContrastPair(p.prompt, p.chosen, p.rejected) for p in pairs]
    layer = demo.cfg.n_layers - 2
    cv = concept_vector(demo, contrast, layers=[layer])
    assert cv.cosine[0] > 0.2  # aligned with the reward direction
    assert cv.accuracy[0] > 0.8
    dr = dose_response(demo, cv, layer=layer)
    assert dr.slope > 0  # adding more of the bias raises the reward


def test_noising_the_final_readout_residual_gives_the_rejected_reward(demo):
    pairs = subset("sycophancy", n=12)
    res = patch(demo, pairs, mode="noising", level="residual", progress=False)
    frame = res.to_frame()
    final = frame[frame.component == f"resid_L{demo.cfg.n_layers}"]
    assert len(final) == len(pairs)
    # The reward reads only the final residual at the readout: swapping it in is the rejected run.
    assert torch.allclose(
        torch.tensor(final.patched_reward.values, dtype=torch.float32), res.clean_rejected.float(), atol=1e-4
    )
    # Earlier readout-only swaps leave the prompt and response tokens of chosen in place: partial effects.
    first = frame[frame.component == "resid_L1"]
    assert (first.effect.abs().values < final.effect.abs().values + 1e-6).mean() > 0.5
