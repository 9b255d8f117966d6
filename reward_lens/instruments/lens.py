"""The reward lens: the reward read from the intermediate residual stream at the readout, layer by layer.

Two variants, both reading along the reward direction w (and adding the head's bias b):

    "normed"  w . h_l / s(h_l) + b     the final norm recomputed on the intermediate residual h_l (the
                                       logit-lens analogue: what the head would say if the model stopped here)
    "frozen"  w . h_l / s_final + b    the final norm's scale frozen at its real value at the readout;
    additive
                                       (consecutive differences are exactly the direct attributions of the
                                       components in between) and ends exactly at the reward

Sites, named as every instrument names residuals (`reward_lens.instruments.sites`): "resid_L{l}" the
residual entering block l (resid_L0: the embedding; resid_L{n_layers}: the final residual) and, with
`include_mid=True`, "resid_mid_L{l}" (after block l's attention). Depth: resid_L{l} l/n_layers,
resid_mid_L{l} (l + 0.5)/n_layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from reward_lens.core.directions import reward_from_final_resid
from reward_lens.core.pipeline import Reads, Shared, Spec, run_spec
from reward_lens.instruments.sites import resid_mid_name, resid_name
from reward_lens.model.hooks import act_name
from reward_lens.model.validation import check_model, checked_arguments
from reward_lens.plotting import figure_axes, finish
from reward_lens.results import PairRewards, to_numpy
from reward_lens.stats import crystallization_depth, reward_scale

VARIANTS = ("normed", "frozen")


@dataclass
class LensResult(PairRewards):
    """`values[(variant, side)]` is [n_pairs, n_sites] (side "chosen" or "rejected"); `sites`, `layers`
    (-1 for resid_L0, the embedding) and `depths` describe the columns; `reward_*` [n_pairs] the model's
    rewards."""

    pair_ids: List[str]
    sites: List[str]
    layers: List[int]
    depths: List[float]
    values: dict
    reward_chosen: Float[torch.Tensor, " pair"]
    reward_rejected: Float[torch.Tensor, " pair"]

    def get(self, variant: str = "normed", quantity: str = "gap") -> torch.Tensor:
        """[n_pairs, n_sites] of quantity "chosen", "rejected" or "gap" in `variant`."""
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if quantity == "gap":
            return self.values[(variant, "chosen")] - self.values[(variant, "rejected")]
        if quantity not in ("chosen", "rejected"):
            raise ValueError(f"quantity must be 'chosen', 'rejected' or 'gap', got {quantity!r}")
        return self.values[(variant, quantity)]

    def crystallization_depth(
        self, variant: str = "normed", rtol: float = 0.1, atol: float = 0.0
    ) -> torch.Tensor:
        """Per pair, the first depth from which the gap stays within `rtol * |final gap| + atol` of the
        final gap and has the final gap's sign at every later site ([n_pairs] float64; NaN when the final
        gap is zero up to float noise, `reward_lens.stats.zero_gaps`). Defaults: the normed lens, 10% relative
        tolerance (`reward_lens.stats.crystallization_depth`)."""
        scale = reward_scale(self.reward_chosen, self.reward_rejected)
        gap = to_numpy(self.get(variant, "gap").double())
        depth = crystallization_depth(gap, self.depths, rtol, atol, scale=scale)
        return torch.from_numpy(depth)

    def to_frame(self) -> pd.DataFrame:
        """One row per (pair, site, variant): pair, site, layer, depth, variant, chosen, rejected, gap."""
        n, S = len(self.pair_ids), len(self.sites)
        frames = []
        for variant in VARIANTS:
            c, r = (
                to_numpy(self.get(variant, "chosen")).ravel(),
                to_numpy(self.get(variant, "rejected")).ravel(),
            )
            frames.append(
                pd.DataFrame(
                    {
                        "pair": np.repeat(self.pair_ids, S),
                        "site": self.sites * n,
                        "layer": self.layers * n,
                        "depth": self.depths * n,
                        "variant": variant,
                        "chosen": c,
                        "rejected": r,
                        "gap": c - r,
                    }
                )
            )
        return pd.concat(frames, ignore_index=True)

    def summary(self) -> pd.DataFrame:
        """One row per variant: n_pairs, pair accuracy, mean reward gap, crystallization depth (mean,
        median)."""
        rows = []
        for variant in VARIANTS:
            d = self.crystallization_depth(variant).numpy()
            finite = d[np.isfinite(d)]
            rows.append(
                {
                    "variant": variant,
                    "n_pairs": len(self.pair_ids),
                    "pair_accuracy": float((self.reward_gap > 0).float().mean()),
                    "mean_reward_gap": float(self.reward_gap.mean()),
                    "crystallization_depth_mean": float(finite.mean()) if len(finite) else np.nan,
                    "crystallization_depth_median": float(np.median(finite)) if len(finite) else np.nan,
                }
            )
        return pd.DataFrame(rows)

    def plot(self, quantity: str = "gap", band: tuple = (0.25, 0.75), ax=None):
        """Median curve over pairs of each variant against depth, with an inter-quantile band."""
        created = ax is None
        fig, ax = figure_axes(ax, (6.5, 3.8))
        x = np.asarray(self.depths)
        for variant, color in zip(VARIANTS, ("tab:blue", "tab:orange")):
            v = to_numpy(self.get(variant, quantity))
            ax.plot(x, np.median(v, 0), color=color, label=f"{variant} (median)")
            if len(v) > 1:
                lo, hi = np.quantile(v, band[0], 0), np.quantile(v, band[1], 0)
                ax.fill_between(
                    x, lo, hi, color=color, alpha=0.2, label=f"{variant} {band[0]:.0%}-{band[1]:.0%}"
                )
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xlabel("fractional depth")
        ax.set_ylabel(f"reward {quantity} read at the readout")
        ax.set_title(f"Reward lens over {len(self.pair_ids)} pair(s)")
        ax.legend(fontsize=8)
        return finish(fig, created)


class LensSpec(Spec):
    """The reward lens as a pipeline instrument (`reward_lens.core.pipeline`): reads the residual at the
    readout after every block (and mid-block with `include_mid`) and the final norm's scale."""

    name = "lens"

    def __init__(self, include_mid: bool = False):
        self.include_mid = include_mid

    def setup(self, model, pairs) -> None:
        L = model.cfg.n_layers
        self.hooks, self.sites, self.layers, self.depths = (
            [act_name("resid_pre", 0)],
            [resid_name(0)],
            [-1],
            [0.0],
        )
        for l in range(L):
            if self.include_mid:
                self.hooks.append(act_name("resid_mid", l))
                self.sites.append(resid_mid_name(l))
                self.layers.append(l)
                self.depths.append((l + 0.5) / L)
            self.hooks.append(act_name("resid_post", l))
            self.sites.append(resid_name(l + 1))
            self.layers.append(l)
            self.depths.append((l + 1) / L)

    def reads(self, model, batch) -> Reads:
        return Reads.both(readout=self.hooks + ["ln_final.hook_scale"])

    def step(self, model, shared: Shared) -> LensResult:
        values, rewards = {}, {}
        for side in ("chosen", "rejected"):
            cap = shared.caps[side]
            direction, bias = shared.direction(model, side)
            resid = torch.stack([cap.at_readout[h] for h in self.hooks], 1).float()  # [B, S, d]
            scale = cap.at_readout["ln_final.hook_scale"].float()[:, None]  # [B, 1, 1]
            normed = reward_from_final_resid(model, resid, direction[:, None], bias[:, None])
            values[("normed", side)] = normed
            values[("frozen", side)] = (resid / scale * direction[:, None]).sum(-1) + bias[:, None]
            rewards[side] = cap.rewards.float()
        return LensResult(
            pair_ids=shared.pair_ids,
            sites=self.sites,
            layers=self.layers,
            depths=self.depths,
            values={(v, s): values[(v, s)] for v in VARIANTS for s in ("chosen", "rejected")},
            reward_chosen=rewards["chosen"],
            reward_rejected=rewards["rejected"],
        )


@checked_arguments(counts={"batch_size": 1}, flags=("include_mid",))
def lens(
    model,
    pairs,
    *,
    include_mid: bool = False,
    batch_size: int = 8,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = True,
) -> LensResult:
    """The reward lens of each pair's chosen and rejected response in both variants (module docstring)."""
    check_model(model, "lens")
    return run_spec(
        model,
        pairs,
        LensSpec(include_mid),
        batch_size=batch_size,
        padding_side=padding_side,
        progress=progress and "lens",
    )
