"""Divergence-aware patching: how far out of distribution does each patch push the model?

A patch splices an activation into a context it never co-occurred with; when the resulting residual
state is unlike any clean one, the patching effect measures the model off its data manifold. For every
readout patch of a sweep this scores the patched residual at the readout, flags the out-of-distribution
ones and reports effects with and without them.

State scored (`state`): "site" (default) the residual right after the patched site (resid_mid of the
layer for attn/head patches, the residual leaving the block for mlp patches, the patched residual itself
for embed/resid patches), or "final" the final residual the reward head reads.
Score (`method`): "mahalanobis" (default) the Mahalanobis distance in the top `n_components` principal
axes of the clean states of the same hook at the readout, over both responses of every pair given
(eigenvalues floored at 1e-6 of the total variance); or "norm_ratio" max(r, 1/r) with r = |patched state|
/ |the target's clean state|.
Threshold: per site, the `quantile` of the scores of clean-vs-clean swaps — the same patch with the
activation taken from another pair's response of the same role (pair i <- pair i+1), i.e. swapping one
clean activation for another. A patch scoring above it is flagged. Memory: the fit keeps the clean
states, n_pairs x 2 x n_state_hooks x d_model floats (`max_reference` subsamples the pairs used).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch

from reward_lens.core.batching import PairBatch, pair_batches
from reward_lens.core.pipeline import Reads, Shared, Spec, run_spec
from reward_lens.core.readout import Capture, capture
from reward_lens.instruments.patching.contrastive import (
    PatchResult,
    add_sums,
    batch_sums,
    means_from_sums,
    means_reads,
)
from reward_lens.instruments.patching.engines import (
    clean_reads,
    patch_batch,
    readout_entries,
    readout_sweep,
    sweep_memo,
)
from reward_lens.instruments.patching.positions import patch_positions, site_values
from reward_lens.instruments.patching.spec import TARGETS, check_options
from reward_lens.instruments.sites import Site, sites_for
from reward_lens.model.hooks import act_name, final_resid_name, layer_of, resid_entering
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import finish, panels
from reward_lens.results import PairRewards, to_numpy

METHODS = ("mahalanobis", "norm_ratio")
STATES = ("site", "final")


def state_hook(site: Site, n_layers: int, state: str = "site") -> str:
    """The hook whose readout value a patch of `site` leaves changed first (state="site") or last."""
    if state == "final":
        return final_resid_name(n_layers)
    if site.kind == "embed":
        return site.hook_name(n_layers)
    if site.kind == "resid":
        return resid_entering(site.layer, n_layers)
    if site.kind in ("attn", "head"):
        return act_name("resid_mid", site.layer)
    return act_name("resid_post", site.layer)


@dataclass
class PCAMahalanobis:
    """Mahalanobis distance in the top principal axes of reference samples [n, d]."""

    mean: torch.Tensor
    axes: torch.Tensor  # [d, k]
    variances: torch.Tensor  # [k]

    @classmethod
    def fit(
        cls, X: torch.Tensor, n_components: Optional[int] = None, floor: float = 1e-6
    ) -> "PCAMahalanobis":
        X = X.double()
        n, d = X.shape
        if n < 2:
            raise ValueError(
                "the Mahalanobis fit needs at least 2 reference states; give at least 1 pair (2 responses)"
            )
        k = min(n - 1, d, n_components if n_components is not None else 16)
        mean = X.mean(0)
        _, s, Vh = torch.linalg.svd(X - mean, full_matrices=False)
        var = s**2 / (n - 1)
        total = var.sum().clamp(min=1e-300)
        return cls(mean, Vh[:k].T, var[:k].clamp(min=floor * total))

    def score(self, x: torch.Tensor) -> torch.Tensor:
        proj = (x.double() - self.mean) @ self.axes
        return (proj.pow(2) / self.variances).sum(-1).sqrt()


@dataclass
class DivergenceResult(PairRewards):
    """`scores`/`calibration_scores` [n_pairs, n_sites]; `threshold` [n_sites]; `patching` the patched
    rewards of `mode` (target `target`); `reward_chosen`/`reward_rejected` [n_pairs] its clean rewards."""

    patching: PatchResult
    mode: str
    target: str
    scores: torch.Tensor
    calibration_scores: torch.Tensor
    threshold: torch.Tensor
    settings: dict = field(default_factory=dict)

    @property
    def pair_ids(self) -> List[str]:
        return self.patching.pair_ids

    def after_merge(self) -> "DivergenceResult":
        """The threshold over every pair's clean swaps (parts of the pairs merged: recomputed)."""
        self.threshold = calibrated_threshold(self.calibration_scores, self.settings["quantile"])
        return self

    @property
    def reward_chosen(self) -> torch.Tensor:
        return self.patching.clean_chosen

    @property
    def reward_rejected(self) -> torch.Tensor:
        return self.patching.clean_rejected

    @property
    def frac_flagged(self) -> float:
        """Fraction of all patches (pairs x sites) flagged out of distribution."""
        return float(self.flagged.float().mean())

    @property
    def flagged(self) -> torch.Tensor:
        return self.scores > self.threshold[None]

    @checked_arguments(flags=("normalized", "drop_flagged"))
    def effect(self, normalized: bool = False, drop_flagged: bool = False) -> torch.Tensor:
        """[n_pairs, n_sites] patching effects; flagged patches NaN when drop_flagged."""
        eff = self.patching.effect(self.mode, self.target, normalized=normalized)
        return eff.masked_fill(self.flagged, float("nan")) if drop_flagged else eff

    @checked_arguments(flags=("normalized",))
    def summary(self, normalized: bool = False) -> pd.DataFrame:
        """Per site: mean effect over all patches and over the in-distribution ones, how many were flagged."""
        eff = to_numpy(self.effect(normalized))
        flagged = to_numpy(self.flagged).astype(bool)
        kept = np.where(flagged, np.nan, eff)
        with np.errstate(invalid="ignore"), __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore", RuntimeWarning)
            mean_kept = np.nanmean(kept, 0)
        return pd.DataFrame(
            {
                "component": self.patching.components,
                "layer": [s.layer for s in self.patching.sites],
                "mean_effect_all": eff.mean(0),
                "mean_effect_in_distribution": mean_kept,
                "n_flagged": flagged.sum(0),
                "frac_flagged": flagged.mean(0),
                "threshold": to_numpy(self.threshold),
                "median_score": np.median(to_numpy(self.scores), 0),
            }
        )

    def to_frame(self) -> pd.DataFrame:
        """The patching frame of this mode/target plus ood_score, calibration_score, threshold, flagged."""
        f = self.patching.to_frame()
        f = f[(f["mode"] == self.mode) & (f["target"] == self.target)].reset_index(drop=True)
        S = len(self.patching.sites)
        f["ood_score"] = to_numpy(self.scores).ravel()
        f["calibration_score"] = to_numpy(self.calibration_scores).ravel()
        f["threshold"] = np.tile(to_numpy(self.threshold), len(f) // S)
        f["flagged"] = to_numpy(self.flagged).ravel()
        return f

    def plot(self, ax=None):
        """Left: score per site (patches vs clean swaps) against the threshold. Right: mean effect with
        and without the flagged patches. `ax`: two Axes (or one, split in two)."""
        names = self.patching.components
        x = np.arange(len(names))
        created = ax is None
        fig, (ax1, ax2) = panels(ax, 2, (max(10, 0.35 * len(names)), 4))
        sc, cal = to_numpy(self.scores), to_numpy(self.calibration_scores)
        ax1.scatter(
            np.repeat(x[None], len(sc), 0).ravel() - 0.15, sc.ravel(), s=6, label="patches", alpha=0.6
        )
        ax1.scatter(
            np.repeat(x[None], len(cal), 0).ravel() + 0.15, cal.ravel(), s=6, label="clean swaps", alpha=0.6
        )
        ax1.step(x, to_numpy(self.threshold), where="mid", color="tab:red", label="threshold")
        ax1.set_yscale("log")
        ax1.set_ylabel(f"OOD score ({self.settings.get('method')})")
        s = self.summary()
        ax2.bar(x - 0.2, s["mean_effect_all"], width=0.4, label="all patches")
        ax2.bar(x + 0.2, s["mean_effect_in_distribution"], width=0.4, label="in-distribution only")
        for ax in (ax1, ax2):
            ax.set_xticks(x)
            ax.set_xticklabels(names, rotation=90, fontsize=7)
            ax.legend(fontsize=8)
        ax2.set_ylabel(f"mean {self.mode} effect")
        return finish(fig, created)


class DivergenceSpec(Spec):
    """Divergence-aware patching as a pipeline instrument (the options of `divergence_patch`).

    Pre-pass (always): the reference pairs' clean states at the state hooks (the Mahalanobis fit, unless
    `reference` is given), every pair's target-role site values at the readout (the clean swaps take pair
    i + 1's from there: no forward of their own) and, for mean ablation without `means`, the means. Its
    clean captures are kept for the patching pass within the pipeline's budget."""

    name = "divergence"

    def __init__(
        self,
        mode: str = "noising",
        target: Optional[str] = None,
        level: Union[str, Sequence[str]] = "component",
        layers: Optional[Sequence[int]] = None,
        state: str = "site",
        method: str = "mahalanobis",
        n_components: Optional[int] = None,
        quantile: float = 0.95,
        max_reference: Optional[int] = None,
        means: Optional[Dict[str, torch.Tensor]] = None,
        reference: Optional[Dict[str, PCAMahalanobis]] = None,
    ):
        self.mode, self.target, self.level, self.layers, self.state = mode, target, level, layers, state
        self.method, self.n_components, self.quantile = method, n_components, quantile
        self.max_reference, self.given_means, self.given_reference = max_reference, means, reference

    def setup(self, model, pairs) -> None:
        self.target = _check_divergence_options(
            model, pairs, self.mode, self.target, self.method, self.state, self.quantile
        )
        L = model.cfg.n_layers
        self.means, self.reference = self.given_means, self.given_reference  # pre-pass state: per call
        self.sites = sites_for(model.cfg, self.level, self.layers)
        self.hooks = [state_hook(s, L, self.state) for s in self.sites]
        self.site_hooks = sorted({s.hook_name(L) for s in self.sites})
        self.n_pairs = len(pairs)
        self.fit_needed = self.reference is None and self.method == "mahalanobis"
        self.ref_rows = set(reference_indices(len(pairs), self.max_reference))

    def needs_pre_pass(self) -> bool:
        return True

    def pre_reads(self, model, batch) -> Reads:
        reads = Reads.both(readout=sorted(set(self.hooks)) if self.fit_needed else [])
        reads = reads.union(Reads({self.target: self.site_hooks}))
        if self.mode == "mean" and self.means is None:
            reads = reads.union(means_reads(model, self.sites, "readout"))
        return reads

    def pre_step(self, model, shared: Shared):
        batch = shared.batch
        start = batch.index.start
        rows = [b for b in range(batch.index.stop - start) if start + b in self.ref_rows]
        states = (
            {
                h: [shared.caps[side].at_readout[h][rows].float().cpu() for side in ("chosen", "rejected")]
                for h in sorted(set(self.hooks))
            }
            if self.fit_needed
            else {}
        )
        swaps = {h: shared.caps[self.target].at_readout[h].cpu() for h in self.site_hooks}
        needs_means = self.mode == "mean" and self.means is None
        sums = batch_sums(model, shared, self.sites, "readout") if needs_means else None
        return {"states": states, "swaps": swaps, "sums": sums}

    def pre_finish(self, model, pieces) -> None:
        if self.mode == "mean" and self.means is None:
            self.means = means_from_sums(model, self.sites, *add_sums([p["sums"] for p in pieces]))
        if self.fit_needed:
            states = {h: torch.cat([t for p in pieces for t in p["states"][h]]) for h in pieces[0]["states"]}
            self.reference = fit_reference(states, self.n_components)
        self.swaps = {h: torch.cat([p["swaps"][h] for p in pieces]) for h in self.site_hooks}
        self.scorer = _Scorer(self.hooks, self.method, self.reference or {})

    def reads(self, model, batch) -> Reads:
        reads, _ = clean_reads(model, batch, self.sites, [self.mode], "readout", "fast")
        return Reads({s: r[0] for s, r in reads.items()}, {s: r[1] for s, r in reads.items()})

    def step(self, model, shared: Shared) -> DivergenceResult:
        mode, target, batch = self.mode, self.target, shared.batch
        out = patch_batch(
            model,
            batch,
            self.sites,
            [mode],
            "readout",
            "fast",
            self.means,
            shared.pair_ids,
            64,
            caps=shared.caps,
            directions=shared.directions,
            memo=sweep_memo(shared),
        )
        if (mode, target) not in out.entries:  # (the generic path was refused above: a gate read late)
            raise ValueError(
                "divergence_patch scores readout-only recomputations, exact only when the head's gate "
                "position precedes the readout; here it does not (ArmoRM's gating pattern at or after the "
                "readout). Select one objective (model.reward_head.set_objective) or fix the gating pattern"
            )
        tcap = out.captures[target]
        clean_states = {h: _clean_state(tcap, h) for h in set(self.hooks)}
        entry = _stack_states(out.entries[(mode, target)])
        scores = self.scorer(entry if self.state == "site" else out.final[(mode, target)], clean_states)
        entry_c, final_c = self.clean_swaps(model, batch, tcap)
        calib = self.scorer(entry_c if self.state == "site" else final_c, clean_states)
        patching = PatchResult(
            pair_ids=shared.pair_ids,
            sites=self.sites,
            positions="readout",
            method="fast",
            clean_chosen=out.clean_chosen,
            clean_rejected=out.clean_rejected,
            patched={(mode, target): out.patched[(mode, target)]},
        )
        return DivergenceResult(
            patching=patching,
            mode=mode,
            target=target,
            scores=scores.float(),
            calibration_scores=calib.float(),
            threshold=torch.zeros(len(self.sites)),
            settings={
                "state": self.state,
                "method": self.method,
                "n_components": self.n_components,
                "quantile": self.quantile,
            },
        )

    def clean_swaps(self, model, batch: PairBatch, tcap: Capture):
        """The same patches with the value from the next pair's response of the same role (pair i <- pair
        i+1), from the pre-pass: (entry states [B, S, d], final residuals or None)."""
        idx = torch.tensor([(i + 1) % self.n_pairs for i in range(batch.index.start, batch.index.stop)])
        device = tcap.tok.input_ids.device
        other = Capture(tcap.tok, tcap.rewards, {h: v[idx].to(device) for h, v in self.swaps.items()}, {})
        pos = patch_positions(batch, "readout", tcap.tok, tcap.tok, None)
        values = [site_values(model, s, "noising", pos, other, None, "readout") for s in self.sites]
        entries = readout_entries(model, tcap, self.sites, values)
        final = readout_sweep(model, tcap, entries) if self.state == "final" else None
        return _stack_states(entries), final


# The options repeat DivergenceSpec's on purpose: the spec joins a shared pipeline (run_audit), this is the
# typed, checked public call for one instrument alone; every instrument has the pair (patch / PatchSpec, ...).
@checked_arguments(counts={"n_components": 1, "max_reference": 1, "batch_size": 1})
def divergence_patch(
    model,
    pairs,
    *,
    mode: str = "noising",
    target: Optional[str] = None,
    level: Union[str, Sequence[str]] = "component",
    layers: Optional[Sequence[int]] = None,
    state: str = "site",
    method: str = "mahalanobis",
    n_components: Optional[int] = None,
    quantile: float = 0.95,
    max_reference: Optional[int] = None,
    batch_size: int = 8,
    padding_side: Optional[str] = None,
    means: Optional[Dict[str, torch.Tensor]] = None,
    reference: Optional[Dict[str, PCAMahalanobis]] = None,
    shard: Optional[slice] = None,
    progress: Union[bool, str] = True,
) -> DivergenceResult:
    """Readout patching of `level` in `mode` with an OOD score per patch, a threshold calibrated on
    clean-vs-clean swaps and flags (see the module docstring). Needs at least 2 pairs.

    `reference`: state hook -> a fit (`fit_reference`) to score against instead of fitting on `pairs`.
    `shard`: patch and score only `pairs[shard]` (the swaps still take the next pair of all `pairs`; the
    threshold is then this shard's, so `reward_lens.distributed` recomputes it over the merged shards)."""
    spec = DivergenceSpec(
        mode, target, level, layers, state, method, n_components, quantile, max_reference, means, reference
    )
    return run_spec(
        model,
        pairs,
        spec,
        batch_size=batch_size,
        padding_side=padding_side,
        progress=progress and "divergence",
        within=shard,
    )


def _check_divergence_options(model, pairs, mode, target, method, state, quantile) -> str:
    """The target run (the mode's default when None), after checking every option."""
    if not isinstance(mode, str):
        raise ValueError("divergence_patch takes one mode; call it once per mode")
    check_options([mode], "readout", "fast")
    target = target or TARGETS[mode][0]
    if target not in TARGETS[mode]:
        raise ValueError(f"mode {mode!r} patches {TARGETS[mode]}, not {target!r}")
    if method not in METHODS or state not in STATES:
        raise ValueError(
            f"method must be one of {METHODS} and state one of {STATES}; got {method!r}, {state!r}"
        )
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    if len(pairs) < 2:
        raise ValueError("divergence_patch calibrates on swaps between pairs; give at least 2 pairs")
    if not model.has_readout_fast_path:
        raise ValueError(
            "divergence_patch scores the patched readout states of the KV-cache fast path, which needs a "
            "native architecture; this model runs on the generic path (see conversion/GENERIC.md)"
        )
    return target


def calibrated_threshold(calibration_scores: torch.Tensor, quantile: float) -> torch.Tensor:
    """[n_sites] the `quantile` of the clean-swap scores of each site (over all pairs given)."""
    return torch.quantile(calibration_scores.double(), quantile, dim=0).float()


def reference_indices(n: int, max_reference: Optional[int]) -> List[int]:
    """Which of n pairs the Mahalanobis fit uses: all, or `max_reference` evenly spaced."""
    if max_reference is None or max_reference >= n:
        return list(range(n))
    return [int(i) for i in np.linspace(0, n - 1, max_reference).round().astype(int)]


def reference_pairs(pairs: Sequence, max_reference: Optional[int]) -> List:
    """The pairs whose clean states the Mahalanobis fit uses: all, or `max_reference` evenly spaced."""
    return [pairs[i] for i in reference_indices(len(pairs), max_reference)]


def reference_states(
    model,
    ref_pairs,
    hooks,
    batch_size: int = 8,
    padding_side=None,
    progress=False,
    within: Optional[slice] = None,
) -> Dict[str, torch.Tensor]:
    """State hook -> [2 * n_pairs, d_model] clean readout states (each batch's chosen, then its rejected),
    float32 on the host; of `ref_pairs[within]` only when given."""
    states: Dict[str, List[torch.Tensor]] = {h: [] for h in set(hooks)}
    for batch in pair_batches(
        model, ref_pairs, batch_size, progress and "divergence: reference", padding_side, within
    ):
        for tok in (batch.chosen, batch.rejected):
            cap = capture(model, tok, readout_names=sorted(states))
            for h in states:
                states[h].append(cap.at_readout[h].float().cpu())
    return {h: torch.cat(v) for h, v in states.items()}


def fit_reference(
    states: Dict[str, torch.Tensor], n_components: Optional[int] = None
) -> Dict[str, PCAMahalanobis]:
    """One PCA-Mahalanobis fit per state hook (`reference_states`)."""
    return {h: PCAMahalanobis.fit(v, n_components) for h, v in states.items()}


class _Scorer:
    """OOD scores [batch, n_sites] of readout states [batch, n_sites, d] (one state hook per site)."""

    def __init__(self, hooks: List[str], method: str, fits: Dict[str, PCAMahalanobis]):
        self.hooks, self.method, self.fits = hooks, method, fits

    def __call__(self, states: torch.Tensor, clean: Dict[str, torch.Tensor]) -> torch.Tensor:
        out = []
        states = states.float().cpu()  # one transfer per batch, not one per site
        for i, h in enumerate(self.hooks):
            x = states[:, i]
            if self.method == "mahalanobis":
                out.append(self.fits[h].score(x))
            else:
                r = x.norm(dim=-1) / clean[h].float().cpu().norm(dim=-1).clamp(min=1e-12)
                out.append(torch.maximum(r, 1 / r).double())
        return torch.stack(out, -1)


def _stack_states(entries) -> torch.Tensor:
    return torch.stack([e.state for e in entries], 1)


def _clean_state(tcap: Capture, hook: str) -> torch.Tensor:
    """The target's clean readout value of a state hook, from the fast path's capture."""
    acts = tcap.at_readout
    if hook in acts:
        return acts[hook]
    if hook == act_name("embed"):
        return acts[act_name("resid_pre", 0)]
    return acts[act_name("resid_pre", layer_of(hook) + 1)]  # a block's resid_post is the next one's resid_pre
