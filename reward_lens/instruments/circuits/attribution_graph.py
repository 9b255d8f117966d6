"""The reward attribution graph of one text: every (component, position) node, direct effects between them in
the model linearised at that text (circuit-tracer's attribution graphs, with the reward as the one logit).

    graph = attribution_graph(model, prompt, response)       # or input_ids=..., or a PreferencePair
    graph.to_frame()                                          # nodes: node, kind, layer, head, position, ...
    graph.edges                                               # source, target, weight
    small = graph.prune(node_threshold=0.8, edge_threshold=0.98)
    small.top_paths()                                         # the strongest paths into the reward
    small.html(); small.to_json("graph.json")                 # the view; circuit-tracer's JSON layout

Nodes: the token embedding at each position (`E@p`), each head (`L{l}H{h}@p`) and MLP (`mlp_L{l}@p`) at
each position, an attention output bias (`bias_L{l}@p`, only where a layer has one), one error node per
materialised head or MLP (`err:<node>`, what the frozen linearisation leaves: its biases and rounding) and
the reward. Values are exact total effects in the linearised model (`graph_build`); incoming edges are
materialised for the reward and the `max_nodes` heads and MLPs of largest |value| (all of them when they
fit), over every source. The definitions: docs/theory.md, "The attribution graph".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import pandas as pd
import torch

from reward_lens.core.batching import Tokenized, tokenize
from reward_lens.data.pairs import PreferencePair, TokenPair
from reward_lens.instruments.circuits import graph_build as gb
from reward_lens.instruments.circuits import graph_prune as gp
from reward_lens.instruments.circuits.graph_base import RewardGraph, text_fields
from reward_lens.model.validation import checked_arguments

KINDS = ("embed", "head", "mlp", "bias", "error", "reward")


@dataclass
class AttributionGraph(RewardGraph):
    """One text's attribution graph. `nodes` (one row per node, its index the node's column in `rows`),
    `rows` [n_rows, n_nodes] the materialised incoming edges of the targets `row_nodes` (row t, column s:
    the direct effect of s on t), `reward` the model's reward on the text and `bias` the readout's constant
    (the reward's incoming edges sum to reward - bias)."""

    # the fields, frames, restriction and paths: RewardGraph

    def summary(self) -> pd.DataFrame:
        """The 10 most influential nodes besides the reward, with the graph's exactness checks as attrs."""
        frame = self.nodes[self.nodes.kind != "reward"].sort_values("influence", ascending=False).head(10)
        out = frame[["node", "kind", "position", "token", "value", "influence"]].reset_index(drop=True)
        out.attrs.update(self.completeness())
        return out

    def completeness(self) -> Dict[str, float]:
        """The exactness checks: the reward's incoming edges minus (reward - bias) (`reward_error`,
        relative), and the largest |error| of a head / MLP relative to the largest |value|."""
        incoming = float(self.rows[self.row_nodes == self.reward_node].sum())
        scale = max(abs(self.reward - self.bias), 1e-12)
        errors = self.nodes.error.abs().max()
        return {
            "reward_error": abs(incoming - (self.reward - self.bias)) / scale,
            "max_error": float(0.0 if np.isnan(errors) else errors)
            / max(self.nodes.value.abs().max(), 1e-12),
        }

    def component_influence(self) -> pd.DataFrame:
        """One row per component (`E`, `L1H2`, `mlp_L0`, ...), summed over positions: influence, value and
        |value|, most influential first. The per-node scores a benchmark ranks planted components by."""
        return self._influence_by_component(("embed", "head", "mlp", "bias"))

    def plot(self, ax: Any = None) -> Any:
        """Nodes by position (x) and layer (y), area by influence, colour by the sign of the value."""
        from reward_lens.plotting import figure_axes, finish

        created = ax is None
        fig, ax = figure_axes(ax, figsize=(10, 5))
        frame = self.nodes[self.nodes.kind != "error"]
        y = [gb.row_of(k, l, self.n_layers) for k, l in zip(frame.kind, frame.layer)]
        size = 400 * frame.influence / max(frame.influence.max(), 1e-12) + 2
        colour = np.where(frame.value >= 0, "#2166ac", "#b2182b")
        ax.scatter(frame.position, y, s=size, c=colour, alpha=0.6)
        ax.set_xticks(range(len(self.tokens)))
        ax.set_xticklabels(self.tokens, rotation=90, fontsize=6)
        ax.set_yticks([0] + [1 + 2 * l for l in range(self.n_layers)] + [1 + 2 * self.n_layers])
        ax.set_yticklabels(["embed"] + [f"L{l}" for l in range(self.n_layers)] + ["reward"])
        ax.set_title(f"attribution graph: reward {self.reward:.3f} (bias {self.bias:.3f})")
        return finish(fig, created)

    # ------------------------------------------------------------------ influence, pruning, paths
    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> "AttributionGraph":
        """The graph pruned as circuit-tracer prunes (`graph_prune`): nodes reaching `node_threshold` of the
        influence (tokens and the reward always), edges reaching `edge_threshold` of the edge influence,
        then nodes left without an outgoing (or, for heads and MLPs, incoming) edge dropped. Node values,
        influence and errors are those of this graph."""
        kinds = self.nodes.kind.to_numpy()
        always = torch.from_numpy(np.isin(kinds, ["embed", "reward"]))
        component = torch.from_numpy(np.isin(kinds, ["head", "mlp"]))
        keep, edges, _ = gp.prune(
            self.rows, self.row_nodes, self.reward_node, always, component, node_threshold, edge_threshold
        )
        return self._restricted(keep, self.rows * edges, (node_threshold, edge_threshold))

    # ------------------------------------------------------------------ views
    @checked_arguments(counts={"max_nodes": 1})
    def html(self, max_nodes: int = 600) -> str:
        """An interactive offline view (no server, no external script; `graph_html`): layers x positions,
        hover for the numbers, click a node for its paths to the reward, a weight threshold control. A graph
        with more than `max_nodes` nodes is pruned first with the default thresholds (said in the view)."""
        from reward_lens.instruments.circuits.graph_html import graph_html

        graph = self if len(self.nodes) <= max_nodes else self.prune()
        return graph_html(graph)

    def _repr_html_(self) -> str:
        return self.html()

    def to_json(self, path=None, slug: Optional[str] = None) -> Dict[str, Any]:
        """The graph as a graph file for circuit-tracer's frontend and Neuronpedia's viewer (`metadata`,
        `qParams`, `nodes`, `links`; the reward as the one target logit; docs/theory.md lists every field),
        written to `path` when given (a directory: `{slug}.json` there plus its `graph-metadata.json`
        listing; `slug` defaults to the file's stem). A graph not yet pruned is pruned first with the
        default thresholds, as circuit-tracer's `create_graph_files` does."""
        from reward_lens.instruments.circuits import graph_json as gj

        out = gj.component_graph_json(self if self.thresholds else self.prune(), gj.slug_of(path, slug))
        if path is not None:
            gj.write(out, path)
        return out


# ---------------------------------------------------------------------------------------------------
# Building one graph


def _slot_name(kind: str, layer: int, head: int, position: int) -> str:
    base = {"embed": "E", "head": f"L{layer}H{head}", "bias": f"bias_L{layer}", "mlp": f"mlp_L{layer}"}[kind]
    return f"{base}@{position}"


def _assemble_rows(model, lin: gb.Linearised, targets: List[tuple]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows [n_targets + 1, T*K + n_targets + 1], errors [n_targets]): the targets' incoming edges over
    every slot, each target's error node (column T*K + i) and the reward's row last."""
    T, K = lin.values.shape
    n = len(targets)
    N = T * K + n + 1
    rows = torch.zeros(n + 1, N)
    heads = [i for i, t in enumerate(targets) if t[0] == gb.HEAD]
    mlps = [i for i, t in enumerate(targets) if t[0] == gb.MLP]
    if heads:
        block = gb.head_rows(model, lin, [targets[i][1:] for i in heads])
        rows[torch.tensor(heads), : T * K] = block.reshape(len(heads), -1)
        del block
    if mlps:
        block = gb.mlp_rows(model, lin, [(targets[i][1], targets[i][3]) for i in mlps])
        for j, i in enumerate(mlps):
            p = targets[i][3]
            rows[i, p * K : (p + 1) * K] = block[j]
    rows[n, lin.readout * K : (lin.readout + 1) * K] = gb.reward_row(lin)
    slot = {
        (k, l, h): i for i, (k, l, h) in enumerate(zip(lin.layout.kind, lin.layout.layer, lin.layout.head))
    }
    values = torch.tensor([float(lin.values[t[3], slot[t[:3]]]) for t in targets])
    errors = values - rows[:n].sum(1)
    rows[torch.arange(n), T * K + torch.arange(n)] = errors
    return rows, errors


def _node_table(lin: gb.Linearised, targets, errors, tokens: List[str], influence) -> pd.DataFrame:
    T, K = lin.values.shape
    lay = lin.layout
    kind = [lay.kind[k] for p in range(T) for k in range(K)]
    layer = [lay.layer[k] for p in range(T) for k in range(K)]
    head = [lay.head[k] for p in range(T) for k in range(K)]
    pos = [p for p in range(T) for k in range(K)]
    names = [_slot_name(*x) for x in zip(kind, layer, head, pos)]
    error = np.full(T * K, np.nan)
    has_row = np.zeros(T * K, dtype=bool)
    slot = {(k, l, h): i for i, (k, l, h) in enumerate(zip(lay.kind, lay.layer, lay.head))}
    for i, t in enumerate(targets):
        error[t[3] * K + slot[t[:3]]] = float(errors[i])
        has_row[t[3] * K + slot[t[:3]]] = True
    err_names = [f"err:{names[t[3] * K + slot[t[:3]]]}" for t in targets]
    frame = pd.DataFrame(
        {
            "node": names + err_names + ["reward"],
            "kind": kind + ["error"] * len(targets) + ["reward"],
            "layer": layer + [t[1] for t in targets] + [len(set(layer)) - 1],
            "head": head + [t[2] for t in targets] + [-1],
            "position": pos + [t[3] for t in targets] + [lin.readout],
            "value": np.concatenate([lin.values.flatten().numpy(), errors.numpy(), [lin.reward - lin.bias]]),
            "error": np.concatenate([error, np.full(len(targets) + 1, np.nan)]),
            "has_row": np.concatenate([has_row, np.ones(len(targets) + 1, dtype=bool)]),
        }
    )
    frame["token"] = [tokens[p] for p in frame.position]
    frame["influence"] = influence.numpy().astype(np.float64)
    frame["cumulative_influence"] = gp.cumulative_influence(influence).numpy().astype(np.float64)
    return frame[
        ["node", "kind", "layer", "head", "position", "token", "value", "influence", "cumulative_influence"]
        + ["error", "has_row"]
    ]


@torch.no_grad()
def build_graph(model, tok: Tokenized, max_nodes: Optional[int] = 1024) -> AttributionGraph:
    """The attribution graph of the one sequence in `tok` (unpadded)."""
    gb.check_supported(model)
    lin = gb.linearise(model, tok)
    targets = gb.candidate_targets(lin, max_nodes)
    rows, errors = _assemble_rows(model, lin, targets)
    N = rows.shape[1]
    slot = {
        (k, l, h): i for i, (k, l, h) in enumerate(zip(lin.layout.kind, lin.layout.layer, lin.layout.head))
    }
    K = lin.values.shape[1]
    row_nodes = torch.tensor([t[3] * K + slot[t[:3]] for t in targets] + [N - 1], dtype=torch.long)
    influence = gp.node_influence(rows, row_nodes, N - 1)
    text = text_fields(model, tok, lin)
    return AttributionGraph(
        nodes=_node_table(lin, targets, errors, text["tokens"], influence),
        rows=rows,
        row_nodes=row_nodes,
        meta={"max_nodes": max_nodes, "n_targets": len(targets)},
        **text,
    )


def _single(model, ids) -> Tokenized:
    ids = torch.as_tensor(ids)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(
            f"input_ids must hold integer token ids, got dtype {ids.dtype}; convert them with .long() "
            "(or tokenise the text with model.to_tokens)"
        )
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(
            "input_ids must be one sequence of token ids (a 1-D tensor or [1, T]), got shape "
            f"{tuple(ids.shape)}; build one graph per text"
        )
    ids = ids.to(model.cfg.device)
    mask = torch.ones_like(ids)
    return Tokenized(ids, mask, model.readout_positions(ids, mask))


@checked_arguments(counts={"max_nodes": 1, "max_features": 0})
def attribution_graph(
    model,
    prompt: Union[str, PreferencePair, TokenPair, None] = None,
    response: Optional[str] = None,
    *,
    input_ids: Optional[torch.Tensor] = None,
    max_nodes: Optional[int] = 1024,
    transcoders: Any = None,
    max_features: Optional[int] = None,
) -> Union[AttributionGraph, Dict[str, AttributionGraph]]:
    """The reward attribution graph of one text: (prompt, response) as the model reads them, a prompt that
    is a whole conversation (`response=None`), or `input_ids` (a 1-D tensor or [1, T]). A `PreferencePair`
    or `TokenPair` gives both sides' graphs, {"chosen": ..., "rejected": ...}. Incoming edges are
    materialised for the reward and the `max_nodes` heads / MLPs of largest |value| (None: all). A process
    RM's graph is of the step it reads (`read_step`).

    With `transcoders` (a loaded set covering every layer, e.g. `reward_lens.load_transcoders("demo")`)
    it is the feature graph instead (`feature_graph.FeatureGraph`): transcoder features, MLP error nodes,
    tokens, a constant and the reward, every MLP replaced by its transcoder; `max_features` caps the
    features whose incoming edges are materialised (chosen by influence on the reward, as circuit-tracer
    chooses them; None: all; 0: the reward's row alone, which is all that every node's `value` and the
    reward's edges need)."""
    kw: Dict[str, Any] = {"max_nodes": max_nodes, "transcoders": transcoders, "max_features": max_features}
    if isinstance(prompt, (PreferencePair, TokenPair)):
        pair = prompt
        if isinstance(pair, TokenPair):
            return {
                s: attribution_graph(model, input_ids=getattr(pair, s), **kw) for s in ("chosen", "rejected")
            }
        return {
            s: attribution_graph(model, pair.prompt, getattr(pair, s), **kw) for s in ("chosen", "rejected")
        }
    if input_ids is not None:
        if prompt is not None or response is not None:
            raise ValueError("pass either input_ids or (prompt, response), not both")
        return _build(model, _single(model, input_ids), kw)
    if prompt is None:
        raise ValueError(
            "attribution_graph needs a text: (prompt, response), input_ids=, or a PreferencePair"
        )
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, str) for t in prompt):
        raise ValueError(
            f"attribution_graph builds the graph of one text, got a list of {len(prompt)} texts: pass "
            "attribution_graph(model, prompt, response), and call it once per text"
        )
    if response is None:
        batch = model.to_tokens([prompt])  # a bare text: BOS + text, as model(text) reads it
        ids = batch if isinstance(batch, torch.Tensor) else batch["input_ids"]
        return _build(model, _single(model, ids[0]), kw)
    return _build(model, tokenize(model, [prompt], [response]), kw)


def _build(model, tok: Tokenized, kw: Dict[str, Any]):
    if kw["transcoders"] is None:
        return build_graph(model, tok, kw["max_nodes"])
    from reward_lens.instruments.circuits.feature_graph import build_feature_graph

    return build_feature_graph(model, tok, kw["transcoders"], kw["max_features"])
