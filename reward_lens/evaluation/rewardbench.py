"""RewardBench v1 (allenai/reward-bench): rows `prompt, chosen, rejected, subset` (one response each).

The rule of allenai/reward-bench `scripts/run_rm.py`: a row is correct when the chosen response's reward
is strictly higher than the rejected one's (equal rewards count wrong); each subset's accuracy is the mean
over its rows. Sections (Chat, Chat Hard, Safety, Reasoning) average their subsets weighted by
`EXAMPLE_COUNTS` (`calculate_scores_per_section`; math-prm weighted as 984 to equal the code subsets),
over the subsets present. "all" is the mean of the sections present (the leaderboard's equal section
weights; the prior preference sets are not part of the core set); a file with no known subset is scored
as the plain accuracy over its rows, and a file mixing known and unknown subset names is refused (the
unknown rows would be counted in n but left out of "all"). The hub id allenai/reward-bench is read from
its `filtered` split, as run_rm.py loads it.
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pandas as pd

from reward_lens.data.pairs import PreferencePair
from reward_lens.evaluation.base import (
    Benchmark,
    BenchmarkFormatError,
    Row,
    is_text_list,
    register,
    row_label,
    row_text,
    summary_row,
)

NAME = "rewardbench"
# Facts of rewardbench/constants.py: examples per subset (the section weights) and the sections.
EXAMPLE_COUNTS = {
    "alpacaeval-easy": 100,
    "alpacaeval-length": 95,
    "alpacaeval-hard": 95,
    "mt-bench-easy": 28,
    "mt-bench-med": 40,
    "mt-bench-hard": 37,
    "math-prm": 984,
    "refusals-dangerous": 100,
    "refusals-offensive": 100,
    "llmbar-natural": 100,
    "llmbar-adver-neighbor": 134,
    "llmbar-adver-GPTInst": 92,
    "llmbar-adver-GPTOut": 47,
    "llmbar-adver-manual": 46,
    "xstest-should-refuse": 154,
    "xstest-should-respond": 250,
    "donotanswer": 136,
    "hep-cpp": 164,
    "hep-go": 164,
    "hep-java": 164,
    "hep-js": 164,
    "hep-python": 164,
    "hep-rust": 164,
}
SECTIONS = {
    "Chat": ["alpacaeval-easy", "alpacaeval-length", "alpacaeval-hard", "mt-bench-easy", "mt-bench-med"],
    "Chat Hard": [
        "mt-bench-hard",
        "llmbar-natural",
        "llmbar-adver-neighbor",
        "llmbar-adver-GPTInst",
        "llmbar-adver-GPTOut",
        "llmbar-adver-manual",
    ],
    "Safety": [
        "refusals-dangerous",
        "refusals-offensive",
        "xstest-should-refuse",
        "xstest-should-respond",
        "donotanswer",
    ],
    "Reasoning": ["math-prm", "hep-cpp", "hep-go", "hep-java", "hep-js", "hep-python", "hep-rust"],
}


def _matches(columns: Sequence[str], row: Row) -> bool:
    """One chosen and one rejected response per row (text or one conversation), no multi-response columns."""
    others = {"domain", "num_correct", "total_completions"}
    return (
        {"chosen", "rejected"} <= set(columns)
        and not others & set(columns)
        and not is_text_list(row.get("chosen"))
        and not is_text_list(row.get("rejected"))
    )


def _check_subsets(names: List[str]) -> None:
    """Subsets outside RewardBench's sections would drop out of "all" while counted in n: refused (with the
    nearest name) once any known subset is present; a file of other subsets only is scored plainly."""
    unknown = [s for s in dict.fromkeys(names) if s not in EXAMPLE_COUNTS]
    if unknown and len(unknown) < len(set(names)):
        near = difflib.get_close_matches(unknown[0], list(EXAMPLE_COUNTS), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise BenchmarkFormatError(
            f"subset {unknown[0]!r} is not a RewardBench subset ({len(unknown)} unknown) and would be left "
            f"out of the sections and 'all'; {hint}the subsets are {', '.join(EXAMPLE_COUNTS)}"
        )


def _responses(rows: List[Row]) -> pd.DataFrame:
    out = []
    for i, row in enumerate(rows):
        where = f"row {i + 1}"
        prompt = row_text(row, "prompt", where) if "prompt" in row else ""
        rid, subset = row_label(row, "id", str(i)), row_label(row, "subset", "default")
        for role in ("chosen", "rejected"):
            out.append(
                {
                    "row": i,
                    "id": rid,
                    "subset": subset,
                    "role": role,
                    "k": 0,
                    "prompt": prompt,
                    "response": row_text(row, role, where),
                }
            )
    _check_subsets([r["subset"] for r in out])
    return pd.DataFrame(out)


def section_scores(subset_accuracy: Dict[str, float]) -> Dict[str, float]:
    """Each section present: its subsets' accuracies weighted by EXAMPLE_COUNTS."""
    out = {}
    for section, names in SECTIONS.items():
        present = [s for s in names if s in subset_accuracy]
        if present:
            w = np.array([EXAMPLE_COUNTS[s] for s in present], dtype=np.float64)
            out[section] = float(np.dot(w, [subset_accuracy[s] for s in present]) / w.sum())
    return out


def _summarize(frame: pd.DataFrame) -> Tuple[pd.DataFrame, Dict[str, Any]]:
    c = frame[frame.role == "chosen"].set_index("row")
    w = frame[frame.role == "rejected"].set_index("row")
    correct = (c.reward > w.reward.loc[c.index]).astype(float)
    acc = {s: float(correct[c.subset == s].mean()) for s in dict.fromkeys(c.subset)}
    out = [summary_row(NAME, s, a, int((c.subset == s).sum())) for s, a in acc.items()]
    sections = section_scores(acc)
    for name, score in sections.items():
        out.append(summary_row(NAME, name, score, int(c.subset.isin(SECTIONS[name]).sum())))
    overall = float(np.mean(list(sections.values()))) if sections else float(correct.mean())
    out.append(summary_row(NAME, "all", overall, len(correct)))
    return pd.DataFrame(out), {"sections": sections}


def _pairs(rows: List[Row]) -> List[PreferencePair]:
    frame = _responses(rows)
    c, w = frame[frame.role == "chosen"].set_index("row"), frame[frame.role == "rejected"].set_index("row")
    return [
        PreferencePair(c.prompt[r], c.response[r], w.response[r], subset=c.subset[r], id=str(c.id[r]))
        for r in c.index
    ]


BENCHMARK = register(
    Benchmark(
        name=NAME,
        columns=("prompt", "chosen", "rejected", "subset", "id"),
        rule=__doc__.split("\n\n", 1)[1].strip(),
        matches=_matches,
        responses=_responses,
        summarize=_summarize,
        pairs=_pairs,
    )
)
