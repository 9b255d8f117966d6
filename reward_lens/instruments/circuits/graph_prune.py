"""Influence, pruning and paths of an attribution graph, as circuit-tracer defines them
(safety-research/circuit-tracer, `circuit_tracer/graph.py`), with the reward as the one target logit
(weight 1).

The adjacency is held as the rows that exist: `rows` [n_rows, N] (targets) over all N nodes (sources), with
`row_nodes` [n_rows] naming each row's target; a node without a row has no incoming edges. Never a dense
N x N matrix.

- normalised adjacency: |A| with each row divided by its sum (clamped at 1e-10);
- influence: w A + w A^2 + ... for the logit weights w (a node's share of the reward's incoming mass,
  through all paths of the normalised graph);
- pruning: keep the nodes whose influence, sorted, reaches `node_threshold` of the total (token and
  reward nodes always), then the edges whose score (normalised weight times the target's influence in the
  node-pruned graph, plus its logit weight) reaches `edge_threshold` of the total; then, repeatedly, drop
  component and error nodes without a kept outgoing edge and component nodes without a kept incoming edge.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch


def normalize_rows(rows: torch.Tensor) -> torch.Tensor:
    """|rows| with each row scaled to sum 1 (rows of zeros stay zero)."""
    a = rows.abs()
    a /= a.sum(1, keepdim=True).clamp(min=1e-10)  # in place: a graph's rows can be most of its memory
    return a


def propagate(
    norm: torch.Tensor,
    row_nodes: torch.Tensor,
    start: torch.Tensor,
    max_iter: int = 1000,
    row_scale: Optional[torch.Tensor] = None,
):
    """sum_{k >= 1} start A^k for the normalised adjacency A given by its rows (start: [N] weights). With
    `row_scale` [n_rows], A = diag(row_scale) norm, applied to the vector instead of the matrix."""
    scale = torch.ones(len(row_nodes)) if row_scale is None else row_scale
    current = (start[row_nodes] * scale) @ norm
    total = current.clone()
    for _ in range(max_iter):
        current = (current[row_nodes] * scale) @ norm
        if not bool(current.any()):
            return total
        total += current
    raise RuntimeError(f"influence did not converge in {max_iter} steps (the graph has a cycle)")


def node_influence(rows: torch.Tensor, row_nodes: torch.Tensor, target: int) -> torch.Tensor:
    """[N] each node's influence on `target` (circuit-tracer's compute_node_influence). The row
    normalisation scales the propagated vector, so the rows are held once more (|rows|)."""
    a = rows.abs()
    w = torch.zeros(rows.shape[1])
    w[target] = 1.0
    return propagate(a, row_nodes, w, row_scale=1.0 / a.sum(1).clamp(min=1e-10))


def ordered_influence(
    rows: torch.Tensor,
    row_nodes: torch.Tensor,
    target: int,
    row_level: torch.Tensor,
    use: Optional[torch.Tensor] = None,
    skip_column: Optional[int] = None,
    block: int = 32,
) -> torch.Tensor:
    """[N] `node_influence` of the graph of the rows `use` (indices into `rows`; None: all), for a graph
    whose edges only run up levels: a row of level v has no edge from a node whose row has level >= v
    (the feature graph: a feature reads only layers below its own; the reward is above all). Then one
    pass over the rows in decreasing level is the whole series: a node's influence is complete once every
    row above it has passed. |rows| is taken a block of rows at a time (never a copy of the rows);
    `skip_column` (the constant node) is left out of the normalised adjacency."""
    use = torch.arange(len(row_nodes)) if use is None else use
    N = rows.shape[1]
    reach = torch.zeros(N)  # influence, plus the logit weight at the target
    reach[target] = 1.0
    levels = row_level[use]
    for level in torch.unique(levels).flip(0).tolist():
        here = use[levels == level]
        update = torch.zeros(N)  # rows of one level feed only nodes below it: apply after the level
        for b in here.split(block):
            a = rows[b].abs_()  # rows[b] is a copy (b indexes): made non-negative in place
            if skip_column is not None:
                a[:, skip_column] = 0
            update += (reach[row_nodes[b]] / a.sum(1).clamp(min=1e-10)) @ a
        reach += update
    reach[target] -= 1.0
    return reach


def find_threshold(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The score above which the largest scores reach `fraction` of the total."""
    ordered = torch.sort(scores.flatten(), descending=True).values
    cumulative = torch.cumsum(ordered, 0) / ordered.sum().clamp(min=1e-30)
    index = min(int(torch.searchsorted(cumulative, torch.tensor(fraction))), len(ordered) - 1)
    return ordered[index]


