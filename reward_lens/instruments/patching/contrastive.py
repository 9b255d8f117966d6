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

Fast path (method="fast", the default). A readout-position patch at layer l changes only the readout
token from l on: it is the last attended token (right padding puts pads after it, left padding before
it, and pads are masked), so no other position attends to it. The target's post-RoPE keys and values
are cached in its one clean run; every patch of a sweep is then one row of a batch of single-token
queries recomputed through layers l..L-1 (`Attention.forward_readout`), attending to the cached keys
of the other positions plus its own fresh key. A sweep costs about one forward per response.
Multi-position patches start the forward at the patched layer (`start_at_layer`) from the cached
residual. method="naive" runs one full `run_with_hooks` forward per patch (the reference).
"""

from __future__ import annotations

import warnings
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from reward_lens.core.validation import safe_ratio
from reward_lens.data.pairs import as_pairs, pair_labels
from reward_lens.instruments.sites import Site, sites_for
from reward_lens.plotting import diverging_heatmap, finish, panels
from reward_lens.results import PairRewards, to_numpy
from reward_lens.core.readout import (
    Capture,
    PairBatch,
    Tokenized,
    capture,
    first_token,
    pair_batches,
    readout_direction,
    reward_from_final_resid,
)

MODES = ("noising", "denoising", "zero", "mean")
POSITIONS = ("readout", "prompt", "all")
METHODS = ("fast", "naive")
_TARGETS = {"noising": ("chosen",), "denoising": ("rejected",), "zero": ("chosen", "rejected"), "mean": ("chosen", "rejected")}
_SOURCE = {"noising": "rejected", "denoising": "chosen"}
_PRE, _MID = 0, 1  # where a readout patch enters its block: before attention, or between attention and MLP


@dataclass
class PatchResult(PairRewards):
    """Patched rewards per pair and site. `patched[(mode, target)]` is [n_pairs, n_sites] (target:
    "chosen" or "rejected"); `clean_chosen`/`clean_rejected` [n_pairs] the clean rewards (also
    `reward_chosen`/`reward_rejected`, with `reward_gap`, as every result)."""

    pair_ids: List[str]
    sites: List[Site]
    positions: str
    method: str
    clean_chosen: Float[torch.Tensor, "pair"]
    clean_rejected: Float[torch.Tensor, "pair"]
    patched: Dict[Tuple[str, str], torch.Tensor] = field(default_factory=dict)

    @property
    def components(self) -> List[str]:
        return [s.name for s in self.sites]

    @property
    def modes(self) -> List[str]:
        return list(dict.fromkeys(m for m, _ in self.patched))

    @property
    def reward_chosen(self) -> torch.Tensor:
        return self.clean_chosen

    @property
    def reward_rejected(self) -> torch.Tensor:
        return self.clean_rejected

    @property
    def clean_gap(self) -> torch.Tensor:
        return self.clean_chosen - self.clean_rejected

    def _key(self, mode: str, target: Optional[str]) -> Tuple[str, str]:
        if target is None:
            target = _TARGETS.get(mode, ("chosen",))[0]
        if (mode, target) not in self.patched:
            raise KeyError(f"no patches for mode={mode!r}, target={target!r}; have {sorted(self.patched)}")
        return mode, target

    def patched_reward(self, mode: str, target: Optional[str] = None) -> torch.Tensor:
        return self.patched[self._key(mode, target)]

    def effect(self, mode: str, target: Optional[str] = None, normalized: bool = False) -> torch.Tensor:
        """[n_pairs, n_sites]: patched - clean reward of the target (divided by the clean gap if normalized).
        target defaults to the mode's (chosen for noising/zero/mean, rejected for denoising)."""
        mode, target = self._key(mode, target)
        clean = self.clean_chosen if target == "chosen" else self.clean_rejected
        eff = self.patched[(mode, target)] - clean[:, None]
        return safe_ratio(eff, self.clean_gap[:, None]) if normalized else eff

    def to_frame(self) -> pd.DataFrame:
        """One row per (pair, site, mode, target): pair, component, layer, head, level, mode, target,
        position, clean_reward, patched_reward, effect, clean_gap, normalized_effect."""
        frames = []
        n, S = len(self.pair_ids), len(self.sites)
        gap = to_numpy(self.clean_gap)
        for (mode, target), patched in self.patched.items():
            clean = to_numpy(self.clean_chosen if target == "chosen" else self.clean_rejected)
            p = to_numpy(patched)
            eff = p - clean[:, None]
            frames.append(pd.DataFrame({
                "pair": [pid for pid in self.pair_ids for _ in range(S)],
                "component": [s.name for s in self.sites] * n,
                "layer": [s.layer for s in self.sites] * n,
                "head": pd.array([s.head for s in self.sites] * n, dtype="Int64"),
                "level": [s.level for s in self.sites] * n,
                "mode": mode, "target": target, "position": self.positions,
                "clean_reward": clean.repeat(S), "patched_reward": p.ravel(), "effect": eff.ravel(),
                "clean_gap": gap.repeat(S), "normalized_effect": safe_ratio(eff, gap[:, None]).ravel(),
            }))
        return pd.concat(frames, ignore_index=True)

    def summary(self) -> pd.DataFrame:
        """One row per (mode, target, site): mean effect and mean normalised effect over pairs."""
        rows = []
        for mode, target in self.patched:
            eff, norm = to_numpy(self.effect(mode, target)), to_numpy(self.effect(mode, target, normalized=True))
            rows.append(pd.DataFrame({
                "mode": mode, "target": target, "component": self.components, "layer": [s.layer for s in self.sites],
                "level": [s.level for s in self.sites], "mean_effect": eff.mean(0),
                "mean_normalized_effect": norm.mean(0), "mean_abs_effect": abs(eff).mean(0),
            }))
        return pd.concat(rows, ignore_index=True)

    def plot(self, mode: Optional[str] = None, normalized: bool = True, ax=None):
        """Mean effect over pairs, one panel per level: component level as an attn/mlp x layer heatmap, heads
        as a head x layer heatmap, residual as a line over layers. `ax`: one Axes per level (or one, split)."""
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
        """(grid [rows, layers], layers, row labels): attn/mlp rows for components, one row per head for heads."""
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
# Where patches go and what is patched in.


