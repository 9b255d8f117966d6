r"""Misalignment cascade detector: do a reward model's failure modes travel together?

Matched design: n base items, each perturbed along every quality dimension k (length, confidence,
formatting, sycophancy, ...), so that item j has one reward effect per dimension,
E[j, k] = r(perturb_k(item_j)) − r(item_j). If the items on which the reward over-pays for length are
also those on which it over-pays for confidence, the two failure modes are coupled: an optimiser that
finds one gets the other (a *cascade*). Definitions (also in ``docs/theory.md``):

1. Correlation matrix R[k, l] = corr_j(E[j, k], E[j, l]) over items (Pearson, or Spearman on ranks).
   Items missing any dimension are dropped (the design is matched; the count is reported).
2. Confidence intervals: percentile bootstrap over items (the unit of the matched design), ``n_boot``
   resamples; a pair of dimensions is **linked** when its interval excludes 0. Two-sided p-values from
   the t distribution of r with n − 2 degrees of freedom.
3. Clusters: average-linkage hierarchical clustering (scipy) on the distance 1 − R, so that strongly
   positively correlated dimensions merge first and anti-correlated ones (distance up to 2) last; the tree
   is cut at ``distance_threshold`` (default 0.5: within a cluster the average correlation is at least
   0.5). A dimension with zero variance over items has undefined correlations and is treated as
   uncorrelated (distance 1). A **cascade** is a cluster of two or more dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import diverging_heatmap, finish, panels
from reward_lens.stats import bootstrap_indices, check_level, column_correlations, percentile_ci, ranks

_ITEM_COLS = ("item", "item_id", "base", "base_id", "id", "pair")
_VALUE_COLS = ("delta", "reward_delta", "effect", "value")


@dataclass
class CascadeResult:
    """Correlations of per-item reward effects across dimensions, their CIs, and the clusters."""

    dimensions: List[str]
    effects: pd.DataFrame  # items x dimensions (complete rows only)
    corr: np.ndarray  # [K, K]
    ci_low: np.ndarray
    ci_high: np.ndarray
    p_value: np.ndarray
    labels: np.ndarray  # [K] cluster label per dimension (1-based, scipy's fcluster)
    linkage: np.ndarray  # scipy linkage matrix
    method: str
    distance_threshold: float
    level: float
    n_items: int
    n_dropped: int
    notes: List[str] = field(default_factory=list)

    @property
    def clusters(self) -> List[List[str]]:
        """Every cluster (as dimension names), largest first."""
        groups = {}
        for d, lab in zip(self.dimensions, self.labels):
            groups.setdefault(int(lab), []).append(d)
        return sorted(groups.values(), key=lambda g: (-len(g), self.dimensions.index(g[0])))

    @property
    def cascades(self) -> List[List[str]]:
        """Clusters of two or more correlated failure modes."""
        return [c for c in self.clusters if len(c) > 1]

    @property
    def linked(self) -> np.ndarray:
        """[K, K] bool: the correlation's interval excludes 0."""
        return (self.ci_low > 0) | (self.ci_high < 0)

    def corr_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.corr, index=self.dimensions, columns=self.dimensions)

    def to_frame(self) -> pd.DataFrame:
        """One row per pair of dimensions: r, interval, p-value, linked, same cluster."""
        rows = []
        K = len(self.dimensions)
        for a in range(K):
            for b in range(a + 1, K):
                rows.append(
                    {
                        "dimension_a": self.dimensions[a],
                        "dimension_b": self.dimensions[b],
                        "r": self.corr[a, b],
                        "ci_low": self.ci_low[a, b],
                        "ci_high": self.ci_high[a, b],
                        "p_value": self.p_value[a, b],
                        "linked": bool(self.linked[a, b]),
                        "same_cluster": bool(self.labels[a] == self.labels[b]),
                        "n_items": self.n_items,
                    }
                )
        return pd.DataFrame(rows)

    def clusters_frame(self) -> pd.DataFrame:
        """dimension, cluster (0 = largest), cluster_size, mean_r within the cluster."""
        rows = []
        for c, members in enumerate(self.clusters):
            idx = [self.dimensions.index(m) for m in members]
            sub = self.corr[np.ix_(idx, idx)]
            mean_r = float(np.nanmean(sub[~np.eye(len(idx), dtype=bool)])) if len(idx) > 1 else np.nan
            rows += [
                {"dimension": m, "cluster": c, "cluster_size": len(members), "mean_r": mean_r}
                for m in members
            ]
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        """One row per cluster (largest first): its dimensions, size, mean within-cluster r, whether a
        cascade."""
        rows = []
        for c, members in enumerate(self.clusters):
            idx = [self.dimensions.index(m) for m in members]
            sub = self.corr[np.ix_(idx, idx)]
            rows.append(
                {
                    "cluster": c,
                    "dimensions": ", ".join(members),
                    "size": len(members),
                    "mean_r": float(np.nanmean(sub[~np.eye(len(idx), dtype=bool)]))
                    if len(idx) > 1
                    else np.nan,
                    "cascade": len(members) > 1,
                    "n_items": self.n_items,
                }
            )
        return pd.DataFrame(rows)

    def summary_text(self) -> str:
        """The summary as one sentence (what `summary()` returned before it became a DataFrame)."""
        found = "; ".join("{" + ", ".join(c) + "}" for c in self.cascades) or "none"
        return f"{self.n_items} matched items, {len(self.dimensions)} dimensions; cascades: {found}"

    def plot(self, ax=None):
        """Dendrogram (left) and the correlation heatmap in dendrogram order with intervals (right).
        `ax`: two Axes (or one, split in two)."""
        from scipy.cluster.hierarchy import dendrogram

        K = len(self.dimensions)
        created = ax is None
        fig, (ax0, ax1) = panels(ax, 2, (3 + 1.0 * K + 2.5, 1.5 + 0.8 * K), width_ratios=[1, 2.2])
        tree = dendrogram(
            self.linkage,
            labels=self.dimensions,
            orientation="left",
            ax=ax0,
            color_threshold=self.distance_threshold,
            above_threshold_color="0.6",
        )
        ax0.axvline(self.distance_threshold, ls="--", c="0.4", lw=0.8)
        ax0.set_xlabel("distance 1 − r")
        order = [self.dimensions.index(d) for d in tree["ivl"]][::-1]  # top-to-bottom as in the dendrogram
        R = self.corr[np.ix_(order, order)]
        names = [self.dimensions[i] for i in order]
        text = np.empty((K, K), dtype=object)
        for i in range(K):
            for j in range(K):
                a, b = order[i], order[j]
                mark = "*" if self.linked[a, b] and a != b else ""
                text[i, j] = (
                    f"{R[i, j]:.2f}{mark}"
                    if a == b
                    else f"{R[i, j]:.2f}{mark}\n[{self.ci_low[a, b]:.2f},{self.ci_high[a, b]:.2f}]"
                )
        diverging_heatmap(
            ax1,
            R,
            xlabels=names,
            ylabels=names,
            label=f"{self.method} r",
            limit=1.0,
            annotations=text,
            xrotation=45,
        )
        ax1.set_title(f"per-item reward effects, n={self.n_items} (* CI excludes 0)")
        return finish(fig, created)


