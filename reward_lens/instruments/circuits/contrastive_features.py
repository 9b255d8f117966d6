"""Which transcoder features change the reward between a text and its control: the contrastive ranking on
two feature graphs.

    tc = reward_lens.load_transcoders("demo")
    c = contrastive_features(model, (prompt, long_response), (prompt, short_response), transcoders=tc)
    c.to_frame()   # layer, feature, value_text, value_control, delta, positions_text, positions_control, rank
    c.rank_of({(2, 26), (3, 200)})   # best rank of any of these (layer, feature) pairs

One text's graph ranks what builds its whole reward, and most of that (the readout token's and the answer's
features) is shared by every text. A mechanism planted as a difference between texts (appended filler, an
agreeing opener, a trigger word) shows as the change of a feature's push. Each graph's `value` is a node's
exact signed total effect on the reward in that text's local replacement model; a (layer, feature)'s value
in a text is the sum of its nodes' values over every position it is active at (0 where it is inactive),
and features are ranked by delta = value_text - value_control, largest increase first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Tuple

import numpy as np
import pandas as pd

from reward_lens.instruments.circuits.feature_graph import FeatureGraph
from reward_lens.model.validation import checked_arguments

KEY = ["layer", "feature"]


@dataclass
class ContrastiveFeatures:
    """The features of a text against its control: `features` (one row per (layer, feature) active in
    either, ranked by `delta` descending, `rank` 1-based), both rewards, and the two graphs."""

    features: pd.DataFrame
    reward_text: float
    reward_control: float
    graph: FeatureGraph = field(repr=False)
    control_graph: FeatureGraph = field(repr=False)

    def to_frame(self) -> pd.DataFrame:
        return self.features.copy()

    @checked_arguments(counts={"top": 1})
    def summary(self, top: int = 10) -> pd.DataFrame:
        """The `top` features by delta, the reward change as attrs."""
        out = self.features.head(top).reset_index(drop=True)
        out.attrs.update(
            reward_text=self.reward_text,
            reward_control=self.reward_control,
            reward_change=self.reward_text - self.reward_control,
        )
        return out

    def rank_of(self, features: Iterable[Tuple[int, int]]) -> float:
        """The best rank of any of `features` ((layer, feature) pairs); inf when none is active in either."""
        wanted = {(int(l), int(i)) for l, i in features}
        hit = [(int(l), int(i)) in wanted for l, i in zip(self.features.layer, self.features.feature)]
        ranks = self.features["rank"].to_numpy()[np.array(hit, dtype=bool)]
        return float(ranks.min()) if len(ranks) else float("inf")

    @checked_arguments(counts={"top": 1})
    def plot(self, ax: Any = None, top: int = 15) -> Any:
        """The `top` features' value in the text and in the control, as horizontal bars."""
        from reward_lens.plotting import figure_axes, finish

        created = ax is None
        fig, ax = figure_axes(ax, figsize=(7, 5))
        frame = self.features.head(top)[::-1]
        y = np.arange(len(frame))
        ax.barh(y + 0.2, frame.value_text, height=0.4, label="text", color="#2166ac")
        ax.barh(y - 0.2, frame.value_control, height=0.4, label="control", color="#999999")
        ax.set_yticks(y)
        ax.set_yticklabels([f"L{l}F{i}" for l, i in zip(frame.layer, frame.feature)], fontsize=7)
        ax.set_xlabel("summed total effect on the reward")
        ax.legend()
        change = self.reward_text - self.reward_control
        ax.set_title(f"features by change of push (reward change {change:+.3f})")
        return finish(fig, created)


def feature_values(graph: FeatureGraph) -> pd.DataFrame:
    """Per (layer, feature) of one graph: `value` summed over the positions it is active at, `positions`
    (how many)."""
    nodes = graph.nodes[graph.nodes.kind == "feature"]
    grouped = nodes.groupby(KEY, sort=True).value.agg(["sum", "count"])
    return grouped.rename(columns={"sum": "value", "count": "positions"}).reset_index()


def contrast_graphs(graph: FeatureGraph, control_graph: FeatureGraph) -> ContrastiveFeatures:
    """The contrastive ranking of two built feature graphs (the same model and transcoders)."""
    for name, g in (("graph", graph), ("control_graph", control_graph)):
        if not isinstance(g, FeatureGraph):
            raise TypeError(
                f"contrast_graphs: {name} is a {type(g).__name__}, not a FeatureGraph; build it with "
                "attribution_graph(model, ..., transcoders=tc)"
            )
    if graph.n_layers != control_graph.n_layers:
        raise ValueError(
            f"contrast_graphs: the graphs have {graph.n_layers} and {control_graph.n_layers} layers; "
            "build both with the same model and transcoders"
        )
    text, ctrl = feature_values(graph), feature_values(control_graph)
    frame = text.merge(ctrl, on=KEY, how="outer", suffixes=("_text", "_control"))
    frame = frame.fillna(
        {"value_text": 0.0, "value_control": 0.0, "positions_text": 0, "positions_control": 0}
    )
    frame = frame.astype({"positions_text": int, "positions_control": int})
    frame["delta"] = frame.value_text - frame.value_control
    frame = frame.sort_values(["delta", *KEY], ascending=[False, True, True], kind="stable")
    frame = frame.reset_index(drop=True)
    frame["rank"] = np.arange(1, len(frame) + 1)
    cols = [*KEY, "value_text", "value_control", "delta", "positions_text", "positions_control", "rank"]
    return ContrastiveFeatures(
        features=frame[cols],
        reward_text=float(graph.reward),
        reward_control=float(control_graph.reward),
        graph=graph,
        control_graph=control_graph,
    )


def _graph_of(model, text, tc, max_features: Optional[int], what: str) -> FeatureGraph:
    from reward_lens.instruments.circuits.attribution_graph import attribution_graph

    if isinstance(text, FeatureGraph):
        return text
    if isinstance(text, tuple) and len(text) == 2 and all(isinstance(t, str) for t in text):
        return attribution_graph(model, text[0], text[1], transcoders=tc, max_features=max_features)
    if hasattr(text, "dim") and hasattr(text, "shape"):  # token ids
        return attribution_graph(model, input_ids=text, transcoders=tc, max_features=max_features)
    raise TypeError(
        f"contrastive_features: {what} is a {type(text).__name__}; pass a (prompt, response) tuple of "
        "strings, a 1-D tensor of token ids, or a FeatureGraph"
    )


@checked_arguments(counts={"max_features": 0})
def contrastive_features(
    model,
    text,
    control,
    *,
    transcoders: Any = None,
    max_features: Optional[int] = 0,
) -> ContrastiveFeatures:
    """Rank transcoder features by how much more they push the reward in `text` than in `control` (each a
    (prompt, response) tuple, 1-D token ids, or an already built FeatureGraph): both texts' feature graphs
    on `transcoders`, each (layer, feature)'s signed total effect summed over positions, ranked by the
    difference. `max_features` is the graphs' cap on materialised rows (values do not need rows: 0)."""
    if transcoders is None and not (isinstance(text, FeatureGraph) and isinstance(control, FeatureGraph)):
        raise ValueError(
            "contrastive_features needs transcoders=: a loaded set covering every layer, e.g. "
            "reward_lens.load_transcoders('demo')"
        )
    graph = _graph_of(model, text, transcoders, max_features, "text")
    control_graph = _graph_of(model, control, transcoders, max_features, "control")
    return contrast_graphs(graph, control_graph)