@dataclass
class _Positions:
    """Flat (row, position) lists of one mode's patch: target positions and the matching source ones."""

    t_rows: torch.Tensor
    t_pos: torch.Tensor
    s_rows: Optional[torch.Tensor] = None
    s_pos: Optional[torch.Tensor] = None


def _lengths(tok: Tokenized) -> torch.Tensor:
    return tok.attention_mask.long().sum(-1)


def _patch_positions(batch: PairBatch, positions: str, target: Tokenized, source: Optional[Tokenized], pair_ids) -> _Positions:
    B = target.input_ids.shape[0]
    rows = torch.arange(B)
    if positions == "readout":
        return _Positions(rows, target.readout.cpu(), rows if source is not None else None,
                          source.readout.cpu() if source is not None else None)
    if positions == "prompt":
        counts = batch.prompt_len.cpu()
    else:  # "all"
        counts = _lengths(target).cpu()
        if source is not None:
            other = _lengths(source).cpu()
            bad = (counts != other).nonzero().flatten().tolist()
            if bad:
                b = bad[0]
                raise ValueError(
                    f"positions='all' patches position k onto position k, but pair {pair_ids[b]} has responses of "
                    f"{int(counts[b])} and {int(other[b])} tokens; use positions='readout' (the default) or "
                    "'prompt', or zero/mean ablation"
                )
    t_first = first_token(target).cpu()
    s_first = first_token(source).cpu() if source is not None else None
    t_rows, t_pos, s_pos = [], [], []
    for b in range(B):
        k = torch.arange(int(counts[b]))
        t_rows.append(torch.full_like(k, b))
        t_pos.append(t_first[b] + k)
        if source is not None:
            s_pos.append(s_first[b] + k)
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
    t_rows = cat(t_rows)
    return _Positions(t_rows, cat(t_pos), t_rows if source is not None else None, cat(s_pos) if source is not None else None)


