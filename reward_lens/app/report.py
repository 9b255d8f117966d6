"""A self-contained HTML report: one file, plots inlined as PNG data URIs, opens offline.

The layout fits a phone (390 CSS pixels, with the viewport tag: laid out at the device's width, not shrunk
from 980) and a 1280-pixel window: the page never scrolls sideways. Every table sits in its own box
(`.table-wrap`) that scrolls horizontally when the table is wider than the page, and its cells break
between words (never inside one); figures shrink to the page width; long unbroken text (token heatmaps,
ids) wraps anywhere. `tests/test_report_browser.py` checks both widths in headless Chromium."""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Union

from reward_lens.app.output import GENERATOR, write_text_atomic
from reward_lens.plotting import pyplot

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:1.5em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{border-bottom:2px solid #444;font-size:1.6em;overflow-wrap:break-word}
h2{margin-top:2em;border-bottom:1px solid #ccc;font-size:1.25em}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3}td,th{overflow-wrap:normal;word-break:normal;hyphens:none}
img{max-width:100%;height:auto;border:1px solid #eee}.note{color:#555;font-size:.9em}
.table-wrap{max-width:100%;overflow-x:auto;margin:.5em 0}.table-wrap table{margin:0}
p,li{overflow-wrap:break-word}.rl-tokens{max-width:100%;overflow-x:auto;overflow-wrap:anywhere}
.findings{background:#f6f8fa;border-left:4px solid #2c7fb8;padding:.4em 1em}.findings li{margin:.35em 0}
.explain{color:#333}
@media (max-width:600px){body{margin:.8em auto;padding:0 .6em}table{font-size:.8em}}
"""


def figure_to_data_uri(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")

    pyplot().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass
class Section:
    title: str
    parts: List[str] = field(default_factory=list)

    def text(self, text: str, note: bool = False) -> "Section":
        cls = ' class="note"' if note else ""
        self.parts.append(f"<p{cls}>{html.escape(text)}</p>")
        return self

    def table(self, frame: Any, max_rows: int = 40, float_format: str = "{:.4g}") -> "Section":
        shown = frame.head(max_rows)
        table = shown.to_html(index=False, float_format=lambda x: float_format.format(x), border=0)
        self.parts.append(f'<div class="table-wrap">{table}</div>')  # a wide table scrolls in its own box
        if len(frame) > max_rows:
            self.parts.append(
                f'<p class="note">first {max_rows} of {len(frame)} rows; all rows are in the CSV files</p>'
            )
        return self

    def explain(self, text: str) -> "Section":
        """What the section measures and how to read it (one or two sentences, before its tables)."""
        self.parts.append(f'<p class="explain">{html.escape(text)}</p>')
        return self

    def bullets(self, items: List[str], cls: str = "") -> "Section":
        attr = f' class="{cls}"' if cls else ""
        lines = "".join(f"<li>{html.escape(item)}</li>" for item in items)
        self.parts.append(f"<ul{attr}>{lines}</ul>")
        return self

    def html(self, markup: str) -> "Section":
        """A trusted, self-contained HTML fragment (e.g. a token heatmap), inserted as is."""
        self.parts.append(markup)
        return self

    def figure(self, fig: Any, alt: str = "") -> "Section":
        self.parts.append(f'<img alt="{html.escape(alt or self.title)}" src="{figure_to_data_uri(fig)}">')
        return self


class Report:
    def __init__(self, title: str):
        self.title = title
        self.sections: List[Section] = []

    def section(self, title: str) -> Section:
        sec = Section(title)
        self.sections.append(sec)
        return sec

    def to_html(self) -> str:
        body = "\n".join(f"<h2>{html.escape(s.title)}</h2>\n" + "\n".join(s.parts) for s in self.sections)
        return (
            "<!doctype html><html><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"{GENERATOR}<title>{html.escape(self.title)}</title><style>{_STYLE}</style></head><body><h1>{html.escape(self.title)}</h1>\n{body}\n</body></html>"
        )

    def save(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, self.to_html())
