"""Attribution patching (AtP): the first-order estimate of every patch of a sweep from one backward pass.

    effect(site) ~= grad_site(reward of the target run) . (patched value - clean value)

summed over the patched positions (at the readout on a native model: a backward through the readout
token alone, `readout_gradients`; elsewhere the full backward of the target's clean run). Modes, levels
and positions are those of `patch` (the same targets
and values are patched in), so the estimates line up with real patching one to one; `AtPResult.compare`
reports the error against a `PatchResult`. Cost per target response: its forward, the source's forward
and one backward, for all sites at once. Parameters stay frozen: the graph starts at the embedding,
which a hook makes require grad.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch

from reward_lens.core.directions import reward_from_final_resid
from reward_lens.core.pipeline import Reads, Shared, run_spec
from reward_lens.core.readout import Capture
from reward_lens.instruments.patching.contrastive import MeansPrePass, PatchResult, SiteEffects
from reward_lens.instruments.patching.engines import readout_capture_names, readout_recompute_exact
from reward_lens.instruments.patching.positions import patch_positions, select, site_values
from reward_lens.instruments.patching.spec import SOURCE, TARGETS, check_options
from reward_lens.instruments.sites import Site, sites_for
from reward_lens.model.frozen import gradients_on, with_frozen_weights
from reward_lens.model.hooks import act_name, resid_entering
from reward_lens.model.placement import block_device
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import finish, panels
from reward_lens.results import to_numpy
from reward_lens.stats import spearman, spearman_rows


@dataclass
class AtPComparison:
    """AtP estimates beside real patching effects. `frame`: one row per (pair, site, mode, target) with
    atp_effect, patch_effect, abs_error. `metrics`: per (mode, target) mean_abs_error, max_abs_error,
    relative_error (sum |atp - patch| / sum |patch|), pooled Spearman rho and mean per-pair rho."""

    frame: pd.DataFrame
    metrics: pd.DataFrame

    def to_frame(self) -> pd.DataFrame:
        return self.frame

    def summary(self) -> pd.DataFrame:
        """The metrics: one row per (mode, target)."""
        return self.metrics

    def plot(self, ax=None):
        """AtP estimate against the real patching effect, one panel per (mode, target), with y = x."""
        keys = list(self.frame.groupby(["mode", "target"]).groups)
        created = ax is None
        fig, axes = panels(ax, len(keys), (4.2 * len(keys), 4))
        for ax, (mode, target) in zip(axes, keys):
            f = self.frame[(self.frame["mode"] == mode) & (self.frame["target"] == target)]
            ax.scatter(f["patch_effect"], f["atp_effect"], s=8, alpha=0.6)
            lim = float(np.nanmax(np.abs(f[["patch_effect", "atp_effect"]].to_numpy()))) or 1.0
            ax.plot([-lim, lim], [-lim, lim], color="black", lw=0.5)
            ax.set_xlabel("patching effect")
            ax.set_ylabel("AtP estimate")
            m = self.metrics[(self.metrics["mode"] == mode) & (self.metrics["target"] == target)].iloc[0]
            ax.set_title(
                f"{mode} ({target}): rel. err {m['relative_error']:.2f}, rho {m['spearman_pooled']:.2f}",
                fontsize=9,
            )
        return finish(fig, created)


@dataclass
class AtPResult(SiteEffects):
    """`estimates[(mode, target)]`: [n_pairs, n_sites] first-order estimates of patched - clean reward;
    `clean_chosen`/`clean_rejected` [n_pairs] the clean rewards (also `reward_chosen`/`reward_rejected`)."""

    pair_ids: List[str]
    sites: List[Site]
    positions: str
    clean_chosen: torch.Tensor
    clean_rejected: torch.Tensor
    estimates: Dict[Tuple[str, str], torch.Tensor] = field(default_factory=dict)

    @checked_arguments(flags=("normalized",))
    def effect(self, mode: str, target: Optional[str] = None, normalized: bool = False) -> torch.Tensor:
        target = target or TARGETS[mode][0]
        if (mode, target) not in self.estimates:
            raise KeyError(
                f"no estimates for mode={mode!r}, target={target!r}; have {sorted(self.estimates)}"
            )
        eff = self.estimates[(mode, target)]
        return self.per_gap(eff) if normalized else eff

    def to_frame(self) -> pd.DataFrame:
        """pair, component, layer, head, level, mode, target, position, atp_effect, normalized_effect."""
        frames = []
        for (mode, target), est in self.estimates.items():
            e = to_numpy(est)
            values = {"atp_effect": e.ravel(), "normalized_effect": self.per_gap(e).ravel()}
            frames.append(self.site_frame(mode, target, values))
        return pd.concat(frames, ignore_index=True)

    def summary(self) -> pd.DataFrame:
        """One row per (mode, target, site): mean estimated effect and mean |estimate| over pairs."""
        rows = []
        for (mode, target), est in self.estimates.items():
            e = to_numpy(est)
            values = {"mean_atp_effect": e.mean(0), "mean_abs_atp_effect": np.abs(e).mean(0)}
            rows.append(self.site_summary(mode, target, values))
        return pd.concat(rows, ignore_index=True)

    def plot(self, mode: Optional[str] = None, target: Optional[str] = None, ax=None):
        """Mean AtP estimate per site over pairs (bars, std error bars) for one (mode, target)."""
        mode = mode or next(iter(self.estimates))[0]
        e = to_numpy(self.effect(mode, target))
        created = ax is None
        fig, (ax,) = panels(ax, 1, (max(6, 0.25 * len(self.sites)), 3.5))
        ax.bar(range(len(self.sites)), e.mean(0), yerr=e.std(0) if len(e) > 1 else None)
        ax.set_xticks(range(len(self.sites)))
        ax.set_xticklabels(self.components, rotation=90, fontsize=7)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_ylabel("AtP estimate of the patching effect")
        ax.set_title(f"Attribution patching: {mode} over {len(e)} pair(s)")
        return finish(fig, created)

    def compare(self, patching: PatchResult) -> AtPComparison:
        """Error of these estimates against real patching of the same pairs, sites and modes."""
        if patching.pair_ids != self.pair_ids:
            raise ValueError(
                "the patching result covers other pairs; run both on the same pairs in the same order"
            )
        names = [s.name for s in patching.sites]
        missing = [s.name for s in self.sites if s.name not in names]
        if missing:
            raise ValueError(
                f"the patching result lacks sites {missing[:5]}; patch the same level(s) and layers"
            )
        cols = [names.index(s.name) for s in self.sites]
        rows, metrics = [], []
        for (mode, target), est in self.estimates.items():
            if (mode, target) not in patching.patched:
                continue
            real = patching.effect(mode, target)[:, cols]
            a, p = to_numpy(est), to_numpy(real)
            per_pair = spearman_rows(a, p) if a.shape[1] > 1 else np.array([np.nan])
            metrics.append(
                {
                    "mode": mode,
                    "target": target,
                    "mean_abs_error": float(np.abs(a - p).mean()),
                    "max_abs_error": float(np.abs(a - p).max()),
                    "relative_error": float(np.abs(a - p).sum() / max(np.abs(p).sum(), 1e-12)),
                    "spearman_pooled": spearman(a, p) if a.size > 1 else np.nan,
                    "spearman_per_pair_mean": float(np.nanmean(per_pair))
                    if np.isfinite(per_pair).any()
                    else np.nan,
                }
            )
            n, S = a.shape
            rows.append(
                pd.DataFrame(
                    {
                        "pair": np.repeat(self.pair_ids, S),
                        "component": [s.name for s in self.sites] * n,
                        "layer": [s.layer for s in self.sites] * n,
                        "mode": mode,
                        "target": target,
                        "atp_effect": a.ravel(),
                        "patch_effect": p.ravel(),
                        "abs_error": np.abs(a - p).ravel(),
                    }
                )
            )
        if not rows:
            raise ValueError("no (mode, target) in common between the AtP estimates and the patching result")
        return AtPComparison(pd.concat(rows, ignore_index=True), pd.DataFrame(metrics))


@with_frozen_weights
def readout_gradients(
    model, cap: Capture, sites: Sequence[Site], direction: torch.Tensor, bias: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """Site name -> d reward / d its activation at the readout [batch, ...site shape], by a backward
    through the readout token alone. Exact where the readout engine is (`readout_recompute_exact`): an
    activation at the readout reaches the reward through the readout's own later states only (its key
    and value included; earlier positions' keys and values are constants), so one single-token chain
    through the blocks' readout steps, on the cached keys and values of `cap`, has every gradient."""
    L = model.cfg.n_layers
    tok, acts = cap.tok, cap.at_readout
    device = tok.input_ids.device
    ctx = model.readout_context(tok, kv=cap.full)
    head_layers = sorted({s.layer for s in sites if s.kind == "head"})
    with gradients_on("attribution_patch"):
        x = acts[resid_entering(0, L)].detach()[:, None].requires_grad_(True)  # [B, 1, d]
        pre, mid, zs = [x], [], []
        for l in range(L):
            block, here = model.blocks[l], block_device(model, l)
            cos, sin, sees = ctx.on(here)
            m = block.readout_attn(pre[-1].to(here), cos, sin, *ctx.layer_kv(l, here), sees)
            if l in head_layers:  # each head's z enters through the output map; the value stays exactly m
                z = acts[act_name("z", l)].detach()
                new = z.clone().requires_grad_(True)  # alternative h: head h's z is new[:, h]
                heads = list(range(z.shape[1]))
                written = model.resid_mid_with_heads(l, acts[resid_entering(l, L)], z, heads, new)
                m = m + (written - written.detach()).sum(1, keepdim=True).to(here)
                zs.append(new)
            mid.append(m)
            pre.append(block.readout_mlp(m))
        reward = reward_from_final_resid(model, pre[-1][:, 0].to(device), direction, bias)
        grads = torch.autograd.grad(reward.float().sum(), pre + mid + zs)  # one backward for every site
    g_pre, g_mid = [g[:, 0] for g in grads[: L + 1]], [g[:, 0] for g in grads[L + 1 : 2 * L + 1]]
    g_z = {l: g.to(device) for l, g in zip(head_layers, grads[2 * L + 1 :])}
    out: Dict[str, torch.Tensor] = {}
    for site in sites:
        if site.kind in ("embed", "resid"):
            out[site.name] = g_pre[site.layer if site.kind == "resid" else 0].to(device)
        elif site.kind == "attn":
            out[site.name] = g_mid[site.layer].to(device)
        elif site.kind == "mlp":
            out[site.name] = g_pre[site.layer + 1].to(device)
        else:
            out[site.name] = g_z[site.layer][:, site.head]
    return out


