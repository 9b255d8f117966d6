"""Sites: the places in the model an instrument reads or patches (components, heads, residual stream)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import pandas as pd

from reward_lens.model.hooks import act_name, resid_entering

LEVELS = ("component", "head", "residual")
SITE_HOOK_KIND = {"attn": "attn_out", "mlp": "mlp_out", "head": "z"}  # site kind -> hook kind (per layer)


@dataclass(frozen=True)
class Site:
    """One place in the model an instrument reads or patches.

    kind: "embed" | "attn" | "mlp" | "head" | "resid". `layer` is the block index (-1 for embed;
    n_layers for the final residual, the one the reward head reads). `hook_name` is the hook point holding
    its activation (for a head, `hook_z`, sliced at `head`).
    """

    name: str
    kind: str
    layer: int
    head: Optional[int] = None

    @property
    def level(self) -> str:
        return {
            "embed": "component",
            "attn": "component",
            "mlp": "component",
            "head": "head",
            "resid": "residual",
        }[self.kind]

    def hook_name(self, n_layers: int) -> str:
        """The hook holding the site's activation (see `reward_lens.model.hooks`)."""
        if self.kind == "embed":
            return act_name(self.name)  # "embed" or "pos_embed"
        if self.kind == "resid":
            return resid_entering(self.layer, n_layers)
        return act_name(SITE_HOOK_KIND[self.kind], self.layer)


def site_rows(pair_ids: Sequence[str], sites: Sequence[Site]) -> Dict[str, Any]:
    """The identifying columns of a frame with one row per (pair, site), pairs outermost (the order of a
    [pair, site] tensor's `ravel()`): pair, component, layer, head, level."""
    n, S = len(pair_ids), len(sites)
    return {
        "pair": [pid for pid in pair_ids for _ in range(S)],
        "component": [s.name for s in sites] * n,
        "layer": [s.layer for s in sites] * n,
        "head": pd.array([s.head for s in sites] * n, dtype="Int64"),
        "level": [s.level for s in sites] * n,
    }


def _check_layers(layers: Optional[Sequence[int]], n_layers: int) -> List[int]:
    if layers is None:
        return list(range(n_layers))
    layers = sorted(set(int(l) for l in layers))
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: this model has blocks 0..{n_layers - 1}")
    return layers


def component_sites(cfg, layers: Optional[Sequence[int]] = None, embed: bool = True) -> List[Site]:
    """embed, then attn_L{l}, mlp_L{l} for each layer: the terms the residual stream is the sum of.

    Models with learned position embeddings (generic path, e.g. GPT-2) add "pos_embed" after "embed".
    """
    sites = [Site("embed", "embed", -1)] if embed else []
    if embed and getattr(cfg, "positional_embedding_type", None) == "standard":
        sites.append(Site("pos_embed", "embed", -1))
    for l in _check_layers(layers, cfg.n_layers):
        sites += [Site(f"attn_L{l}", "attn", l), Site(f"mlp_L{l}", "mlp", l)]
    return sites


def head_sites(cfg, layers: Optional[Sequence[int]] = None) -> List[Site]:
    return [
        Site(f"L{l}H{h}", "head", l, h)
        for l in _check_layers(layers, cfg.n_layers)
        for h in range(cfg.n_heads)
    ]


def resid_name(layer: int) -> str:
    """The one name of the residual entering block `layer` (`layer` = n_layers: the final residual), in
    every instrument: patching's residual sites, the lens, path patching."""
    return f"resid_L{layer}"


def resid_mid_name(layer: int) -> str:
    """The one name of block `layer`'s residual between its attention and its MLP."""
    return f"resid_mid_L{layer}"


def resid_sites(cfg, layers: Optional[Sequence[int]] = None) -> List[Site]:
    """resid_L{l}: the residual entering block l; resid_L{n_layers}: the final residual."""
    chosen = _check_layers(layers, cfg.n_layers) + ([cfg.n_layers] if layers is None else [])
    return [Site(resid_name(l), "resid", l) for l in chosen]


def sites_for(cfg, level: Union[str, Sequence[str]], layers: Optional[Sequence[int]] = None) -> List[Site]:
    levels = [level] if isinstance(level, str) else list(level)
    out: List[Site] = []
    for lv in levels:
        if lv == "component":
            out += component_sites(cfg, layers, embed=layers is None)
        elif lv == "head":
            out += head_sites(cfg, layers)
        elif lv == "residual":
            out += resid_sites(cfg, layers)
        else:
            raise ValueError(f"unknown level {lv!r}; use one of {LEVELS}")
    return out
