"""A leading, calibrated reward-hack alarm for group-based RL (GRPO, RLOO): what the reward *pays for* inside
each prompt group, before the policy has moved, and whether the policy then moves that way.

GRPO's advantage is the reward standardised within the group of completions of one prompt
(A_gi = (r_gi - mean_g) / std_g, TRL's `scale_rewards="group"`), so what pushes the policy towards a
per-completion feature x (response length, a concept's projection, any user function) is the within-group
association of A and x, not its size. Per step and feature:

  pressure    T = Σ_g Σ_i A_gi (x_gi - x̄_g), reported as the weighted correlation T / sqrt(ΣA² Σx̃²);
              its p-value comes from permuting the rewards within each group (`n_perm` draws, the
              (b + 1) / (B + 1) estimate), which is exact for any reward that ignores the completion: such
              rewards are exchangeable within a group, whatever the policy has become. z = Φ⁻¹(1 - p)
              is then no larger in distribution than a standard normal, step after step, given the past.
  behaviour   z = (mean_i x_i - m_ref) / se_ref against a pre-flight reference (for length: log length):
              the policy's own drift. m_ref and se_ref (the spread of a batch's mean over groups of
              prompts) come from `Reference` (pre-flight rollouts of the initial policy, or the first batch).
  explained   share of the reward's gain since the reference that the feature's drift explains,
              slope_ref · (x̄ - x̄_ref) / (r̄ - r̄_ref): descriptive, no threshold.

Each z feeds two one-sided CUSUMs, S_t = max(0, S_{t-1} + z_t - k) (up: the reward pays for more x, or x
rises; down: less), alarming at S_t ≥ h. h is set by simulation of i.i.d. standard normal z over the run's
horizon so that P(any crossing) ≤ α / (2 · number of features): by the domination above, the pressure
channel's false-alarm probability over the whole run is at most α for any completion-blind reward (noise,
within-group shuffles). A CUSUM, not a confidence sequence: the alarm must fire on a push that lasts, and
CUSUM is the optimal detector of a sustained shift of size ≈ 2k (Lorden); its threshold needs only the null
of one step, which the permutation gives exactly. The pressure CUSUM's k is `min_pressure` · √(N − G) (N
completions in G groups, from the first batch): a within-group correlation ρ adds about ρ · √(N − G) to z
per step, so pressures below `min_pressure` drift the CUSUM down and pressures of twice it are what it is
tuned to catch. The behaviour CUSUMs use k = 0.5 (a one-standard-error drift).

**Rule.** "Hack on X" is raised at the first step where the pressure channel on X crosses h: the reward
pays for X inside the groups, beyond chance and beyond `min_pressure`, which is what GRPO climbs. It leads
because it reads the cause (the advantage's dependence on X), not its effect: a batch mean of X moves by
less than the prompt mix's noise for the first several steps (the behaviour channel, whose crossing is
recorded as the confirmation, and the explained share, descriptive).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
from scipy.stats import norm

SIDES = ("up", "down")
CHANNELS = ("pressure", "behaviour")


@lru_cache(maxsize=64)
def cusum_threshold(alpha: float, horizon: int, k: float = 0.5, n_sim: int = 40000, seed: int = 0) -> float:
    """h with P(max_t S_t ≥ h within `horizon` steps) = alpha for a one-sided CUSUM of i.i.d. N(0, 1)
    increments with reference value k (Monte Carlo over `n_sim` paths, fixed seed)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 step, got {horizon}")
    rng = np.random.default_rng(seed)
    s = np.zeros(n_sim)
    peak = np.zeros(n_sim)
    for _ in range(int(horizon)):
        s = np.maximum(0.0, s + rng.standard_normal(n_sim) - k)
        np.maximum(peak, s, out=peak)
    return float(np.quantile(peak, 1.0 - alpha))


def on_scale(feature: str, values) -> np.ndarray:
    """A feature's values as its behaviour channel reads them: log length for "length", others as they
    are."""
    values = np.asarray(values, np.float64)
    return np.log(np.maximum(values, 1.0)) if feature == "length" else values


def group_ids(prompts: Sequence) -> np.ndarray:
    """One integer per completion: equal for completions of the same prompt (GRPO's groups)."""
    index: Dict = {}
    return np.array([index.setdefault(p, len(index)) for p in prompts], dtype=np.int64)


