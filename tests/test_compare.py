"""Cross-model comparison: exact profiles, agreement 1 with itself, scale invariance, different depths."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import tiny_hf_model

from reward_lens import HookedRewardModel
from reward_lens.app.compare import (
    compare_models,
    compare_profiles,
    compare_report_sections,
    crystallization_depths,
    model_profile,
)
from reward_lens.data.pairs import TokenPair


def token_pairs(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, 97, (4,), generator=g)
        c = torch.randint(1, 97, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
        r = torch.randint(1, 97, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
        out.append(TokenPair(torch.cat([prompt, c]), torch.cat([prompt, r]), id=f"p{i}"))
    return out


@pytest.fixture(scope="module")
def models():
    return {
        "seed0": HookedRewardModel.from_hf_model(tiny_hf_model("llama", seed=0)),
        "seed1": HookedRewardModel.from_hf_model(tiny_hf_model("llama", seed=1)),
        # another architecture, depth and width: only basis-free quantities can be compared
        "mistral_2L": HookedRewardModel.from_hf_model(
            tiny_hf_model("mistral", seed=2, num_hidden_layers=2, hidden_size=48, num_attention_heads=4)
        ),
    }


@pytest.fixture(scope="module")
def pairs():
    return token_pairs()


def direct_gaps(model, pairs):
    with torch.no_grad():
        return np.array([float(model(p.chosen[None]) - model(p.rejected[None])) for p in pairs])


def test_profile_is_exact(models, pairs):
    model = models["seed0"]
    prof = model_profile(model, pairs, batch_size=4, variant="frozen")
    gaps = direct_gaps(model, pairs)
    np.testing.assert_allclose(prof.gaps, gaps, atol=1e-5, rtol=1e-5)  # batched/padded = one at a time
    np.testing.assert_allclose(prof.attribution_gap.sum(1), prof.gaps, atol=1e-5, rtol=1e-5)  # exact split
    np.testing.assert_allclose(prof.lens_gap[:, -1], prof.gaps, atol=1e-5, rtol=1e-5)  # lens ends at the gap
    assert prof.max_decomposition_error < 1e-4
    assert prof.components[:3] == ["embed", "attn_L0", "mlp_L0"] and len(prof.components) == 1 + 2 * 3
    np.testing.assert_allclose(prof.lens_depths, [0, 1 / 3, 2 / 3, 1])
    np.testing.assert_allclose(prof.component_depths[:3], [0, 0.5 / 3, 1 / 3])
    # the frozen lens after block l = embed + the first l blocks' attn + mlp terms
    np.testing.assert_allclose(prof.lens_gap[:, 2], prof.attribution_gap[:, :5].sum(1), atol=1e-5)
    normed = model_profile(model, pairs, batch_size=5)  # the default variant also ends at the gap
    np.testing.assert_allclose(normed.lens_gap[:, -1], gaps, atol=1e-5, rtol=1e-5)


def test_crystallization_agrees_with_the_lens_instrument(models, pairs):
    from reward_lens.instruments import lens

    res = lens(models["seed1"], pairs, progress=False)
    for variant in ("normed", "frozen"):
        for tol in (0.05, 0.3):
            mine = crystallization_depths(
                res.get(variant, "gap").double().numpy(), np.asarray(res.depths), tol
            )
            np.testing.assert_array_equal(mine, res.crystallization_depth(variant, rtol=tol).numpy())


def naive_crystallization(lens, depths, tol):
    out = []
    for row in lens:
        final = row[-1]
        if final == 0:
            out.append(np.nan)
            continue
        first = len(row) - 1
        for l in range(len(row) - 1, -1, -1):
            if np.sign(row[l]) == np.sign(final) and abs(row[l] - final) <= tol * abs(final):
                first = l
            else:
                break
        out.append(depths[first])
    return np.array(out)


def test_crystallization_matches_naive_loop():
    rng = np.random.default_rng(0)
    lens = np.cumsum(rng.standard_normal((50, 9)), axis=1)
    depths = np.linspace(0, 1, 9)
    for tol in (0.0, 0.1, 0.5):
        np.testing.assert_array_equal(
            crystallization_depths(lens, depths, tol), naive_crystallization(lens, depths, tol)
        )
    lens[0] = 0.0
    assert np.isnan(crystallization_depths(lens, depths)[0])


def test_model_against_itself_agrees_fully(models, pairs):
    m = models["seed0"]
    res = compare_models({"a": m, "a_again": m}, pairs, n_boot=200)
    row = res.agreement.iloc[0]
    assert row.agreement == 1.0 and row.ci_low == 1.0 and row.spearman == pytest.approx(1.0)
    summary = res.pairwise.set_index("metric").value
    for metric in (
        "lens_curve_max_abs_diff",
        "crystallization_median_diff",
        "crystallization_ks",
        "attribution_abs_tv",
        "attribution_signed_l1",
    ):
        assert summary[metric] == pytest.approx(0.0, abs=1e-12)


def test_scale_and_shift_of_the_reward_change_nothing(models, pairs):
    m = models["seed0"]
    scaled = HookedRewardModel.from_hf_model(tiny_hf_model("llama", seed=0))
    with torch.no_grad():
        scaled.reward_head.W_R.mul_(3.0)
        scaled.reward_head.b_R.add_(7.0)
    res = compare_models({"rm": m, "3rm+7": scaled}, pairs, n_boot=0)
    np.testing.assert_allclose(res.profiles["3rm+7"].gaps, 3 * res.profiles["rm"].gaps, rtol=1e-4, atol=1e-5)
    summary = res.pairwise.set_index("metric").value
    assert summary["agreement"] == 1.0
    assert summary["lens_curve_max_abs_diff"] < 1e-4 and summary["attribution_abs_tv"] < 1e-4
    assert summary["crystallization_ks"] == 0.0


def test_three_models_different_architectures(models, pairs):
    frames = {
        n: pd.DataFrame({"dimension": ["length", "confidence", "formatting"], "effect": e, "verdict": v})
        for n, e, v in [
            ("seed0", [0.5, -0.1, 0.0], ["rewards", "penalizes", "neutral"]),
            ("seed1", [0.2, 0.1, 0.0], ["rewards", "rewards", "neutral"]),
            ("mistral_2L", [-0.3, 0.0, 0.4], ["penalizes", "neutral", "rewards"]),
        ]
    }
    res = compare_models(models, pairs, probes=frames, n_boot=300, batch_size=3)
    assert (
        res.names == ["seed0", "seed1", "mistral_2L"] and res.n_bins == 2
    )  # the shallowest model has 2 layers
    gaps = {n: direct_gaps(m, pairs) for n, m in models.items()}
    for r in res.agreement.itertuples():
        expected = np.mean(np.sign(gaps[r.model_a]) == np.sign(gaps[r.model_b]))
        assert r.agreement == pytest.approx(expected)
        assert r.ci_low <= r.agreement <= r.ci_high
    acc = res.accuracy.set_index("model").accuracy
    for n in models:
        assert acc[n] == pytest.approx(np.mean(gaps[n] > 0))
    # shares sum to one per model; the lens curve ends at 1 (the whole margin)
    sums = res.attribution.groupby("model")[["signed_share", "abs_share"]].sum()
    np.testing.assert_allclose(sums.values, 1.0, atol=1e-9)
    ends = res.lens[res.lens.depth == 1.0].set_index("model")["share"]
    np.testing.assert_allclose(ends.values, 1.0, atol=1e-9)
    assert set(res.crystallization.model) == set(models) and len(res.crystallization) == 3 * len(pairs)
    # probes side by side, standardised by each model's spread of gaps
    pr = res.to_frame("probes").set_index(["model", "dimension"])
    sd = np.std(gaps["seed1"], ddof=1)
    assert pr.loc[("seed1", "length"), "effect_per_gap_sd"] == pytest.approx(0.2 / sd, rel=1e-4)
    s = res.pairwise.query("model_a == 'seed0' and model_b == 'seed1'").set_index("metric").value
    assert s["probe_verdict_agreement"] == pytest.approx(2 / 3)
    # outputs for the report
    assert isinstance(res.plot(), matplotlib.figure.Figure)
    sections = compare_report_sections(res)
    assert all(
        isinstance(t, str) and isinstance(o, (pd.DataFrame, matplotlib.figure.Figure)) for t, o in sections
    )
    assert any(t == "Hacking-probe profiles" for t, _ in sections)
    M = res.agreement_matrix()
    assert M.shape == (3, 3) and (np.diag(M) == 1).all()


def test_bad_inputs(models, pairs):
    with pytest.raises(ValueError, match="at least two models"):
        compare_models({"a": models["seed0"]}, pairs)
    p1 = model_profile(models["seed0"], pairs[:4], name="a")
    p2 = model_profile(models["seed1"], pairs[:3], name="b")
    with pytest.raises(ValueError, match="same pairs"):
        compare_profiles([p1, p2])
    with pytest.raises(ValueError, match="unknown model"):
        compare_models(models, pairs, probes={"nope": pd.DataFrame()})
    res = compare_models({"a": models["seed0"], "b": models["seed1"]}, pairs[:4], n_boot=0)
    with pytest.raises(ValueError, match="no probe profiles"):
        res.to_frame("probes")
    with pytest.raises(ValueError, match="unknown kind"):
        res.to_frame("nope")
