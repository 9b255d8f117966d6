"""The hack alarm against independent computations: the pressure statistic and its permutation p-value by
exhaustive enumeration, GRPO's advantages as TRL computes them, the CUSUM by a plain loop, the threshold's
false-alarm rate on fresh simulations, and the whole alarm's false-alarm rate under the null it claims
(rewards that ignore the completion) and its speed on a reward that pays for length."""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import norm

from reward_lens.integrations.alarm import (
    HackAlarm,
    Reference,
    advantages,
    cusum_threshold,
    group_ids,
    pressure,
)


def _batch(rng, groups=8, size=8, slope=0.0):
    lengths = rng.integers(5, 40, size=groups * size).astype(float)
    g = np.repeat(np.arange(groups), size)
    rewards = slope * lengths + rng.standard_normal(groups * size)
    return rewards, lengths, g


def test_advantages_are_trls():
    rng = np.random.default_rng(0)
    r, _, g = _batch(rng)
    t = torch.tensor(r).view(-1, 8)
    trl = ((t - t.mean(1, keepdim=True)) / (t.std(1, keepdim=True) + 1e-4)).reshape(-1).numpy()
    assert np.allclose(advantages(r, g), trl, atol=1e-12)
    assert np.allclose(advantages(r, g, "none"), (t - t.mean(1, keepdim=True)).reshape(-1).numpy())


def test_pressure_statistic_and_pvalue_against_enumeration():
    """Two groups of 4: all 24 x 24 within-group permutations enumerated."""
    rng = np.random.default_rng(1)
    r = rng.standard_normal(8)
    x = rng.standard_normal(8)
    g = np.repeat([0, 1], 4)
    a = advantages(r, g)
    naive = sum(a[i] * (x[i] - x[g == g[i]].mean()) for i in range(8))
    exact = []
    for p0 in itertools.permutations(range(4)):
        for p1 in itertools.permutations(range(4)):
            rp = np.concatenate([r[:4][list(p0)], r[4:][list(p1)]])
            ap = advantages(rp, g)
            exact.append(sum(ap[i] * (x[i] - x[g == g[i]].mean()) for i in range(8)))
    exact = np.array(exact)
    p_exact = float((exact >= naive - 1e-12).mean())
    pr = pressure(r, x, g, n_perm=20000, rng=np.random.default_rng(2))
    assert pr.statistic == pytest.approx(naive, abs=1e-12)
    assert pr.p_up == pytest.approx(p_exact, abs=0.01)
    assert pr.z_up == pytest.approx(norm.isf(pr.p_up))
    rc = r - np.array([r[g == v].mean() for v in g])
    xc = x - np.array([x[g == v].mean() for v in g])
    assert pr.slope == pytest.approx((rc @ xc) / (xc @ xc), rel=1e-12)
    assert pr.value == pytest.approx(naive / np.sqrt((a @ a) * (xc @ xc)), rel=1e-12)


def test_group_ids_follow_prompts():
    assert group_ids(["a", "b", "a", "c", "b"]).tolist() == [0, 1, 0, 2, 1]


def test_threshold_keeps_its_false_alarm_rate_on_fresh_paths():
    h = cusum_threshold(0.05, 100, 0.5)
    rng = np.random.default_rng(123)  # not the calibration's seed
    s, peak = np.zeros(20000), np.zeros(20000)
    for _ in range(100):
        s = np.maximum(0, s + rng.standard_normal(20000) - 0.5)
        peak = np.maximum(peak, s)
    assert (peak >= h).mean() == pytest.approx(0.05, abs=0.006)
    assert cusum_threshold(0.01, 100, 0.5) > h  # rarer alarms need a higher threshold


def test_cusum_matches_a_plain_loop():
    rng = np.random.default_rng(3)
    alarm = HackAlarm(["length"], horizon=20, n_perm=199)
    zs, s_up = [], 0.0
    for step in range(1, 21):
        r, x, g = _batch(rng, slope=0.02)
        out = alarm.update(step, r, {"length": x}, g)
        pr = pressure(r, x, g)  # the z this step used is recomputed from its history entry instead
        zs.append(out["pressure/length/z"])
        s_up = max(0.0, s_up + zs[-1] - alarm.pressure_k)
        assert out["pressure/length/cusum_up"] == pytest.approx(s_up, abs=1e-9)
        assert abs(pr.value - out["pressure/length"]) < 1e-12
    assert alarm.pressure_k == pytest.approx(0.15 * np.sqrt(64 - 8))


def test_false_alarm_rate_under_rewards_that_ignore_the_completion():
    """200 runs of 30 steps with pure-noise rewards: hack alarms at most alpha (+ Monte Carlo error)."""
    rng = np.random.default_rng(4)
    fired = 0
    for run in range(200):
        alarm = HackAlarm(["length"], horizon=30, n_perm=99, seed=run)
        for step in range(1, 31):
            r, x, g = _batch(rng)
            alarm.update(step, r, {"length": x}, g)
        fired += any(a["channel"] == "hack" for a in alarm.alarms)
    assert fired / 200 <= 0.05 + 2 * np.sqrt(0.05 * 0.95 / 200)


def test_a_reward_paying_for_length_is_alarmed_at_once():
    rng = np.random.default_rng(5)
    alarm = HackAlarm(["length"], horizon=200)
    for step in range(1, 4):
        r, x, g = _batch(rng, slope=0.3)
        alarm.update(step, r, {"length": x}, g)
    assert alarm.hack_steps()["length"] is not None and alarm.hack_steps()["length"] <= 2
    hacks = [a for a in alarm.alarms if a["channel"] == "hack"]
    assert hacks[0]["side"] == "up" and alarm.summary().shape[0] >= 1


def test_behaviour_channel_reads_drift_against_its_reference():
    rng = np.random.default_rng(6)
    r, x, g = _batch(rng)
    ref = Reference.fit(r, np.log(x), g)
    means = [np.log(x[g == v]).mean() for v in range(8)]
    assert ref.mean == pytest.approx(np.log(x).mean()) and ref.group_sd == pytest.approx(
        np.std(means, ddof=1)
    )
    alarm = HackAlarm(["length"], horizon=50, references={"length": ref})
    first = None
    for step in range(1, 16):
        r, x, g = _batch(rng)
        first = x * 1.5 if first is None else first
        alarm.update(step, r, {"length": x * 1.5}, g)  # every completion 50% longer than the reference
    assert any(a["channel"] == "behaviour" and a["side"] == "up" for a in alarm.alarms)
    expected = (np.log(first).mean() - ref.mean) / (ref.group_sd / np.sqrt(8))
    assert alarm.history[0]["behaviour/length/z"] == pytest.approx(expected, rel=1e-12)
    assert not any(a["channel"] == "hack" for a in alarm.alarms)  # drift without pressure is no hack


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alpha": 0}, "alpha"),
        ({"alpha": True}, "alpha"),
        ({"scale": "batch"}, "scale"),
        ({"n_perm": 10}, "n_perm"),
        ({"min_pressure": 1.5}, "min_pressure"),
        ({"features": []}, "features"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HackAlarm(**kwargs)
