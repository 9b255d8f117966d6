"""Circuit faithfulness and faithfulness curves (docs/theory.md, "Circuits").

A circuit is a set of edges of the readout graph (senders embed + heads + MLPs, every receiver). Noising:
the target is the chosen run; circuit edges carry their sender's output as recomputed in the circuit run,
every other edge the rejected run's. Denoising: the target is the rejected run; circuit edges carry the
chosen run's outputs, the others the recomputed ones. Either way

    faithfulness = (r(circuit) - r_rejected) / (r_chosen - r_rejected)      per pair

is 1 for every edge and 0 for none, exactly (NaN for a tie: no gap to keep); the readout's input is then
one run's final residual. The
readout token is recomputed over the target's cached keys/values (`graph.circuit_rewards`).

The curve: faithfulness of the top-n edges of a ranking for n in `sizes`; x = n / n_edges. CPR = the area
under the mean curve over x in [0, 1] (trapezoids), CMD = the area between it and 1 (of |1 - f|).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch

from reward_lens.core.batching import pair_batches
from reward_lens.core.directions import readout_direction
from reward_lens.core.readout import capture
from reward_lens.data.pairs import as_pairs, pair_labels
from reward_lens.instruments.circuits.graph import (
    TARGET,
    capture_names,
    circuit_rewards,
    edge_mask,
    nodes,
    target_run,
)
from reward_lens.instruments.circuits.positions import circuit_rewards_all, source_run_all, target_run_all
from reward_lens.instruments.patching.path import check_positions, token_aligned_batches
from reward_lens.model.frozen import with_frozen_weights
from reward_lens.model.validation import as_index, checked_arguments, safe_ratio
from reward_lens.plotting import finish, panels
from reward_lens.results import to_numpy

Edge = Tuple[str, str]


def _assignments(model, circuits: Sequence[Union[str, Sequence[Edge]]], mode: str):
    snodes, rnodes = nodes(model, None, None)
    valid = edge_mask(snodes, rnodes)
    s_at = {s.name: i for i, s in enumerate(snodes)}
    r_at = {r.name: j for j, r in enumerate(rnodes)}
    out = torch.zeros(len(circuits), len(snodes), len(rnodes), dtype=torch.bool)
    for k, edges in enumerate(circuits):
        if isinstance(edges, str):
            if edges != "all":
                raise ValueError(f"edges must be 'all' or a list of (sender, receiver), got {edges!r}")
            out[k] = valid
            continue
        for s, r in edges:
            if s not in s_at or r not in r_at or not valid[s_at[s], r_at[r]]:
                raise ValueError(
                    f"({s!r}, {r!r}) is not an edge of the readout graph (senders {snodes[0].name}, "
                    "L{l}H{h}, mlp_L{l}; path_patch's receivers; the receiver reads later)"
                )
            out[k, s_at[s], r_at[r]] = True
    return snodes, rnodes, (out if mode == "noising" else ~out)  # True: the edge carries the recomputed value


def _circuit_batch(model, tok, stok, snodes, rnodes, recomputed, everywhere: bool):
    """(circuit rewards [B, K], target rewards, source rewards) of one batch."""
    direction, bias = readout_direction(model, tok)
    if everywhere:
        tcap, seq = target_run_all(model, tok)
        src = source_run_all(model, stok)
        r = circuit_rewards_all(model, tcap.full, seq, src.full, snodes, rnodes, recomputed, direction, bias)
        return r.cpu(), tcap.rewards, src.rewards
    ctx = target_run(model, tok)
    src = capture(model, stok, capture_names(model))
    r = circuit_rewards(model, ctx, src.at_readout, snodes, rnodes, recomputed, direction, bias)
    return r.cpu(), ctx.cap.rewards, src.rewards


@torch.no_grad()
def circuit_faithfulness_matrix(
    model,
    pairs,
    circuits,
    *,
    mode: str = "noising",
    positions: str = "readout",
    batch_size: int = 8,
    padding_side: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(faithfulness [n_pairs, n_circuits], clean gap [n_pairs]) of several circuits at once."""
    everywhere = check_positions(positions) == "all"
    if mode not in TARGET:
        raise ValueError(f"mode must be one of {tuple(TARGET)}, got {mode!r}")
    if not model.has_head_hooks or any(b.output_gain_hooks() for b in model.blocks):
        raise ValueError(
            "circuits need per-head outputs that add up to the attention output (a native architecture "
            "without post-norms)"
        )
    snodes, rnodes, recomputed = _assignments(model, circuits, mode)
    t_side, s_side = TARGET[mode]
    out, gaps = [], []
    batches = (token_aligned_batches if everywhere else pair_batches)(
        model, as_pairs(pairs), batch_size, False, padding_side
    )
    for batch in batches:
        tok, stok = getattr(batch, t_side), getattr(batch, s_side)
        r, r_target, r_source = _circuit_batch(model, tok, stok, snodes, rnodes, recomputed, everywhere)
        rc, rr = (r_target, r_source) if t_side == "chosen" else (r_source, r_target)
        gap = (rc - rr).float().cpu()
        out.append(safe_ratio(r - rr.float().cpu()[:, None], gap[:, None]))  # a tie (no gap): NaN
        gaps.append(gap)
    return torch.cat(out), torch.cat(gaps)


@checked_arguments(counts={"batch_size": 1})
@with_frozen_weights
def circuit_faithfulness(
    model,
    pairs,
    edges: Union[str, Sequence[Edge]] = "all",
    *,
    mode: str = "noising",
    positions: str = "readout",
    batch_size: int = 8,
    padding_side: Optional[str] = None,
) -> torch.Tensor:
    """Per pair [n_pairs]: the fraction of the clean gap the circuit `edges` keeps (module docstring).
    edges: "all", or (sender, receiver) pairs (e.g. `EdgeAttributionResult.circuit(top_n=20)`).
    positions: "readout" (edges at the readout token) or "all" (every edge at every position;
    token-aligned pairs)."""
    return circuit_faithfulness_matrix(
        model,
        pairs,
        [edges],
        mode=mode,
        positions=positions,
        batch_size=batch_size,
        padding_side=padding_side,
    )[0][:, 0]


