"""Readout-aligned contrastive activation patching, with a KV-cache fast path.

Modes (target run <- value patched in):
    noising    chosen   <- rejected's activation      (how much of the preference the site carries)
    denoising  rejected <- chosen's activation        (how much of it the site alone restores)
    zero       chosen and rejected <- 0
    mean       chosen and rejected <- the mean activation over the pairs given (both responses)
Levels: "component" (embed, attn_L{l}, mlp_L{l}), "head" (L{l}H{h}, the head's hook_z), "residual"
(resid_L{l}: the residual entering block l; resid_L{n_layers}: the final residual).
Positions: chosen and rejected differ in length, so by default the source's readout activation is
patched onto the target's readout ("readout"); "prompt" patches the shared prompt tokens (the longest
common prefix, position k onto position k; under causal attention the two runs agree there, so
contrastive prompt patches are exactly no-ops and the option matters for zero/mean ablation); "all"
patches every position and needs equal lengths for the contrastive modes.
Effects: `effect` = patched reward - the target's clean reward; `normalized_effect` = effect / clean gap
(chosen - rejected): noising -1 erases the preference, denoising +1 restores all of it.

Fast path (method="fast", the default). A readout-position patch at layer l changes the readout token
from l on and, under causal attention, nothing before it; positions after the readout (right padding, a
trailing EOS when pad = EOS) may change but the reward never reads them, so the readout need not be the
last attended token (a gated head's gate position must precede it). The target's post-RoPE keys and
values are cached in its one clean run; every patch of a sweep is then one row of a batch of single-token
queries recomputed through layers l..L-1 by the blocks' own readout step, attending to the cached keys
of the other positions plus its own fresh key. A sweep costs about one forward per response.
Multi-position patches start the forward at the patched layer (`start_at_layer`) from the cached
residual. method="naive" runs one full `run_with_hooks` forward per patch (the reference).

The package: `spec` (modes, options), `positions` (where patches go, what is written), `engines`
(readout / layer / naive engines, `patch_batch`), this module (`patch`, `PatchResult`, `site_means`),
`atp` (attribution patching).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from reward_lens.core.pipeline import Reads, Shared, Spec, run_spec
from reward_lens.instruments.patching.engines import (  # noqa: F401
    clean_reads,
    has_readout_fast_path,
    patch_batch,
    sweep_memo,
)
from reward_lens.instruments.patching.positions import select
from reward_lens.instruments.patching.spec import METHODS, MODES, POSITIONS, TARGETS, check_options  # noqa: F401
from reward_lens.instruments.sites import Site, site_rows, sites_for
from reward_lens.model.validation import check_model, checked_arguments, safe_ratio
from reward_lens.plotting import diverging_heatmap, finish, panels
from reward_lens.results import CleanPairRewards, to_numpy
from reward_lens.stats import reward_scale


class GapNormalized(CleanPairRewards):
    """Patching results whose effects [n_pairs, ...] are also given per clean gap (`per_gap`)."""

    def per_gap(self, effect: Any) -> Any:
        """`effect` [n_pairs, ...] (a tensor, or a numpy array) divided by each pair's clean gap; a tie:
        NaN (`safe_ratio` at the clean rewards' scale)."""
        gap = self.clean_gap if isinstance(effect, torch.Tensor) else to_numpy(self.clean_gap)
        gap = gap.reshape(-1, *([1] * (effect.ndim - 1)))
        return safe_ratio(effect, gap, reward_scale(self.clean_chosen, self.clean_rejected))


class SiteEffects(GapNormalized):
    """Per-(pair, site) patching results (`pair_ids`, `sites`, `positions`): their component names and
    frames."""

    pair_ids: List[str]
    sites: List[Site]
    positions: str

    @property
    def components(self) -> List[str]:
        return [s.name for s in self.sites]

    def site_frame(self, mode: str, target: str, values: Dict[str, Any]) -> pd.DataFrame:
        """One (mode, target)'s rows, one per (pair, site) in `ravel()` order: the identifying columns
        (`site_rows`, mode, target, position), then `values`."""
        return pd.DataFrame(
            {
                **site_rows(self.pair_ids, self.sites),
                "mode": mode,
                "target": target,
                "position": self.positions,
                **values,
            }
        )

    def site_summary(self, mode: str, target: str, values: Dict[str, Any]) -> pd.DataFrame:
        """One (mode, target)'s summary rows, one per site: mode, target, component, layer, then `values`."""
        return pd.DataFrame(
            {
                "mode": mode,
                "target": target,
                "component": self.components,
                "layer": [s.layer for s in self.sites],
                **values,
            }
        )


@dataclass
class PatchResult(SiteEffects):
    """Patched rewards per pair and site. `patched[(mode, target)]` is [n_pairs, n_sites] (target:
    "chosen" or "rejected"); `clean_chosen`/`clean_rejected` [n_pairs] the clean rewards (also
    `reward_chosen`/`reward_rejected`, with `reward_gap`, as every result)."""

    pair_ids: List[str]
    sites: List[Site]
    positions: str
    method: str
    clean_chosen: Float[torch.Tensor, " pair"]
    clean_rejected: Float[torch.Tensor, " pair"]
    patched: Dict[Tuple[str, str], torch.Tensor] = field(default_factory=dict)

    @property
    def modes(self) -> List[str]:
        return list(dict.fromkeys(m for m, _ in self.patched))

    def _key(self, mode: str, target: Optional[str]) -> Tuple[str, str]:
        if target is None:
            target = TARGETS.get(mode, ("chosen",))[0]
        if (mode, target) not in self.patched:
            raise KeyError(f"no patches for mode={mode!r}, target={target!r}; have {sorted(self.patched)}")
        return mode, target

    def patched_reward(self, mode: str, target: Optional[str] = None) -> torch.Tensor:
        return self.patched[self._key(mode, target)]

    @checked_arguments(flags=("normalized",))
    def effect(self, mode: str, target: Optional[str] = None, normalized: bool = False) -> torch.Tensor:
        """[n_pairs, n_sites]: patched - clean reward of the target (divided by the clean gap if normalized).
        target defaults to the mode's (chosen for noising/zero/mean, rejected for denoising)."""
        mode, target = self._key(mode, target)
        clean = self.clean_chosen if target == "chosen" else self.clean_rejected
        eff = self.patched[(mode, target)] - clean[:, None]
        return self.per_gap(eff) if normalized else eff

    def to_frame(self) -> pd.DataFrame:
        """One row per (pair, site, mode, target): pair, component, layer, head, level, mode, target,
        position, clean_reward, patched_reward, effect, clean_gap, normalized_effect."""
        frames = []
        S = len(self.sites)
        gap = to_numpy(self.clean_gap)
        for (mode, target), patched in self.patched.items():
            clean = to_numpy(self.clean_chosen if target == "chosen" else self.clean_rejected)
            p = to_numpy(patched)
            eff = p - clean[:, None]
            values = {
                "clean_reward": clean.repeat(S),
                "patched_reward": p.ravel(),
                "effect": eff.ravel(),
                "clean_gap": gap.repeat(S),
                "normalized_effect": self.per_gap(eff).ravel(),
            }
            frames.append(self.site_frame(mode, target, values))
        return pd.concat(frames, ignore_index=True)

    def summary(self) -> pd.DataFrame:
        """One row per (mode, target, site): mean effect and mean normalised effect over pairs."""
        rows = []
        for mode, target in self.patched:
            eff, norm = (
                to_numpy(self.effect(mode, target)),
                to_numpy(self.effect(mode, target, normalized=True)),
            )
            values = {
                "level": [s.level for s in self.sites],
                "mean_effect": eff.mean(0),
                "mean_normalized_effect": norm.mean(0),
                "mean_abs_effect": abs(eff).mean(0),
            }
            rows.append(self.site_summary(mode, target, values))
        return pd.concat(rows, ignore_index=True)

    @checked_arguments(flags=("normalized",))
    def plot(self, mode: Optional[str] = None, normalized: bool = True, ax=None):
        """Mean effect over pairs, one panel per level: component level as an attn/mlp x layer heatmap, heads
        as a head x layer heatmap, residual as a line over layers. `ax`: one Axes per level (or one,
        split)."""
        mode = mode or self.modes[0]
        with warnings.catch_warnings():  # ties (NaN) left out; all tied: an empty (NaN) map, no warning
            warnings.simplefilter("ignore", RuntimeWarning)
            eff = np.nanmean(to_numpy(self.effect(mode, normalized=normalized)), 0)
        levels = list(dict.fromkeys(s.level for s in self.sites))
        created = ax is None
        fig, axes = panels(ax, len(levels), (5.5 * len(levels), 3.6))
        label = "normalised effect" if normalized else "effect"
        for ax, level in zip(axes, levels):
            idx = [i for i, s in enumerate(self.sites) if s.level == level]
            sites = [self.sites[i] for i in idx]
            if level == "residual":
                ax.plot([s.layer for s in sites], eff[idx], marker="o")
                ax.set_xlabel("residual entering layer")
                ax.set_ylabel(label)
            else:
                grid, layers, rows = self._site_grid(sites, eff[idx], level)
                diverging_heatmap(ax, grid, xlabels=layers, ylabels=rows, label=label)
                ax.set_xlabel("layer")
            title = f"{mode} ({level})"
            for i, s in zip(idx, sites):  # embedding terms are not on the layer grid: give them in the title
                if s.kind == "embed":
                    title += f"; {s.name}: {eff[i]:.3g}"
            ax.set_title(title)
        return finish(fig, created)

    @staticmethod
    def _site_grid(sites: List[Site], values, level: str):
        """(grid [rows, layers], layers, row labels): attn/mlp rows for components, one row per head for
        heads."""
        import numpy as np

        layers = sorted({s.layer for s in sites if s.layer >= 0})
        if level == "component":
            rows = ["attn", "mlp"]
            key = {s.name: (rows.index(s.kind), layers.index(s.layer)) for s in sites if s.kind in rows}
        else:
            heads = sorted({s.head for s in sites})
            rows = [f"H{h}" for h in heads]
            key = {s.name: (heads.index(s.head), layers.index(s.layer)) for s in sites}
        grid = np.full((len(rows), len(layers)), np.nan)
        for s, v in zip(sites, values):
            if s.name in key:
                grid[key[s.name]] = v
        return grid, layers, rows


# ---------------------------------------------------------------------------------------------------
# The instrument.


def site_hooks(model, sites: Sequence[Site]) -> List[str]:
    L = model.cfg.n_layers
    return sorted({s.hook_name(L) for s in sites})


def means_reads(model, sites: Sequence[Site], positions: str) -> Reads:
    """What the mean-ablation sums read: the sites' hooks at the readout, or whole (other positions)."""
    names = site_hooks(model, sites)
    return Reads.both(readout=names) if positions == "readout" else Reads.both(full=names)


def batch_sums(
    model, shared: Shared, sites: Sequence[Site], positions: str
) -> Tuple[Dict[str, torch.Tensor], int]:
    """(hook -> float64 sum, count) of one batch's both responses (chosen, then rejected)."""
    sums: Dict[str, torch.Tensor] = {}
    count = 0
    for side in ("chosen", "rejected"):
        cap = shared.caps[side]
        if positions == "readout":
            acts = {h: cap.at_readout[h].double().sum(0) for h in site_hooks(model, sites)}
            count += cap.tok.input_ids.shape[0]
        else:
            m = cap.tok.attention_mask.bool()
            acts = {
                h: cap.full[h][m.to(cap.full[h].device)].double().sum(0) for h in site_hooks(model, sites)
            }
            count += int(m.sum())
        for h, v in acts.items():
            sums[h] = sums.get(h, 0) + v
    return sums, count


def add_sums(pieces) -> Tuple[Dict[str, torch.Tensor], int]:
    sums: Dict[str, torch.Tensor] = {}
    count = 0
    for part_sums, part_count in pieces:
        for h, v in part_sums.items():
            sums[h] = sums[h] + v.to(sums[h].device) if h in sums else v
        count += part_count
    return sums, count


class SumsSpec(Spec):
    """Float64 sums and counts of the sites' activations over both responses of every pair (`site_sums`)."""

    name = "site_sums"

    def __init__(self, sites: Sequence[Site], positions: str = "readout"):
        self.sites, self.positions = list(sites), positions

    def reads(self, model, batch) -> Reads:
        return means_reads(model, self.sites, self.positions)

    def step(self, model, shared: Shared):
        return batch_sums(model, shared, self.sites, self.positions)

    def finish(self, model, pieces, pair_ids):
        return add_sums(pieces)


class MeansPrePass(Spec):
    """A spec whose mean-ablation values (when a mode is "mean" and none are given) are computed over all
    pairs in a pre-pass: `self.means` set by `pre_finish`."""

    modes: List[str]
    means: Optional[Dict[str, torch.Tensor]]
    sites: List[Site]
    positions: str

    given_means: Optional[Dict[str, torch.Tensor]] = None

    def needs_pre_pass(self) -> bool:
        return "mean" in self.modes and self.given_means is None

    def pre_reads(self, model, batch) -> Reads:
        return means_reads(model, self.sites, self.positions)

    def pre_step(self, model, shared: Shared):
        return batch_sums(model, shared, self.sites, self.positions)

    def pre_finish(self, model, pieces) -> None:
        sums, count = add_sums(pieces)
        self.means = means_from_sums(model, self.sites, sums, count)


class PatchSpec(MeansPrePass):
    """Contrastive patching as a pipeline instrument (the options of `patch`). Name: "patch" for the
    component level, else "patch:" + the levels joined by "+" (so two levels can be requested at once)."""

    step_late = True  # beside divergence-aware patching and the effect decomposition: one sweep serves all

    def __init__(
        self,
        mode: Union[str, Sequence[str]] = "noising",
        level: Union[str, Sequence[str]] = "component",
        positions: str = "readout",
        layers: Optional[Sequence[int]] = None,
        method: str = "fast",
        max_rows: int = 64,
        means: Optional[Dict[str, torch.Tensor]] = None,
        name: Optional[str] = None,
    ):
        self.modes = [mode] if isinstance(mode, str) else list(dict.fromkeys(mode))
        check_options(self.modes, positions, method)
        self.level, self.positions, self.layers, self.method = level, positions, layers, method
        self.max_rows, self.means, self.given_means = max_rows, means, means
        levels = [level] if isinstance(level, str) else list(level)
        self.name = name or ("patch" if levels == ["component"] else "patch:" + "+".join(levels))

    def setup(self, model, pairs) -> None:
        self.sites = sites_for(model.cfg, self.level, self.layers)
        self.means = self.given_means  # a spec used again computes its pre-pass again

    def reads(self, model, batch) -> Reads:
        reads, _ = clean_reads(model, batch, self.sites, self.modes, self.positions, self.method)
        return Reads({s: r[0] for s, r in reads.items()}, {s: r[1] for s, r in reads.items()})

    def step(self, model, shared: Shared) -> PatchResult:
        out = patch_batch(
            model,
            shared.batch,
            self.sites,
            self.modes,
            self.positions,
            self.method,
            self.means,
            shared.pair_ids,
            self.max_rows,
            caps=shared.caps,
            directions=shared.directions,
            memo=sweep_memo(shared),
        )
        return PatchResult(
            pair_ids=shared.pair_ids,
            sites=self.sites,
            positions=self.positions,
            method=self.method,
            clean_chosen=out.clean_chosen,
            clean_rejected=out.clean_rejected,
            patched=out.patched,
        )


def site_sums(
    model,
    pairs,
    sites: Sequence[Site],
    positions: str = "readout",
    *,
    batch_size: int = 8,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = False,
) -> Tuple[Dict[str, torch.Tensor], int]:
    """(hook name -> float64 sum of its activation, count) over both responses of every pair: at the
    readout (positions="readout") or over every real token. Sums of disjoint pair sets add up (ranks)."""
    return run_spec(
        model,
        pairs,
        SumsSpec(sites, positions),
        batch_size=batch_size,
        padding_side=padding_side,
        progress=progress and "means",
    )


def means_from_sums(
    model, sites: Sequence[Site], sums: Dict[str, torch.Tensor], count: int
) -> Dict[str, torch.Tensor]:
    """Site name -> mean activation (the model's dtype) from `site_sums`' sums and count."""
    L = model.cfg.n_layers
    return {
        s.name: select(s, sums[s.hook_name(L)].to(model.cfg.device) / count).to(model.cfg.dtype)
        for s in sites
    }


def site_means(
    model,
    pairs,
    sites: Sequence[Site],
    positions: str = "readout",
    *,
    batch_size: int = 8,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = False,
) -> Dict[str, torch.Tensor]:
    """Mean activation of each site over both responses of every pair: at the readout (positions=
    "readout") or over every real token (otherwise). The values mean ablation writes."""
    sums, count = site_sums(
        model, pairs, sites, positions, batch_size=batch_size, padding_side=padding_side, progress=progress
    )
    return means_from_sums(model, sites, sums, count)


@checked_arguments(counts={"batch_size": 1, "max_rows": 1})
def patch(
    model,
    pairs,
    *,
    mode: Union[str, Sequence[str]] = "noising",
    level: Union[str, Sequence[str]] = "component",
    positions: str = "readout",
    layers: Optional[Sequence[int]] = None,
    method: str = "fast",
    batch_size: int = 8,
    max_rows: int = 64,
    padding_side: Optional[str] = None,
    means: Optional[Dict[str, torch.Tensor]] = None,
    progress: Union[bool, str] = True,
) -> PatchResult:
    """Contrastive activation patching of every site of `level` (see the module docstring).

    mode/level may be lists (one sweep shares the clean runs). `layers` restricts the sweep (embed and
    the final residual are then left out). Mean ablation uses `site_means` over `pairs` unless `means`
    (site name -> vector) is given. `max_rows` bounds the batch of a multi-position forward.
    """
    check_model(model, "patch")
    spec = PatchSpec(mode, level, positions, layers, method, max_rows, means, name="patch")
    return run_spec(
        model, pairs, spec, batch_size=batch_size, padding_side=padding_side, progress=progress and "patch"
    )
