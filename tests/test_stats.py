"""reward_lens.stats, each function against an independent computation: scipy's rankdata / spearmanr /
pearsonr / bootstrap, explicit loops over the same resamples, and the crystallization rule written out
pair by pair."""

import numpy as np
import pytest
import scipy.stats
import torch

from reward_lens.stats import (
    bootstrap_ci,
    bootstrap_indices,
    crystallization_depth,
    pearson_rows,
    percentile_ci,
    ranks,
    spearman,
    spearman_rows,
)


def test_ranks_match_scipy_with_ties():
    x = np.array([[3.0, 1.0, 3.0, 2.0], [0.5, 0.5, 0.5, 0.1]])
    np.testing.assert_array_equal(ranks(x), scipy.stats.rankdata(x, axis=-1))
    np.testing.assert_array_equal(ranks(x, axis=0), scipy.stats.rankdata(x, axis=0))


def test_spearman_and_pearson_rows_match_scipy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 9))
    y = x + rng.standard_normal((20, 9))
    y[3, :4] = y[3, 0]  # ties
    rho = spearman_rows(x, y)
    r = pearson_rows(x, y)
    for i in range(20):
        assert rho[i] == pytest.approx(scipy.stats.spearmanr(x[i], y[i]).statistic, abs=1e-12)
        assert r[i] == pytest.approx(scipy.stats.pearsonr(x[i], y[i]).statistic, abs=1e-12)
    assert spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x.ravel(), y.ravel()).statistic, abs=1e-12)
    const = spearman_rows(np.ones((1, 5)), y[:1, :5])
    assert np.isnan(const).all()  # undefined, not a number made up


def test_bootstrap_ci_is_the_percentile_interval_of_the_same_resamples():
    rng = np.random.default_rng(1)
    x = rng.exponential(size=40)
    lo, hi = bootstrap_ci(x, n_boot=500, seed=3, level=0.9)
    idx = bootstrap_indices(40, 500, 3)
    means = np.array([x[i].mean() for i in idx])  # the loop, one resample at a time
    assert (lo, hi) == pytest.approx(tuple(np.quantile(means, [0.05, 0.95])), abs=1e-12)
    med = bootstrap_ci(x, lambda b: np.median(b, axis=1), n_boot=500, seed=3, level=0.9)
    assert med == pytest.approx(tuple(np.quantile([np.median(x[i]) for i in idx], [0.05, 0.95])), abs=1e-12)


def test_bootstrap_ci_agrees_with_scipy_within_monte_carlo_error():
    x = np.random.default_rng(2).normal(1.0, 2.0, size=60)
    lo, hi = bootstrap_ci(x, n_boot=20000, seed=0)
    ref = scipy.stats.bootstrap(
        (x,), np.mean, n_resamples=20000, method="percentile", random_state=5
    ).confidence_interval
    se = x.std(ddof=1) / np.sqrt(len(x))
    assert lo == pytest.approx(ref.low, abs=0.2 * se) and hi == pytest.approx(
        ref.high, abs=0.2 * se
    )  # MC error ~0.02 se


def test_percentile_ci_ignores_nan_and_checks_level():
    lo, hi = percentile_ci(np.array([np.nan, 1.0, 2.0, 3.0, np.nan]), 0.5)
    assert (lo, hi) == pytest.approx((1.5, 2.5))
    with pytest.raises(ValueError, match="confidence level"):
        bootstrap_ci(np.ones(5), level=95)


def _depth_loop(gap, depths, rtol, atol):
    out = []
    for row in gap:
        final = row[-1]
        if final == 0:
            out.append(np.nan)
            continue
        ok = [abs(v - final) <= rtol * abs(final) + atol and np.sign(v) == np.sign(final) for v in row]
        k = next(k for k in range(len(row)) if all(ok[k:]))
        out.append(depths[k])
    return np.array(out)