def _wide_effects(
    effects: Any, dimensions: Optional[Sequence[str]], item_col, dimension_col, value_col
) -> pd.DataFrame:
    """Items x dimensions from a wide frame, a tidy frame, an array, a mapping, or a probe result."""
    if hasattr(effects, "per_item") and not isinstance(effects, pd.DataFrame):
        effects = effects.per_item
    if isinstance(effects, Mapping):
        effects = pd.DataFrame({k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in effects.items()})
    elif not isinstance(effects, pd.DataFrame):
        if isinstance(effects, torch.nn.Module):
            raise ValueError(
                "detect_cascades takes per-item reward effects, not a model: pass run_probes(model, ...)'s "
                "result, an items x dimensions frame/array, or a mapping dimension -> per-item effects"
            )
        if hasattr(effects, "detach"):
            effects = effects.detach().cpu().numpy()
        try:
            arr = np.asarray(effects, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"cannot read per-item effects from a {type(effects).__name__}; pass a probe-suite "
                "result, a frame, an items x dimensions array or a mapping dimension -> per-item effects"
            ) from None
        if arr.ndim != 2:
            raise ValueError(f"per-item effects must be 2-D [items, dimensions], got shape {arr.shape}")
        names = list(dimensions) if dimensions is not None else [f"dim_{k}" for k in range(arr.shape[1])]
        if len(names) != arr.shape[1]:
            raise ValueError(f"{len(names)} dimension names for {arr.shape[1]} columns")
        return pd.DataFrame(arr, columns=names)
    frame = effects
    dim_col = dimension_col or ("dimension" if "dimension" in frame.columns else None)
    if dim_col is not None:  # tidy: one row per (item, dimension)
        val = value_col or next((c for c in _VALUE_COLS if c in frame.columns), None)
        item = item_col or next((c for c in _ITEM_COLS if c in frame.columns), None)
        if val is None or item is None:
            raise ValueError(
                f"a tidy per-item frame needs an item column (one of {_ITEM_COLS}) and a value column "
                f"(one of {_VALUE_COLS}); found {list(frame.columns)}. Pass item_col=/value_col="
            )
        if frame.duplicated([item, dim_col]).any():
            frame = frame.groupby([item, dim_col], sort=False)[val].mean().reset_index()
        wide = frame.pivot(index=item, columns=dim_col, values=val)
        order = list(dict.fromkeys(frame[dim_col].tolist()))
        wide = wide[order]
    else:
        wide = frame.set_index(item_col) if item_col else frame
        wide = wide.select_dtypes(include="number")
    if dimensions is not None:
        missing = [d for d in dimensions if d not in wide.columns]
        if missing:
            raise ValueError(
                f"dimension(s) {missing} not among the per-item effects' columns {list(wide.columns)}"
            )
        wide = wide[list(dimensions)]
    wide.columns = [str(c) for c in wide.columns]
    return wide.astype(np.float64)