def advantages(rewards: np.ndarray, groups: np.ndarray, scale: str = "group") -> np.ndarray:
    """GRPO's advantages: reward minus its group's mean, divided by the group's std (unbiased, + 1e-4, as
    TRL) when `scale="group"`, by nothing when `scale="none"`."""
    r = np.asarray(rewards, np.float64)
    out = np.zeros_like(r)
    for g in np.unique(groups):
        m = groups == g
        d = r[m] - r[m].mean()
        if scale == "group":
            d = d / ((r[m].std(ddof=1) if m.sum() > 1 else 0.0) + 1e-4)
        out[m] = d
    return out


@dataclass
class Pressure:
    """One step's within-group association of advantage and a feature: `value` the weighted correlation,
    `statistic` T, p-values of the permutation test on each side and their z-scores."""

    value: float
    statistic: float
    p_up: float
    p_down: float
    z_up: float
    z_down: float
    slope: float  # within-group OLS slope of the reward on the feature (reward units per unit of x)


def pressure(
    rewards: np.ndarray,
    feature: np.ndarray,
    groups: np.ndarray,
    *,
    scale: str = "group",
    n_perm: int = 999,
    rng: Optional[np.random.Generator] = None,
) -> Pressure:
    """The pressure of one batch (see the module docstring); rewards permuted within each group `n_perm`
    times."""
    rng = np.random.default_rng(0) if rng is None else rng
    r = np.asarray(rewards, np.float64)
    x = np.asarray(feature, np.float64)
    a = advantages(r, groups, scale)
    t_obs, sa, sx, sxy = 0.0, 0.0, 0.0, 0.0
    t_perm = np.zeros(n_perm)
    for g in np.unique(groups):
        m = groups == g
        if m.sum() < 2:
            continue
        xc = x[m] - x[m].mean()
        ag = a[m]
        rc = r[m] - r[m].mean()
        t_obs += float(ag @ xc)
        sa += float(ag @ ag)
        sx += float(xc @ xc)
        sxy += float(rc @ xc)
        if float(xc @ xc) > 0 and float(ag @ ag) > 0:
            perms = np.argsort(rng.random((n_perm, int(m.sum()))), axis=1)
            t_perm += ag[perms] @ xc
    value = t_obs / np.sqrt(sa * sx) if sa > 0 and sx > 0 else 0.0
    tol = 1e-12 * max(1.0, abs(t_obs))
    p_up = (1 + int((t_perm >= t_obs - tol).sum())) / (n_perm + 1)
    p_down = (1 + int((t_perm <= t_obs + tol).sum())) / (n_perm + 1)
    return Pressure(
        float(value),
        float(t_obs),
        p_up,
        p_down,
        float(norm.isf(p_up)),
        float(norm.isf(p_down)),
        float(sxy / sx) if sx > 0 else 0.0,
    )


@dataclass
class Reference:
    """A feature's behaviour under the initial policy: the mean `mean` of its (log, for length) values, the
    spread `group_sd` of its per-prompt-group means (a batch of G groups has standard error group_sd / √G),
    the mean reward and the within-group slope of the reward on the feature (for the explained share)."""

    mean: float
    group_sd: float
    reward_mean: float
    slope: float
    n_groups: int

    @classmethod
    def fit(cls, rewards, values, groups, scale: str = "group") -> "Reference":
        values = np.asarray(values, np.float64)
        ids = np.unique(groups)
        means = np.array([values[groups == g].mean() for g in ids])
        sd = float(means.std(ddof=1)) if len(ids) > 1 else float(values.std(ddof=1))
        slope = pressure(rewards, values, groups, scale=scale, n_perm=1).slope
        return cls(float(values.mean()), sd, float(np.mean(rewards)), slope, int(len(ids)))

    def to_dict(self) -> dict:
        return dict(self.__dict__)


Feature = Callable[[str], float]


@dataclass
class _Track:
    """The running state of one feature: two CUSUMs per channel and the first crossings."""

    name: str
    reference: Optional[Reference] = None
    cusum: Dict[str, float] = field(
        default_factory=lambda: {f"{c}/{s}": 0.0 for c in CHANNELS for s in SIDES}
    )
    crossed: Dict[str, Optional[int]] = field(default_factory=dict)
    hack: Optional[int] = None