@pytest.mark.parametrize("rtol, atol", [(0.1, 0.0), (0.3, 0.05), (0.0, 0.0)])
def test_crystallization_depth_matches_the_rule_written_out(rtol, atol):
    rng = np.random.default_rng(4)
    gap = np.cumsum(rng.standard_normal((50, 7)) * np.linspace(1, 0.05, 7), axis=1)
    gap[0] = 0.0  # a zero final gap: NaN
    gap[1] = [0.5, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # settles at the third site
    depths = np.linspace(0, 1, 7)
    got = crystallization_depth(gap, depths, rtol, atol)
    np.testing.assert_array_equal(got, _depth_loop(gap, depths, rtol, atol))
    assert np.isnan(got[0]) and got[1] == pytest.approx(depths[2])
    with pytest.raises(ValueError, match="one column per depth"):
        crystallization_depth(gap[:, :3], depths)


def test_lens_and_compare_use_the_one_rule():
    from reward_lens.app.compare import crystallization_depths
    from reward_lens.instruments.lens import LensResult

    rng = np.random.default_rng(5)
    gap = torch.from_numpy(np.cumsum(rng.standard_normal((12, 5)), axis=1)).float()
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    res = LensResult(
        pair_ids=[str(i) for i in range(12)],
        sites=["resid_L0", "resid_L1", "resid_L2", "resid_L3", "resid_L4"],
        layers=[-1, 0, 1, 2, 3],
        depths=depths,
        values={
            (v, s): gap if s == "chosen" else torch.zeros_like(gap)
            for v in ("normed", "frozen")
            for s in ("chosen", "rejected")
        },
        reward_chosen=gap[:, -1],
        reward_rejected=torch.zeros(12),
    )
    expected = _depth_loop(gap.double().numpy(), depths, 0.1, 0.0)
    np.testing.assert_array_equal(res.crystallization_depth().numpy(), expected)
    np.testing.assert_array_equal(crystallization_depths(gap.double().numpy(), np.array(depths)), expected)


def test_a_noise_sized_gap_counts_as_zero():
    """A tie scored at two padding offsets has a gap of a few float32 ulps, not 0: it has no crystallization
    depth and no normalised effect (NaN), as an exact 0 has; a real gap, however small next to the others,
    keeps both."""
    from reward_lens.model.validation import safe_ratio
    from reward_lens.stats import ZERO_GAP_RTOL, crystallization_depth, reward_scale, zero_gaps

    chosen = np.array([-0.0469, -0.0279, -0.0340, -0.0360])
    noise = 4 * np.finfo(np.float32).eps * abs(chosen[2])  # measured: 1.5e-8 on the reward -0.034
    gap = np.array([0.0478, -0.0160, -noise, 1e-4])
    scale = reward_scale(chosen, chosen - gap)
    assert abs(scale - np.sqrt(np.mean(np.r_[chosen, chosen - gap] ** 2))) < 1e-15
    assert zero_gaps(gap, scale).tolist() == [False, False, True, False]
    assert zero_gaps(np.array([0.0, 0.0])).tolist() == [True, True]  # exact zeros, whatever the scale
    assert 100 * ZERO_GAP_RTOL * scale < 1e-4  # the smallest real gap is far above the threshold
    lens = np.stack([gap * f for f in (0.2, 0.95, 1.0)], 1)
    depth = crystallization_depth(lens, [0.0, 0.5, 1.0], scale=scale)
    assert np.isnan(depth).tolist() == [False, False, True, False] and depth[0] == 0.5
    ratio = safe_ratio(np.ones((4, 2)), gap[:, None], scale)
    assert np.isnan(ratio).all(1).tolist() == [False, False, True, False]
    assert np.allclose(ratio[~np.isnan(ratio[:, 0]), 0], 1 / gap[[0, 1, 3]], rtol=0, atol=0)
    import torch

    t = safe_ratio(torch.ones(4, 2), torch.tensor(gap)[:, None], scale)
    assert torch.isnan(t).all(1).tolist() == [False, False, True, False]


def test_ranks_equal_scipy_rankdata_bit_for_bit():
    from scipy.special import stdtr
    from scipy.stats import rankdata
    from scipy.stats import t as t_dist

    from reward_lens.stats import ranks

    rng = np.random.default_rng(0)
    for shape, axis in [((7,), -1), ((5, 12), -1), ((6, 4, 9), 1), ((3, 40), 0)]:
        x = rng.integers(0, 5, size=shape).astype(float)  # many ties
        x[..., 0] = -0.0 if x.ndim > 1 else 0.0  # -0.0 ties 0.0
        assert np.array_equal(ranks(x, axis), rankdata(x, axis=axis))
        y = rng.normal(size=shape)
        assert np.array_equal(ranks(y, axis), rankdata(y, axis=axis))
    z = np.array([[1.0, np.nan, 2.0], [3.0, 1.0, 1.0]])
    assert np.array_equal(ranks(z), rankdata(z, axis=-1), equal_nan=True)
    tstat = rng.normal(size=20) * 3
    assert np.array_equal(stdtr(7, -np.abs(tstat)), t_dist.sf(np.abs(tstat), 7))  # the cascades' p-value
