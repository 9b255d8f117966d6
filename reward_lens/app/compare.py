r"""Cross-model comparison: two or more reward models on the same preference pairs.

Residual bases differ between models (different widths, different training runs, different
architectures), so a direction, a neuron index or an activation of one model means nothing in another.
Only **basis-free** quantities are compared, and only in **scale-free** form (a reward model is defined
up to a positive affine map: r and 3r + 7 prefer the same responses):

- *preference agreement*: the fraction of pairs on which two models prefer the same response (sign of
  the gap Δ = r(chosen) − r(rejected)), with a bootstrap interval, and the Spearman correlation of gaps;
- *lens curves on fractional depth*: the reward lens of the gap (``reward_lens.lens``; default variant
  "normed", the final norm recomputed on the intermediate residual, as the lens instrument; "frozen" is
  the additive one) after the embedding (depth 0) and after each block l (depth (l + 1) / L); both end
  exactly at Δ. Aggregated as Σ_i sign(Δ_i) lens_i(depth) / Σ_i |Δ_i| (the share of the total preference
  margin read at that depth, ending at 1) with per-pair median and quartiles of lens_i / Δ_i,
  interpolated onto a common depth grid;
- *crystallization depth*: per pair, the first fractional depth from which the lens of the gap keeps the
  final sign and stays within ``tol`` · |Δ| of it (default tol = 0.1, the lens instrument's rule);
  distributions compared by medians and the two-sample Kolmogorov–Smirnov statistic;
- *attribution profiles by fractional depth*: exact direct attribution of each gap to embed and every
  attention and MLP output (they sum to Δ exactly; the final norm's scale is frozen at its real value),
  components placed at depth 0 (embed), (l + ½)/L (attn_l) and (l + 1)/L (mlp_l), summed in ``n_bins``
  right-closed depth bins, as the signed share Σ_i sign(Δ_i) attr_i(bin) / Σ_i |Δ_i| (sums to 1 over bins)
  and the absolute share of Σ |attr|; compared by total-variation distance;
- *probe profiles*: hacking-probe effects side by side, standardised by each model's spread of gaps
  (effect / sd(Δ)) so that models on different reward scales line up, with the verdicts.

`compare_models(models, pairs)` runs the lens and attribution instruments on every model;
`profile_from_results` builds a `ModelProfile` from results already computed (e.g. by the audit);
`compare_profiles` does the math on `ModelProfile`s (plain arrays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from reward_lens import distributed as dist
from reward_lens.app.profiles import (
    ModelProfile,
    crystallization_depths,
    depth_bins,
    model_profile,
    standardise_probes,
)
from reward_lens.core.autobatch import BatchSize
from reward_lens.data.pairs import as_pairs
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import figure_axes, finish, panels, pyplot
from reward_lens.stats import bootstrap_indices, check_level, percentile_ci, zero_gaps

# ------------------------------------------------------------------------------------------- the result


@dataclass
class ComparisonResult:
    """Basis-free comparison of reward models on the same pairs (see module doc)."""

    names: List[str]
    profiles: Dict[str, ModelProfile]
    accuracy: pd.DataFrame  # model, accuracy, n_pairs, gap_sd, max_decomposition_error
    agreement: pd.DataFrame  # model_a, model_b, agreement, ci_low, ci_high, spearman, spearman_p, n_pairs
    lens: pd.DataFrame  # model, depth, share, median, q25, q75 (on the common grid)
    crystallization: pd.DataFrame  # model, pair, depth
    attribution: pd.DataFrame  # model, bin, depth_low, depth_high, signed_share, abs_share
    probes: Optional[pd.DataFrame]  # model, dimension, effect, ..., effect_per_gap_sd
    pairwise: pd.DataFrame  # model_a, model_b, metric, value
    tol: float
    n_bins: int
    level: float = 0.95

    def agreement_matrix(self) -> pd.DataFrame:
        M = pd.DataFrame(np.eye(len(self.names)), index=self.names, columns=self.names)
        for _, r in self.agreement.iterrows():
            M.loc[r.model_a, r.model_b] = M.loc[r.model_b, r.model_a] = r.agreement
        return M

    def to_frame(self, kind: str = "summary") -> pd.DataFrame:
        """kind: 'summary' (pairwise metrics, tidy), 'accuracy', 'agreement', 'lens', 'crystallization',
        'attribution' or 'probes'."""
        frames = {
            "summary": self.pairwise,
            "accuracy": self.accuracy,
            "agreement": self.agreement,
            "lens": self.lens,
            "crystallization": self.crystallization,
            "attribution": self.attribution,
            "probes": self.probes,
        }
        if kind not in frames:
            raise ValueError(f"unknown kind {kind!r}; choose one of {sorted(frames)}")
        if frames[kind] is None:
            raise ValueError("no probe profiles in this comparison; pass probes= to compare_models")
        return frames[kind]

    def summary(self) -> pd.DataFrame:
        """One row per pair of models, the basis-free metrics as columns (agreement, gap_spearman, ...)."""
        wide = self.pairwise.pivot_table(
            index=["model_a", "model_b"], columns="metric", values="value", sort=False
        )
        order = list(dict.fromkeys(self.pairwise["metric"]))
        return wide[order].reset_index().rename_axis(columns=None)

    # -------------------------------------------------------------- drawing
    def _colors(self):
        cycle = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
        return {n: cycle[i % len(cycle)] for i, n in enumerate(self.names)}

    def _draw_lens(self, ax) -> None:
        col = self._colors()
        for n in self.names:
            f = self.lens[self.lens.model == n]
            ax.fill_between(f.depth, f.q25, f.q75, color=col[n], alpha=0.15, lw=0)
            ax.plot(f.depth, f["share"], color=col[n], label=f"{n} (margin share)")
            ax.plot(f.depth, f["median"], color=col[n], ls="--", lw=0.8)
        ax.axhline(1.0, c="0.5", lw=0.6)
        ax.axhline(0.0, c="0.5", lw=0.6)
        ax.set_xlabel("fractional depth")
        ax.set_ylabel("lens of the gap / final gap")
        ax.set_title("reward lens (solid: margin share; dashed: median, band: IQR)", fontsize=9)
        ax.legend(fontsize=7)

    def _draw_crystallization(self, ax) -> None:
        data = [
            self.crystallization[self.crystallization.model == n].depth.dropna().to_numpy()
            for n in self.names
        ]
        ax.boxplot([d if len(d) else np.array([np.nan]) for d in data], vert=False)
        ax.set_yticks(range(1, len(self.names) + 1), self.names)
        ax.set_xlim(-0.05, 1.05)
        ax.set_xlabel("crystallization depth")
        ax.set_title(f"crystallization depth per pair (tol {self.tol})", fontsize=9)

    def _draw_attribution(self, ax) -> None:
        col = self._colors()
        k = len(self.names)
        width = 0.8 / k
        for j, n in enumerate(self.names):
            f = self.attribution[self.attribution.model == n]
            ax.bar(f["bin"] + (j - (k - 1) / 2) * width, f.signed_share, width, color=col[n], label=n)
        labels = [
            f"{lo:.2f}–{hi:.2f}"
            for lo, hi in self.attribution[self.attribution.model == self.names[0]][
                ["depth_low", "depth_high"]
            ].to_numpy()
        ]
        ax.set_xticks(range(self.n_bins), labels, rotation=45, ha="right", fontsize=7)
        ax.axhline(0, c="0.5", lw=0.6)
        ax.set_ylabel("share of preference margin")
        ax.set_title("attribution of the gap by fractional depth", fontsize=9)
        ax.legend(fontsize=7)

    def _draw_agreement(self, ax) -> None:
        M = self.agreement_matrix()
        im = ax.imshow(M.values, vmin=0, vmax=1, cmap="viridis")
        ax.set_xticks(range(len(self.names)), self.names, rotation=45, ha="right")
        ax.set_yticks(range(len(self.names)), self.names)
        for (i, j), v in np.ndenumerate(M.values):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
        acc = ", ".join(f"{r.model} {r.accuracy:.2f}" for r in self.accuracy.itertuples())
        ax.set_title(f"preference agreement (accuracy: {acc})", fontsize=9)
        ax.figure.colorbar(im, ax=ax, fraction=0.046)

    def _draw_probes(self, ax) -> None:
        col = self._colors()
        dims = list(dict.fromkeys(self.probes.dimension))
        k = len(self.names)
        width = 0.8 / k
        for j, n in enumerate(self.names):
            f = self.probes[self.probes.model == n].set_index("dimension").reindex(dims)
            ax.bar(
                np.arange(len(dims)) + (j - (k - 1) / 2) * width,
                f.effect_per_gap_sd,
                width,
                color=col[n],
                label=n,
            )
        ax.set_xticks(range(len(dims)), dims, rotation=45, ha="right")
        ax.axhline(0, c="0.5", lw=0.6)
        ax.set_ylabel("probe effect / sd of gaps")
        ax.set_title("hacking-probe profiles (standardised)", fontsize=9)
        ax.legend(fontsize=7)

    def _views(self) -> List[Tuple[str, Any]]:
        views = [
            ("Preference agreement", self._draw_agreement),
            ("Reward lens on fractional depth", self._draw_lens),
            ("Crystallization depth", self._draw_crystallization),
            ("Attribution profile by fractional depth", self._draw_attribution),
        ]
        if self.probes is not None:
            views.append(("Hacking-probe profiles", self._draw_probes))
        return views

    def figures(self) -> List[Tuple[str, Any]]:
        """One figure per view: (title, Figure)."""
        out = []
        for title, draw in self._views():
            fig, ax = figure_axes(None, (6.5, 4))
            draw(ax)
            out.append((title, finish(fig, True)))
        return out

    def plot(self, ax=None):
        """All views in one figure: agreement, lens curves, crystallization, attribution (and probes).
        `ax`: one Axes per view (4, or 5 with probes), or one to split."""
        views = self._views()
        created = ax is None
        fig, axes = panels(ax, len(views), (13, 4.2 * ((len(views) + 1) // 2)), ncols=2)
        for a, (_, draw) in zip(axes, views):
            draw(a)
        if created:
            fig.suptitle("cross-model comparison (basis-free, scale-free quantities only)")
        return finish(fig, created)


def compare_report_sections(result: ComparisonResult) -> List[Tuple[str, Any]]:
    """(title, DataFrame or matplotlib Figure) items for an HTML report, in reading order."""
    sections: List[Tuple[str, Any]] = [
        ("Models", result.accuracy),
        ("Pairwise comparison (basis-free metrics)", result.pairwise),
    ]
    for title, fig in result.figures():
        sections.append((title, fig))
        if title == "Preference agreement":
            sections.append(("Preference agreement (table)", result.agreement))
        if title == "Hacking-probe profiles":
            sections.append(("Hacking-probe profiles (table)", result.probes))
    return sections


# ------------------------------------------------------------------------------------------- the math


def compare_profiles(
    profiles: Union[Sequence[ModelProfile], Mapping[str, ModelProfile]],
    *,
    tol: float = 0.1,
    n_bins: Optional[int] = None,
    grid_points: int = 21,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    ranks: Any = None,
) -> Optional[ComparisonResult]:
    """Compare precomputed model profiles measured on the same pairs (in the same order)."""
    check_level(level)
    profs = _checked_profiles(profiles)
    n = len(profs[0].gaps)
    if n_bins is None:
        n_bins = max(1, min(10, min(p.n_layers for p in profs)))
    grid = np.linspace(0.0, 1.0, grid_points)
    views = {p.name: _model_views(p, grid, tol, n_bins) for p in profs}
    probe_frames = [standardise_probes(p.probes, p.gaps, p.name) for p in profs if p.probes is not None]
    probes = pd.concat(probe_frames, ignore_index=True) if probe_frames else None

    idx = bootstrap_indices(n, n_boot, seed) if n_boot else None
    agree_rows, pair_rows = [], []
    for i in range(len(profs)):
        for j in range(i + 1, len(profs)):
            a, b = profs[i], profs[j]
            agree = _agreement(a, b, idx, level)
            agree_rows.append(agree)
            metrics = _pair_metrics(views[a.name], views[b.name], agree)
            if probes is not None and a.probes is not None and b.probes is not None:
                metrics.update(_probe_metrics(probes, a.name, b.name))
            pair_rows += [
                {"model_a": a.name, "model_b": b.name, "metric": k, "value": v} for k, v in metrics.items()
            ]

    def rows(key):
        return pd.DataFrame([r for v in views.values() for r in v[key]])

    return ComparisonResult(
        names=[p.name for p in profs],
        profiles={p.name: p for p in profs},
        accuracy=rows("accuracy"),
        agreement=pd.DataFrame(agree_rows),
        lens=rows("lens"),
        crystallization=rows("crystallization"),
        attribution=rows("attribution"),
        probes=probes,
        pairwise=pd.DataFrame(pair_rows),
        tol=tol,
        n_bins=n_bins,
        level=level,
    )


def _checked_profiles(
    profiles: Union[Sequence[ModelProfile], Mapping[str, ModelProfile]],
) -> List[ModelProfile]:
    profs = list(profiles.values()) if isinstance(profiles, Mapping) else list(profiles)
    if len(profs) < 2:
        raise ValueError("need at least two models to compare")
    names = [p.name for p in profs]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be distinct, got {names}")
    for p in profs:
        p.validate()
    n = len(profs[0].gaps)
    if any(len(p.gaps) != n for p in profs):
        raise ValueError(
            f"profiles cover different numbers of pairs {[len(p.gaps) for p in profs]}; compare models on "
            "the same pairs"
        )
    if profs[0].pair_ids and any(p.pair_ids and p.pair_ids != profs[0].pair_ids for p in profs):
        raise ValueError(
            "profiles list different pair ids: compare models on the same pairs, in the same order"
        )
    return profs


def _model_views(p: ModelProfile, grid: np.ndarray, tol: float, n_bins: int) -> Dict[str, Any]:
    """One model's rows of the accuracy, lens, crystallization and attribution tables, and its curves."""
    g, n = p.gaps, len(p.gaps)
    accuracy = [
        {
            "model": p.name,
            "accuracy": float((g > 0).mean()),
            "n_pairs": n,
            "n_layers": p.n_layers,
            "gap_sd": float(np.std(g, ddof=1)) if n > 1 else np.nan,
            "max_decomposition_error": p.max_decomposition_error,
        }
    ]
    signed = (np.sign(g)[:, None] * p.lens_gap).sum(0)
    # the whole margin as the lens reads it at the last depth (= sum |gap| up to float rounding), so the
    # curve ends at exactly 1
    mass = signed[-1] if np.abs(g).sum() > 0 else 0.0
    share = signed / mass if mass > 0 else np.full(p.lens_gap.shape[1], np.nan)
    nz = ~zero_gaps(g)  # ties and float-noise gaps have no share
    q = (
        np.nanquantile(p.lens_gap[nz] / g[nz, None], [0.25, 0.5, 0.75], axis=0)
        if nz.any()
        else np.full((3, p.lens_gap.shape[1]), np.nan)
    )
    curve = np.interp(grid, p.lens_depths, share)
    lens_rows = [
        {
            "model": p.name,
            "depth": d,
            "share": curve[j],
            "median": np.interp(d, p.lens_depths, q[1]),
            "q25": np.interp(d, p.lens_depths, q[0]),
            "q75": np.interp(d, p.lens_depths, q[2]),
        }
        for j, d in enumerate(grid)
    ]
    depths = crystallization_depths(p.lens_gap, p.lens_depths, tol)
    ids = p.pair_ids or [str(i) for i in range(n)]
    bins = depth_bins(p.component_depths, n_bins)
    signed, absolute = np.zeros(n_bins), np.zeros(n_bins)
    np.add.at(signed, bins, (np.sign(g)[:, None] * p.attribution_gap).sum(0))
    np.add.at(absolute, bins, np.abs(p.attribution_gap).sum(0))
    # the margin as attribution splits it (= the lens's `mass` up to fp32 rounding): shares sum to exactly 1
    total = signed.sum()
    signed = signed / total if mass > 0 and total > 0 else signed * np.nan
    absolute = absolute / absolute.sum() if absolute.sum() > 0 else absolute * np.nan
    attribution = [
        {
            "model": p.name,
            "bin": b,
            "depth_low": b / n_bins,
            "depth_high": (b + 1) / n_bins,
            "signed_share": signed[b],
            "abs_share": absolute[b],
        }
        for b in range(n_bins)
    ]
    return {
        "accuracy": accuracy,
        "lens": lens_rows,
        "attribution": attribution,
        "curve": curve,
        "crystallization": [{"model": p.name, "pair": i, "depth": d} for i, d in zip(ids, depths)],
        "depths": depths,
        "shares": (signed, absolute),
    }


