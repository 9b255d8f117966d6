"""Views of an attribution graph: a self-contained interactive HTML page (SVG, no server, no external script)
and circuit-tracer's graph-file JSON.

The HTML lays nodes out by position (x, the text along the axis) and layer (y: embeddings at the bottom,
each layer's heads then its MLP, the reward on top). Hovering a node shows its numbers (a `<title>`),
clicking it highlights its paths to the reward, a slider hides the edges below a |weight| rank. The nodes
and edges it draws are also embedded as JSON (`script.graph-data`), so a test can read them back.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any, Dict

import numpy as np

from reward_lens.instruments.circuits.graph_build import row_of

WIDTH, HEIGHT = 1200, 560

_SCRIPT = """<script>(function(){var root=document.getElementById('%(id)s');
var data=JSON.parse(root.querySelector('script.graph-data').textContent);
var s=root.querySelector('input[type=range]'),out=root.querySelector('output');
var lines=root.querySelectorAll('line[data-rank]'),circles=root.querySelectorAll('circle[data-node]');
var outgoing={};data.edges.forEach(function(e,i){(outgoing[e.source]=outgoing[e.source]||[]).push(i);});
function show(){var n=+s.value;out.textContent=n;lines.forEach(function(e){
e.style.display=(+e.dataset.rank<n)?'':'none';});}
function highlight(start){var seen={},edges={},stack=[start];seen[start]=1;while(stack.length){
var v=stack.pop();(outgoing[v]||[]).forEach(function(i){if(lines[i].style.display==='none')return;
edges[i]=1;var t=data.edges[i].target;if(!seen[t]){seen[t]=1;stack.push(t);}});}
lines.forEach(function(e,i){e.classList.toggle('on',!!edges[i]);e.classList.toggle('off',!edges[i]);});
circles.forEach(function(c){c.classList.toggle('off',!seen[c.dataset.node]);});
root.querySelector('.clicked').textContent=start;}
circles.forEach(function(c){c.addEventListener('click',function(){highlight(c.dataset.node);});});
s.addEventListener('input',show);show();})();</script>"""

_STYLE = """<style>.rl-graph line.off{stroke-opacity:0.05}.rl-graph line.on{stroke-opacity:0.95}
.rl-graph circle.off{opacity:0.2}.rl-graph circle{cursor:pointer}</style>"""


def _xy(row, graph) -> tuple:
    """(x, y) of a node: its position's column (heads spread inside it), its layer's row."""
    T, L, H = len(graph.tokens), graph.n_layers, graph.n_heads
    cell = (WIDTH - 80) / T
    x = 60 + cell * (row.position + 0.5)
    kind = "head" if row.kind in ("error", "bias") and row.head >= 0 else row.kind
    if (row.kind == "error" and row.head < 0) or row.kind == "feature":  # transcoder features: MLP rows
        kind = "mlp"
    if kind == "head" or row.kind == "bias":
        x += cell * ((row.head if row.head >= 0 else H) - H / 2) / (H + 2)
    y = HEIGHT - 70 - (HEIGHT - 110) * row_of(kind, row.layer, L) / (2 * L + 1)
    return x, y + (6 if row.kind == "error" else 0)


def graph_html(graph) -> str:
    """The interactive view of `graph` (an AttributionGraph), one string."""
    nodes = graph.nodes
    edges = graph.edges
    order = np.argsort(-np.abs(edges.weight.to_numpy()), kind="stable")
    edges = edges.iloc[order].reset_index(drop=True)
    where = {r.node: _xy(r, graph) for r in nodes.itertuples()}
    top = max(float(np.abs(edges.weight).max()) if len(edges) else 1.0, 1e-12)
    inf_top = max(float(nodes.influence.max()), 1e-12)
    uid = f"rl-graph-{id(graph):x}"
    pruned = (
        f"pruned at node_threshold={graph.thresholds[0]}, edge_threshold={graph.thresholds[1]}"
        if graph.thresholds
        else "not pruned"
    )
    start = min(len(edges), 200)
    parts = [
        _STYLE,
        f'<div id="{uid}" class="rl-graph" style="font-family:sans-serif;max-width:100%">',
        f"<div>Reward attribution graph: reward {graph.reward:.4g} = bias {graph.bias:.4g} + the reward's "
        f"incoming edges; {len(nodes)} nodes, {len(edges)} edges ({escape(pruned)}). Edges shown (largest "
        f'|weight| first): <output>{start}</output> <input type="range" min="0" max="{len(edges)}" '
        f'value="{start}"> Clicked: <span class="clicked">none</span> (click a node for its paths to the '
        "reward)</div>",
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" style="width:100%;height:auto" '
        'xmlns="http://www.w3.org/2000/svg">',
    ]
    for rank, e in enumerate(edges.itertuples()):
        (x1, y1), (x2, y2) = where[e.source], where[e.target]
        colour = "#2166ac" if e.weight >= 0 else "#b2182b"
        width = 0.3 + 4 * abs(e.weight) / top
        parts.append(
            f'<line data-rank="{rank}" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'stroke="{colour}" stroke-width="{width:.2f}" stroke-opacity=".5"><title>'
            f"{escape(e.source)} -&gt; {escape(e.target)}: weight={e.weight!r}</title></line>"
        )
    for r in nodes.itertuples():
        x, y = where[r.node]
        fill = {"embed": "#555", "reward": "#000", "error": "#bbb"}.get(
            r.kind, "#2166ac" if r.value >= 0 else "#b2182b"
        )
        parts.append(
            f'<circle data-node="{escape(r.node)}" data-value="{r.value!r}" data-influence="{r.influence!r}" '
            f'cx="{x:.1f}" cy="{y:.1f}" r="{2 + 6 * r.influence / inf_top:.1f}" fill="{fill}"><title>'
            f"{escape(r.node)} ({r.kind}) token {escape(repr(r.token))}: value={r.value!r} "
            f"influence={r.influence!r}</title></circle>"
        )
    parts += _axes(graph)
    parts.append("</svg>")
    data = {"nodes": _node_records(nodes), "edges": edges.to_dict("records")}
    parts.append(f'<script type="application/json" class="graph-data">{_safe_json(data)}</script>')
    parts.append(_SCRIPT % {"id": uid} + "</div>")
    return "\n".join(parts)


def _axes(graph) -> list:
    """The tokens along the x axis and the layer names along the y axis."""
    T, L = len(graph.tokens), graph.n_layers
    cell = (WIDTH - 80) / T
    out = []
    for p, tok in enumerate(graph.tokens):
        x = 60 + cell * (p + 0.5)
        out.append(
            f'<text x="{x:.1f}" y="{HEIGHT - 50}" font-size="9" text-anchor="end" '
            f'transform="rotate(-60 {x:.1f} {HEIGHT - 50})">{escape(tok.strip() or repr(tok))}</text>'
        )
    for kind, layer, label in (
        [("embed", -1, "embed")]
        + [(k, l, f"L{l} {'attn' if k == 'head' else 'mlp'}") for l in range(L) for k in ("head", "mlp")]
        + [("reward", 0, "reward")]
    ):
        y = HEIGHT - 70 - (HEIGHT - 110) * row_of(kind, layer, L) / (2 * L + 1)
        out.append(f'<text x="2" y="{y + 3:.1f}" font-size="9">{escape(label)}</text>')
    return out


def _node_records(nodes) -> list:
    cols = ["node", "kind", "layer", "head", "position", "token", "value", "influence"]
    return [{c: _plain(getattr(r, c)) for c in cols} for r in nodes[cols].itertuples()]


def _plain(v):
    return v.item() if isinstance(v, np.generic) else v


def _safe_json(data) -> str:
    return json.dumps(data).replace("</", "<\\/")


# ---------------------------------------------------------------------------------------------------
# circuit-tracer's graph file


def _ct_node(r, graph, cumulative: float) -> Dict[str, Any]:
    """One node as circuit-tracer's frontend reads it (`circuit_tracer/frontend/graph_models.Node`)."""
    L, H = graph.n_layers, graph.n_heads
    base = {"ctx_idx": int(r.position), "token_prob": 0.0, "is_target_logit": False, "run_idx": 0}
    base.update({"reverse_ctx_idx": 0, "influence": cumulative, "activation": float(r.value)})
    if r.kind == "embed":
        tid = graph.token_ids[r.position]
        ids = {"node_id": f"E_{tid}_{r.position}", "jsNodeId": f"E_{tid}-{r.position}"}
        return {
            **base,
            **ids,
            "feature": int(r.position),
            "layer": "E",
            "feature_type": "embedding",
            "clerp": r.token,
        }
    if r.kind == "reward":
        layer = str(L + 1)
        return {
            **base,
            "node_id": f"{layer}_0_{r.position}",
            "jsNodeId": f"L_0-{r.position}",
            "feature": 0,
            "layer": layer,
            "feature_type": "logit",
            "token_prob": 1.0,
            "is_target_logit": True,
            "clerp": f"reward {graph.reward:.4g} (bias {graph.bias:.4g})",
            "activation": None,
        }
    slot = int(r.head) if r.head >= 0 else (H + 1 if r.kind == "bias" or r.node.startswith("err:bias") else H)
    if r.kind == "error":
        f = -1 - slot
        return {
            **base,
            "node_id": f"{r.layer}_{f}_{r.position}",
            "jsNodeId": f"{r.layer}_{f}-{r.position}",
            "feature": f,
            "layer": str(int(r.layer)),
            "feature_type": "mlp reconstruction error",
            "clerp": f"{r.node}: linearisation remainder (biases, rounding)",
            "activation": None,
        }
    feature = (int(r.layer) + slot) * (int(r.layer) + slot + 1) // 2 + slot  # circuit-tracer's Cantor pairing
    return {
        **base,
        "node_id": f"{r.layer}_{slot}_{r.position}",
        "jsNodeId": f"{r.layer}_{slot}-0",
        "feature": feature,
        "layer": str(int(r.layer)),
        "feature_type": "cross layer transcoder",
        "clerp": r.node.split("@")[0] + f" at {r.token!r}",
    }


def graph_json(graph, path) -> Dict[str, Any]:
    """Write `graph` as circuit-tracer's graph file at `path` and return the object written."""
    nodes = graph.nodes
    records = [_ct_node(r, graph, float(r.cumulative_influence)) for r in nodes.itertuples()]
    ids = {r.node: rec["node_id"] for r, rec in zip(nodes.itertuples(), records)}
    links = [
        {"source": ids[e.source], "target": ids[e.target], "weight": float(e.weight)}
        for e in graph.edges.itertuples()
    ]
    out = {
        "metadata": {
            "slug": Path(path).stem,
            "scan": f"reward-lens:{graph.model_name or 'model'}",
            "transcoder_list": [],
            "prompt_tokens": list(graph.tokens),
            "prompt": "".join(graph.tokens),
            "node_threshold": graph.thresholds[0] if graph.thresholds else None,
            "schema_version": 1,
        },
        "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
        "nodes": records,
        "links": links,
    }
    Path(path).write_text(json.dumps(out, indent=1))
    return out