def _select(site: Site, x: torch.Tensor) -> torch.Tensor:
    return x[..., site.head, :] if site.kind == "head" else x


def _site_values(
    model, site: Site, mode: str, pos: _Positions, src: Optional[Capture], means: Optional[Dict[str, torch.Tensor]],
    positions: str,
) -> torch.Tensor:
    """[n_patched_positions, ...site shape] values to write at `pos`."""
    cfg = model.cfg
    N = len(pos.t_rows)
    width = cfg.d_head if site.kind == "head" else cfg.d_model
    if mode == "zero":
        return torch.zeros(N, width, dtype=cfg.dtype, device=cfg.device)
    if mode == "mean":
        return means[site.name].to(cfg.device).expand(N, width)
    hook = site.hook(cfg.n_layers)
    if positions == "readout":
        return _select(site, src.at_readout[hook])[pos.s_rows.to(cfg.device)]
    return _select(site, src.full[hook])[pos.s_rows.to(cfg.device), pos.s_pos.to(cfg.device)]


# ---------------------------------------------------------------------------------------------------
# Engines: each returns the patched rewards [batch, n_sites] of one target batch.


def _readout_is_last(tok: Tokenized) -> bool:
    idx = torch.arange(tok.input_ids.shape[1], device=tok.attention_mask.device)
    after = tok.attention_mask.bool() & (idx[None] > tok.readout.to(idx.device)[:, None])
    return not bool(after.any())


def _target_readout_names(model, sites: Sequence[Site]) -> List[str]:
    L = model.cfg.n_layers
    names = [f"blocks.{l}.hook_resid_pre" for l in range(L)] + [f"blocks.{l}.hook_resid_mid" for l in range(L)]
    names.append(f"blocks.{L - 1}.hook_resid_post")
    names += sorted({f"blocks.{s.layer}.attn.hook_z" for s in sites if s.kind == "head"})
    return names


def _kv_names(model) -> List[str]:
    return [f"blocks.{l}.attn.hook_{k}" for l in range(model.cfg.n_layers) for k in ("rot_k", "v")]


def _entries(model, tcap: Capture, sites: Sequence[Site], values: Sequence[torch.Tensor]):
    """(layer, stage, state [B, d]) per site: the residual a readout patch leaves behind, and where the
    recomputation resumes. Head patches change the layer's attention output by (z'_h - z_h) W_O[h]
    (before Gemma-2's post-norm), all heads of a layer in one product."""
    cfg, L = model.cfg, model.cfg.n_layers
    acts = tcap.at_readout

    def resid_pre(l: int) -> torch.Tensor:
        return acts[f"blocks.{l}.hook_resid_pre"] if l < L else acts[f"blocks.{L - 1}.hook_resid_post"]

    out: List = [None] * len(sites)
    heads_by_layer: Dict[int, List[int]] = {}
    for i, (site, v) in enumerate(zip(sites, values)):
        if site.kind == "embed":
            out[i] = (0, _PRE, v)
        elif site.kind == "resid":
            out[i] = (site.layer, _PRE, v)
        elif site.kind == "attn":
            out[i] = (site.layer, _MID, resid_pre(site.layer) + v)
        elif site.kind == "mlp":
            out[i] = (site.layer + 1, _PRE, acts[f"blocks.{site.layer}.hook_resid_mid"] + v)
        else:
            heads_by_layer.setdefault(site.layer, []).append(i)
    for l, members in heads_by_layer.items():
        attn = model.blocks[l].attn
        z = acts[f"blocks.{l}.attn.hook_z"]  # [B, n_heads, d_head]
        heads = [sites[i].head for i in members]
        raw = z.reshape(z.shape[0], -1) @ attn.W_O.reshape(-1, cfg.d_model) + attn.b_O  # as the forward
        new = torch.stack([values[i] for i in members], 1)  # [B, k, d_head]
        delta = torch.einsum("bkh,khm->bkm", new - z[:, heads], attn.W_O[heads])
        attn_out = raw[:, None] + delta
        if cfg.post_norms:
            attn_out = model.blocks[l].ln1_post(attn_out)
        state = resid_pre(l)[:, None] + attn_out
        for j, i in enumerate(members):
            out[i] = (l, _MID, state[:, j])
    return out


