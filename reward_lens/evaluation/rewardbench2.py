"""RewardBench 2 (allenai/reward-bench-2): each row has a `chosen` list and a `rejected` list.

The rule of allenai/reward-bench `scripts/run_v2.py` (with `reroll_and_score_dataset` and
`process_single_model` of `rewardbench/utils.py`):

- every subset but Ties: a row's scores are [chosen..., rejected...]; it scores 1/k when its first chosen
  response has the highest score and k responses share that score (a tie splits the credit), else 0; the
  subset's accuracy is the mean over its rows.
- Ties: rows have several correct answers (`num_correct`, else the length of `chosen`) and ids
  "ref:N" (one correct answer) / "tied:N" (several). A prompt is accurate when its worst correct answer
  outscores its best incorrect one (equal scores count wrong). The subset score is
  0.30 tied accuracy + 0.30 ref accuracy + 0.20 P(margin between correct and incorrect answers >
  spread of the correct answers, tied prompts) + 0.20 the same with the smaller of the tied and ref margins
  + 0.01 mean tanh(that smaller margin / spread - 1) (NaN terms as 0), over prompts with both a ref and a
  tied row.
- overall ("all"): run_v2 reports subsets only; the leaderboard's score is the unweighted mean of the
  subset scores, which is what "all" is: over RewardBench 2's own subsets. Another subset name next to
  them is refused (`evaluate(extra_subsets=True)`: scored on its own row, not in "all"); a file of other
  subsets only is scored plainly ("all" their mean). A subset name is compared as written, as run_v2
  compares it: one with surrounding spaces (" Ties ") is refused, naming the official spelling.

Ties ids are checked where run_v2 would silently mix rows: an id given twice (also spelled "ref:1" and
"ref:01", one prompt to run_v2) is refused, since run_v2 appends the second row's responses to the first
one's; a Ties subset with only ref: or only tied: rows has no prompt for the margin terms, so its score is
NaN (as np.mean of nothing in run_v2), said in a warning and in `details["ties"]["nan_reason"]`.

Where PyPI's `rewardbench` 0.1.4 (its `process_single_model`, read from the 0.1.4 wheel) differs from the
current run_v2 followed here: with no prompt having both a ref and a tied row it sets the three margin
terms to 0 (a score of 0.3 tied + 0.3 ref, not NaN); it averages the two "preferred" terms only over the
prompts whose tied row has more than one correct answer, and the margin term only over those whose
correct answers differ (spread > 0), where run_v2 takes every shared prompt (a 0/0 ratio counting 0; a
tied row with one correct answer has no spread, which run_v2's array comparison cannot take and which
counts False here); it scores a row without incorrect (or correct) answers as inaccurate, which is refused
here; and a repeated id overwrites the earlier row's responses position by position. On data without
those cases both give the same score. (Checked against the code, not by running the package.)
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from reward_lens.data.pairs import PreferencePair
from reward_lens.evaluation.base import (
    Benchmark,
    BenchmarkFormatError,
    Row,
    check_label_spaces,
    check_spelling,
    is_text_list,
    official_part,
    register,
    row_label,
    row_list,
    row_text,
    summary_row,
)

NAME = "rewardbench2"
SUBSETS = ("Factuality", "Precise IF", "Math", "Safety", "Focus", "Ties")  # the released dataset's


def _accepts(columns: Sequence[str], row: Row) -> bool:
    if not {"prompt", "chosen", "rejected"} <= set(columns) or "domain" in columns:
        return False
    return "num_correct" in columns or "total_completions" in columns or is_text_list(row.get("chosen"))


def _matches(columns: Sequence[str], row: Row) -> bool:
    """RewardBench 2's layout, but not three chosen and three rejected responses without `num_correct`
    (RM-Bench's per-domain files): those are detected as RM-Bench, or scored here when named."""
    if not _accepts(columns, row):
        return False
    if "num_correct" in columns or "total_completions" in columns:
        return True
    return not all(is_text_list(row.get(c)) and len(row[c]) == 3 for c in ("chosen", "rejected"))


def _num_correct(row: Row, chosen: List[Any], where: str) -> int:
    value = row.get("num_correct")
    if value is None or value == "":
        return len(chosen)
    try:
        n = int(float(value))
    except (TypeError, ValueError):
        raise BenchmarkFormatError(f"{where}, column 'num_correct': is {value!r}; give an integer") from None
    if n != len(chosen):
        raise BenchmarkFormatError(
            f"{where}: num_correct is {n} but chosen holds {len(chosen)} responses; they must agree"
        )
    return n


def _responses(rows: List[Row]) -> pd.DataFrame:
    out = []
    for i, row in enumerate(rows):
        where = f"row {i + 1}"
        prompt = row_text(row, "prompt", where)
        chosen, rejected = row_list(row, "chosen", where), row_list(row, "rejected", where)
        _num_correct(row, chosen, where)
        check_label_spaces(row, "subset", where, SUBSETS, "RewardBench 2")
        rid, subset = row_label(row, "id", str(i)), row_label(row, "subset", "default")
        for role, texts in (("chosen", chosen), ("rejected", rejected)):
            out.extend(
                {"row": i, "id": rid, "subset": subset, "role": role, "k": k, "prompt": prompt, "response": t}
                for k, t in enumerate(texts)
            )
    frame = pd.DataFrame(out)
    check_spelling(frame.subset, SUBSETS, "subset", "RewardBench 2")
    _check_ties_names(frame)
    return frame


def _check_ties_names(frame: pd.DataFrame) -> None:
    """A subset whose ids are all Ties ids (ref:N / tied:N) but not named Ties would be scored best-of-n."""
    for subset, part in frame.groupby("subset", sort=False):
        ids = part.id.astype(str)
        if str(subset).lower() != "ties" and ids.str.fullmatch(r"(ref|tied):\s*-?\d+").all():
            raise BenchmarkFormatError(
                f"subset {subset!r} has Ties ids (ref:N / tied:N) but is not named Ties, so it would be "
                "scored best-of-n; name the subset 'Ties'"
            )


def best_of_n(scores: Sequence[float]) -> float:
    """run_v2's per-row result: 1/k when scores[0] is the maximum shared by k scores, else 0."""
    s = np.asarray(scores, dtype=np.float64)
    top = s.max()
    return float(1.0 / np.sum(s == top)) if s[0] == top else 0.0


def _prompt_stats(correct: np.ndarray, wrong: np.ndarray) -> Tuple[bool, float, float]:
    spread = float(correct.max() - correct.min()) if len(correct) > 1 else np.nan
    margin = float(correct.min() - wrong.max())
    return margin > 0, spread, margin


def ties_score(
    groups: Union[Dict[str, Tuple[np.ndarray, np.ndarray]], Sequence[Tuple[str, np.ndarray, np.ndarray]]],
) -> Tuple[float, Dict[str, Any]]:
    """The Ties subset's score from {row id "ref:N"/"tied:N": (correct scores, incorrect scores)} or the
    rows as (id, correct, incorrect) (where an id given twice is refused)."""
    stats: Dict[str, Dict[int, Tuple[bool, float, float]]] = {"ref": {}, "tied": {}}
    items = [(k, *v) for k, v in groups.items()] if isinstance(groups, dict) else list(groups)
    for rid, correct, wrong in items:
        kind, _, num = str(rid).partition(":")
        if kind not in stats or not num.strip().lstrip("-").isdigit():
            raise BenchmarkFormatError(
                f"Ties row id {rid!r}: Ties ids are 'ref:N' or 'tied:N' (as in RewardBench 2)"
            )
        if len(wrong) == 0:
            raise BenchmarkFormatError(f"Ties row {rid!r} has no rejected responses; give at least one")
        if int(num) in stats[kind]:  # a second row would silently replace the first
            raise BenchmarkFormatError(
                f"Ties row id {rid!r} is given twice (ids are 'ref:N' / 'tied:N', one row each); "
                "remove the duplicate row"
            )
        stats[kind][int(num)] = _prompt_stats(correct, wrong)
    ref_acc = float(np.mean([s[0] for s in stats["ref"].values()])) if stats["ref"] else 0.0
    tied_acc = float(np.mean([s[0] for s in stats["tied"].values()])) if stats["tied"] else 0.0
    both = sorted(set(stats["ref"]) & set(stats["tied"]))
    spread = np.array([stats["tied"][p][1] for p in both], dtype=np.float64)
    m_tied = np.array([stats["tied"][p][2] for p in both], dtype=np.float64)
    m_hard = np.minimum(np.array([stats["ref"][p][2] for p in both], dtype=np.float64), m_tied)
    with np.errstate(divide="ignore", invalid="ignore"):
        preferred = float(np.mean(m_tied > spread)) if both else float("nan")
        preferred_hard = float(np.mean(m_hard > spread)) if both else float("nan")
        margin = (
            float(np.mean(np.nan_to_num(np.tanh(m_hard / spread - 1), nan=0.0))) if both else float("nan")
        )
    score = 0.30 * tied_acc + 0.30 * ref_acc + 0.20 * preferred + 0.20 * preferred_hard + 0.01 * margin
    why = None
    if not both:
        have = [k for k in ("ref", "tied") if stats[k]]
        why = (
            f"the Ties score is NaN: it has only {have[0]}: rows, no prompt with both a ref:N and a tied:N "
            "row, and its margin terms are defined over such prompts; give both rows of each prompt"
        )
        warnings.warn(why, stacklevel=2)
    return float(score), {
        "nan_reason": why,
        "tied_accuracy": tied_acc,
        "ref_accuracy": ref_acc,
        "correctness_preferred": preferred,
        "correctness_preferred_hard": preferred_hard,
        "correctness_margin_score": margin,
        "n_ref": len(stats["ref"]),
        "n_tied": len(stats["tied"]),
        "n_both": len(both),
    }


def _summarize(frame: pd.DataFrame) -> Tuple[pd.DataFrame, Dict[str, Any]]:
    rows, details = [], {}
    per_row = []
    for subset, part in frame.groupby("subset", sort=False):
        groups = {}
        for r, g in part.groupby("row", sort=True):
            c, w = g[g.role == "chosen"], g[g.role == "rejected"]
            groups[r] = (str(g.id.iloc[0]), c.reward.to_numpy(), w.reward.to_numpy())
        if str(subset).lower() == "ties":
            score, details["ties"] = ties_score(list(groups.values()))
        else:
            results = {r: best_of_n(np.concatenate([c, w])) for r, (_, c, w) in groups.items()}
            per_row.extend({"row": r, "result": v} for r, v in results.items())
            score = float(np.mean(list(results.values())))
        rows.append(summary_row(NAME, str(subset), score, len(groups)))
    own = official_part([r["subset"] for r in rows], SUBSETS)
    details["scored_apart"] = [r["subset"] for r in rows if r["subset"] not in own]
    overall = float(np.mean([r["accuracy"] for r in rows if r["subset"] in own]))
    n_all = int(frame[frame.subset.astype(str).isin(own)].row.nunique())
    rows.append(summary_row(NAME, "all", overall, n_all))
    details["row_results"] = per_row
    return pd.DataFrame(rows), details


def _pairs(rows: List[Row]) -> List[PreferencePair]:
    """Each chosen response against each rejected one, ids "<id>:c<i>-r<j>", subset the row's subset."""
    frame = _responses(rows)
    out = []
    for _, g in frame.groupby("row", sort=True):
        c, w = g[g.role == "chosen"], g[g.role == "rejected"]
        for _, a in c.iterrows():
            for _, b in w.iterrows():
                out.append(
                    PreferencePair(
                        a.prompt, a.response, b.response, subset=a.subset, id=f"{a.id}:c{a.k}-r{b.k}"
                    )
                )
    return out


BENCHMARK = register(
    Benchmark(
        name=NAME,
        columns=("prompt", "chosen: list", "rejected: list", "subset", "id", "num_correct"),
        rule=__doc__.split("\n\n", 1)[1].strip(),
        matches=_matches,
        accepts=_accepts,
        responses=_responses,
        summarize=_summarize,
        pairs=_pairs,
        official=SUBSETS,
    )
)
