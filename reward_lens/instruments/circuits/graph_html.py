"""The view of an attribution graph: a self-contained interactive HTML page (SVG, no server, no external
script). The graph files (JSON) are `graph_json`'s.

The HTML lays nodes out by position (x, the text along the axis) and layer (y: embeddings at the bottom,
each layer's heads then its MLP, the reward on top). Hovering a node shows its numbers (a `<title>`),
clicking it highlights its paths to the reward, a slider hides the edges below a |weight| rank. A feature
graph's view can list each feature's top activating texts (`feature_examples`), shown when the feature is
clicked. The nodes, edges and texts it draws are also embedded as JSON (`script.graph-data`), so a test can
read them back.
"""

from __future__ import annotations

import json
from html import escape

import numpy as np

from reward_lens.instruments.circuits.graph_build import row_of
from reward_lens.instruments.circuits.graph_json import process_token as shown
from reward_lens.instruments.circuits.html import svg_edge

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
var panels=root.querySelectorAll('div[data-examples]');
circles.forEach(function(c){c.addEventListener('click',function(){highlight(c.dataset.node);
panels.forEach(function(p){p.hidden=p.dataset.examples!==c.dataset.component;});});});
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


def graph_html(graph, examples=None, source: str = "") -> str:
    """The interactive view of `graph` (an AttributionGraph or FeatureGraph), one string; `examples` (a
    FeatureExamples) lists each feature's top activating texts, `source` says where those come from."""
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
        parts.append(
            svg_edge(
                rank,
                where[e.source],
                where[e.target],
                e.weight,
                0.3 + 4 * abs(e.weight) / top,
                ".5",
                f"{escape(e.source)} -&gt; {escape(e.target)}: weight={e.weight!r}",
            )
        )
    top_text = _top_texts(examples)
    for r in nodes.itertuples():
        x, y = where[r.node]
        fill = {"embed": "#555", "reward": "#000", "error": "#bbb"}.get(
            r.kind, "#2166ac" if r.value >= 0 else "#b2182b"
        )
        component = r.node.split("@")[0] if r.kind == "feature" else ""
        extra = f' data-component="{escape(component)}"' if component else ""
        radius = 2 + 6 * r.influence / inf_top
        parts.append(
            f'<circle data-node="{escape(r.node)}"{extra} data-value="{r.value!r}" '
            f'data-influence="{r.influence!r}" cx="{x:.1f}" cy="{y:.1f}" r="{radius:.1f}" fill="{fill}">'
            f"<title>{escape(r.node)} ({r.kind}) token {escape(repr(r.token))}: value={r.value!r} "
            f"influence={r.influence!r}{escape(top_text.get(component, ''))}</title></circle>"
        )
    parts += _axes(graph)
    parts.append("</svg>")
    if source and examples is None:
        parts.append(f"<div>Top activating texts: {escape(source)}.</div>")
    if examples is not None:
        first = nodes[nodes.kind == "feature"].sort_values("influence", ascending=False).node
        parts += _example_panels(examples, source, first.iloc[0].split("@")[0] if len(first) else "")
    data = {"nodes": _node_records(nodes), "edges": edges.to_dict("records")}
    if examples is not None:
        data["examples"] = [
            {k: _plain(v) for k, v in row.items()} for row in examples.frame.to_dict("records")
        ]
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


def _top_texts(examples) -> dict:
    """Each feature's most active context, for its node's hover title."""
    if examples is None:
        return {}
    top = examples.frame[examples.frame["rank"] == 0]
    return {
        r.component: f" | top text: {shown(r.before)}[{shown(r.token)}]{shown(r.after)} ({r.activation:.4g})"
        for r in top.itertuples()
    }


def _example_panels(examples, source: str, first: str) -> list:
    """One panel per feature with its top activating texts (the most active token marked), the most
    influential feature's shown first; clicking a feature shows its panel."""
    frame = examples.frame
    out = [
        f'<div class="rl-examples"><div>Top activating texts of each feature: the {examples.k} most active '
        f"of {examples.n_texts} texts ({escape(source)}); click a feature to show its texts.</div>"
    ]
    for component, rows in frame.groupby("component", sort=False):
        hidden = "" if component == first else " hidden"
        layer, feature = int(rows.layer.iloc[0]), int(rows.feature.iloc[0])
        out.append(
            f'<div data-examples="{escape(component)}"{hidden}><b>{escape(component)}</b> (layer {layer}, '
            f"feature {feature})<ol>"
        )
        for r in rows.itertuples():
            before, token, after = (escape(shown(t)) for t in (r.before, r.token, r.after))
            out.append(
                f'<li data-activation="{r.activation!r}" data-text="{r.text}">{before}<mark>{token}</mark>'
                f"{after} <small>({escape(r.label)}, activation {r.activation:.4g})</small></li>"
            )
        out.append("</ol></div>")
    out.append("</div>")
    return out


def _node_records(nodes) -> list:
    cols = ["node", "kind", "layer", "head", "position", "token", "value", "influence"]
    return [{c: _plain(getattr(r, c)) for c in cols} for r in nodes[cols].itertuples()]


def _plain(v):
    return v.item() if isinstance(v, np.generic) else v


def _safe_json(data) -> str:
    return json.dumps(data).replace("</", "<\\/")