@checked_arguments(counts={"n_boot": 0, "seed": 0})
def detect_cascades(
    effects: Any,
    dimensions: Optional[Sequence[str]] = None,
    *,
    method: str = "pearson",
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    distance_threshold: float = 0.5,
    item_col: Optional[str] = None,
    dimension_col: Optional[str] = None,
    value_col: Optional[str] = None,
) -> CascadeResult:
    """Correlation matrix (with bootstrap CIs) of per-item reward effects across dimensions, and clusters.

    `effects`: items x dimensions (a wide frame, an array with `dimensions`, a mapping dimension -> [n]),
    a tidy frame (item, dimension, delta), or a probe-suite result with a `.per_item` frame.
    """
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform
    from scipy.special import (
        stdtr,  # the t distribution's CDF (scipy.stats.t.sf without importing scipy.stats)
    )

    check_level(level)
    if method not in ("pearson", "spearman"):
        raise ValueError(f"method must be 'pearson' or 'spearman', got {method!r}")
    if not 0 < distance_threshold < 2:
        raise ValueError(f"distance_threshold is a 1 − r distance in (0, 2), got {distance_threshold}")
    wide = _wide_effects(effects, dimensions, item_col, dimension_col, value_col)
    dims = list(wide.columns)
    if len(dims) < 2:
        raise ValueError(f"need per-item effects on at least 2 dimensions to correlate, got {dims}")
    complete = wide.dropna()
    if np.isinf(complete.to_numpy()).any():
        raise ValueError("per-item effects hold inf values; fix the reward computation or drop those items")
    n_dropped = len(wide) - len(complete)
    n = len(complete)
    if n < 4:
        raise ValueError(
            f"only {n} items have an effect on every dimension; a correlation needs at least 4 matched items"
        )
    X = complete.to_numpy()
    Xs = ranks(X, axis=-2) if method == "spearman" else X
    R = column_correlations(Xs)
    boot = []
    if n_boot:
        idx = bootstrap_indices(n, n_boot, seed)
        for chunk in np.array_split(np.arange(n_boot), max(1, (n_boot * n * len(dims)) // 2_000_000)):
            Xb = X[idx[chunk]]
            boot.append(column_correlations(ranks(Xb, axis=-2) if method == "spearman" else Xb))
        lo, hi = percentile_ci(np.concatenate(boot), level)
    else:
        lo = hi = np.full_like(R, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        tstat = R * np.sqrt((n - 2) / np.maximum(1e-300, 1 - R**2))
    p = 2 * stdtr(n - 2, -np.abs(tstat))  # = scipy.stats.t.sf(|t|, n - 2)
    np.fill_diagonal(p, 0.0)
    D = 1.0 - np.where(np.isnan(R), 0.0, R)
    np.fill_diagonal(D, 0.0)
    D = np.clip((D + D.T) / 2, 0.0, 2.0)
    Z = linkage(squareform(D, checks=False), method="average")
    labels = fcluster(Z, t=distance_threshold, criterion="distance")
    notes = []
    const = [d for d, s in zip(dims, X.std(0)) if s == 0]
    if const:
        notes.append(
            f"no variation over items (correlations undefined, treated as uncorrelated): {', '.join(const)}"
        )
    if n_dropped:
        notes.append(f"{n_dropped} item(s) without an effect on every dimension were dropped")
    return CascadeResult(
        dims, complete, R, lo, hi, p, labels, Z, method, distance_threshold, level, n, n_dropped, notes
    )
