"""The faithfulness gap: does observational attribution predict causal patching effects?

Per pair, the Spearman rank correlation over components between attribution magnitude and patching
effect magnitude; the mean over pairs and the pooled correlation (all pairs' components together), each
with a bootstrap confidence interval over pairs. The paper's headline (mean rho = -0.256 on
Skywork-Reward-Llama-3.1-8B-v0.2, -0.027 on ArmoRM over RewardBench pairs) is one call:

    faithfulness(model, load_pairs("rewardbench.jsonl"))

which runs `attribute` (exact direct attribution of the gap, final norm included) and `patch`
(noising at the readout, component level: embed, attn_L{l}, mlp_L{l}) and compares them. With results
already computed: `faithfulness(attribute(model, pairs), patch(model, pairs))`. An `AtPResult` can
stand in for the attribution (how well does attribution patching rank the real effects?).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import pandas as pd
import torch

from reward_lens.instruments.attribution import AttributionResult, attribute
from reward_lens.instruments.patching.atp import AtPResult
from reward_lens.instruments.patching.contrastive import PatchResult, patch
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import finish, panels
from reward_lens.results import to_numpy
from reward_lens.stats import bootstrap_indices, percentile_ci, spearman, spearman_rows


@dataclass
class FaithfulnessResult:
    """`attribution`/`effect` [n_pairs, n_components] as compared (signed; magnitudes are ranked when
    `absolute`). `per_pair_rho` [n_pairs]; `mean_rho`/`pooled_rho` with `*_ci` (low, high)."""

    pair_ids: List[str]
    components: List[str]
    attribution: torch.Tensor
    effect: torch.Tensor
    per_pair_rho: torch.Tensor
    mean_rho: float
    mean_rho_ci: Tuple[float, float]
    pooled_rho: float
    pooled_rho_ci: Tuple[float, float]
    settings: dict = field(default_factory=dict)

    def summary(self) -> pd.DataFrame:
        """One row: n_pairs, mean_rho (+ CI), pooled_rho (+ CI), and the settings used."""
        return pd.DataFrame(
            [
                {
                    "n_pairs": len(self.pair_ids),
                    "n_components": len(self.components),
                    "mean_rho": self.mean_rho,
                    "mean_rho_low": self.mean_rho_ci[0],
                    "mean_rho_high": self.mean_rho_ci[1],
                    "pooled_rho": self.pooled_rho,
                    "pooled_rho_low": self.pooled_rho_ci[0],
                    "pooled_rho_high": self.pooled_rho_ci[1],
                    **self.settings,
                }
            ]
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per (pair, component): attribution, effect, and the pair's rho."""
        n, C = self.attribution.shape
        return pd.DataFrame(
            {
                "pair": np.repeat(self.pair_ids, C),
                "component": self.components * n,
                "attribution": to_numpy(self.attribution).ravel(),
                "effect": to_numpy(self.effect).ravel(),
                "pair_rho": np.repeat(to_numpy(self.per_pair_rho), C),
            }
        )

    def plot(self, ax=None):
        """Left: |attribution| vs |effect| over all pairs and components, late layers darker. Right: the
        per-pair rho distribution with the mean and its CI. `ax`: two Axes (or one, split in two)."""
        created = ax is None
        fig, (ax1, ax2) = panels(ax, 2, (10, 4))
        a, e = to_numpy(self.attribution), to_numpy(self.effect)
        if self.settings.get("absolute", True):
            a, e = np.abs(a), np.abs(e)
        depth = np.array([_depth(c) for c in self.components], dtype=float)
        colors = np.broadcast_to(depth / max(depth.max(), 1), a.shape)
        sc = ax1.scatter(a.ravel(), e.ravel(), c=colors.ravel(), cmap="viridis", s=8, alpha=0.6)
        fig.colorbar(sc, ax=ax1, label="relative depth")
        ax1.set_xlabel("|attribution|" if self.settings.get("absolute", True) else "attribution")
        ax1.set_ylabel("|patching effect|" if self.settings.get("absolute", True) else "patching effect")
        ax1.set_title(f"pooled rho = {self.pooled_rho:.3f}")
        rho = to_numpy(self.per_pair_rho)
        ax2.hist(rho[np.isfinite(rho)], bins=min(30, max(5, len(rho) // 3)), color="tab:gray")
        ax2.axvline(self.mean_rho, color="tab:red", label=f"mean {self.mean_rho:.3f}")
        ax2.axvspan(*self.mean_rho_ci, color="tab:red", alpha=0.2, label="CI")
        ax2.set_xlabel("per-pair Spearman rho")
        ax2.legend(fontsize=8)
        return finish(fig, created)


def _depth(component: str) -> int:
    if component == "embed":
        return 0
    digits = "".join(ch for ch in component.split("_L")[-1] if ch.isdigit())
    return int(digits) + 1 if digits else 0


def _tie_groups(x: np.ndarray):
    """(sort order, each sorted value's tie-group id, the groups' first sorted positions) of a 1-d x."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    starts = np.ones(len(xs), dtype=bool)
    starts[1:] = xs[1:] != xs[:-1]
    return order, np.cumsum(starts) - 1, np.flatnonzero(starts)


def _weighted_ranks(groups, weights: np.ndarray) -> np.ndarray:
    """[k, N] average ranks of the N values within each of k multisets, value j taken weights[:, j]
    times: the ranks of the pooled vector that repeats each value by its weight (ties share their mean)."""
    order, gid, starts = groups
    w = weights[:, order]
    size = np.add.reduceat(w, starts, axis=1)  # [k, groups]: copies per tie group
    before = np.cumsum(size, axis=1) - size
    out = np.empty_like(w)
    out[:, order] = (before + (size + 1) / 2)[:, gid]
    return out


def pooled_spearman(a: np.ndarray, e: np.ndarray, idx: np.ndarray, chunk: int = 100) -> np.ndarray:
    """`spearman(a[i], e[i])` for each row i of `idx` [n_boot, n] (the pooled rho of each resample of
    pairs), without building the resamples: a resample repeats pair p's values as often as it draws p, so
    its ranks are weighted ranks over one sort of all values, and its rho the weighted Pearson r of them
    (equal to the per-resample call to 1e-12; tested). `chunk` resamples at a time."""
    n = a.shape[0]
    a, e = a.reshape(n, -1).astype(np.float64), e.reshape(n, -1).astype(np.float64)
    per_pair = a.shape[1]
    has_nan = np.isnan(a).any(1) | np.isnan(e).any(1)  # a resample holding one ranks as NaN (scipy's rule)
    ga, ge = _tie_groups(np.nan_to_num(a.ravel())), _tie_groups(np.nan_to_num(e.ravel()))
    out = []
    for start in range(0, len(idx), chunk):
        rows = idx[start : start + chunk]
        draws = np.zeros((len(rows), n))
        np.add.at(draws, (np.arange(len(rows))[:, None], rows), 1.0)
        w = np.repeat(draws, per_pair, axis=1)
        ra, re = _weighted_ranks(ga, w), _weighted_ranks(ge, w)
        total = w.sum(1, keepdims=True)
        ca = ra - (w * ra).sum(1, keepdims=True) / total
        ce = re - (w * re).sum(1, keepdims=True) / total
        va, ve = (w * ca * ca).sum(1), (w * ce * ce).sum(1)
        ok = (va > 1e-9) & (ve > 1e-9)  # non-constant ranks have a weighted variance >= 1/2
        with np.errstate(invalid="ignore", divide="ignore"):
            rho = np.where(ok, (w * ca * ce).sum(1) / np.sqrt(np.where(ok, va * ve, 1.0)), np.nan)
        rho[(draws[:, has_nan] > 0).any(1)] = np.nan
        out.append(rho)
    return np.concatenate(out) if out else np.zeros(0)


def _bootstrap(per_pair: np.ndarray, a: np.ndarray, e: np.ndarray, n_boot: int, ci: float, seed: int):
    """Percentile intervals of the mean per-pair rho and of the pooled rho, pairs resampled together."""
    if len(per_pair) < 2:  # resampling one pair gives a zero-width interval: the CI is not available (NaN)
        return (np.nan, np.nan), (np.nan, np.nan)
    idx = bootstrap_indices(len(per_pair), n_boot, seed)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a resample of only constant pairs has no rho
        means = np.nanmean(per_pair[idx], axis=1)
    pooled = pooled_spearman(a, e, idx)
    return tuple(tuple(float(v) for v in percentile_ci(x, ci)) for x in (means, pooled))


@checked_arguments(counts={"n_boot": 1, "seed": 0}, flags=("absolute",))
def faithfulness(
    attribution,
    patching=None,
    *,
    quantity: str = "gap",
    mode: str = "noising",
    target: Optional[str] = None,
    absolute: bool = True,
    n_boot: int = 1000,
    ci: float = 0.95,
    seed: int = 0,
    **run_kwargs,
) -> FaithfulnessResult:
    """Spearman rho between attribution and patching effect, per pair and pooled, with bootstrap CIs.

    `faithfulness(attribution_result, patch_result)` compares results; `faithfulness(model, pairs)` runs
    `attribute(model, pairs)` and `patch(model, pairs, mode=mode)` first (`run_kwargs`, e.g. batch_size,
    go to both). quantity: which attribution ("gap", "chosen", "rejected"); mode/target: which patching
    effect; absolute: rank magnitudes (the paper's comparison) rather than signed values.
    """
    if not isinstance(attribution, (AttributionResult, AtPResult, PatchResult)) and hasattr(
        attribution, "reward_head"
    ):
        model, pairs = attribution, patching
        if pairs is None:
            raise ValueError("faithfulness(model, pairs): give the pairs to run attribution and patching on")
        attribution = attribute(model, pairs, heads=False, **run_kwargs)
        patching = patch(model, pairs, mode=mode, level="component", **run_kwargs)
    if not isinstance(patching, PatchResult):
        raise TypeError(
            "faithfulness needs a PatchResult (from patch) as its second argument, or (model, pairs)"
        )
    if isinstance(attribution, AttributionResult):
        a_values, a_names = attribution.get(quantity), attribution.components
    elif isinstance(attribution, AtPResult):
        a_values, a_names = attribution.effect(mode, target), attribution.components
    else:
        raise TypeError(
            f"cannot compare a {type(attribution).__name__}; pass an AttributionResult or AtPResult"
        )
    if list(attribution.pair_ids) != list(patching.pair_ids):
        raise ValueError(
            "attribution and patching cover different pairs; run both on the same pairs in the same order"
        )
    p_names = patching.components
    common = [c for c in a_names if c in p_names]
    if len(common) < 3:
        raise ValueError(
            f"only {len(common)} component(s) in common between attribution and patching; patch at "
            "level='component'"
        )
    a = a_values[:, [a_names.index(c) for c in common]].double()
    e = patching.effect(mode, target)[:, [p_names.index(c) for c in common]].double()
    xa, xe = to_numpy(a).astype(np.float64), to_numpy(e).astype(np.float64)
    if absolute:
        xa, xe = np.abs(xa), np.abs(xe)
    per_pair = spearman_rows(xa, xe)
    mean_ci, pooled_ci = _bootstrap(per_pair, xa, xe, n_boot, ci, seed)
    return FaithfulnessResult(
        pair_ids=list(patching.pair_ids),
        components=common,
        attribution=a.float(),
        effect=e.float(),
        per_pair_rho=torch.from_numpy(per_pair).float(),
        mean_rho=float(np.nanmean(per_pair)) if np.isfinite(per_pair).any() else float("nan"),
        mean_rho_ci=mean_ci,
        pooled_rho=spearman(xa, xe),
        pooled_rho_ci=pooled_ci,
        settings={
            "quantity": quantity if isinstance(attribution, AttributionResult) else "atp",
            "mode": mode,
            "absolute": absolute,
            "n_boot": n_boot,
            "ci": ci,
        },
    )