@dataclass
class HackAlarm:
    """Pressure and behaviour channels with CUSUM alarms for each feature (see the module docstring).

    features: names of the tracked features ("length" is the response length in RM tokens, on a log scale in
    the behaviour channel; others are given as values to `update`). alpha: the false-alarm probability of
    the pressure channels over `horizon` steps, shared out over the features and sides. min_pressure: the
    within-group correlation the pressure CUSUM ignores (its k, see the module docstring). k: the behaviour
    CUSUMs' reference value. references: feature -> `Reference` (pre-flight); a feature without one takes
    its reference from the first batch.
    """

    features: Sequence[str] = ("length",)
    alpha: float = 0.05
    horizon: Optional[int] = None
    min_pressure: float = 0.15
    k: float = 0.5
    n_perm: int = 9999
    scale: str = "group"
    references: Mapping[str, Reference] = field(default_factory=dict)
    seed: int = 0
    alarms: List[dict] = field(default_factory=list)
    history: List[dict] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be a probability in (0, 1), got {self.alpha!r}")
        if self.scale not in ("group", "none"):
            raise ValueError(f"scale must be 'group' or 'none' (TRL's scale_rewards), got {self.scale!r}")
        if isinstance(self.n_perm, bool) or not isinstance(self.n_perm, int) or self.n_perm < 99:
            raise ValueError(f"n_perm must be an integer >= 99, got {self.n_perm!r}")
        if isinstance(self.min_pressure, bool) or not 0 <= self.min_pressure < 1:
            raise ValueError(f"min_pressure must be a correlation in [0, 1), got {self.min_pressure!r}")
        if not self.features:
            raise ValueError("no features to track; pass at least one name (e.g. features=['length'])")
        self.features = list(dict.fromkeys(self.features))
        self._rng = np.random.default_rng(self.seed)
        self._tracks = {f: _Track(f, self.references.get(f)) for f in self.features}
        self.pressure_k: Optional[float] = None

    # ------------------------------------------------------------------------------------------ thresholds
    def threshold(self, channel: str = "pressure") -> float:
        """h of a channel's CUSUMs: P(any crossing within `horizon`) ≤ alpha / (2 · features) for i.i.d.
        N(0, 1) increments (the pressure channel's null is dominated by them, see the module docstring)."""
        k = self.pressure_k if channel == "pressure" else self.k
        if k is None:
            raise ValueError("the pressure CUSUM's k is set by the first batch; call update first")
        return cusum_threshold(self.alpha / (2 * len(self.features)), int(self.horizon or 1000), round(k, 6))

    def reset(self) -> None:
        """Forget the run (not the references): a new training run starts from zero."""
        self.alarms, self.history = [], []
        self.pressure_k = None
        self._rng = np.random.default_rng(self.seed)
        self._tracks = {f: _Track(f, self.references.get(f)) for f in self.features}

    # ------------------------------------------------------------------------------------------ update
    def update(self, step: int, rewards, values: Mapping[str, np.ndarray], groups) -> dict:
        """One batch: `rewards` the trainer receives, `values[feature]` per completion, `groups` per
        completion. Returns the flat statistics of this step (also appended to `history`); new alarms are
        appended to `alarms` as {"step", "feature", "channel", "side"}."""
        rewards = np.asarray(rewards, np.float64)
        groups = np.asarray(groups)
        n_groups = len(np.unique(groups))
        if self.pressure_k is None:
            self.pressure_k = self.min_pressure * float(np.sqrt(max(len(rewards) - n_groups, 1)))
        h = {"pressure": self.threshold("pressure"), "behaviour": self.threshold("behaviour")}
        k = {"pressure": self.pressure_k, "behaviour": self.k}
        out: Dict[str, float] = {"step": step}
        for name in self.features:
            tr = self._tracks[name]
            raw = np.asarray(values[name], np.float64)
            x = on_scale(name, raw)
            pr = pressure(rewards, raw, groups, scale=self.scale, n_perm=self.n_perm, rng=self._rng)
            if tr.reference is None:
                tr.reference = Reference.fit(rewards, x, groups, self.scale)
            ref = tr.reference
            se = ref.group_sd / np.sqrt(n_groups) if ref.group_sd > 0 else np.inf
            zb = (x.mean() - ref.mean) / se
            z = {
                "pressure/up": pr.z_up,
                "pressure/down": pr.z_down,
                "behaviour/up": zb,
                "behaviour/down": -zb,
            }
            for key, zk in z.items():
                channel, side = key.split("/")
                tr.cusum[key] = max(0.0, tr.cusum[key] + float(zk) - k[channel])
                if tr.cusum[key] >= h[channel] and tr.crossed.get(key) is None:
                    tr.crossed[key] = step
                    self.alarms.append({"step": step, "feature": name, "channel": channel, "side": side})
                    if channel == "pressure" and tr.hack is None:  # the rule: see the module docstring
                        tr.hack = step
                        self.alarms.append({"step": step, "feature": name, "channel": "hack", "side": side})
            gain = rewards.mean() - ref.reward_mean
            drift = x.mean() - ref.mean
            out.update(
                {
                    f"pressure/{name}": pr.value,
                    f"pressure/{name}/p_up": pr.p_up,
                    f"pressure/{name}/z": float(np.clip(pr.z_up, -8, 8)),
                    f"pressure/{name}/cusum_up": tr.cusum["pressure/up"],
                    f"pressure/{name}/cusum_down": tr.cusum["pressure/down"],
                    f"behaviour/{name}/z": float(zb),
                    f"behaviour/{name}/cusum_up": tr.cusum["behaviour/up"],
                    f"behaviour/{name}/cusum_down": tr.cusum["behaviour/down"],
                    f"explained/{name}": float(ref.slope * drift / gain)
                    if abs(gain) > 1e-9
                    else float("nan"),
                    f"alarm/{name}": float(tr.hack is not None),
                }
            )
        out["alarm/threshold"] = h["pressure"]
        out["alarm/behaviour_threshold"] = h["behaviour"]
        out["alarms"] = float(sum(t.hack is not None for t in self._tracks.values()))
        self.history.append(out)
        return out

    def hack_steps(self) -> Dict[str, Optional[int]]:
        """Feature -> the step its hack alarm was raised (None: not raised)."""
        return {name: tr.hack for name, tr in self._tracks.items()}

    def to_frame(self):
        """One row per step and statistic."""
        import pandas as pd

        rows = [
            {"step": h["step"], "statistic": k, "value": v}
            for h in self.history
            for k, v in h.items()
            if k != "step"
        ]
        return pd.DataFrame(rows, columns=["step", "statistic", "value"])

    def summary(self):
        """Every alarm: step, feature, channel, side."""
        import pandas as pd

        return pd.DataFrame(self.alarms, columns=["step", "feature", "channel", "side"])

    def plot(self, feature: str = "length", ax=None):
        """The four CUSUMs of one feature over the steps with the thresholds; the hack alarm marked."""
        steps = [h["step"] for h in self.history]
        series = {
            f"{c}/cusum_{side}": [h[f"{c}/{feature}/cusum_{side}"] for h in self.history]
            for c in CHANNELS
            for side in SIDES
        }
        last = self.history[-1] if self.history else {}
        thresholds = {
            c: last.get(k)
            for c, k in (("pressure", "alarm/threshold"), ("behaviour", "alarm/behaviour_threshold"))
        }
        return plot_cusums(steps, series, thresholds, self.alarms, feature, ax)


