"""Why attribution and patching disagree, as a measurement (docs/theory.md, "The effect decomposition").

For a component c patched at the readout (its output difference Δ_c, source run minus target run), the
patching effect splits exactly into

    direct     = w . Δ_c / s_t                    the final residual alone, the final norm's scale s frozen
                                                  at the target's (what observational attribution sees)
    norm       = r(final_t + Δ_c) - r_t - direct  the final norm's scale responding to Δ_c
    via_L{k}   = r(final_t + Δ_c + Σ_{j<=k} d_j) - r(final_t + Δ_c + Σ_{j<k} d_j)
                                                  layer k responding (d_j: layer j's attention + MLP output
                                                  change at the readout in the patched run; layers after k
                                                  frozen at their clean values), for the layers after c
    total      = direct + norm + Σ_k via_L{k}     = patch(model, pairs, mode=mode)'s effect

The readout token alone is recomputed over the target's cached keys/values (as `patch`'s fast path does).
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
from reward_lens.instruments.circuits.graph import TARGET, TargetRun, capture_names
from reward_lens.instruments.patching.engines import (
    clean_reads,
    patch_batch,
    readout_recompute_exact,
    sweep_memo,
)
from reward_lens.instruments.sites import component_sites
from reward_lens.model.frozen import with_frozen_weights
from reward_lens.model.hooks import act_name, final_resid_name
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import finish, panels
from reward_lens.results import CleanPairRewards, to_numpy
from reward_lens.stats import spearman


@dataclass
class EffectDecompositionResult(CleanPairRewards):
    """`direct`, `norm`, `total` [n_pairs, n_components]; `via` [n_pairs, n_components, n_layers] (0 for
    layers at or before the component: they do not read it); clean rewards [n_pairs]."""

    pair_ids: List[str]
    components: List[str]
    mode: str
    clean_chosen: Float[torch.Tensor, " pair"]
    clean_rejected: Float[torch.Tensor, " pair"]
    direct: Float[torch.Tensor, "pair component"]
    norm: Float[torch.Tensor, "pair component"]
    via: Float[torch.Tensor, "pair component layer"]
    total: Float[torch.Tensor, "pair component"]

    @property
    def terms(self) -> List[str]:
        return ["direct", "norm"] + [f"via_L{k}" for k in range(self.via.shape[-1])]

    def stacked(self) -> torch.Tensor:
        """[n_pairs, n_components, n_terms] in the order of `terms`; sums to `total` over the last axis."""
        return torch.cat([self.direct[..., None], self.norm[..., None], self.via], -1)

    def to_frame(self) -> pd.DataFrame:
        """One row per (pair, component, term): pair, component, term, value (terms: direct, norm,
        via_L{k}, total)."""
        values = to_numpy(torch.cat([self.stacked(), self.total[..., None]], -1))
        terms = self.terms + ["total"]
        rows = [
            (pid, c, t, values[i, j, k])
            for i, pid in enumerate(self.pair_ids)
            for j, c in enumerate(self.components)
            for k, t in enumerate(terms)
        ]
        return pd.DataFrame(rows, columns=["pair", "component", "term", "value"])

    @checked_arguments(counts={"top": 1})
    def disagreement(self, top: int = 5) -> pd.DataFrame:
        """For the `top` components with the largest mean |total - direct|: the gap (mean over pairs) and
        the share of it from the norm and from each later layer (shares sum to 1)."""
        gap = (self.total - self.direct).mean(0)
        order = torch.argsort(gap.abs(), descending=True)[:top]
        parts = self.stacked()[..., 1:].mean(0)  # norm, via_L*: [n_components, 1 + n_layers]
        rows = []
        for j in order.tolist():
            share = (parts[j] / gap[j]).tolist() if float(gap[j]) != 0 else [float("nan")] * parts.shape[1]
            rows.append(
                [
                    self.components[j],
                    float(self.direct[:, j].mean()),
                    float(self.total[:, j].mean()),
                    float(gap[j]),
                ]
                + share
            )
        return pd.DataFrame(
            rows, columns=["component", "direct", "total", "gap"] + [f"share_{t}" for t in self.terms[1:]]
        )

    def direct_total_rho(self) -> float:
        """Mean over pairs of the Spearman between |direct| and |total| across components (faithfulness's
        statistic, with the decomposition's own direct term as the attribution)."""
        d, t = to_numpy(self.direct).__abs__(), to_numpy(self.total).__abs__()
        return float(np.nanmean([spearman(d[i], t[i]) for i in range(d.shape[0])]))

    def summary(self) -> pd.DataFrame:
        """Mean of every term per component over pairs, largest |total - direct| first."""
        mean = to_numpy(torch.cat([self.stacked(), self.total[..., None]], -1).mean(0))
        out = pd.DataFrame(mean, columns=self.terms + ["total"])
        out.insert(0, "component", self.components)
        return out.reindex((out.total - out.direct).abs().sort_values(ascending=False).index).reset_index(
            drop=True
        )

    @checked_arguments(counts={"top": 1})
    def plot(self, top: int = 5, ax=None):
        """The disagreement shares of the `top` components: stacked bars of norm and via_L{k} shares."""
        fig, (ax,), created = (*panels(ax, 1, (7, 3.5)), ax is None)
        table = self.disagreement(top)
        bottom_pos, bottom_neg = np.zeros(len(table)), np.zeros(len(table))
        cmap = __import__("matplotlib").colormaps["viridis"]
        cols = [c for c in table.columns if c.startswith("share_")]
        for n, col in enumerate(cols):
            v = table[col].to_numpy(dtype=float)
            base = np.where(v >= 0, bottom_pos, bottom_neg)
            color = "tab:red" if col == "share_norm" else cmap(n / max(1, len(cols) - 1))
            ax.bar(table.component, v, bottom=base, color=color, label=col[6:] if n < 12 else None)
            bottom_pos, bottom_neg = bottom_pos + np.clip(v, 0, None), bottom_neg + np.clip(v, None, 0)
        ax.axhline(1.0, color="k", lw=0.6, ls="--")
        ax.set_ylabel("share of total - direct")
        ax.set_title(
            f"Why attribution and patching disagree (|direct| vs |total| rho = {self.direct_total_rho():.2f})"
        )
        ax.legend(fontsize=6, ncol=2)
        return finish(fig, created)


def _first_sublayer(site, L: int) -> int:
    """Index (attn_j = 2j, mlp_j = 2j + 1, final = 2L) of the first sub-layer that reads the site's output."""
    return {"embed": 0, "attn": 2 * site.layer + 1, "mlp": 2 * site.layer + 2}[site.kind]


def _first_sublayers(sites, L: int, device) -> torch.Tensor:
    """[C] `_first_sublayer` of every site."""
    return torch.tensor([_first_sublayer(s, L) for s in sites], device=device)


def _entries(model, sites, tgt, src) -> torch.Tensor:
    """[B, C, d]: the target residual with the source's output of each site written in at the readout."""
    out = []
    for s in sites:
        if s.kind == "embed":
            out.append(src[act_name("resid_pre", 0)])
        elif s.kind == "attn":
            out.append(tgt[act_name("resid_pre", s.layer)] + src[act_name("attn_out", s.layer)])
        else:
            out.append(tgt[act_name("resid_mid", s.layer)] + src[act_name("mlp_out", s.layer)])
    return torch.stack(out, 1)


def _component_deltas(model, sites, tgt, src) -> torch.Tensor:
    names = [
        act_name("resid_pre", 0) if s.kind == "embed" else act_name(f"{s.kind}_out", s.layer) for s in sites
    ]
    return torch.stack([src[n] - tgt[n] for n in names], 1)  # [B, C, d]


@torch.no_grad()
def _loop_changes(model, ctx: TargetRun, src, sites):
    """(d_layer [B, C, L, d], final [B, C, d]) by the reference loop: every component's row through every
    sub-layer, the rows that have not entered yet held at the clean residual. d_layer[:, c, k] is layer
    k's attention + MLP output change at the readout in component c's patched run."""
    cfg, L = model.cfg, model.cfg.n_layers
    tgt = ctx.cap.at_readout
    entry = _entries(model, sites, tgt, src)  # the residual a readout patch leaves, as `patch` forms it
    B, C = entry.shape[:2]
    first = _first_sublayers(sites, L, entry.device)
    d_layer = torch.zeros(B, C, L, cfg.d_model, dtype=entry.dtype, device=entry.device)
    state = None
    for k in range(2 * L):
        l, kind = divmod(k, 2)
        base = tgt[act_name("resid_mid" if kind else "resid_pre", l)][:, None].expand(-1, C, -1)
        fresh = torch.where((first == k)[None, :, None], entry, base)
        state = fresh if state is None else torch.where((first >= k)[None, :, None], fresh, state)
        block = model.blocks[l]
        if kind == 0:  # the blocks' own readout steps, as `patch`'s fast path runs them
            new = block.readout_attn(state, *ctx.step_args(l))
        else:
            new = block.readout_mlp(state)
        clean = tgt[act_name("mlp_out" if kind else "attn_out", l)][:, None]
        responding = (first <= k)[None, :, None]
        d_layer[:, :, l] += torch.where(responding, new - state - clean, torch.zeros_like(new))
        state = new
    final = torch.where((first == 2 * L)[None, :, None], entry, state)  # the last MLP: nothing after it
    return d_layer, final


def _sweep_changes(model, tgt, sites, changes: torch.Tensor) -> torch.Tensor:
    """d_layer [B, C, L, d] from a readout sweep's per-block changes of each row (`readout_sweep(...,
    layer_changes=True)`): minus the clean attention / MLP outputs of the sub-layers that ran."""
    L = model.cfg.n_layers
    first = _first_sublayers(sites, L, changes.device)
    k = 2 * torch.arange(L, device=changes.device)
    ran_attn = (first[:, None] <= k[None]).to(changes.dtype)[None, :, :, None]  # [1, C, L, 1]
    ran_mlp = (first[:, None] <= k[None] + 1).to(changes.dtype)[None, :, :, None]
    attn = torch.stack([tgt[act_name("attn_out", l)] for l in range(L)], 1)[:, None]  # [B, 1, L, d]
    mlp = torch.stack([tgt[act_name("mlp_out", l)] for l in range(L)], 1)[:, None]
    return changes - ran_attn * attn - ran_mlp * mlp


@torch.no_grad()
def _terms(model, cap, src, direction, bias, sites, d_layer, final):
    """(direct, norm, via, total) of one batch: `cap` the target run's capture, `src` the source run's
    readout activations, (direction, bias) the target's readout direction, `d_layer` [B, C, L, d] each
    layer's output change and `final` [B, C, d] the recomputed final residual of every component's patch."""
    L = model.cfg.n_layers
    tgt = cap.at_readout
    delta = _component_deltas(model, sites, tgt, src)
    B, C = delta.shape[:2]
    first = _first_sublayers(sites, L, delta.device)
    final_t = tgt[final_resid_name(L)].float()

    def reward(x):
        return reward_from_final_resid(model, x, direction[:, None], bias[:, None]).float()

    r_t = cap.rewards.float()[:, None]
    scale = tgt[act_name("final_scale")].float().reshape(-1, 1)  # the final norm's scale in the target run
    direct = (direction[:, None] * delta.float()).sum(-1) / scale
    partial = final_t[:, None, None] + delta.float()[:, :, None] + d_layer.float().cumsum(2)[:, :, :-1]
    r_last = reward(final)  # the recomputed final residual, as `patch` reads it
    r_k = torch.cat([reward(partial.reshape(B, C * (L - 1), -1)).view(B, C, L - 1), r_last[..., None]], -1)
    r_0 = reward(final_t[:, None] + delta.float())  # no layer responding
    last = (first == 2 * L)[None]  # nothing reads the last MLP: no via terms
    r_0, r_k = torch.where(last, r_last, r_0), torch.where(last[..., None], r_last[..., None], r_k)
    via = torch.diff(torch.cat([r_0[..., None], r_k], -1), dim=-1)
    norm = r_0 - r_t - direct
    total = r_k[..., -1] - r_t
    return direct, norm, via, total


class EffectSpec(Spec):
    """The effect decomposition as a pipeline instrument: reads what the readout recomputation needs from
    the target run (activations at the readout, every layer's keys/values) and the source run's readout
    activations; its clean passes are shared with the other instruments of the call.

    `method`: "sweep" (default) takes every layer's change from patching's readout sweep of the same mode
    (one sweep, shared with a `PatchSpec` or `DivergenceSpec` of the call, which then costs nothing more);
    "loop" recomputes each component's row through every sub-layer on its own (the reference)."""

    name = "effect_decomposition"
    step_late = True  # beside patching's specs, so that its sweep of the same mode serves both

    def __init__(self, mode: str = "noising", method: str = "sweep"):
        if mode not in TARGET:
            raise ValueError(f"mode must be one of {tuple(TARGET)}, got {mode!r}")
        if method not in ("sweep", "loop"):
            raise ValueError(f"method must be 'sweep' or 'loop' (the reference), got {method!r}")
        self.mode, self.method = mode, method

    def setup(self, model, pairs) -> None:
        self.sites = component_sites(model.cfg)

    def reads(self, model, batch) -> Reads:
        t_side, s_side = TARGET[self.mode]
        names = capture_names(model)
        reads = Reads(readout={t_side: names, s_side: names}, full={t_side: model.readout_kv_names()})
        if self.method == "sweep":
            patching, _ = clean_reads(model, batch, self.sites, [self.mode], "readout", "fast")
            reads = reads.union(
                Reads({s: r[0] for s, r in patching.items()}, {s: r[1] for s, r in patching.items()})
            )
        return reads

    def before_steps(self, model, shared: Shared) -> None:
        if self.method == "sweep":  # the sweep, whichever instrument runs it first, keeps each block's change
            sweep_memo(shared).want_changes.add((self.mode, TARGET[self.mode][0]))

    def step(self, model, shared: Shared) -> EffectDecompositionResult:
        t_side, s_side = TARGET[self.mode]
        tcap = shared.caps[t_side]
        if not readout_recompute_exact(model, tcap.tok):
            raise ValueError(
                "the effect decomposition recomputes the readout alone, which needs a native architecture "
                "whose head reads nothing at or after the readout (not ArmoRM's gate, not the generic path)"
            )
        src = shared.caps[s_side].at_readout
        if self.method == "loop":
            ctx = TargetRun(tcap, model.readout_context(tcap.tok, kv=tcap.full))
            d_layer, final = _loop_changes(model, ctx, src, self.sites)
        else:
            key = (self.mode, t_side)
            out = patch_batch(
                model,
                shared.batch,
                self.sites,
                [self.mode],
                "readout",
                "fast",
                None,
                shared.pair_ids,
                64,
                caps=shared.caps,
                directions=shared.directions,
                memo=sweep_memo(shared),
            )
            d_layer = _sweep_changes(model, tcap.at_readout, self.sites, out.changes[key])
            final = out.final[key]
        direction, bias = shared.direction(model, t_side)
        direct, norm, via, total = _terms(model, tcap, src, direction, bias, self.sites, d_layer, final)
        return EffectDecompositionResult(
            pair_ids=shared.pair_ids,
            components=[s.name for s in self.sites],
            mode=self.mode,
            clean_chosen=shared.caps["chosen"].rewards.float(),
            clean_rejected=shared.caps["rejected"].rewards.float(),
            direct=direct,
            norm=norm,
            via=via,
            total=total,
        )


@checked_arguments(counts={"batch_size": 1})
@with_frozen_weights
def effect_decomposition(
    model,
    pairs,
    *,
    mode: str = "noising",
    level: str = "component",
    method: str = "sweep",
    batch_size: int = 8,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = False,
) -> EffectDecompositionResult:
    """Every component's readout patching effect split exactly into direct + norm + Σ_k via_L{k} (module
    docstring). mode: "noising" or "denoising"; level: "component" (embed, attn_L{l}, mlp_L{l});
    method: "sweep" (patching's readout sweep, each block's change kept) or "loop" (the reference)."""
    if level != "component":
        raise ValueError(f"level must be 'component' (embed, attn_L{{l}}, mlp_L{{l}}), got {level!r}")
    spec = EffectSpec(mode, method)
    return run_spec(
        model,
        pairs,
        spec,
        batch_size=batch_size,
        padding_side=padding_side,
        progress=progress and "effect decomposition",
    )
