"""The attribution graphs as graph files that circuit-tracer's local frontend and Neuronpedia's graph viewer
read: one JSON object with `metadata`, `qParams`, `nodes` and `links`, valid under Neuronpedia's graph schema
(`apps/webapp/app/api/graph/graph-schema.json` in hijohnnylin/neuronpedia), nodes as circuit-tracer's
`frontend/graph_models.Node` writes them, the reward as the one target logit (probability 1).

The viewer scores a graph from its nodes and links alone: it sorts the nodes by kind (features, errors,
embeddings, logits), rebuilds the adjacency from the links and computes circuit-tracer's replacement and
completeness with the logits weighted by `token_prob`. So the feature graph's constant node (b_dec, the
attention's biases), which circuit-tracer's graphs do not have, is left out with its edges, exactly as
`FeatureGraph.scores()` leaves it out of the normalised adjacency: the viewer's scores of the file are the
graph's `scores()` (`tests/test_graph_json.py`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from reward_lens.version import __version__

GENERATOR = {"name": "reward-lens", "version": __version__}
QPARAMS = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
REWARD_CLERP = 'Output "reward" (p=1.000)'  # the viewer reads the logit's probability from "(p=...)"


def cantor(layer: int, index: int) -> int:
    """circuit-tracer's and Neuronpedia's feature number of (layer, index) (schema_version 1)."""
    return (layer + index) * (layer + index + 1) // 2 + index


def neuronpedia_id(text: str, default: str) -> str:
    """`text` as Neuronpedia accepts a scan (model id) or slug: letters, digits, '_', '.', '-' only."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or default


def process_token(token: str) -> str:
    """A token as circuit-tracer writes it into `prompt_tokens` (newline, tab and return made visible)."""
    return token.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def _node(node_id: str, feature: int, layer: str, ctx: int, kind: str, js: str, clerp: str, **rest) -> Dict:
    out = {
        "node_id": node_id,
        "feature": int(feature),
        "layer": layer,
        "ctx_idx": int(ctx),
        "feature_type": kind,
        "token_prob": 0.0,
        "is_target_logit": False,
        "run_idx": 0,
        "reverse_ctx_idx": 0,
        "jsNodeId": js,
        "clerp": clerp,
        "influence": None,
        "activation": None,
    }
    out.update(rest)
    return out


def token_node(token_id: int, position: int, token: str, influence: float, **rest) -> Dict:
    return _node(
        f"E_{token_id}_{position}",
        position,
        "E",
        position,
        "embedding",
        f"E_{token_id}-{position}",
        token,
        influence=influence,
        **rest,
    )


def reward_node(n_layers: int, readout: int, influence: float) -> Dict:
    """The reward as circuit-tracer writes a target logit (vocabulary index 0: a reward has no token)."""
    layer = str(n_layers + 1)
    return _node(
        f"{layer}_0_{readout}",
        0,
        layer,
        readout,
        "logit",
        f"L_0-{readout}",
        REWARD_CLERP,
        token_prob=1.0,
        is_target_logit=True,
        influence=influence,
    )


def document(graph, nodes: List[Dict], links: List[Dict], slug: str, extra: Optional[Dict] = None) -> Dict:
    """The whole graph file around `nodes` and `links`."""
    meta: Dict[str, Any] = {
        "slug": neuronpedia_id(slug, "reward-graph"),
        "scan": neuronpedia_id(graph.model_name, "reward-model"),
        "transcoder_list": [],
        "prompt_tokens": [process_token(t) for t in graph.tokens],
        "prompt": "".join(graph.tokens),
        "schema_version": 1,
        "info": {
            "description": f"reward attribution graph: reward {graph.reward:.6g} = bias {graph.bias:.6g} + "
            "the reward's incoming edges (the one logit, probability 1)",
            "generator": dict(GENERATOR),
        },
    }
    if graph.thresholds:
        meta["node_threshold"] = float(graph.thresholds[0])
        meta["pruning_settings"] = {
            "node_threshold": float(graph.thresholds[0]),
            "edge_threshold": float(graph.thresholds[1]),
        }
    meta.update(extra or {})
    return {"metadata": meta, "qParams": dict(QPARAMS), "nodes": nodes, "links": links}


def write(out: Dict, path) -> Path:
    """Write the graph file at `path`; into a directory, as circuit-tracer's `create_graph_files` does:
    `{slug}.json` there, and the graph's metadata added to (or replaced in) its `graph-metadata.json`, the
    list circuit-tracer's local frontend (`serve(data_dir)`) reads. Returns the file written."""
    path = Path(path)
    if not path.is_dir():
        path.write_text(json.dumps(out, indent=1))
        return path
    file = path / f"{out['metadata']['slug']}.json"
    file.write_text(json.dumps(out, indent=1))
    listing = path / "graph-metadata.json"
    graphs = json.loads(listing.read_text()).get("graphs", []) if listing.exists() else []
    graphs = [g for g in graphs if g.get("slug") != out["metadata"]["slug"]] + [out["metadata"]]
    listing.write_text(json.dumps({"graphs": graphs}, indent=2))
    return file