@torch.no_grad()
def atp_estimates(
    model,
    shared: Shared,
    sites: Sequence[Site],
    modes: Sequence[str],
    positions: str,
    means: Optional[Dict[str, torch.Tensor]],
) -> Dict[Tuple[str, str], torch.Tensor]:
    """(mode, target) -> [batch, n_sites] estimates of one batch from its clean captures: the targets'
    gradients from the full backward of their capture, or (readout positions, no gradients captured)
    from `readout_gradients`."""
    L = model.cfg.n_layers
    batch, caps = shared.batch, shared.caps
    out: Dict[Tuple[str, str], torch.Tensor] = {}
    at_readout: Dict[str, Dict[str, torch.Tensor]] = {}
    for m in modes:
        src = caps[SOURCE[m]] if m in SOURCE else None
        for target in TARGETS[m]:
            cap = caps[target]
            tok = cap.tok
            pos = patch_positions(batch, positions, tok, src.tok if src else None, shared.pair_ids)
            rows, t_pos = pos.t_rows.to(tok.input_ids.device), pos.t_pos.to(tok.input_ids.device)
            B = tok.input_ids.shape[0]
            chain = not cap.grads
            if chain and target not in at_readout:
                at_readout[target] = readout_gradients(model, cap, sites, *shared.direction(model, target))
            est = []
            for site in sites:
                h = site.hook_name(L)
                new = site_values(model, site, m, pos, src, means, positions).float()
                if chain:  # readout positions: one row per target row
                    old, g = select(site, cap.at_readout[h]).float(), at_readout[target][site.name].float()
                else:
                    old = select(site, cap.full[h])[rows, t_pos].float()
                    g = select(site, cap.grads[h])[rows, t_pos].float()
                per_position = (g * (new - old)).sum(-1)
                est.append(torch.zeros(B, device=per_position.device).index_add_(0, rows, per_position))
            out[(m, target)] = torch.stack(est, -1)
    return out