@dataclass
class FaithfulnessCurve:
    """`faithfulness` [n_pairs, n_sizes] of the top-`sizes[k]` edges of `ranking` (of `n_edges` edges)."""

    pair_ids: List[str]
    sizes: List[int]
    n_edges: int
    mode: str
    faithfulness: torch.Tensor
    positions: str = "readout"

    @property
    def fraction(self) -> np.ndarray:
        return np.asarray(self.sizes, dtype=float) / self.n_edges

    @property
    def mean(self) -> np.ndarray:
        return to_numpy(self.faithfulness).mean(0)

    @property
    def cpr(self) -> float:
        """Area under the mean faithfulness curve over the fraction of edges kept."""
        return float(np.trapezoid(self.mean, self.fraction))

    @property
    def cmd(self) -> float:
        """Area between the mean faithfulness curve and 1."""
        return float(np.trapezoid(np.abs(1.0 - self.mean), self.fraction))

    def to_frame(self) -> pd.DataFrame:
        """One row per (pair, size): pair, size, fraction, faithfulness."""
        f = to_numpy(self.faithfulness)
        rows = [
            (pid, n, n / self.n_edges, f[i, k])
            for i, pid in enumerate(self.pair_ids)
            for k, n in enumerate(self.sizes)
        ]
        return pd.DataFrame(rows, columns=["pair", "size", "fraction", "faithfulness"])

    def summary(self) -> pd.DataFrame:
        """CPR, CMD, and the smallest circuit whose mean faithfulness reaches 0.9 (NaN if none)."""
        reach = [n for n, m in zip(self.sizes, self.mean) if m >= 0.9]
        return pd.DataFrame(
            {
                "cpr": [self.cpr],
                "cmd": [self.cmd],
                "n_edges": [self.n_edges],
                "size_at_0.9": [reach[0] if reach else float("nan")],
            }
        )

    def plot(self, ax=None):
        fig, (ax,), created = (*panels(ax, 1, (5, 3.5)), ax is None)
        f = to_numpy(self.faithfulness)
        for row in f:
            ax.plot(self.sizes, row, color="0.8", lw=0.7)
        ax.plot(self.sizes, self.mean, color="tab:blue", marker="o", ms=3, label="mean")
        ax.axhline(1.0, color="k", lw=0.6, ls="--")
        ax.set_xscale("symlog")
        ax.set_xlabel("edges in the circuit")
        ax.set_ylabel("faithfulness")
        ax.set_title(
            f"Faithfulness curve ({self.mode}, positions={self.positions}): CPR {self.cpr:.3f}, CMD "
            f"{self.cmd:.3f}"
        )
        ax.legend(fontsize=7)
        return finish(fig, created)


def default_sizes(n_edges: int) -> List[int]:
    out = {0, n_edges}
    n = 1
    while n < n_edges:
        out.add(n)
        n *= 2
    return sorted(out)


def _check_sizes(sizes: Sequence[int], n_ranked: int) -> List[int]:
    """A non-empty list of circuit sizes, each an integer in [0, n_ranked] (never widened or rounded)."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__") or len(sizes) == 0:
        raise ValueError(
            f"sizes={sizes!r}: give a non-empty list of circuit sizes (edge counts, e.g. [0, 4, 16]), or "
            "None for the default"
        )
    return [
        as_index(n, "circuit size", n_ranked + 1, hint=f" (the ranking has {n_ranked} edges)") for n in sizes
    ]


@checked_arguments(counts={"batch_size": 1})
@with_frozen_weights
def faithfulness_curve(
    model,
    pairs,
    ranking,
    *,
    sizes: Optional[Sequence[int]] = None,
    mode: Optional[str] = None,
    positions: Optional[str] = None,
    batch_size: int = 8,
    padding_side: Optional[str] = None,
) -> FaithfulnessCurve:
    """Faithfulness of the top-n edges of `ranking` (an EdgeAttributionResult, ranked by |mean score|,
    or an ordered list of edges) for each n in `sizes` (default 0, 1, 2, 4, ..., every edge). `mode` and
    `positions` default to the ranking's (else "noising", "readout")."""
    if hasattr(ranking, "ranking"):
        mode = mode or ranking.mode
        positions = positions or getattr(ranking, "positions", None)
        ranking = ranking.ranking()
    mode = mode or "noising"
    positions = check_positions(positions or "readout")
    snodes, rnodes = nodes(model, None, None)
    n_edges = int(edge_mask(snodes, rnodes).sum())
    if sizes is None and len(ranking) < n_edges:
        raise ValueError(
            f"the ranking holds {len(ranking)} of the model's {n_edges} edges, and the default sizes go up "
            f"to every edge: pass sizes= (each at most {len(ranking)}), or rank every edge"
        )
    sizes = _check_sizes(sizes, len(ranking)) if sizes is not None else default_sizes(n_edges)
    if any(n > len(ranking) for n in sizes):
        raise ValueError(f"sizes go up to {max(sizes)} but the ranking has {len(ranking)} edges")
    f, _ = circuit_faithfulness_matrix(
        model,
        pairs,
        [list(ranking[:n]) for n in sizes],
        mode=mode,
        positions=positions,
        batch_size=batch_size,
        padding_side=padding_side,
    )
    return FaithfulnessCurve(pair_labels(as_pairs(pairs)), sizes, n_edges, mode, f, positions)