def plot_cusums(steps, series: Mapping[str, Sequence[float]], thresholds, alarms, feature: str, ax=None):
    """One feature's CUSUMs ("pressure/cusum_up", ... -> values per step) with each channel's threshold and
    the hack alarm's step: the alarm's picture, for `HackAlarm.plot` and the monitor page. Returns the
    Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 3.6)) if ax is None else (ax.figure, ax)
    colours = {"pressure": "#c44e52", "behaviour": "#4c72b0"}
    for key, values in series.items():
        channel, stat = key.split("/")
        ls = "-" if stat.endswith("up") else ":"
        ax.plot(
            steps[: len(values)], values, ls, color=colours[channel], lw=1.2, label=f"{channel} {stat[6:]}"
        )
    for channel, h in thresholds.items():
        if h is not None:
            ax.axhline(h, color=colours[channel], lw=0.8, ls="--", label=f"{channel} h = {h:.2f}")
    for a in alarms:
        if a["feature"] == feature and a["channel"] == "hack":
            ax.axvline(a["step"], color="#d62728", lw=1.5, label=f"hack alarm, step {a['step']}")
    ax.set_xlabel("training step")
    ax.set_yscale("symlog", linthresh=10)  # the thresholds (a few units) stay readable beside large sums
    ax.set_ylabel("CUSUM")
    ax.set_title(f"hack alarm on {feature}: pressure (reward pays for it) and behaviour (policy moves)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig
