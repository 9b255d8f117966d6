"""Basis-free profiles of one reward model on preference pairs (`ModelProfile`), the input of
`reward_lens.app.compare`: its gaps, the lens of the gap by fractional depth, the attribution of the gap by
component depth, and standardised probe effects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Union

import numpy as np
import pandas as pd

from reward_lens import distributed as dist
from reward_lens.data.pairs import as_pairs
from reward_lens.instruments import AttributionSpec, LensSpec
from reward_lens.plotting import figure_axes, finish
from reward_lens.stats import crystallization_depth, zero_gaps

# ------------------------------------------------------------------------------------------- profiles


@dataclass
class ModelProfile:
    """The basis-free measurements of one model on a list of pairs (plain arrays)."""

    name: str
    gaps: np.ndarray  # [n] r(chosen) − r(rejected), the model's own output
    lens_gap: np.ndarray  # [n, S] lens of the gap at each site (embed, after block 0, ..., after block L−1)
    lens_depths: np.ndarray  # [S] fractional depths of the sites (0, 1/L, ..., 1)
    attribution_gap: np.ndarray  # [n, C] exact attribution of the gap to each component
    components: List[str]  # embed, attn_L0, mlp_L0, ...
    component_depths: np.ndarray  # [C]
    pair_ids: List[str] = field(default_factory=list)
    probes: Optional[pd.DataFrame] = None  # per dimension: effect (+ ci_low, ci_high, verdict, cohens_d)
    max_decomposition_error: float = 0.0  # max |Σ attributions + bias − reward| / max |reward|

    @property
    def n_layers(self) -> int:
        return len(self.lens_depths) - 1

    def to_frame(self) -> pd.DataFrame:
        """One row per pair: model, pair, gap (the model's r(chosen) − r(rejected))."""
        ids = self.pair_ids or [str(i) for i in range(len(self.gaps))]
        return pd.DataFrame({"model": self.name, "pair": ids, "gap": np.asarray(self.gaps, dtype=np.float64)})

    def summary(self) -> pd.DataFrame:
        """One row: model, n_pairs, n_layers, accuracy, mean gap, median crystallization depth."""
        depth = crystallization_depths(self.lens_gap, self.lens_depths)
        return pd.DataFrame(
            [
                {
                    "model": self.name,
                    "n_pairs": len(self.gaps),
                    "n_layers": self.n_layers,
                    "accuracy": float((np.asarray(self.gaps) > 0).mean()),
                    "mean_gap": float(np.mean(self.gaps)),
                    "crystallization_depth_median": float(np.nanmedian(depth))
                    if np.isfinite(depth).any()
                    else np.nan,
                    "max_decomposition_error": self.max_decomposition_error,
                }
            ]
        )

    def plot(self, ax=None):
        """The lens of the gap over fractional depth as a share of the final gap: median and quartiles."""
        g = np.asarray(self.gaps)
        nz = ~zero_gaps(g)  # ties and float-noise gaps have no share
        per_pair = self.lens_gap[nz] / g[nz, None]
        created = ax is None
        fig, ax = figure_axes(ax, (6.0, 3.6))
        if nz.any():
            q25, q50, q75 = np.nanquantile(per_pair, [0.25, 0.5, 0.75], axis=0)
            ax.fill_between(self.lens_depths, q25, q75, alpha=0.2, lw=0)
            ax.plot(self.lens_depths, q50, marker="o", label="median over pairs")
        ax.axhline(1.0, c="0.5", lw=0.6)
        ax.axhline(0.0, c="0.5", lw=0.6)
        ax.set_xlabel("fractional depth")
        ax.set_ylabel("lens of the gap / final gap")
        ax.set_title(f"{self.name}: reward lens of the gap over {len(g)} pair(s)", fontsize=9)
        return finish(fig, created)

    def validate(self) -> None:
        n = len(self.gaps)
        if n == 0:
            raise ValueError(f"profile {self.name!r} has no pairs")
        if self.lens_gap.shape[0] != n or self.attribution_gap.shape[0] != n:
            raise ValueError(
                f"profile {self.name!r}: gaps, lens and attribution disagree on the number of pairs"
            )
        if self.lens_gap.shape[1] != len(self.lens_depths) or self.attribution_gap.shape[1] != len(
            self.components
        ):
            raise ValueError(
                f"profile {self.name!r}: lens/attribution widths do not match their depth/component lists"
            )
        if len(self.component_depths) != len(self.components):
            raise ValueError(
                f"profile {self.name!r}: {len(self.components)} components but "
                f"{len(self.component_depths)} depths"
            )


def component_depths(components: Sequence[str], layers: Sequence[int], n_layers: int) -> np.ndarray:
    """Fractional depth of each attribution component: embed 0, attn_L{l} (l + ½)/L, mlp_L{l} (l + 1)/L."""
    out = []
    for name, layer in zip(components, layers):
        if layer < 0:
            out.append(0.0)
        elif str(name).startswith("attn"):
            out.append((layer + 0.5) / n_layers)
        else:
            out.append((layer + 1.0) / n_layers)
    return np.array(out)


def profile_from_results(
    name: str, lens_result: Any, attribution_result: Any, *, variant: str = "normed", probes: Any = None
) -> ModelProfile:
    """A ModelProfile from the instruments' results on the same pairs: `reward_lens.lens` (its `variant`
    lens of the gap) and `reward_lens.attribute` (component terms of the gap)."""

    def arr(t):
        return t.detach().double().cpu().numpy() if hasattr(t, "detach") else np.asarray(t, dtype=np.float64)

    if list(lens_result.pair_ids) != list(attribution_result.pair_ids):
        raise ValueError(f"{name!r}: the lens and attribution results cover different pairs")
    n_layers = max(attribution_result.layers) + 1
    gaps = arr(lens_result.reward_chosen) - arr(lens_result.reward_rejected)
    keep = [
        j for j, site in enumerate(lens_result.sites) if not str(site).startswith("resid_mid")
    ]  # block outputs only
    return ModelProfile(
        name=name,
        gaps=gaps,
        lens_gap=arr(lens_result.get(variant, "gap"))[:, keep],
        lens_depths=np.asarray(lens_result.depths, dtype=np.float64)[keep],
        attribution_gap=arr(attribution_result.gap),
        components=list(attribution_result.components),
        component_depths=component_depths(attribution_result.components, attribution_result.layers, n_layers),
        pair_ids=[str(i) for i in lens_result.pair_ids],
        probes=probes,
        max_decomposition_error=float(attribution_result.max_relative_error()),
    )


def model_profile(
    model,
    pairs: Any,
    *,
    name: str = "model",
    variant: str = "normed",
    batch_size: Any = 8,
    progress: Union[bool, str] = False,
    ranks: Any = None,
) -> Optional[ModelProfile]:
    """Run the reward lens and the exact attribution (`reward_lens.instruments`) of `model` on `pairs`
    and keep the basis-free parts: gaps, the lens of the gap by depth, the attribution of the gap.
    Under torchrun (`ranks`, `reward_lens.distributed`) the pairs are sharded; rank 0 gets the profile,
    the other ranks None."""
    out = dist.run(
        model,
        as_pairs(pairs),
        [LensSpec(), AttributionSpec(heads=False)],
        ranks=ranks,
        batch_size=batch_size,
        progress=progress,
    )  # one clean pass per side serves both
    return (
        None if out is None else profile_from_results(name, out["lens"], out["attribution"], variant=variant)
    )


def crystallization_depths(lens_gap: np.ndarray, depths: np.ndarray, tol: float = 0.1) -> np.ndarray:
    """Per pair: the first fractional depth from which the lens of the gap has the final sign and stays
    within tol·|final| of the final value; NaN for a zero gap (`reward_lens.stats.crystallization_depth`)."""
    return crystallization_depth(lens_gap, depths, rtol=tol)


def depth_bins(depths: np.ndarray, n_bins: int) -> np.ndarray:
    """Right-closed bins (k/n, (k+1)/n], depth 0 in the first."""
    return np.clip(np.ceil(np.asarray(depths) * n_bins - 1e-9).astype(int) - 1, 0, n_bins - 1)


def standardise_probes(frame: Any, gaps: np.ndarray, model: str) -> pd.DataFrame:
    if hasattr(frame, "to_frame") and not isinstance(frame, pd.DataFrame):
        frame = frame.to_frame()
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(
            f"probe results for {model!r} must be a probe-suite result or a frame, got {type(frame).__name__}"
        )
    eff = next((c for c in ("effect", "mean_delta", "delta") if c in frame.columns), None)
    if "dimension" not in frame.columns or eff is None:
        raise ValueError(
            f"probe frame of {model!r} needs columns 'dimension' and 'effect'; got {list(frame.columns)}"
        )
    keep = [
        c
        for c in ("dimension", eff, "ci_low", "ci_high", "cohens_d", "p_value", "verdict")
        if c in frame.columns
    ]
    out = frame[keep].rename(columns={eff: "effect"}).copy()
    sd = float(np.std(gaps, ddof=1)) if len(gaps) > 1 else np.nan
    out["effect_per_gap_sd"] = out["effect"] / sd if sd and sd > 0 else np.nan
    out.insert(0, "model", model)
    return out
