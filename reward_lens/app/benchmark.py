"""The audit of a benchmark file: its score by the official rule in results.json and the report, and for
RM-Bench the hard-subset misses (a plainer chosen response losing to a fancier rejected one) with the
attribution terms that carry the style preference."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pandas as pd

from reward_lens.data.pairs import PreferencePair
from reward_lens.evaluation import BenchmarkResult, read_source, resolve
from reward_lens.evaluation.rmbench import STYLES, hard_misses, pair_id
from reward_lens.instruments import attribute

TOP_TERMS = 3  # attribution terms listed per missed pair
MAX_MISSES = 64  # missed pairs attributed (the most wrong first)


def is_benchmark_file(path: Any) -> bool:
    """A file in a benchmark layout that `load_pairs` cannot read (RewardBench 2, RM-Bench, JudgeBench):
    audited as its pairwise expansion, with the benchmark's score."""
    try:
        rows, label = read_source(path)
        return resolve(rows, "auto", label).name in ("rewardbench2", "rmbench", "judgebench")
    except ValueError:
        return False


def _miss_pairs(result: BenchmarkResult, misses: pd.DataFrame) -> List[PreferencePair]:
    out = []
    for m in misses.itertuples():
        row = result.rows[m.row]
        i, j = STYLES.index(m.chosen_style), STYLES.index(m.rejected_style)
        out.append(
            PreferencePair(
                row["prompt"],
                row["chosen"][i],
                row["rejected"][j],
                subset=str(m.domain),
                id=pair_id(str(m.id), i, j),
            )
        )
    return out


def style_misses(model, result: BenchmarkResult, batch_size: int = 8) -> Tuple[pd.DataFrame, pd.DataFrame]:
    """(misses, components): each missed hard pair with its TOP_TERMS largest attribution terms of the gap,
    and each component's mean gap term over the missed pairs (negative: it carries the wrong preference)."""
    misses = hard_misses(result.scores)
    misses["gap"] = misses.reward_chosen - misses.reward_rejected
    misses = misses.sort_values("gap").head(MAX_MISSES).reset_index(drop=True)
    if misses.empty:
        return misses, pd.DataFrame(columns=["component", "layer", "mean_gap_term", "n_pairs"])
    attr = attribute(model, _miss_pairs(result, misses), batch_size=batch_size, progress=False)
    terms = attr.to_frame()
    tops = []
    for pid, g in terms.groupby("pair", sort=False):
        g = g.reindex(g.gap.abs().sort_values(ascending=False).index).head(TOP_TERMS)
        tops.append(
            {"pair": pid, "top_terms": "; ".join(f"{c} {v:+.4f}" for c, v in zip(g.component, g.gap))}
        )
    misses.insert(
        0,
        "pair",
        [
            pair_id(str(m.id), STYLES.index(m.chosen_style), STYLES.index(m.rejected_style))
            for m in misses.itertuples()
        ],
    )
    misses = misses.merge(pd.DataFrame(tops), on="pair", how="left")
    comp = (
        terms.groupby(["component", "layer"], sort=False)
        .gap.mean()
        .rename("mean_gap_term")
        .reset_index()
        .sort_values("mean_gap_term")
        .reset_index(drop=True)
    )
    comp["n_pairs"] = len(misses)
    return misses, comp


def benchmark_outputs(
    model, result: BenchmarkResult, batch_size: int = 8
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(record entry for results.json, {csv name: frame}) of a benchmark result, with RM-Bench's misses."""
    record: Dict[str, Any] = {
        "name": result.benchmark,
        "source": result.source,
        "rule": result.rule,
        "accuracy": result.accuracy,
        "summary": result.summary().to_dict("records"),
    }
    frames = {"benchmark_summary": result.summary(), "benchmark_scores": result.to_frame()}
    if result.benchmark == "rmbench":
        misses, comp = style_misses(model, result, batch_size)
        record["hard_misses"] = {
            "n": len(hard_misses(result.scores)),
            "attributed": len(misses),
            "pairs": misses.to_dict("records"),
            "components": comp.head(10).to_dict("records"),
        }
        frames["rmbench_hard_misses"], frames["rmbench_miss_components"] = misses, comp
    return record, frames


def benchmark_section(
    report: Any, record: Dict[str, Any], frames: Dict[str, pd.DataFrame], figure: Any
) -> None:
    """The report's benchmark section: the summary table and plot, and RM-Bench's style misses."""
    sec = report.section(f"Benchmark: {record['name']}")
    sec.text(f"Scored by the official rule: {record['rule']}")
    sec.table(frames["benchmark_summary"])
    sec.figure(figure)
    if "hard_misses" in record:
        h = record["hard_misses"]
        sec.text(
            f"RM-Bench hard comparisons missed: {h['n']} (a plainer chosen response scored at most as "
            f"high as a fancier rejected one). The {h['attributed']} most wrong are attributed exactly; "
            f"each lists its {TOP_TERMS} largest terms of the reward gap. Components with the most "
            "negative mean term carry the style preference."
        )
        shown = (
            frames["rmbench_hard_misses"][
                ["pair", "domain", "chosen_style", "rejected_style", "gap", "top_terms"]
            ]
            if len(frames["rmbench_hard_misses"])
            else frames["rmbench_hard_misses"]
        )
        sec.table(shown, max_rows=20)
        sec.table(frames["rmbench_miss_components"].head(10))