def _agreement(a: ModelProfile, b: ModelProfile, idx: Optional[np.ndarray], level: float) -> Dict[str, Any]:
    """Preference agreement of two models (with its bootstrap interval) and the Spearman rho of their gaps."""
    from scipy.stats import spearmanr

    n = len(a.gaps)
    same = np.sign(a.gaps) == np.sign(b.gaps)
    lo, hi = percentile_ci(same[idx].mean(1), level) if idx is not None else (np.nan, np.nan)
    if n >= 3 and np.ptp(a.gaps) > 0 and np.ptp(b.gaps) > 0:
        sr = spearmanr(a.gaps, b.gaps)
        rho, rho_p = float(sr.statistic), float(sr.pvalue)
    else:
        rho, rho_p = np.nan, np.nan
    return {
        "model_a": a.name,
        "model_b": b.name,
        "agreement": float(same.mean()),
        "ci_low": float(lo),
        "ci_high": float(hi),
        "spearman": rho,
        "spearman_p": rho_p,
        "n_pairs": n,
    }


def _pair_metrics(va: Dict[str, Any], vb: Dict[str, Any], agree: Dict[str, Any]) -> Dict[str, float]:
    """The basis-free metrics of one pair of models from their views."""
    from scipy.stats import ks_2samp

    ca, cb = va["depths"][~np.isnan(va["depths"])], vb["depths"][~np.isnan(vb["depths"])]
    ks = ks_2samp(ca, cb) if len(ca) and len(cb) else None
    return {
        "agreement": agree["agreement"],
        "gap_spearman": agree["spearman"],
        "lens_curve_max_abs_diff": float(np.max(np.abs(va["curve"] - vb["curve"]))),
        "crystallization_median_diff": float(np.median(cb) - np.median(ca))
        if len(ca) and len(cb)
        else np.nan,
        "crystallization_ks": float(ks.statistic) if ks is not None else np.nan,
        "crystallization_ks_p": float(ks.pvalue) if ks is not None else np.nan,
        "attribution_abs_tv": float(0.5 * np.abs(va["shares"][1] - vb["shares"][1]).sum()),
        "attribution_signed_l1": float(np.abs(va["shares"][0] - vb["shares"][0]).sum()),
    }