def slug_of(path, slug: Optional[str]) -> str:
    """The graph's slug: `slug` if given, else the file's stem (a directory or no path: "reward-graph")."""
    if slug is not None:
        return str(slug)
    return Path(path).stem if path is not None and not Path(path).is_dir() else "reward-graph"


def _links(graph, ids: Dict[str, str]) -> List[Dict]:
    """The graph's non-zero edges between written nodes (`ids`: node name -> node_id)."""
    return [
        {"source": ids[e.source], "target": ids[e.target], "weight": float(e.weight)}
        for e in graph.edges.itertuples()
        if e.source in ids and e.target in ids
    ]


# ---------------------------------------------------------------------------------------------------
# The feature graph


def feature_graph_json(graph, slug: str = "reward-graph") -> Dict[str, Any]:
    """`graph` (a FeatureGraph) as a graph file: features ("cross layer transcoder", node id
    `{layer}_{feature}_{position}`, `feature` the Cantor number, `activation`), MLP error nodes ("mlp
    reconstruction error", node id `{layer}_error_mlp_{position}` as Neuronpedia's own converter writes
    it: circuit-tracer's `0_{layer}_{position}` collides with layer-0 features), token embeddings, the
    reward as the logit; `influence` is the cumulative influence circuit-tracer writes; the constant is
    left out. Each feature's and error's `clerp` carries its signed total effect on the reward."""
    records, ids = [], {}
    for r in graph.nodes.itertuples():
        if r.kind == "constant":
            continue
        l, p, cum = int(r.layer), int(r.position), float(r.cumulative_influence)
        if r.kind == "feature":
            i = int(r.feature)
            rec = _node(
                f"{l}_{i}_{p}",
                cantor(l, i),
                str(l),
                p,
                "cross layer transcoder",
                f"{l}_{i}-0",
                f"L{l}F{i}: reward effect {r.value:+.4g}",
                influence=cum,
                activation=float(r.activation),
            )
        elif r.kind == "error":
            rec = _node(
                f"{l}_error_mlp_{p}",
                -1,
                str(l),
                p,
                "mlp reconstruction error",
                f"{l}_{p}-0",
                f"MLP L{l} error: reward effect {r.value:+.4g}",
                influence=cum,
            )
        elif r.kind == "embed":
            rec = token_node(graph.token_ids[p], p, process_token(r.token), cum)
        else:
            rec = reward_node(graph.n_layers, graph.readout, cum)
        records.append(rec)
        ids[r.node] = rec["node_id"]
    extra = {
        "generation_settings": {"max_feature_nodes": int(graph.meta.get("n_targets", 0))},
        **{f"{k}_score": float(v) for k, v in graph.scores().items()},
    }
    out = document(graph, records, _links(graph, ids), slug, extra)
    constant = float(graph.rows[graph.row_nodes == graph.reward_node][0, graph.constant_node])
    out["metadata"]["info"]["description"] = (
        f"reward feature graph: reward {graph.reward!r} = bias {graph.bias!r} + constant {constant!r} "
        "(b_dec and attention biases, not a node here) + the links into the reward (the one logit, "
        "probability 1)"
    )
    return out


# ---------------------------------------------------------------------------------------------------
# The component graph


def _component_node(r, graph) -> Dict[str, Any]:
    """A head, MLP, bias or error node of the component graph (circuit-tracer's frontend has only feature
    kinds: heads, MLPs and biases are "cross layer transcoder" nodes named in `clerp`)."""
    H = graph.n_heads
    slot = int(r.head) if r.head >= 0 else (H + 1 if r.kind == "bias" or r.node.startswith("err:bias") else H)
    layer = int(r.layer)
    if r.kind == "error":
        f = -1 - slot
        return _node(
            f"{layer}_{f}_{r.position}",
            f,
            str(layer),
            r.position,
            "mlp reconstruction error",
            f"{layer}_{f}-{r.position}",
            f"{r.node}: linearisation remainder (biases, rounding)",
        )
    return _node(
        f"{layer}_{slot}_{r.position}",
        cantor(layer, slot),
        str(layer),
        r.position,
        "cross layer transcoder",
        f"{layer}_{slot}-0",
        r.node.split("@")[0] + f" at {r.token!r}",
        activation=float(r.value),
    )


def component_graph_json(graph, slug: str = "reward-graph") -> Dict[str, Any]:
    """`graph` (an AttributionGraph) as a graph file (docs/theory.md, "The JSON file")."""
    records, ids = [], {}
    for r in graph.nodes.itertuples():
        cum = float(r.cumulative_influence)
        if r.kind == "embed":
            rec = token_node(
                graph.token_ids[r.position], int(r.position), r.token, cum, activation=float(r.value)
            )
        elif r.kind == "reward":
            rec = reward_node(graph.n_layers, int(r.position), cum)
        else:
            rec = {**_component_node(r, graph), "influence": cum}
        records.append(rec)
        ids[r.node] = rec["node_id"]
    return document(graph, records, _links(graph, ids), slug)
