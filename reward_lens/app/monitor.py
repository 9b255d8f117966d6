"""A logged training run (the JSONL of `RewardLensCallback`) as tables, plots and one self-contained HTML
page.

    reward-lens monitor rm_monitor.jsonl [--out page.html]

The page shows, per group of tracked quantities (reward and reward-length correlation, hacking probes,
concept projections, components' shares of the reward), their time series with 95% intervals, the
baseline's interval as a band, and the flagged steps in red; then the per-batch attribution of the reward
recorded by the reward function, and a table of every flag.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import pandas as pd

from reward_lens.app.output import check_out_file, locked_file
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
    alarms: List[dict] = field(default_factory=list)
    notes: List[dict] = field(default_factory=list)

    def channel_frame(self) -> pd.DataFrame:
        """The hack alarm's statistics per batch: step, feature, statistic (pressure, z, CUSUMs, behaviour z,
        explained share), value."""
        rows = []
        for b in self.batches:
            for k, v in b.items():
                head = k.split("/", 1)[0]
                if head in ("pressure", "behaviour", "explained") and v is not None:
                    parts = k.split("/")
                    feature = (
                        "/".join(parts[1:-1])
                        if len(parts) > 2 and parts[-1] in _STATS
                        else "/".join(parts[1:])
                    )
                    stat = f"{head}/{parts[-1]}" if len(parts) > 2 and parts[-1] in _STATS else head
                    rows.append({"step": b["step"], "feature": feature, "statistic": stat, "value": float(v)})
        return pd.DataFrame(rows, columns=["step", "feature", "statistic", "value"])

    def plot_alarm(self, feature: str = "length", ax=None):
        """The alarm's four CUSUMs of one feature (pressure and behaviour, up and down) with the thresholds
        and the alarm step (`reward_lens.integrations.alarm.plot_cusums`). Returns the Figure."""
        from reward_lens.integrations.alarm import plot_cusums

        frame = self.channel_frame()
        frame = frame[frame.feature == feature]
        keys = [f"{c}/cusum_{side}" for c in ("pressure", "behaviour") for side in ("up", "down")]
        parts = {k: frame[frame.statistic == k] for k in keys}
        steps = list(parts[keys[0]].step)
        last = self.batches[-1] if self.batches else {}
        thresholds = {
            "pressure": last.get("alarm/threshold"),
            "behaviour": last.get("alarm/behaviour_threshold"),
        }
        return plot_cusums(
            steps, {k: list(p.value) for k, p in parts.items()}, thresholds, self.alarms, feature, ax
        )

    def to_frame(self) -> pd.DataFrame:
        """Tidy: one row per (check, quantity) with value, ci_low, ci_high, the baseline's interval,
        flagged."""
        base = self.checks[0]["metrics"] if self.checks else {}
        rows = []
        for rec in self.checks:
            for q, est in rec["metrics"].items():
                b = base.get(q, {})
                rows.append(
                    {
                        "step": rec["step"],
                        "kind": rec["kind"],
                        "group": group_of(q),
                        "quantity": q,
                        "value": est["value"],
                        "ci_low": est["ci_low"],
                        "ci_high": est["ci_high"],
                        "baseline_low": b.get("ci_low"),
                        "baseline_high": b.get("ci_high"),
                        "flagged": q in rec.get("flags", []),
                    }
                )
        cols = [
            "step",
            "kind",
            "group",
            "quantity",
            "value",
            "ci_low",
            "ci_high",
            "baseline_low",
            "baseline_high",
            "flagged",
        ]
        return pd.DataFrame(rows, columns=cols).astype({"value": float, "ci_low": float, "ci_high": float})

    def batch_frame(self) -> pd.DataFrame:
        """Tidy per-batch records of the reward function: step, quantity, value."""
        rows = [
            {"step": b["step"], "quantity": k, "value": v}
            for b in self.batches
            for k, v in b.items()
            if k not in ("kind", "step", "n")
        ]
        return pd.DataFrame(rows, columns=["step", "quantity", "value"]).astype({"value": float})

    def summary(self) -> pd.DataFrame:
        """Every flag: step, quantity, value and interval, and the baseline's interval it left."""
        frame = self.to_frame()
        flagged = frame.flagged.astype(bool)  # an empty object column would select columns, not rows
        return frame[flagged].drop(columns=["kind", "group", "flagged"]).reset_index(drop=True)

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
            ax.scatter(
                hit.step,
                hit.value,
                marker="x",
                s=60,
                color="#d62728",
                zorder=5,
                label="flagged" if i == 0 else None,
            )
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
        ax.legend(
            fontsize=7,
            loc="center left",
            bbox_to_anchor=(1.0, 0.5),
            ncol=1 + len(frame.quantity.unique()) // 12,
        )
        fig.tight_layout()
        return fig