def _readout_sweep(model, tcap: Capture, entries) -> torch.Tensor:
    """Final residuals [B, P, d] at the readout of every entry, recomputing only the readout token."""
    cfg, L = model.cfg, model.cfg.n_layers
    tok = tcap.tok
    B, T = tok.input_ids.shape
    device = tok.input_ids.device
    keys = [(layer, stage) for layer, stage, _ in entries]
    order = sorted(range(len(entries)), key=keys.__getitem__)
    sorted_keys = [keys[p] for p in order]
    state = torch.stack([entries[p][2] for p in order], 1).clone()  # [B, P, d]
    readout = tok.readout.to(device)
    mask = tok.attention_mask.to(device)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cos, sin = model.rotary(position_ids[torch.arange(B, device=device), readout][:, None], state.dtype)
    idx = torch.arange(T, device=device)
    before = mask.bool() & (idx[None] < readout[:, None])  # every other position the readout may see
    allowed = {w: before if w is None else before & (idx[None] > readout[:, None] - w) for w in set(cfg.window_sizes)}
    for l in range(sorted_keys[0][0], L):
        n_pre = bisect_left(sorted_keys, (l, _MID))
        n_all = bisect_right(sorted_keys, (l, _MID))
        block = model.blocks[l]
        if n_pre:
            x = state[:, :n_pre]
            z = block.attn.forward_readout(
                block.ln1(x), cos, sin, tcap.full[f"blocks.{l}.attn.hook_rot_k"], tcap.full[f"blocks.{l}.attn.hook_v"],
                allowed[block.attn.window],
            )
            attn_out = z.reshape(B, n_pre, -1) @ block.attn.W_O.reshape(-1, cfg.d_model) + block.attn.b_O
            if cfg.post_norms:
                attn_out = block.ln1_post(attn_out)
            state[:, :n_pre] = x + attn_out
        if n_all:
            x = state[:, :n_all]
            mlp_out = block.mlp(block.ln2(x))
            if cfg.post_norms:
                mlp_out = block.ln2_post(mlp_out)
            state[:, :n_all] = x + mlp_out
    final = torch.empty_like(state)
    final[:, order] = state
    return final


def _start_layer(site: Site) -> int:
    return -1 if site.kind == "embed" else site.layer  # -1: a full forward (hook_embed may precede positions)


def _resid_name(l: int, n_layers: int) -> str:
    return f"blocks.{l}.hook_resid_pre" if l < n_layers else f"blocks.{n_layers - 1}.hook_resid_post"


def _full_resid_names(model, sites: Sequence[Site]) -> List[str]:
    L = model.cfg.n_layers
    return sorted({_resid_name(_start_layer(s), L) for s in sites if s.kind != "embed"})


def has_readout_fast_path(model) -> bool:
    """Whether the model's blocks have `Attention.forward_readout` (native architectures; the generic
    path runs transformers' own layers and takes the `start_at_layer` route instead)."""
    try:
        return hasattr(model.blocks[0].attn, "forward_readout")
    except (AttributeError, NotImplementedError, IndexError):
        return False


def _writer(patches: List[Tuple[torch.Tensor, torch.Tensor, Optional[int], torch.Tensor]]) -> Callable:
    """A hook writing each (rows, positions, head, values) patch into the activation."""

    def hook(x: torch.Tensor, hook) -> torch.Tensor:
        x = x.clone()
        for rows, pos, head, values in patches:
            if head is None:
                x[rows, pos] = values.to(x.dtype)
            else:
                x[rows, pos, head] = values.to(x.dtype)
        return x

    return hook


