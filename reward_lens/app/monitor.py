"""A logged training run (the JSONL of `RewardLensCallback`) as tables, plots and one self-contained HTML page.

    reward-lens monitor rm_monitor.jsonl [--out page.html]

The page shows, per group of tracked quantities (reward and reward-length correlation, hacking probes,
concept projections, components' shares of the reward), their time series with 95% intervals, the
baseline's interval as a band, and the flagged steps in red; then the per-batch attribution of the reward
recorded by the reward function, and a table of every flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import pandas as pd
from reward_lens.app.report import Report

GROUPS: Dict[str, str] = {
    "reward": "reward and its correlation with response length",
    "probe": "hacking probes on the policy's completions (mean Δreward, with property - control)",
    "concept": "projection of the completions on concept vectors (v̂ · resid at the readout)",
    "share": "components' shares of the reward (term / Σ|terms|)",
}


def group_of(quantity: str) -> str:
    """The plot group of a tracked quantity: 'probe', 'concept', 'share' or 'reward'."""
    head = quantity.split("/", 1)[0]
    return head if head in ("probe", "concept", "share") else "reward"


@dataclass
class MonitorRun:
    """The records of one logged run: its header (`run`), the baseline and checks, the per-batch records."""

    run: dict
    checks: List[dict]
    batches: List[dict] = field(default_factory=list)

    def to_frame(self) -> pd.DataFrame:
        """Tidy: one row per (check, quantity) with value, ci_low, ci_high, the baseline's interval, flagged."""
        base = self.checks[0]["metrics"] if self.checks else {}
        rows = []
        for rec in self.checks:
            for q, est in rec["metrics"].items():
                b = base.get(q, {})
                rows.append({"step": rec["step"], "kind": rec["kind"], "group": group_of(q), "quantity": q,
                             "value": est["value"], "ci_low": est["ci_low"], "ci_high": est["ci_high"],
                             "baseline_low": b.get("ci_low"), "baseline_high": b.get("ci_high"),
                             "flagged": q in rec.get("flags", [])})
        cols = ["step", "kind", "group", "quantity", "value", "ci_low", "ci_high", "baseline_low", "baseline_high", "flagged"]
        return pd.DataFrame(rows, columns=cols).astype({"value": float, "ci_low": float, "ci_high": float})

    def batch_frame(self) -> pd.DataFrame:
        """Tidy per-batch records of the reward function: step, quantity, value."""
        rows = [{"step": b["step"], "quantity": k, "value": v} for b in self.batches for k, v in b.items()
                if k not in ("kind", "step", "n")]
        return pd.DataFrame(rows, columns=["step", "quantity", "value"]).astype({"value": float})

    def summary(self) -> pd.DataFrame:
        """Every flag: step, quantity, value and interval, and the baseline's interval it left."""
        frame = self.to_frame()
        return frame[frame.flagged].drop(columns=["kind", "group", "flagged"]).reset_index(drop=True)

    def plot(self, group: str = "reward", ax=None):
        """Time series of one group's quantities (95% intervals as bands), the baseline interval of each as a
        dotted band, flagged steps as red crosses. Returns the Figure."""
        import matplotlib.pyplot as plt

        if group not in GROUPS:
            raise ValueError(f"unknown group {group!r}; choose from {list(GROUPS)}")
        frame = self.to_frame()
        frame = frame[frame.group == group]
        fig, ax = plt.subplots(figsize=(8.0, 3.6)) if ax is None else (ax.figure, ax)
        for i, (q, part) in enumerate(frame.groupby("quantity", sort=False)):
            colour = plt.get_cmap("tab10")(i % 10)
            ax.plot(part.step, part.value, marker="o", ms=3, color=colour, label=q)
            ax.fill_between(part.step, part.ci_low, part.ci_high, color=colour, alpha=0.15, lw=0)
            lo, hi = part.baseline_low.iloc[0], part.baseline_high.iloc[0]
            if lo is not None and hi is not None:
                ax.axhspan(lo, hi, color=colour, alpha=0.06, ls=":", lw=0.8)
            hit = part[part.flagged]
            ax.scatter(hit.step, hit.value, marker="x", s=60, color="#d62728", zorder=5,
                       label="flagged" if i == 0 else None)
        if frame.flagged.any() and not any(h.get_label() == "flagged" for h in ax.collections):
            ax.scatter([], [], marker="x", color="#d62728", label="flagged")
        ax.set_xlabel("training step")
        ax.set_title(GROUPS[group])
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        return fig

    def plot_batches(self, ax=None):
        """Per-batch mean attribution of the reward to each component, as recorded by the reward function."""
        import matplotlib.pyplot as plt

        frame = self.batch_frame()
        frame = frame[frame.quantity.str.startswith("attr/") & frame.quantity.str.endswith("/mean")]
        fig, ax = plt.subplots(figsize=(8.0, 3.6)) if ax is None else (ax.figure, ax)
        for q, part in frame.groupby("quantity", sort=False):
            ax.plot(part.step, part.value, lw=1, label=q.split("/")[1])
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel("training step")
        ax.set_ylabel("mean reward attribution")
        ax.set_title("reward split over components, per batch (exact: terms + bias = reward)")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), ncol=1 + len(frame.quantity.unique()) // 12)
        fig.tight_layout()
        return fig


