"""The reward attribution graph over transcoder features (circuit-tracer's attribution graphs on the local
replacement model, with the reward as the one logit):

    tc = reward_lens.load_transcoders("demo")
    g = attribution_graph(model, prompt, response, transcoders=tc)    # or input_ids=...
    g.to_frame()        # nodes: node, kind (feature / error / embed / constant / reward), layer, position,
                        #        feature, activation, value (total effect), direct (edge into the reward)
    g.edges             # source, target, weight
    g.scores()          # {"replacement", "completeness"}; g.prune(0.8, 0.98).scores() for the pruned graph
    g.to_json("g.json") # Neuronpedia's graph file (pruned first; the viewer scores it as g.prune().scores())
    g.html(texts=...)   # the view, each feature with its top activating texts (the demo: its bundled pairs)

Nodes: every active feature at every position (`L{l}F{i}@p`), one MLP error node per (layer, position)
(`err:mlp_L{l}@p`), the token embeddings (`E@p`), one constant node (`constant`: b_dec, the attention's
biases, everything no source writes) and the reward. Edges go into each feature's pre-activation minus
b_enc (its rows sum to that, with the constant's edge) and into the reward minus its bias. The arithmetic:
`feature_build`; the definitions: docs/theory.md, "The feature attribution graph".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np
import pandas as pd
import torch

from reward_lens.core.batching import Tokenized
from reward_lens.instruments.circuits import feature_build as fb
from reward_lens.instruments.circuits import graph_prune as gp
from reward_lens.instruments.circuits.graph_base import RewardGraph, text_fields
from reward_lens.model.validation import checked_arguments

FEATURE_KINDS = ("feature", "error", "embed", "constant", "reward")


@dataclass
class FeatureGraph(RewardGraph):
    """One text's feature attribution graph: `nodes` (index = column of `rows`), `rows` [n_rows, n_nodes]
    the incoming edges of the targets `row_nodes` (features, the reward last), `reward` the model's reward
    and `bias` the readout's constant. Influence, pruning and scores treat the constant node as
    circuit-tracer treats biases: outside the normalised adjacency. `model` and `transcoders` are what
    built it (the view reads each feature's top activating texts with them)."""

    model: Any = field(default=None, repr=False, compare=False)
    transcoders: Any = field(default=None, repr=False, compare=False)

    @property
    def constant_node(self) -> int:
        return int(np.flatnonzero(self.nodes.kind.to_numpy() == "constant")[0])

    def _scored_rows(self) -> torch.Tensor:
        rows = self.rows.clone()
        rows[:, self.constant_node] = 0
        return rows

    def summary(self) -> pd.DataFrame:
        """The 10 most influential features and error nodes, with scores and conservation as attrs."""
        frame = self.nodes[self.nodes.kind.isin(["feature", "error"])]
        frame = frame.sort_values("influence", ascending=False).head(10)
        cols = ["node", "kind", "layer", "position", "token", "feature", "activation", "value", "influence"]
        out = frame[cols].reset_index(drop=True)
        out.attrs.update(self.scores())
        out.attrs.update(self.completeness())
        return out

    def completeness(self) -> Dict[str, float]:
        """The exactness checks: the reward's incoming edges (constant included) minus (reward - bias),
        relative (`reward_error`), and the largest |incoming edges - (pre-activation - b_enc)| over the
        features with rows, relative to the largest |pre-activation - b_enc| (`feature_error`)."""
        incoming = float(self.rows[self.row_nodes == self.reward_node].sum())
        scale = max(abs(self.reward - self.bias), 1e-12)
        target = torch.tensor(self.nodes.preactivation.to_numpy() - self.nodes.b_enc.to_numpy()).float()
        feats = self.nodes.kind.to_numpy()[self.row_nodes.numpy()] == "feature"
        got = self.rows.sum(1)[feats] - target[self.row_nodes[feats]]
        denom = float(target[self.row_nodes[feats]].abs().max()) if feats.any() else 1.0
        return {
            "reward_error": abs(incoming - (self.reward - self.bias)) / scale,
            "feature_error": float(got.abs().max()) / max(denom, 1e-12) if feats.any() else 0.0,
        }

    def scores(self) -> Dict[str, float]:
        """circuit-tracer's graph scores of this graph, the reward as the one logit (weight 1) over the
        row-normalised |adjacency|: replacement = token influence / (token + error influence);
        completeness = the influence-weighted (influence + logit weight) mean share of a node's incoming
        |edges| that is not from error nodes."""
        rows = self._scored_rows()
        target = self.reward_node
        influence = gp.node_influence(rows, self.row_nodes, target)
        kinds = self.nodes.kind.to_numpy()
        error = torch.from_numpy(kinds == "error")
        tokens = torch.from_numpy(kinds == "embed")
        tok_inf, err_inf = float(influence[tokens].sum()), float(influence[error].sum())
        norm = gp.normalize_rows(rows)
        non_error = torch.ones(rows.shape[1])
        non_error[self.row_nodes] = 1 - norm[:, error].sum(1)
        weight = torch.zeros(rows.shape[1])
        weight[target] = 1.0
        out_inf = influence + weight
        return {
            "replacement": tok_inf / (tok_inf + err_inf) if tok_inf + err_inf > 0 else 0.0,
            "completeness": float((non_error * out_inf).sum() / out_inf.sum()),
        }

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> "FeatureGraph":
        """Pruned as circuit-tracer prunes (|weights|; `graph_prune`): nodes reaching `node_threshold` of
        the influence (tokens, the constant and the reward always), edges reaching `edge_threshold` of
        the edge influence, then features and errors left without an outgoing edge (features also without
        an incoming one) dropped. The kept rows keep their constant edge, so they still sum exactly."""
        kinds = self.nodes.kind.to_numpy()
        always = torch.from_numpy(np.isin(kinds, ["embed", "reward", "constant"]))
        component = torch.from_numpy(kinds == "feature")
        keep, edges, _ = gp.prune(
            self._scored_rows(),
            self.row_nodes,
            self.reward_node,
            always,
            component,
            node_threshold,
            edge_threshold,
        )
        rows = self.rows * edges
        rows[:, self.constant_node] = self.rows[:, self.constant_node]
        return self._restricted(keep, rows, (node_threshold, edge_threshold))

    @checked_arguments(counts={"max_nodes": 1, "k": 1})
    def html(self, max_nodes: int = 600, texts: Any = None, k: int = 5) -> str:
        """The component graph's offline view (`graph_html`) of this graph: features on their layer's MLP
        row, error nodes beside them; pruned first (0.8 / 0.98) beyond `max_nodes` nodes; the constant,
        which has no position, is left out of the picture. Each shown feature comes with its `k` top
        activating texts among `texts` (strings, (prompt, response) tuples or pairs; `feature_examples`),
        shown when the feature is clicked; without `texts`, the demo RM's graphs use its bundled pairs
        (held out from the shipped transcoders' training), other graphs show none."""
        from reward_lens.instruments.circuits.graph_html import graph_html

        graph = self if len(self.nodes) <= max_nodes else self.prune()
        shown = torch.from_numpy(graph.nodes.kind.to_numpy() != "constant")
        view = graph._restricted(shown, graph.rows, graph.thresholds)
        examples, source = self._examples(view, texts, k)
        return graph_html(view, examples=examples, source=source)

    def _examples(self, view: "FeatureGraph", texts: Any, k: int):
        """(FeatureExamples of the view's features or None, where the texts come from)."""
        from reward_lens.demo import DEMO_MODEL_NAME, demo_pairs
        from reward_lens.instruments.circuits.feature_examples import feature_examples

        if self.model is None or self.transcoders is None:
            if texts is not None:
                raise ValueError(
                    "this graph holds no model and transcoders to read texts with; build it with "
                    "attribution_graph(model, ..., transcoders=tc), or call feature_examples yourself"
                )
            return None, ""
        source = "the texts given"
        if texts is None:
            if self.model_name != DEMO_MODEL_NAME:
                return None, "pass texts= to html() for each feature's top activating texts"
            texts, source = demo_pairs(), "the demo's bundled pairs, held out from transcoder training"
        feats = view.nodes[view.nodes.kind == "feature"]
        pairs = list(dict.fromkeys(zip(feats.layer.astype(int), feats.feature.astype(int))))
        if not pairs:
            return None, source
        return feature_examples(self.model, self.transcoders, texts, pairs, k=k), source

    @checked_arguments(flags=("prune",))
    def to_json(self, path=None, prune: bool = True, slug: Optional[str] = None) -> Dict[str, Any]:
        """The graph as a graph file for Neuronpedia's viewer and circuit-tracer's frontend (`metadata`,
        `qParams`, `nodes`, `links`, valid under Neuronpedia's graph schema; `graph_json`), written to
        `path` when given (a directory: `{slug}.json` there plus its `graph-metadata.json` listing, as
        circuit-tracer's `create_graph_files` writes them; `slug` defaults to the file's stem). The reward
        is the one logit (probability 1); features carry layer, position (`ctx_idx`), feature id (in
        `node_id`; `feature` is its Cantor number), activation and influence; the constant node is left
        out, so the viewer's replacement and completeness of the file equal `scores()` of the graph
        written. Pruned first with the default thresholds unless already pruned, as `create_graph_files`
        does; `prune=False` writes every node (the viewer builds a dense N x N matrix: a few thousand
        nodes at most)."""
        from reward_lens.instruments.circuits import graph_json as gj

        graph = self.prune() if prune and not self.thresholds else self
        out = gj.feature_graph_json(graph, gj.slug_of(path, slug))
        if path is not None:
            gj.write(out, path)
        return out

    def _repr_html_(self) -> str:
        return self.html()

    def component_influence(self) -> pd.DataFrame:
        """One row per (layer, feature), summed over positions: influence, value, |value|."""
        return self._influence_by_component(("feature",))

    def plot(self, ax: Any = None) -> Any:
        """Features by position (x) and layer (y), area by influence, colour by the sign of the value."""
        from reward_lens.plotting import figure_axes, finish

        created = ax is None
        fig, ax = figure_axes(ax, figsize=(10, 5))
        frame = self.nodes[self.nodes.kind.isin(["feature", "embed", "reward"])]
        y = np.where(frame.kind == "embed", 0, np.where(frame.kind == "reward", self.n_layers + 1, 0))
        y = np.where(frame.kind == "feature", frame.layer + 1, y)
        size = 400 * frame.influence / max(frame.influence.max(), 1e-12) + 2
        colour = np.where(frame.value >= 0, "#2166ac", "#b2182b")
        ax.scatter(frame.position, y, s=size, c=colour, alpha=0.6)
        ax.set_xticks(range(len(self.tokens)))
        ax.set_xticklabels(self.tokens, rotation=90, fontsize=6)
        ax.set_yticks(range(self.n_layers + 2))
        ax.set_yticklabels(["embed"] + [f"L{l}" for l in range(self.n_layers)] + ["reward"])
        ax.set_title(f"feature graph: reward {self.reward:.3f} (bias {self.bias:.3f})")
        return finish(fig, created)


def check_supported(model, tc) -> None:
    """Refuse, in one line, models and transcoder sets the feature graph does not cover."""
    from reward_lens.model.native import NativeRewardModel

    if not isinstance(model, NativeRewardModel):
        raise ValueError(
            "attribution_graph with transcoders needs a natively hooked model (HookedRewardModel), not "
            f"{type(model).__name__}"
        )
    if model.cfg.post_norms:
        raise ValueError(
            "the feature graph covers pre-norm blocks; this model has post-norms (Gemma-2), whose "
            "outputs pass a norm the linearisation does not freeze"
        )
    if isinstance(tc, (str, bytes)) or not hasattr(tc, "check"):
        raise ValueError(
            f"transcoders= takes a loaded set, got {type(tc).__name__}; load it first with "
            "reward_lens.load_transcoders(path) (or 'demo')"
        )
    tc.check(model, every_layer=True)


def _node_table(run: fb.CleanRun, tc, cols: fb.Columns, values, direct, const_value, tokens):
    f = cols.features
    L, T = cols.L, cols.T
    lay, pos, feat = f[:, 0].numpy(), f[:, 1].numpy(), f[:, 2].numpy()
    # per layer (the layers' [T, d_tc] maps are never stacked into one copy)
    per = [f[f[:, 0] == l] for l in range(L)]
    act = np.concatenate([run.act[l][s[:, 1], s[:, 2]].float().cpu().numpy() for l, s in enumerate(per)])
    pre = np.concatenate([run.pre[l][s[:, 1], s[:, 2]].float().cpu().numpy() for l, s in enumerate(per)])
    b_enc = np.concatenate([tc[l].b_enc[s[:, 2]].detach().float().cpu().numpy() for l, s in enumerate(per)])
    act, pre, b_enc = act.astype(np.float64), pre.astype(np.float64), b_enc.astype(np.float64)
    err_layer, err_pos = np.repeat(np.arange(L), T), np.tile(np.arange(T), L)
    nan = np.full(L * T + T + 2, np.nan)
    value = values.numpy().astype(np.float64)
    value[cols.constant] = const_value
    value[cols.reward] = run.reward - run.bias
    frame = pd.DataFrame(
        {
            "node": [f"L{l}F{i}@{p}" for l, p, i in zip(lay, pos, feat)]
            + [f"err:mlp_L{l}@{p}" for l, p in zip(err_layer, err_pos)]
            + [f"E@{p}" for p in range(T)]
            + ["constant", "reward"],
            "kind": ["feature"] * len(f) + ["error"] * (L * T) + ["embed"] * T + ["constant", "reward"],
            "layer": np.concatenate([lay, err_layer, np.full(T, -1), [-1, L]]),
            "head": -1,
            "position": np.concatenate([pos, err_pos, np.arange(T), [-1, run.readout]]),
            "feature": np.concatenate([feat, np.full(L * T + T + 2, -1)]),
            "activation": np.concatenate([act, nan]),
            "preactivation": np.concatenate([pre, nan]),
            "b_enc": np.concatenate([b_enc, nan]),
            "value": value,
            "direct": direct.numpy().astype(np.float64),
        }
    )
    frame["token"] = [tokens[p] if p >= 0 else "" for p in frame.position]
    return frame


ROUND_MIN, ROUND_MAX = 64, 1024  # the fewest and most feature rows chosen from one influence estimate


def round_size(done: int, left: int) -> int:
    """How many features the next selection round takes: as many as have rows already (at least
    ROUND_MIN, at most ROUND_MAX), never more than are `left`."""
    return min(left, ROUND_MAX, max(ROUND_MIN, done))


def _row_levels(cols: fb.Columns, row_nodes: torch.Tensor) -> torch.Tensor:
    """Each row's layer (the reward's: n_layers): a feature reads only the layers below its own."""
    feats = row_nodes < cols.n_features
    level = torch.full((len(row_nodes),), cols.L, dtype=torch.long)
    level[feats] = cols.features[row_nodes[feats], 0]
    return level


def select_rows(model, run: fb.CleanRun, tc, cols: fb.Columns, rows, row_nodes, chunk: int = 32):
    """Fill `rows` [m + 1, n_cols] (the reward's row last, already there) with the rows of m features
    chosen by influence, as circuit-tracer chooses them: in rounds (`round_size`), each taking the
    features without a row of largest influence on the reward estimated from the rows computed so far
    (the row-normalised |adjacency|, the constant left out; ties: the lower column). `row_nodes` [m + 1]
    gets each row's node, in the order chosen."""
    m = len(rows) - 1
    visited = torch.zeros(cols.n_features, dtype=torch.bool)
    done = 0
    while done < m:
        use = torch.cat([torch.arange(done), torch.tensor([m])])
        level = _row_levels(cols, row_nodes)
        influence = gp.ordered_influence(rows, row_nodes, cols.reward, level, use, cols.constant)
        rank = torch.sort(influence[: cols.n_features], descending=True, stable=True).indices
        take = rank[~visited[rank]][: round_size(done, m - done)]
        visited[take] = True
        row_nodes[done : done + len(take)] = take
        fb.target_rows(model, run, tc, cols, cols.features[take], chunk, out=rows[done : done + len(take)])
        done += len(take)


@torch.no_grad()
def build_feature_graph(
    model, tok: Tokenized, tc, max_nodes: Optional[int] = None, chunk: int = 32
) -> FeatureGraph:
    """The feature graph of the one sequence in `tok` (unpadded): rows for the reward and for
    `max_nodes` features chosen by influence (`select_rows`; None, or at least the active features:
    every active feature, in column order)."""
    check_supported(model, tc)
    run = fb.clean_run(model, tok, tc)
    cols = fb.columns(run)
    every = max_nodes is None or max_nodes >= cols.n_features
    m = cols.n_features if every else max_nodes
    rows = torch.zeros(m + 1, cols.n)
    rows[-1] = fb.reward_row(model, run, tc, cols)
    row_nodes = torch.full((m + 1,), cols.reward, dtype=torch.long)
    if every:
        row_nodes[:-1] = torch.arange(m)
        fb.target_rows(model, run, tc, cols, cols.features, chunk, out=rows[:-1])
    else:
        select_rows(model, run, tc, cols, rows, row_nodes, chunk)
    targets = cols.features[row_nodes[:-1]]
    consts, reward_const = fb.constants(model, run, tc, targets)
    rows[:-1, cols.constant] = consts
    rows[-1, cols.constant] = reward_const
    # after the rows: its transient memory reuses what their backwards freed, not more of the machine's
    values, const_value = fb.total_effects(model, run, tc, cols)
    text = text_fields(model, tok, run)
    nodes = _node_table(run, tc, cols, values, rows[-1].clone(), const_value, text["tokens"])
    nodes["has_row"] = False
    nodes.loc[row_nodes.numpy(), "has_row"] = True
    graph = FeatureGraph(
        nodes=nodes,
        rows=rows,
        row_nodes=row_nodes,
        meta={"max_nodes": max_nodes, "n_targets": m, "n_features": cols.n_features},
        model=model,
        transcoders=tc,
        **text,
    )
    level = _row_levels(cols, row_nodes)
    influence = gp.ordered_influence(rows, row_nodes, cols.reward, level, skip_column=cols.constant)
    graph.nodes["influence"] = influence.numpy().astype(np.float64)
    graph.nodes["cumulative_influence"] = gp.cumulative_influence(influence).numpy().astype(np.float64)
    return graph