def _probe_metrics(probes: pd.DataFrame, a: str, b: str) -> Dict[str, float]:
    """Verdict agreement and Spearman rho of standardised effects over the dimensions both models have."""
    from scipy.stats import spearmanr

    pa = probes[probes.model == a].set_index("dimension")
    pb = probes[probes.model == b].set_index("dimension")
    common = [d for d in pa.index if d in pb.index]
    out = {}
    if common and "verdict" in pa.columns and "verdict" in pb.columns:
        out["probe_verdict_agreement"] = float(
            (pa.loc[common, "verdict"] == pb.loc[common, "verdict"]).mean()
        )
    if len(common) >= 3:
        out["probe_effect_spearman"] = float(
            spearmanr(pa.loc[common, "effect_per_gap_sd"], pb.loc[common, "effect_per_gap_sd"]).statistic
        )
    return out


def _probe_results(models: Mapping[str, Any], probes: Any, batch: BatchSize) -> Dict[str, Any]:
    if probes is None or probes is False:
        return {}
    if probes is True:
        try:
            from reward_lens.probes.suite import run_probes
        except ImportError:
            raise ValueError(
                "the hacking probe suite (reward_lens.probes.suite) is not available in this install; "
                "pass probes={name: probe_result_or_frame} instead"
            ) from None
        return {n: batch.run(lambda bs, m=m: run_probes(m, batch_size=bs)) for n, m in models.items()}
    if isinstance(probes, Mapping):
        unknown = [k for k in probes if k not in models]
        if unknown:
            raise ValueError(f"probe results given for unknown model(s) {unknown}; models are {list(models)}")
        return dict(probes)
    raise TypeError(
        "probes must be None, True (run the probe suite on every model) or a dict name -> probe result"
    )