def load_monitor(path: Union[str, Path]) -> MonitorRun:
    """Read a `RewardLensCallback` JSONL log (the last run in the file, if several were appended)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no monitor log at {str(path)!r}; RewardLensCallback writes it (log_path=)")
    run, checks, batches = {}, [], []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {i + 1} is not JSON ({exc.msg}); is this a RewardLensCallback log?") from None
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "run":
            run, checks, batches = rec, [], []
        elif kind in ("baseline", "check"):
            checks.append(rec)
        elif kind == "batch":
            batches.append(rec)
        else:
            raise ValueError(f"{path} line {i + 1} has kind {kind!r}; expected run, baseline, check or batch records")
    if not checks and not batches:
        raise ValueError(f"{path} holds no baseline, check or batch records; did training reach its first step?")
    return MonitorRun(run, checks, batches)


def render_monitor(path: Union[str, Path], out: Optional[Union[str, Path]] = None) -> Path:
    """Render the log at `path` as one self-contained HTML page (default: next to it, .html); returns its path."""
    mon = load_monitor(path)
    out = Path(out) if out is not None else Path(path).with_suffix(".html")
    report = Report(f"reward-lens training monitor: {mon.run.get('model') or Path(path).name}")
    sec = report.section("Summary")
    flags = mon.summary()
    sec.text(f"{len(mon.checks)} measurements (baseline at step {mon.checks[0]['step'] if mon.checks else '-'}, then "
             f"every {mon.run.get('every', '?')} steps) on the {mon.run.get('sample_size', '?')} most recent "
             f"completions; {len(flags)} flag(s) at step(s) {sorted(set(flags.step)) or 'none'}.")
    sec.text("A quantity is flagged when its 95% interval and the baseline's are disjoint (the reward-length "
             "correlation only when it rises).", note=True)
    costs = [(c["cost_s"], c.get("overhead")) for c in mon.checks]
    if costs:
        over = [o for _, o in costs if o is not None]
        sec.text(f"Measurement cost: {sum(c for c, _ in costs) / len(costs):.3g} s per check"
                 + (f", {100 * sum(over) / len(over):.2g}% of the training time between checks." if over else "."),
                 note=True)
    if len(flags):
        sec.table(flags)
    frame = mon.to_frame()
    for group, title in GROUPS.items():
        if (frame.group == group).any():
            report.section(title[0].upper() + title[1:]).figure(mon.plot(group), alt=f"{group} time series")
    if mon.batches:
        report.section("Per-batch attribution").figure(mon.plot_batches(), alt="per-batch attribution")
    if mon.checks and mon.checks[0].get("concept_cosines"):
        cos = pd.DataFrame(sorted(mon.checks[0]["concept_cosines"].items()), columns=["concept", "cos(v, w_r)"])
        report.section("Concept vectors").text("Cosine of each concept vector with the reward direction.").table(cos)
    return report.save(out)
