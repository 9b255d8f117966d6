"""What the component graph (`attribution_graph.AttributionGraph`) and the feature graph
(`feature_graph.FeatureGraph`) share: the fields of one text's graph, its edge and node frames, its
restriction to a node subset (pruning) and its strongest paths into the reward (`graph_prune`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import pandas as pd
import torch

from reward_lens.instruments.circuits import graph_prune as gp
from reward_lens.model.validation import checked_arguments


@dataclass
class RewardGraph:
    """One text's graph over nodes with the reward as the one logit: `nodes` (one row per node, its index
    the node's column in `rows`), `rows` [n_rows, n_nodes] the materialised incoming edges of the targets
    `row_nodes` (row t, column s: the direct effect of s on t), `reward` the model's reward on the text and
    `bias` the readout's constant. The frames, restriction and paths both graphs share."""

    nodes: pd.DataFrame
    rows: torch.Tensor
    row_nodes: torch.Tensor
    reward: float
    bias: float
    readout: int
    tokens: List[str]
    token_ids: List[int]
    n_layers: int
    n_heads: int
    model_name: str = ""
    thresholds: Optional[Tuple[float, float]] = None
    meta: Dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ frames
    def _influence_by_component(self, kinds: Tuple[str, ...]) -> pd.DataFrame:
        """The nodes of `kinds` summed over positions by component (the node name before `@`):
        influence, value and |value|, most influential first."""
        frame = self.nodes[self.nodes.kind.isin(kinds)].copy()
        frame["component"] = frame.node.str.split("@").str[0]
        frame["abs_value"] = frame.value.abs()
        agg = frame.groupby("component", sort=False)[["influence", "value", "abs_value"]].sum()
        return agg.sort_values("influence", ascending=False).reset_index()

    @property
    def reward_node(self) -> int:
        return int(np.flatnonzero(self.nodes.kind.to_numpy() == "reward")[0])

    @property
    def edges(self) -> pd.DataFrame:
        """One row per materialised non-zero edge: source, target, weight (prune a large graph first)."""
        t, s = torch.nonzero(self.rows, as_tuple=True)
        names = self.nodes.node.to_numpy()
        return pd.DataFrame(
            {
                "source": names[s.numpy()],
                "target": names[self.row_nodes[t].numpy()],
                "weight": self.rows[t, s].numpy().astype(np.float64),
            }
        )

    def to_frame(self) -> pd.DataFrame:
        """The nodes: node, kind, layer, head, position, token, value, influence, cumulative_influence,
        error (head / MLP rows: what their error node holds), has_row (incoming edges materialised)."""
        return self.nodes.copy()

    def _restricted(self, keep: torch.Tensor, rows: torch.Tensor, thresholds) -> "RewardGraph":
        index = torch.nonzero(keep).flatten()
        new_of = torch.full((len(keep),), -1, dtype=torch.long)
        new_of[index] = torch.arange(len(index))
        kept_rows = keep[self.row_nodes]
        nodes = self.nodes.iloc[index.numpy()].reset_index(drop=True)
        return replace(
            self,
            nodes=nodes,
            rows=rows[kept_rows][:, index].contiguous(),
            row_nodes=new_of[self.row_nodes[kept_rows]],
            thresholds=thresholds,
        )

    @checked_arguments(counts={"n": 1})
    def top_paths(self, n: int = 5, start: Union[str, Tuple[str, ...]] = "embed") -> pd.DataFrame:
        """The `n` strongest paths into the reward from nodes of kind `start`: for each start node its path
        of largest product of normalised |weights| (its share of the reward's incoming mass), best first.
        Columns: path (node names, the reward last), share, start, value (the start node's)."""
        best, nxt = gp.best_paths(self.rows, self.row_nodes, self.reward_node)
        starts = np.flatnonzero(self.nodes.kind.isin([start] if isinstance(start, str) else start).to_numpy())
        order = starts[np.argsort(-best[starts].numpy(), kind="stable")][:n]
        names = self.nodes.node.to_numpy()
        return pd.DataFrame(
            {
                "path": [[names[i] for i in gp.follow(nxt, int(s))] for s in order],
                "share": best[order].numpy().astype(np.float64),
                "start": names[order],
                "value": self.nodes.value.to_numpy()[order],
            }
        )

    def path_to_reward(self, node: str) -> List[str]:
        """The strongest path (largest product of normalised |weights|) from `node` to the reward."""
        where = np.flatnonzero(self.nodes.node.to_numpy() == node)
        if not len(where):
            raise ValueError(f"no node {node!r} in this graph (see graph.to_frame().node)")
        _, nxt = gp.best_paths(self.rows, self.row_nodes, self.reward_node)
        names = self.nodes.node.to_numpy()
        return [names[i] for i in gp.follow(nxt, int(where[0]))]


def text_fields(model, tok: Any, run: Any) -> Dict[str, Any]:
    """The `RewardGraph` fields of the one sequence in `tok` and its clean `run` (reward, bias, readout):
    token ids, each token's text (the id as text when the model has no tokenizer), the model's shape and
    name."""
    ids = tok.input_ids[0].tolist()
    return {
        "reward": run.reward,
        "bias": run.bias,
        "readout": run.readout,
        "tokens": [model.tokenizer.decode([i]) if model.tokenizer is not None else str(i) for i in ids],
        "token_ids": ids,
        "n_layers": model.cfg.n_layers,
        "n_heads": model.cfg.n_heads,
        "model_name": str(getattr(model.cfg, "model_name", "") or ""),
    }