LOG_FORMAT = 2  # the "format" of the run record RewardLensCallback writes (2 adds alarm and note records)
_STATS = ("p_up", "z", "cusum_up", "cusum_down")


def load_monitor(path: Union[str, Path]) -> MonitorRun:
    """Read a `RewardLensCallback` JSONL log (the last run in the file, if several were appended). A last line
    cut short (the run still writing, or killed) is skipped with a warning; any other damage is a one-line
    ValueError naming the line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no monitor log at {str(path)!r}; RewardLensCallback writes it (log_path=)")
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give the JSONL file RewardLensCallback wrote (log_path=)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {exc.start}); is this a RewardLensCallback log?"
        ) from None
    if not text.strip():
        raise ValueError(
            f"{path} is empty; training has not reached its first step (or log_path points elsewhere)"
        )
    run, checks, batches, alarms, notes = {}, [], [], [], []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1 and not text.endswith("\n") and checks + batches:
                warnings.warn(
                    f"{path} line {i + 1} is cut short (the run is still writing, or was killed); it is "
                    "skipped",
                    UserWarning,
                    stacklevel=2,
                )
                continue
            raise ValueError(
                f"{path} line {i + 1} is not JSON ({exc.msg}); is this a RewardLensCallback log?"
            ) from None
        kind = _checked_record(rec, f"{path} line {i + 1}")
        if kind == "run":
            run, checks, batches, alarms, notes = rec, [], [], [], []
        elif kind in ("baseline", "check"):
            checks.append(rec)
        elif kind == "alarm":
            alarms.append(rec)
        elif kind == "note":
            notes.append(rec)
        else:
            batches.append(rec)
    if not checks and not batches:
        raise ValueError(
            f"{path} holds no baseline, check or batch records; did training reach its first step?"
        )
    return MonitorRun(run, checks, batches, alarms, notes)


def _checked_record(rec: Any, where: str) -> str:
    """The kind of one log record, after checking the fields the page reads (ValueError naming the field)."""
    kind = rec.get("kind") if isinstance(rec, dict) else None
    if kind not in ("run", "baseline", "check", "batch", "alarm", "note"):
        raise ValueError(
            f"{where} has kind {kind!r}; expected run, baseline, check, batch, alarm or note records"
        )
    hint = "(hand-edited, or written by another reward-lens version?)"
    if kind == "run":
        fmt = rec.get("format", LOG_FORMAT)
        if not isinstance(fmt, int) or fmt > LOG_FORMAT:
            raise ValueError(
                f"{where}: log format {fmt!r} is newer than this reward-lens reads ({LOG_FORMAT}); "
                "upgrade reward-lens to render it"
            )
        return kind
    if not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
        raise ValueError(f"{where}: 'step' is {rec.get('step')!r}, not an integer {hint}")
    if kind == "note":
        if not isinstance(rec.get("text"), str):
            raise ValueError(f"{where}: a note record without 'text' {hint}")
        return kind
    if kind == "alarm":
        if not all(isinstance(rec.get(k), str) for k in ("feature", "channel")):
            raise ValueError(f"{where}: an alarm record needs 'feature' and 'channel' names {hint}")
        return kind
    if kind == "batch":
        for k, v in rec.items():
            if k not in ("kind", "step", "n") and v is not None and not _is_number(v):
                raise ValueError(f"{where}: {k!r} is {v!r}, not a number {hint}")
        return kind
    metrics = rec.get("metrics")
    if not isinstance(metrics, dict):
        raise ValueError(f"{where}: a {kind} record without 'metrics' {hint}")
    for q, est in metrics.items():
        if not isinstance(est, dict) or any(
            k not in est or not (est[k] is None or _is_number(est[k])) for k in ("value", "ci_low", "ci_high")
        ):
            raise ValueError(f"{where}: metric {q!r} needs numeric value, ci_low and ci_high {hint}")
    if not isinstance(rec.get("flags", []), list) or not _is_number(rec.get("cost_s", 0.0)):
        raise ValueError(f"{where}: 'flags' must be a list and 'cost_s' a number {hint}")
    return kind


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def render_monitor(
    path: Union[str, Path], out: Optional[Union[str, Path]] = None, check: bool = True
) -> Path:
    """Render the log at `path` as one self-contained HTML page (default: next to it, .html); returns its
    path. `out` is checked first (`check_out_file`: never the log itself, never a file reward-lens did not
    write)."""
    out = Path(path).with_suffix(".html") if out is None else out
    if not check:
        return _render(path, out)
    out = check_out_file(out, path)
    with locked_file(out):  # one writer at a time, as for a report directory
        return _render(path, out)


def _render(path: Union[str, Path], out: Union[str, Path]) -> Path:
    mon = load_monitor(path)
    report = Report(f"reward-lens training monitor: {mon.run.get('model') or Path(path).name}")
    sec = report.section("Summary")
    flags = mon.summary()
    for note in mon.notes:
        sec.text(f"Step {note['step']}: {note['text']}.")
    if not mon.checks:
        sec.text(
            "The monitor took no measurement: no baseline was ever taken (too few completions with text, or "
            "training stopped before the first check). Nothing was checked."
        )
    alarm_cfg = mon.run.get("alarm")
    if alarm_cfg:
        hacks = [a for a in mon.alarms if a["channel"] == "hack"]
        sec.text(
            "Hack alarm: "
            + (
                "; ".join(f"hack on {a['feature']} ({a['side']}) at step {a['step']}" for a in hacks)
                if hacks
                else "no hack alarm"
            )
            + f" (features {', '.join(alarm_cfg['features'])}; false-alarm probability of the pressure "
            f"channels ≤ {alarm_cfg['alpha']:g} over {alarm_cfg['horizon']} steps for a reward that ignores "
            f"the completion; pressures below {alarm_cfg['min_pressure']:g} ignored)."
        )
    sec.text(
        f"{len(mon.checks)} measurements (baseline at step {mon.checks[0]['step'] if mon.checks else '-'}, "
        f"then every {mon.run.get('every', '?')} steps) on the {mon.run.get('sample_size', '?')} most "
        f"recent completions; {len(flags)} flag(s) at step(s) {sorted(set(flags.step)) or 'none'}."
    )
    sec.text(
        "A quantity is flagged when its 95% interval and the baseline's are disjoint (the reward-length "
        "correlation only when it rises).",
        note=True,
    )
    costs = [(c.get("cost_s") or 0.0, c.get("overhead")) for c in mon.checks]
    if costs:
        over = [o for _, o in costs if o is not None]
        sec.text(
            f"Measurement cost: {sum(c for c, _ in costs) / len(costs):.3g} s per check"
            + (f", {100 * sum(over) / len(over):.2g}% of the training time between checks." if over else "."),
            note=True,
        )
    if len(flags):
        sec.table(flags)
    frame = mon.to_frame()
    for group, title in GROUPS.items():
        if (frame.group == group).any():
            report.section(title[0].upper() + title[1:]).figure(mon.plot(group), alt=f"{group} time series")
    if alarm_cfg:
        alarm_sec = report.section("Hack alarm")
        alarm_sec.text(
            "Per step, on every completion the reward function scored. Pressure: the within-group "
            "association of GRPO's advantage with the feature, its permutation p-value (rewards shuffled "
            "within each prompt group, exact for any reward that ignores the completion) as z = Φ⁻¹(1 − p), "
            "summed in a CUSUM. Behaviour: the batch mean of the feature (log length) against the "
            "pre-flight reference, in standard errors, in a CUSUM. A hack on X is raised when both cross h "
            "on the same side.",
            note=True,
        )
        if mon.alarms:
            alarm_sec.table(pd.DataFrame(mon.alarms).drop(columns=["kind"], errors="ignore"))
        for feature in alarm_cfg["features"]:
            alarm_sec.figure(mon.plot_alarm(feature), alt=f"alarm channels of {feature}")
    if mon.batches:
        report.section("Per-batch attribution").figure(mon.plot_batches(), alt="per-batch attribution")
    if mon.checks and mon.checks[0].get("concept_cosines"):
        cos = pd.DataFrame(
            sorted(mon.checks[0]["concept_cosines"].items()), columns=["concept", "cos(v, w_r)"]
        )
        report.section("Concept vectors").text(
            "Cosine of each concept vector with the reward direction."
        ).table(cos)
    return report.save(out)
