"""Misalignment cascades: a planted correlation is found, with intervals and clusters; input layouts."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr

from reward_lens.theory import detect_cascades

DIMS = ["length", "confidence", "formatting", "sycophancy", "repetition"]


def planted(n=200, seed=0):
    """length & confidence & formatting share a latent factor (r ≈ 0.9); sycophancy is independent;
    repetition is anti-correlated with the factor."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n)
    E = np.stack(
        [
            z + 0.3 * rng.standard_normal(n),
            0.5 * (z + 0.3 * rng.standard_normal(n))
            + 2.0,  # other scale and offset: correlation is scale-free
            z + 0.3 * rng.standard_normal(n),
            rng.standard_normal(n),
            -z + 0.3 * rng.standard_normal(n),
        ],
        axis=1,
    )
    return pd.DataFrame(E, columns=DIMS, index=[f"item{j}" for j in range(n)])


def test_planted_correlation_recovered_with_intervals_and_clusters():
    E = planted()
    res = detect_cascades(E, n_boot=500, seed=0)
    np.testing.assert_allclose(res.corr, np.corrcoef(E.to_numpy().T), atol=1e-12)  # independent computation
    i, j, s, r = (DIMS.index(d) for d in ("length", "confidence", "sycophancy", "repetition"))
    expected = 1 / (1 + 0.09)  # corr of z + e1 and z + e2 with var(e) = 0.09
    assert res.corr[i, j] == pytest.approx(expected, abs=0.05)
    assert res.ci_low[i, j] <= res.corr[i, j] <= res.ci_high[i, j]
    assert res.ci_low[i, j] > 0.8 and res.linked[i, j]
    assert res.ci_low[i, s] < 0 < res.ci_high[i, s] and not res.linked[i, s]
    assert res.ci_high[i, r] < -0.8
    assert res.p_value[i, j] < 1e-10 and res.p_value[i, s] > 0.01
    assert res.cascades == [["length", "confidence", "formatting"]]
    assert sorted(map(tuple, res.clusters)) == sorted(
        [("length", "confidence", "formatting"), ("sycophancy",), ("repetition",)]
    )
    frame = res.to_frame()
    assert (
        len(frame) == 10
        and frame.query("dimension_a == 'length' and dimension_b == 'confidence'").same_cluster.item()
    )
    cl = res.clusters_frame()
    assert cl.set_index("dimension").loc["formatting", "cluster_size"] == 3
    assert isinstance(res.plot(), matplotlib.figure.Figure)
    assert "length, confidence, formatting" in res.summary_text()
    assert res.summary().loc[0, "dimensions"] == "length, confidence, formatting"


def test_bootstrap_interval_has_nominal_coverage_roughly():
    # 40 replicates of a bivariate normal with rho = 0.5, n = 60: the 90% interval covers 0.5 most of the
    # time.
    rng = np.random.default_rng(1)
    hits = 0
    for rep in range(40):
        x = rng.standard_normal(60)
        y = 0.5 * x + np.sqrt(0.75) * rng.standard_normal(60)
        res = detect_cascades(np.stack([x, y], 1), ["x", "y"], n_boot=300, seed=rep, level=0.9)
        hits += res.ci_low[0, 1] <= 0.5 <= res.ci_high[0, 1]
    assert hits >= 30  # nominal 36 of 40; percentile bootstrap under-covers slightly at n = 60


def test_spearman_and_tidy_input_and_probe_like_object():
    E = planted(n=80, seed=3)
    tidy = E.reset_index(names="item").melt(id_vars="item", var_name="dimension", value_name="delta")
    tidy = tidy.sample(frac=1.0, random_state=0)  # order must not matter
    res = detect_cascades(tidy, method="spearman", n_boot=100)
    assert res.dimensions == list(tidy.dimension.drop_duplicates())
    k, l = res.dimensions.index("length"), res.dimensions.index("sycophancy")
    assert res.corr[k, l] == pytest.approx(spearmanr(E["length"], E["sycophancy"]).statistic, abs=1e-12)

    class FakeProbeResult:  # the probe suite's result exposes per-item deltas as `.per_item`
        per_item = tidy

    res2 = detect_cascades(FakeProbeResult(), method="spearman", n_boot=100)
    np.testing.assert_allclose(res2.corr, res.corr)
    # an item missing one dimension is dropped and counted
    res3 = detect_cascades(tidy.iloc[1:], n_boot=0)
    assert res3.n_items == 79 and res3.n_dropped == 1


def test_constant_dimension_and_bad_inputs():
    E = planted(n=30)
    E["constant"] = 0.0
    res = detect_cascades(E, n_boot=50)
    assert np.isnan(res.corr[-1, 0]) and any("constant" in n for n in res.notes)
    assert ["constant"] in res.clusters
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        detect_cascades(E[["length"]])
    with pytest.raises(ValueError, match="at least 4 matched items"):
        detect_cascades(E.iloc[:3])
    with pytest.raises(ValueError, match="method"):
        detect_cascades(E, method="kendall")
    with pytest.raises(ValueError, match="item column"):
        detect_cascades(pd.DataFrame({"dimension": ["a"], "delta": [1.0]}))


def test_a_model_instead_of_effects_is_one_clear_error():
    from reward_lens import demo_pairs, load_demo_model

    with pytest.raises(ValueError, match="not a model: pass run_probes"):
        detect_cascades(load_demo_model(device="cpu"), demo_pairs()[:4])
    with pytest.raises(ValueError, match="cannot read per-item effects from a str"):
        detect_cascades("effects.csv")