@checked_arguments(counts={"batch_size": 1, "n_bins": 1, "n_boot": 0, "seed": 0})
def compare_models(
    models: Mapping[str, Any],
    pairs: Any,
    *,
    probes: Any = None,
    batch_size: int = 8,
    progress: Union[bool, str] = False,
    variant: str = "normed",
    tol: float = 0.1,
    n_bins: Optional[int] = None,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    ranks: Any = None,
) -> Optional[ComparisonResult]:
    """Compare two or more reward models on the same pairs with basis-free, scale-free quantities.

    `models`: name -> HookedRewardModel (any widths, depths, architectures; each uses its own tokenizer).
    `pairs`: PreferencePairs (or TokenPairs, when the models share a vocabulary), or a pairs file.
    `probes`: None; True to run the hacking probe suite on every model; or name -> probe result / frame.
    `variant`: the lens variant for curves and crystallization ("normed", the logit-lens analogue and the
    lens instrument's default, or "frozen", additive); `tol`: crystallization tolerance (relative).
    Under torchrun (`ranks`) the lens and attribution are sharded over ranks and rank 0 compares (the
    other ranks get None).
    """
    if not isinstance(models, Mapping) or len(models) < 2:
        raise ValueError(
            "compare_models needs a dict of at least two models, e.g. {'a': model_a, 'b': model_b}"
        )
    pairs = as_pairs(pairs)
    ranks = ranks or dist.current()
    batch = BatchSize.parse(batch_size, next(iter(models.values())).cfg.device)
    probe_results = _probe_results(models, probes, batch) if ranks.is_main else {}  # probe items: on rank 0
    built = {
        name: model_profile(
            model,
            pairs,
            name=str(name),
            variant=variant,
            batch_size=batch,
            progress=f"{name}" if progress else False,
            ranks=ranks,
        )
        for name, model in models.items()
    }
    if not ranks.is_main:
        return None
    profiles = []
    for name, prof in built.items():
        if name in probe_results:
            prof.probes = probe_results[name]
        profiles.append(prof)
    return compare_profiles(profiles, tol=tol, n_bins=n_bins, n_boot=n_boot, seed=seed, level=level)