def _start_at_layer_sweep(model, tcap: Capture, sites, pos: _Positions, values, max_rows: int) -> torch.Tensor:
    """Multi-position patches: rerun from the patched layer on the cached clean residual, many sites per
    forward (site p occupies rows p*B .. p*B+B-1)."""
    L = model.cfg.n_layers
    tok = tcap.tok
    B = tok.input_ids.shape[0]
    device = tok.input_ids.device
    out = torch.empty(B, len(sites), device=device, dtype=torch.float32)
    rows, t_pos = pos.t_rows.to(device), pos.t_pos.to(device)
    by_layer: Dict[int, List[int]] = {}
    for i, s in enumerate(sites):
        by_layer.setdefault(_start_layer(s), []).append(i)
    per_call = max(1, max_rows // B)
    for layer, members in sorted(by_layer.items()):
        for c in range(0, len(members), per_call):
            chunk = members[c:c + per_call]
            k = len(chunk)
            ids = tok.input_ids.repeat(k, 1)
            x = ids if layer < 0 else tcap.full[_resid_name(layer, L)].repeat(k, 1, 1)
            hooks: Dict[str, list] = {}
            for j, i in enumerate(chunk):
                site = sites[i]
                r = rows + j * B
                if site.kind == "resid":
                    x[r, t_pos] = values[i].to(x.dtype)
                else:
                    hooks.setdefault(site.hook(L), []).append((r, t_pos, site.head, values[i]))
            rewards = model.run_with_hooks(
                x, tok.attention_mask.repeat(k, 1), start_at_layer=None if layer < 0 else layer, input_ids=ids,
                readout_positions=tok.readout.repeat(k), fwd_hooks=[(h, _writer(p)) for h, p in hooks.items()],
            )
            out[:, chunk] = rewards.float().view(k, B).T
    return out


def _naive_sweep(model, tok: Tokenized, sites, pos: _Positions, values) -> torch.Tensor:
    """One full forward per site with `run_with_hooks` writing the patch: the reference."""
    L = model.cfg.n_layers
    device = tok.input_ids.device
    rows, t_pos = pos.t_rows.to(device), pos.t_pos.to(device)
    out = []
    for site, v in zip(sites, values):
        hook = _writer([(rows, t_pos, site.head, v)])
        out.append(model.run_with_hooks(
            tok.input_ids, tok.attention_mask, readout_positions=tok.readout, fwd_hooks=[(site.hook(L), hook)]
        ).float())
    return torch.stack(out, -1)


# ---------------------------------------------------------------------------------------------------
# The instrument.


@torch.no_grad()
def site_means(model, pairs, sites: Sequence[Site], positions: str = "readout", *, batch_size: int = 8,
               padding_side: Optional[str] = None, progress: Union[bool, str] = False) -> Dict[str, torch.Tensor]:
    """Mean activation of each site over both responses of every pair: at the readout (positions=
    "readout") or over every real token (otherwise). The values mean ablation writes."""
    L = model.cfg.n_layers
    hooks = sorted({s.hook(L) for s in sites})
    sums: Dict[str, torch.Tensor] = {}
    count = 0
    for batch in pair_batches(model, as_pairs(pairs), batch_size, progress and "means", padding_side):
        for tok in (batch.chosen, batch.rejected):
            if positions == "readout":
                cap = capture(model, tok, readout_names=hooks)
                acts = {h: cap.at_readout[h].double().sum(0) for h in hooks}
                count += tok.input_ids.shape[0]
            else:
                cap = capture(model, tok, full_names=hooks)
                m = tok.attention_mask.bool()
                acts = {h: cap.full[h][m].double().sum(0) for h in hooks}
                count += int(m.sum())
            for h, v in acts.items():
                sums[h] = sums.get(h, 0) + v
    return {s.name: _select(s, sums[s.hook(L)] / count).to(model.cfg.dtype) for s in sites}


def _check_options(modes, positions, method):
    if not modes:
        raise ValueError(f"no patching mode given (mode={modes!r}); use one or more of {MODES}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown patching mode(s) {bad}; use {MODES}")
    if positions not in POSITIONS:
        raise ValueError(f"unknown positions {positions!r}; use one of {POSITIONS}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use 'fast' or 'naive'")


def _patch_batch(model, batch: PairBatch, sites, modes, positions, method, means, pair_ids, max_rows, keep_states=False):
    L = model.cfg.n_layers
    sides = {"chosen": batch.chosen, "rejected": batch.rejected}
    targets = {t for m in modes for t in _TARGETS[m]}
    sources = {_SOURCE[m] for m in modes if m in _SOURCE}
    site_hooks = sorted({s.hook(L) for s in sites})
    caps: Dict[str, Capture] = {}
    engine_for: Dict[str, str] = {}
    for side, tok in sides.items():
        readout_names, full_names = [], []
        if side in targets and method == "fast":
            fast = positions == "readout" and has_readout_fast_path(model) and _readout_is_last(tok)
            engine_for[side] = "readout" if fast else "layer"
            if engine_for[side] == "readout":
                readout_names += _target_readout_names(model, sites)
                full_names += _kv_names(model)
            else:
                full_names += _full_resid_names(model, sites)
        if side in sources:
            (readout_names if positions == "readout" else full_names).extend(site_hooks)
        caps[side] = capture(model, tok, readout_names, full_names)
    out: Dict[Tuple[str, str], torch.Tensor] = {}
    states: Dict[Tuple[str, str], Tuple[torch.Tensor, torch.Tensor]] = {}
    directions: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for mode in modes:
        src_side = _SOURCE.get(mode)
        for target in _TARGETS[mode]:
            tcap = caps[target]
            src = caps[src_side] if src_side else None
            pos = _patch_positions(batch, positions, tcap.tok, src.tok if src else None, pair_ids)
            values = [_site_values(model, s, mode, pos, src, means, positions) for s in sites]
            if method == "naive":
                out[(mode, target)] = _naive_sweep(model, tcap.tok, sites, pos, values)
            elif engine_for[target] == "readout":
                entries = _entries(model, tcap, sites, values)
                final = _readout_sweep(model, tcap, entries)
                if target not in directions:  # (ArmoRM: one forward for the gate; shared by the modes)
                    directions[target] = readout_direction(model, tcap.tok)
                direction, bias = directions[target]
                out[(mode, target)] = reward_from_final_resid(model, final, direction[:, None], bias[:, None])
                if keep_states:
                    states[(mode, target)] = (torch.stack([e[2] for e in entries], 1), final)
            else:
                out[(mode, target)] = _start_at_layer_sweep(model, tcap, sites, pos, values, max_rows)
    clean = (caps["chosen"].rewards.float(), caps["rejected"].rewards.float())
    return out, clean, caps, states


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
    pairs = as_pairs(pairs)
    modes = [mode] if isinstance(mode, str) else list(dict.fromkeys(mode))
    _check_options(modes, positions, method)
    sites = sites_for(model.cfg, level, layers)
    if "mean" in modes and means is None:
        means = site_means(model, pairs, sites, positions, batch_size=batch_size, padding_side=padding_side)
    ids = pair_labels(pairs)
    chunks: Dict[Tuple[str, str], List[torch.Tensor]] = {}
    clean_c, clean_r = [], []
    for batch in pair_batches(model, pairs, batch_size, progress and "patch", padding_side):
        out, (c, r), _, _ = _patch_batch(model, batch, sites, modes, positions, method, means, ids[batch.index], max_rows)
        clean_c.append(c)
        clean_r.append(r)
        for k, v in out.items():
            chunks.setdefault(k, []).append(v)
    return PatchResult(
        pair_ids=ids, sites=sites, positions=positions, method=method,
        clean_chosen=torch.cat(clean_c).cpu(), clean_rejected=torch.cat(clean_r).cpu(),
        patched={k: torch.cat(v).cpu() for k, v in chunks.items()},
    )
