"""The faithfulness gap: Spearman rho per pair and pooled equals scipy's on the compared values, bootstrap
intervals behave, the one-call form equals the two-step form, and hand-made rankings give rho = -1 / +1."""

import numpy as np
import pytest
import torch
from helpers import one_thread, token_pairs  # noqa: F401
from scipy import stats

from reward_lens.instruments import attribute, attribution_patch, faithfulness, patch
from reward_lens.instruments.attribution import AttributionResult
from reward_lens.instruments.patching.contrastive import PatchResult
from reward_lens.instruments.sites import component_sites

PAIRS = token_pairs([(9, 4), (3, 8), (6, 6), (5, 2), (7, 7), (2, 6)], prompt_len=3, seed=2)


@pytest.fixture(scope="module")
def results(llama_model):
    return attribute(llama_model, PAIRS, progress=False), patch(
        llama_model, PAIRS, mode=["noising", "zero"], progress=False
    )


def test_rho_matches_scipy(results):
    att, pat = results
    res = faithfulness(att, pat, n_boot=200)
    a, e = att.gap.abs().numpy(), pat.effect("noising").abs().numpy()
    expected = [stats.spearmanr(a[i], e[i]).statistic for i in range(len(PAIRS))]
    assert np.allclose(res.per_pair_rho.numpy(), expected, atol=1e-6)
    assert res.mean_rho == pytest.approx(np.mean(expected), abs=1e-6)
    assert res.pooled_rho == pytest.approx(stats.spearmanr(a.ravel(), e.ravel()).statistic, abs=1e-6)
    lo, hi = res.mean_rho_ci
    assert -1 <= lo <= res.mean_rho <= hi <= 1
    assert -1 <= res.pooled_rho_ci[0] <= res.pooled_rho_ci[1] <= 1
    # other choices: signed values, the chosen reward's attribution, zero ablation
    signed = faithfulness(att, pat, absolute=False, quantity="chosen", mode="zero", n_boot=50)
    e2 = pat.effect("zero").numpy()
    assert signed.pooled_rho == pytest.approx(
        stats.spearmanr(att.chosen.numpy().ravel(), e2.ravel()).statistic, abs=1e-6
    )
    assert signed.settings["mode"] == "zero" and signed.settings["quantity"] == "chosen"


def test_one_call_equals_two_steps(llama_model, results):
    one = faithfulness(llama_model, PAIRS, n_boot=100, progress=False)
    two = faithfulness(*results, n_boot=100)
    assert torch.allclose(one.per_pair_rho, two.per_pair_rho, atol=1e-6)
    assert one.pooled_rho == pytest.approx(two.pooled_rho) and one.mean_rho_ci == pytest.approx(
        two.mean_rho_ci
    )
    frame = one.to_frame()
    assert list(frame.columns) == ["pair", "component", "attribution", "effect", "pair_rho"]
    assert len(frame) == len(PAIRS) * 7
    summary = one.summary()
    assert summary.loc[0, "n_pairs"] == len(PAIRS) and summary.loc[0, "mean_rho"] == pytest.approx(
        one.mean_rho
    )
    import matplotlib.figure

    assert isinstance(one.plot(), matplotlib.figure.Figure)


def test_hand_made_rankings(llama_model):
    sites = component_sites(llama_model.cfg)
    C, n = len(sites), 4
    ranks = torch.arange(1, C + 1, dtype=torch.float32).repeat(n, 1)
    zero = torch.zeros(n)
    att = AttributionResult(
        [str(i) for i in range(n)],
        [s.name for s in sites],
        [s.layer for s in sites],
        ranks,
        torch.zeros(n, C),
        zero,
        zero,
        zero,
        zero,
    )
    clean_c, clean_r = torch.ones(n), torch.zeros(n)

    def patching(effects):
        return PatchResult(
            att.pair_ids,
            sites,
            "readout",
            "fast",
            clean_c,
            clean_r,
            {("noising", "chosen"): clean_c[:, None] + effects},
        )

    anti = faithfulness(att, patching(-ranks.flip(-1)), n_boot=50)  # big attribution <-> small |effect|
    assert anti.mean_rho == pytest.approx(-1.0) and anti.pooled_rho < 0
    same = faithfulness(att, patching(-ranks), n_boot=50)
    assert same.mean_rho == pytest.approx(1.0) and same.pooled_rho == pytest.approx(1.0)
    assert same.mean_rho_ci == pytest.approx((1.0, 1.0))


def test_atp_as_the_attribution_and_errors(llama_model, results):
    att, pat = results
    atp = attribution_patch(llama_model, PAIRS, level="component", progress=False)
    res = faithfulness(atp, pat, n_boot=50)
    assert res.settings["quantity"] == "atp" and np.isfinite(res.mean_rho)
    with pytest.raises(ValueError, match="different pairs"):
        faithfulness(att, patch(llama_model, PAIRS[:3], progress=False))
    with pytest.raises(ValueError, match="in common"):
        faithfulness(att, patch(llama_model, PAIRS, level="head", progress=False))
    with pytest.raises(ValueError, match="give the pairs"):
        faithfulness(llama_model)


def test_batched_pooled_bootstrap_equals_the_loop():
    """The pooled rho of each bootstrap resample, from weighted ranks over one sort, is the per-resample
    spearman call (scipy-equal ranks of the materialised resample) to 1e-12, ties, NaN and constants
    included."""
    import numpy as np

    from reward_lens.instruments.faithfulness import pooled_spearman
    from reward_lens.stats import bootstrap_indices, spearman

    rng = np.random.default_rng(3)
    a, e = rng.normal(size=(40, 9)), rng.normal(size=(40, 9))
    a[:, 2] = a[:, 3]  # ties within and across pairs
    e[5] = e[6]
    idx = bootstrap_indices(40, 250, seed=1)
    loop = np.array([spearman(np.abs(a[i]), np.abs(e[i])) for i in idx])
    batched = pooled_spearman(np.abs(a), np.abs(e), idx, chunk=64)
    assert np.abs(loop - batched).max() < 1e-12
    a[7, 0] = np.nan  # resamples drawing pair 7 have no rho, the others keep theirs
    loop = np.array([spearman(np.abs(a[i]), np.abs(e[i])) for i in idx])
    batched = pooled_spearman(np.abs(a), np.abs(e), idx, chunk=64)
    assert np.array_equal(np.isnan(loop), np.isnan(batched)) and 0 < np.isnan(loop).sum() < len(idx)
    assert np.nanmax(np.abs(loop - batched)) < 1e-12
    const = np.ones((40, 9))  # every resample constant: NaN, as spearman gives
    assert np.isnan(pooled_spearman(const, np.abs(e), idx[:5])).all()