def cumulative_influence(influence: torch.Tensor) -> torch.Tensor:
    """[N] each node's cumulative share of influence in descending order (what circuit-tracer's JSON
    calls a node's influence)."""
    order = torch.sort(influence, descending=True)
    out = torch.zeros_like(influence)
    out[order.indices] = torch.cumsum(order.values, 0) / order.values.sum().clamp(min=1e-30)
    return out


def prune(
    rows: torch.Tensor,
    row_nodes: torch.Tensor,
    target: int,
    always: torch.Tensor,
    component: torch.Tensor,
    node_threshold: float = 0.8,
    edge_threshold: float = 0.98,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(node mask [N], edge mask [n_rows, N], influence [N]): `always` marks the token and reward nodes
    (kept), `component` the heads and MLPs (they need an incoming edge too)."""
    for name, t in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float, np.floating, np.integer))
            or not 0.0 <= t <= 1.0
        ):
            raise ValueError(
                f"{name} must be a number between 0 and 1 (the share of influence kept), got {t!r}"
            )
    influence = node_influence(rows, row_nodes, target)
    keep = (influence >= find_threshold(influence, node_threshold)) | always
    pruned = rows * keep[None] * keep[row_nodes][:, None]
    norm = normalize_rows(pruned)
    w = torch.zeros(rows.shape[1])
    w[target] = 1.0
    target_influence = propagate(norm, row_nodes, w) + w
    scores = norm * target_influence[row_nodes][:, None]
    edges = (scores >= find_threshold(scores, edge_threshold)) & (pruned != 0)
    has_row = torch.zeros_like(keep)
    has_row[row_nodes] = True
    while True:
        before = keep.clone()
        edges &= keep[None] & keep[row_nodes][:, None]
        outgoing = edges.any(0)
        incoming = torch.zeros_like(keep)
        incoming[row_nodes] = edges.any(1)
        keep &= always | outgoing
        keep &= ~component | incoming
        if torch.equal(keep, before):
            return keep, edges, influence


def best_paths(rows: torch.Tensor, row_nodes: torch.Tensor, target: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(best [N], next [N]): the largest product of normalised |weights| along a path from each node to
    `target` (1 at the target, 0 where none), and the node that path visits next (-1 at the end)."""
    norm = normalize_rows(rows)
    N = rows.shape[1]
    best = torch.zeros(N)
    best[target] = 1.0
    nxt = torch.full((N,), -1, dtype=torch.long)
    for _ in range(N):
        through = norm * best[row_nodes][:, None]  # [n_rows, N] path share via each row's target
        value, arg = through.max(0)
        value[target] = 1.0
        new_next = torch.where(value > 0, row_nodes[arg], torch.full_like(nxt, -1))
        new_next[target] = -1
        if torch.equal(value, best):
            return value, new_next
        best, nxt = value, new_next
    return best, nxt


def follow(nxt: torch.Tensor, start: int) -> List[int]:
    """The node indices from `start` to the end of its best path."""
    path = [start]
    while int(nxt[path[-1]]) >= 0 and len(path) <= len(nxt):
        path.append(int(nxt[path[-1]]))
    return path
