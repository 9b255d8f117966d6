"""Reward-term conflicts: known aligned / orthogonal / conflicting directions, geometry vs behaviour,
ArmoRM objectives against an independent reference, reward models on one backbone."""

import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
import torch

from reward_lens import HookedRewardModel
from reward_lens.theory import conflicts_from_directions, reward_conflicts


def known_directions(d=256, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(d)
    base /= np.linalg.norm(base)
    noise = rng.standard_normal((3, d)) / np.sqrt(d)
    ortho = rng.standard_normal(d)
    ortho -= (ortho @ base) * base
    return {
        "base": base,
        "aligned": base + 0.5 * noise[0],  # cos ≈ 1 / sqrt(1.25) ≈ 0.89
        "orthogonal": ortho / np.linalg.norm(ortho),
        "conflicting": -base + 0.5 * noise[1],
    }


def test_known_verdicts_from_cosines_and_correlations():
    W = known_directions()
    rng = np.random.default_rng(1)
    delta = rng.standard_normal((400, 256))  # isotropic differences: correlations track cosines
    R = delta @ np.stack(list(W.values())).T
    res = reward_conflicts(W, reward_deltas=R)
    M = np.stack(list(W.values()))
    cos = torch.nn.functional.cosine_similarity(
        torch.tensor(M)[:, None], torch.tensor(M)[None], dim=-1
    ).numpy()
    np.testing.assert_allclose(res.cosine, cos, atol=1e-12)
    np.testing.assert_allclose(res.correlation, np.corrcoef(R.T), atol=1e-12)
    v = res.to_frame().set_index(["term_a", "term_b"])
    assert v.loc[("base", "aligned"), "verdict"] == "aligned"
    assert v.loc[("base", "orthogonal"), "verdict"] == "orthogonal"
    assert v.loc[("base", "conflicting"), "verdict"] == "conflicting"
    assert v.loc[("aligned", "conflicting"), "verdict"] == "conflicting"
    assert not v.disagree.any()
    assert (v.corr_ci_low <= v.correlation).all() and (v.correlation <= v.corr_ci_high).all()
    assert res.counts() == {"aligned": 1, "orthogonal": 3, "conflicting": 2}
    assert res.noise_floor == pytest.approx(3 / 16)
    assert isinstance(res.plot(), matplotlib.figure.Figure)
    # geometry only
    geo = reward_conflicts(W)
    assert geo.correlation is None and list(geo.to_frame().verdict) == list(v.cosine_verdict)


def test_thresholds_are_documented_boundaries():
    from reward_lens.theory.conflicts import classify

    s = np.array([0.3, 0.2999, -0.2999, -0.3, np.nan])
    assert list(classify(s, 0.3)) == ["aligned", "orthogonal", "orthogonal", "conflicting", ""]


def test_orthogonal_directions_can_correlate_on_anisotropic_data():
    d = 128
    a, b = np.zeros(d), np.zeros(d)
    a[0], b[1] = 1.0, 1.0  # orthogonal
    rng = np.random.default_rng(2)
    t = rng.standard_normal(300)
    delta = np.outer(t, a + b) + 0.1 * rng.standard_normal((300, d))  # differences move along a + b
    res = conflicts_from_directions({"a": a, "b": b}, delta @ np.stack([a, b]).T)
    row = res.to_frame().iloc[0]
    assert row.cosine == 0.0 and row.cosine_verdict == "orthogonal"
    assert row.correlation > 0.9 and row.verdict == "aligned" and row.disagree


def test_bad_inputs():
    W = known_directions()
    with pytest.raises(ValueError, match="at least two"):
        conflicts_from_directions({"a": W["base"]})
    with pytest.raises(ValueError, match="zero"):
        conflicts_from_directions({"a": W["base"], "b": np.zeros(256)})
    with pytest.raises(ValueError, match="4 columns"):
        conflicts_from_directions(W, np.zeros((10, 3)))
    with pytest.raises(TypeError, match="no model"):
        reward_conflicts(W, pairs=[1, 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        conflicts_from_directions(np.eye(4), threshold=0.3)  # 3/sqrt(4) = 1.5 > 0.3
    assert any("noise floor" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------- models

PATTERN = [290, 291, 292]


def armorm_pairs(n, seed=0):
    from reward_lens.data.pairs import TokenPair

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = [1] + torch.randint(3, 280, (4,), generator=g).tolist() + PATTERN
        c = torch.randint(3, 280, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, 280, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append(TokenPair(prompt + c, prompt + r, id=str(i)))
    return out


@pytest.fixture(scope="module")
def armorm_dir(tmp_path_factory):
    from armorm_reference import save_tiny_armorm

    return save_tiny_armorm(
        tmp_path_factory.mktemp("armorm_conflicts"),
        seed=3,
        num_objectives=5,
        vocab_size=300,
        pad_token_id=0,
        gating_token_pattern=PATTERN,
    )


@pytest.mark.parametrize("fold_ln", [True, False])
def test_armorm_objectives_against_reference(armorm_dir, fold_ln):
    from armorm_reference import ReferenceArmoRM

    from reward_lens import read_objective

    model = HookedRewardModel.from_pretrained(armorm_dir, fold_ln=fold_ln)
    pairs = armorm_pairs(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # d_model 32: the noise floor warning is expected
        res = reward_conflicts(model, pairs, batch_size=4)
    assert res.names == model.reward_head.objective_names and len(res.names) == 5
    # geometry: the reference's regression rows times the final norm's gain (independent of reward_lens)
    ref = ReferenceArmoRM.from_directory(armorm_dir)
    W = (ref.regression_layer.weight * ref.model.norm.weight).detach().double()
    cos = torch.nn.functional.cosine_similarity(W[:, None], W[None], dim=-1).numpy()
    np.testing.assert_allclose(res.cosine, cos, atol=1e-5)
    # behaviour: per-pair objective reward differences, each objective read as the model's reward
    diffs = np.zeros((len(pairs), 5))
    with torch.no_grad():
        for j in range(5):
            with read_objective(model, j):
                for i, p in enumerate(pairs):
                    diffs[i, j] = float(model(p.chosen[None]) - model(p.rejected[None]))
    np.testing.assert_allclose(res.correlation, np.corrcoef(diffs.T), atol=1e-4)
    assert model.reward_head.objective is None  # restored
    assert res.n_pairs == 8


def test_reward_models_on_one_backbone(llama_hf):
    from helpers import tiny_hf_model

    from reward_lens.data.pairs import TokenPair

    g = torch.Generator().manual_seed(0)
    pairs = [
        TokenPair(torch.randint(1, 97, (7,), generator=g), torch.randint(1, 97, (5,), generator=g))
        for _ in range(6)
    ]
    m1 = HookedRewardModel.from_hf_model(llama_hf)
    m2 = HookedRewardModel.from_hf_model(llama_hf)
    with torch.no_grad():  # a second head on the same backbone: half of m1's direction, half new
        m2.reward_head.W_R.copy_(
            0.5 * m1.reward_head.W_R + torch.randn(m1.reward_head.W_R.shape, generator=g) * 0.3
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = reward_conflicts({"rm1": m1, "rm2": m2}, pairs)
    gaps = np.array([[float(m(p.chosen[None]) - m(p.rejected[None])) for m in (m1, m2)] for p in pairs])
    np.testing.assert_allclose(res.correlation, np.corrcoef(gaps.T), atol=1e-5)
    w1, w2 = m1.reward_direction.double(), m2.reward_direction.double()
    assert res.cosine[0, 1] == pytest.approx(float(w1 @ w2 / w1.norm() / w2.norm()), abs=1e-10)
    # a different backbone is refused, unless asked for
    other = HookedRewardModel.from_hf_model(tiny_hf_model("llama", seed=5))
    with pytest.raises(ValueError, match="do not share a backbone"):
        reward_conflicts({"rm1": m1, "other": other}, pairs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forced = reward_conflicts({"rm1": m1, "other": other}, None, allow_different_backbones=True)
    assert forced.correlation is None and "differ" in forced.notes[-1]
    with pytest.raises(ValueError, match="one reward output"):
        reward_conflicts(m1, pairs)


def test_multi_output_head_folded_or_not():
    from helpers import tiny_hf_model

    from reward_lens.data.pairs import TokenPair

    hf = tiny_hf_model("llama", seed=2, num_labels=3)
    g = torch.Generator().manual_seed(1)
    pairs = [
        TokenPair(torch.randint(1, 97, (6,), generator=g), torch.randint(1, 97, (8,), generator=g))
        for _ in range(5)
    ]
    results = {}
    for fold in (True, False):
        model = HookedRewardModel.from_hf_model(hf, fold_ln=fold)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[fold] = reward_conflicts(model, pairs)
        with torch.no_grad():
            gaps = np.stack(
                [(model(p.chosen[None]) - model(p.rejected[None]))[0].double().numpy() for p in pairs]
            )
        np.testing.assert_allclose(results[fold].correlation, np.corrcoef(gaps.T), atol=1e-5)
    assert results[True].names == ["output_0", "output_1", "output_2"]
    np.testing.assert_allclose(
        results[True].cosine, results[False].cosine, atol=1e-6
    )  # the norm gain is applied
    W = (hf.score.weight * hf.model.norm.weight).detach().double()
    cos = torch.nn.functional.cosine_similarity(W[:, None], W[None], dim=-1).numpy()
    np.testing.assert_allclose(results[True].cosine, cos, atol=1e-6)


def test_custom_directions_on_one_model(llama_model):
    from reward_lens.data.pairs import TokenPair

    g = torch.Generator().manual_seed(4)
    pairs = [
        TokenPair(torch.randint(1, 97, (6,), generator=g), torch.randint(1, 97, (4,), generator=g))
        for _ in range(6)
    ]
    w = llama_model.reward_direction.detach()
    v = torch.randn(w.shape, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # d_model 64: below the noise floor
        res = reward_conflicts(
            llama_model, pairs, directions={"reward": w, "probe": -w + 0.1 * w.norm() / v.norm() * v}
        )
    with torch.no_grad():
        gaps = np.array([float(llama_model(p.chosen[None]) - llama_model(p.rejected[None])) for p in pairs])
    probe = res.to_frame().iloc[0]
    assert probe.cosine < -0.9 and probe.verdict == "conflicting"
    # the "reward" term's per-pair differences are the model's own gaps (w · Δx is exact)
    from reward_lens.theory.conflicts import _readout_states

    x, _ = _readout_states(llama_model, pairs, 3)
    np.testing.assert_allclose((x["chosen"] - x["rejected"]) @ w.double().numpy(), gaps, atol=1e-5)
    with pytest.raises(ValueError, match="width"):
        reward_conflicts(llama_model, pairs, directions={"a": torch.ones(3), "b": torch.ones(3)})
