"""Where a patch goes and what is patched in: the (row, position) pairs of the target and the source for
each position choice, and the values written there for each mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from reward_lens.core.batching import PairBatch, Tokenized, first_token
from reward_lens.core.readout import Capture
from reward_lens.instruments.sites import Site


@dataclass
class Positions:
    """Flat (row, position) lists of one mode's patch: target positions and the matching source ones."""

    t_rows: torch.Tensor
    t_pos: torch.Tensor
    s_rows: Optional[torch.Tensor] = None
    s_pos: Optional[torch.Tensor] = None


def lengths(tok: Tokenized) -> torch.Tensor:
    return tok.attention_mask.long().sum(-1)


def patch_positions(
    batch: PairBatch, positions: str, target: Tokenized, source: Optional[Tokenized], pair_ids
) -> Positions:
    """The target's patched positions and the source's matching ones ("readout": readout onto readout;
    "prompt": the shared prompt tokens, k onto k; "all": every token, equal lengths needed)."""
    B = target.input_ids.shape[0]
    if positions == "readout":  # stays on the device: no host sync per batch and mode
        rows = torch.arange(B, device=target.readout.device)
        return Positions(
            rows,
            target.readout,
            rows if source is not None else None,
            source.readout.to(rows.device) if source is not None else None,
        )
    rows = torch.arange(B)
    if positions == "prompt":
        counts = batch.prompt_len.cpu()
    else:  # "all"
        counts = lengths(target).cpu()
        if source is not None:
            other = lengths(source).cpu()
            bad = (counts != other).nonzero().flatten().tolist()
            if bad:
                b = bad[0]
                raise ValueError(
                    f"positions='all' patches position k onto position k, but pair {pair_ids[b]} has "
                    f"responses of {int(counts[b])} and {int(other[b])} tokens; use positions='readout' "
                    "(the default) or 'prompt', or zero/mean ablation"
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
    return Positions(
        t_rows, cat(t_pos), t_rows if source is not None else None, cat(s_pos) if source is not None else None
    )


def select(site: Site, x: torch.Tensor) -> torch.Tensor:
    """The site's slice of its hook's activation (a head's row of hook_z; the whole vector otherwise)."""
    return x[..., site.head, :] if site.kind == "head" else x


def site_values(
    model,
    site: Site,
    mode: str,
    pos: Positions,
    src: Optional[Capture],
    means: Optional[Dict[str, torch.Tensor]],
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
    hook = site.hook_name(cfg.n_layers)
    if positions == "readout":
        return select(site, src.at_readout[hook])[pos.s_rows.to(cfg.device)]
    return select(site, src.full[hook])[pos.s_rows.to(cfg.device), pos.s_pos.to(cfg.device)]
