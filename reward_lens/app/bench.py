"""`reward-lens bench`: every instrument scored against the mechanisms planted in the organisms.

    reward-lens bench [--out DIR] [--only NAMES] [--device cpu] [--quick]

Each row (`reward_lens.app.bench_registry.CHECKS`) runs one instrument on one organism and compares a metric
with a goal fixed by the organism's ground truth. Writes `bench.csv` (organism, mechanism, instrument,
metric, value, goal, passed), `results.json` (the rows with notes, seconds, errors, and the pending
extension rows) and `bench.html`; exits 0 only when every row meets its goal. A row whose instrument raises
is a miss with the error as its note.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import pandas as pd

from reward_lens.app.bench_checks import BenchContext, Check
from reward_lens.app.bench_registry import all_checks, select
from reward_lens.app.output import write_csv, write_json
from reward_lens.plotting import pyplot

COLUMNS = ["organism", "mechanism", "instrument", "metric", "value", "goal", "passed"]


@dataclass
class BenchResult:
    """The bench's rows (dicts with COLUMNS plus note, seconds, error) and the pending extension rows."""

    rows: List[Dict[str, Any]]
    pending: List[Dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r["passed"] for r in self.rows)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=COLUMNS + ["note", "seconds", "error"])

    def summary(self) -> pd.DataFrame:
        f = self.to_frame()
        return pd.DataFrame(
            [
                {
                    "rows": len(f),
                    "passed": int(f.passed.sum()),
                    "missed": int((~f.passed).sum()),
                    "pending": len(self.pending),
                    "seconds": round(self.seconds, 1),
                }
            ]
        )

    def plot(self, ax: Any = None) -> Any:
        plt = pyplot()
        f = self.to_frame()
        fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 0.28 * len(f) + 1))
        y = np.arange(len(f))[::-1]
        ax.barh(y, np.ones(len(f)), color=["#4f9d69" if p else "#c0504d" for p in f.passed])
        ax.set_yticks(y)
        ax.set_yticklabels(
            [f"{r.organism}/{r.mechanism}: {r.instrument}" for r in f.itertuples()], fontsize=7
        )
        ax.set_xticks([])
        ax.set_title("reward-lens bench (green: goal met)")
        return fig


def run_check(check: Check, ctx: BenchContext) -> Dict[str, Any]:
    t0 = time.perf_counter()
    error = ""
    try:
        value = float(check.run(ctx))
    except Exception as exc:  # a failing instrument is a finding, reported in its row
        value, error = (
            float("nan"),
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}",
        )
    return {
        "organism": check.organism,
        "mechanism": check.mechanism,
        "instrument": check.instrument,
        "metric": check.metric,
        "value": value,
        "goal": check.goal_text(),
        "passed": check.meets(value),
        "note": check.note,
        "seconds": round(time.perf_counter() - t0, 2),
        "error": error,
    }


def run_bench(
    only: Optional[Sequence[str]] = None,
    *,
    device: Optional[str] = "cpu",
    quick: bool = False,
    checks: Optional[Sequence[Check]] = None,
    echo: Callable[[str], None] = print,
) -> BenchResult:
    """Run the selected checks (all by default; `quick`: the reduced subset) and return their rows."""
    t0 = time.perf_counter()
    chosen = select(list(checks) if checks is not None else all_checks(), only, quick)
    ctx = BenchContext(device)
    rows, pending = [], []
    for check in chosen:
        if not check.available():
            pending.append({"row": check.name, "requires": check.requires})
            echo(f"  pending  {check.name} (needs {check.requires})")
            continue
        row = run_check(check, ctx)
        rows.append(row)
        mark = "ok  " if row["passed"] else "MISS"
        echo(
            f"  {mark}  {check.name} = {row['value']:.4g} (goal {row['goal']}, {row['seconds']:.1f}s)"
            + (f"  [{row['error']}]" if row["error"] else "")
        )
    return BenchResult(rows, pending, time.perf_counter() - t0)


def write_bench(result: BenchResult, out: Path) -> List[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frame = result.to_frame()
    write_csv(out / "bench.csv", frame[COLUMNS])  # a value not found (a rank of inf): an empty cell
    payload = {
        "passed": result.passed,
        "seconds": round(result.seconds, 1),
        "rows": frame.to_dict(orient="records"),
        "pending": result.pending,
    }
    write_json(out / "results.json", payload)  # non-finite values: null
    (out / "bench.html").write_text(render_html(result))
    return [out / "bench.csv", out / "results.json", out / "bench.html"]


def render_html(result: BenchResult) -> str:
    frame = result.to_frame()
    cells = []
    for r in frame.itertuples():
        colour = "#e3f4e8" if r.passed else "#fbe3e3"
        note = html.escape(r.note + (f" [{r.error}]" if r.error else ""))
        cells.append(
            f"<tr style='background:{colour}'><td>{html.escape(r.organism)}</td>"
            f"<td>{html.escape(r.mechanism)}</td>"
            f"<td>{html.escape(r.instrument)}</td><td>{html.escape(r.metric)}</td><td>{r.value:.4g}</td>"
            f"<td>{html.escape(r.goal)}</td><td>{'yes' if r.passed else 'no'}</td><td>{note}</td></tr>"
        )
    pending = "".join(
        f"<li>{html.escape(p['row'])} (needs {html.escape(p['requires'])})</li>" for p in result.pending
    )
    head = "".join(f"<th>{c}</th>" for c in COLUMNS + ["note"])
    s = result.summary().to_dict("records")[0]
    return (
        "<!doctype html><meta charset='utf-8'><title>reward-lens "
        "bench</title><style>body{font-family:sans-serif;margin:2em}td,th{padding:4px "
        "8px;border-bottom:1px solid #ddd;font-size:13px;text-align:left}</style><h1>reward-lens "
        f"bench</h1><p>{s['passed']} of {s['rows']} rows meet their goal ({s['seconds']} s). A missed "
        "goal is a finding about an instrument, not a tuning "
        f"target.</p><table><tr>{head}</tr>{''.join(cells)}</table>"
        + (f"<h2>Pending extension rows</h2><ul>{pending}</ul>" if pending else "")
    )