class AtPSpec(MeansPrePass):
    """Attribution patching as a pipeline instrument (the options of `attribution_patch`): reads each
    target's sites with their gradients (at the readout of a native model: the readout engine's states,
    for `readout_gradients`; else the whole sites with the capture's full backward, one per target side,
    shared by the modes and levels) and the sources' sites. Name: "atp" unless given."""

    def __init__(
        self,
        mode: Union[str, Sequence[str]] = "noising",
        level: Union[str, Sequence[str], None] = None,
        positions: str = "readout",
        layers: Optional[Sequence[int]] = None,
        means: Optional[Dict[str, torch.Tensor]] = None,
        name: Optional[str] = None,
    ):
        self.modes = [mode] if isinstance(mode, str) else list(dict.fromkeys(mode))
        check_options(self.modes, positions, "fast")
        self.level, self.positions, self.layers = level, positions, layers
        self.means = self.given_means = means
        self.name = name or "atp"

    def setup(self, model, pairs) -> None:
        if self.level is None:  # components, and heads where the model has per-head hooks (native models)
            self.level = ("component", "head") if model.has_head_hooks else "component"
        self.sites = sites_for(model.cfg, self.level, self.layers)
        self.means = self.given_means  # a spec used again computes its pre-pass again
        self.hooks = sorted({s.hook_name(model.cfg.n_layers) for s in self.sites})

    def reads(self, model, batch) -> Reads:
        out = Reads()
        for side in ("chosen", "rejected"):
            source = any(SOURCE.get(m) == side for m in self.modes)
            out.readout[side] = list(self.hooks) if source and self.positions == "readout" else []
            out.full[side] = list(self.hooks) if source and self.positions != "readout" else []
            out.grads[side] = []
            if not any(side in TARGETS[m] for m in self.modes):
                continue
            if self.positions == "readout" and readout_recompute_exact(model, getattr(batch, side)):
                # gradients by a backward through the readout token alone (`readout_gradients`)
                chain_names, kv = readout_capture_names(model, self.sites)
                out.readout[side] = list(dict.fromkeys(out.readout[side] + self.hooks + chain_names))
                out.full[side] = list(dict.fromkeys(out.full[side] + kv))
            else:
                out.grads[side] = list(self.hooks)
        return out

    def step(self, model, shared: Shared) -> "AtPResult":
        return AtPResult(
            pair_ids=shared.pair_ids,
            sites=self.sites,
            positions=self.positions,
            clean_chosen=shared.caps["chosen"].rewards.float(),
            clean_rejected=shared.caps["rejected"].rewards.float(),
            estimates=atp_estimates(model, shared, self.sites, self.modes, self.positions, self.means),
        )


@checked_arguments(counts={"batch_size": 1})
def attribution_patch(
    model,
    pairs,
    *,
    mode: Union[str, Sequence[str]] = "noising",
    level: Union[str, Sequence[str], None] = None,
    positions: str = "readout",
    layers: Optional[Sequence[int]] = None,
    batch_size: int = 8,
    padding_side: Optional[str] = None,
    means: Optional[Dict[str, torch.Tensor]] = None,
    progress: Union[bool, str] = True,
) -> AtPResult:
    """AtP estimates of `patch(model, pairs, mode=..., level=..., positions=...)` for every site."""
    spec = AtPSpec(mode, level, positions, layers, means, name="atp")
    return run_spec(
        model,
        pairs,
        spec,
        batch_size=batch_size,
        padding_side=padding_side,
        progress=progress and "attribution patching",
    )
