"""A self-contained, offline HTML view of an edge attribution: an SVG graph with nodes by layer, edge
width and colour by mean score (blue positive, red negative), a hover title per edge with its values, and a
slider that shows the top-n edges. No server, no external script: one string."""

from __future__ import annotations

import json
from html import escape
from typing import Dict, List, Tuple

from reward_lens.instruments.patching.path import parse_receiver

_SCRIPT = """<script>(function(){var root=document.getElementById('%(id)s');var s=root.querySelector('input');
var out=root.querySelector('output');function show(){var n=+s.value;out.textContent=n;
root.querySelectorAll('line[data-rank]').forEach(function(e){
e.style.display=(+e.dataset.rank<n)?'':'none';});}
s.addEventListener('input',show);show();})();</script>"""


_DEFINITION = {
    "readout": "edges at the readout token only (positions='readout': an edge into a key or value is the "
    "readout's own key or value)",
    "all": "edges at every position (positions='all': each sender's difference at every position, the "
    "receiver recomputed at every position)",
}


def _column(name: str, cfg) -> Tuple[float, str]:
    """(x column, group) of a node: embed 0, layer l's attention 1 + 2l, its MLP 2 + 2l, readout last."""
    if name == "embed":
        return 0.0, "embed"
    if name == "readout":
        return 1.0 + 2 * cfg.n_layers, "readout"
    if name.startswith("mlp_L"):
        return 2.0 + 2 * int(name[5:]), "mlp"
    if name.startswith("attn_L"):
        return 1.0 + 2 * int(name[6:]), "attn"
    if "." in name:
        node = parse_receiver(cfg, name)
        return 0.8 + 2 * node.layer, "input"
    return 1.2 + 2 * int(name[1:].split("H")[0]), "head"


def svg_edge(rank: int, start, end, value: float, width: float, opacity: str, title: str) -> str:
    """One ranked edge line of a circuit drawing (`data-rank` drives the top-n slider): blue for a
    positive value, red for a negative one; `title` is HTML already escaped."""
    (x1, y1), (x2, y2) = start, end
    colour = "#2166ac" if value >= 0 else "#b2182b"
    return (
        f'<line data-rank="{rank}" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
        f'stroke="{colour}" stroke-width="{width:.2f}" stroke-opacity="{opacity}"><title>{title}'
        "</title></line>"
    )


def _positions(names: List[str], cfg, width: float, height: float) -> Dict[str, Tuple[float, float]]:
    columns: Dict[float, List[str]] = {}
    for n in names:
        columns.setdefault(_column(n, cfg)[0], []).append(n)
    span = 2.0 + 2 * cfg.n_layers
    out = {}
    for x, members in columns.items():
        for i, n in enumerate(members):
            out[n] = (40 + (width - 80) * x / span, 30 + (height - 60) * (i + 0.5) / len(members))
    return out


def circuit_html(result, top_n: int = 30, max_edges: int = 200) -> str:
    """The view of `result` (an EdgeAttributionResult); `top_n` edges shown at first, up to `max_edges`."""
    cfg = _Cfg(result)
    table = result.summary().head(max_edges)
    names = list(dict.fromkeys(list(table.sender) + list(table.receiver)))
    width, height = 960, 520
    pos = _positions(names, cfg, width, height)
    top = max((abs(v) for v in table.mean_score), default=1.0) or 1.0
    uid = f"rl-circuit-{id(result):x}"
    parts = [
        f'<div id="{uid}" class="reward-lens-circuit" style="font-family:sans-serif">',
        f"<div>{escape(result.method)} ({escape(result.mode)}), {len(result.pair_ids)} pair(s), "
        f"{_DEFINITION[getattr(result, 'positions', 'readout')]}. "
        f'Top <output>{min(top_n, len(table))}</output> edges: <input type="range" min="1" '
        f'max="{max(1, len(table))}" value="{min(top_n, len(table))}"></div>',
        f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
    ]
    for rank, row in enumerate(table.itertuples()):
        parts.append(
            svg_edge(
                rank,
                pos[row.sender],
                pos[row.receiver],
                row.mean_score,
                0.5 + 6.0 * abs(row.mean_score) / top,
                "0.7",
                f"{escape(row.sender)} -&gt; {escape(row.receiver)}: score={row.mean_score!r} "
                f"normalized={row.mean_normalized_score!r}",
            )
        )
    for n, (x, y) in pos.items():
        parts.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="#444"><title>{escape(n)}</title></circle><text '
            f'x="{x + 5:.1f}" y="{y - 5:.1f}" font-size="8">{escape(n)}</text>'
        )
    parts.append("</svg>")
    parts.append(f'<script type="application/json" class="edges">{json.dumps(_records(table))}</script>')
    parts.append(_SCRIPT % {"id": uid} + "</div>")
    return "\n".join(parts)


def _records(table) -> List[dict]:
    return [
        {
            "sender": r.sender,
            "receiver": r.receiver,
            "score": float(r.mean_score),
            "normalized_score": float(r.mean_normalized_score),
        }
        for r in table.itertuples()
    ]


class _Cfg:
    """The layer and head counts the layout needs, read off the node names."""

    def __init__(self, result):
        import re

        layers = [int(m) for n in result.senders + result.receivers for m in re.findall(r"L(\d+)", n)]
        heads = [int(m) for n in result.senders + result.receivers for m in re.findall(r"H(\d+)", n)]
        kv = [int(m) for n in result.receivers for m in re.findall(r"KV(\d+)", n)]
        self.n_layers = max(layers, default=0) + 1
        self.n_heads = max(heads, default=0) + 1
        self.n_key_value_heads = max(kv, default=0) + 1
