"""JudgeBench (ScalerLab/JudgeBench): rows `question, response_A, response_B, label` ("A>B" or "B>A"),
optionally `source` and `pair_id`.

The rule of JudgeBench's `run_judge.py` and `utils/metrics.py` for a reward-model judge: by default each
pair is judged twice, as (A, B) and as (B, A); a game's decision is "first > second" when the first
response's reward is strictly higher, else "second > first", and the second game's decision is flipped
back. A pair counts correct when more of its two decisions agree with the label than contradict it.
Equal rewards give one decision each way, so a tie counts wrong (never half). With `single_game=True`
(`run_judge.py --single_game`, which JudgeBench's README recommends for reward models, whose score of a
response does not depend on the order) only the game (A, B) is played: "A>B" when r_A > r_B, else "B>A",
so a tie counts as B>A (right when the label is B>A). Accuracy is reported per
source (the prefixes mmlu-pro, livebench-reasoning, livebench-math, livecodebench, as the script groups
them; other sources by name) and over all pairs ("all").
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pandas as pd

from reward_lens.data.pairs import PreferencePair
from reward_lens.evaluation.base import (
    Benchmark,
    BenchmarkFormatError,
    Row,
    check_spelling,
    register,
    row_label,
    row_text,
    summary_row,
)

NAME = "judgebench"
LABELS = ("A>B", "B>A")
SOURCES = ("mmlu-pro", "livebench-reasoning", "livebench-math", "livecodebench")


def _matches(columns: Sequence[str], row: Row) -> bool:
    return {"question", "response_A", "response_B", "label"} <= set(columns)


def _label(row: Row, where: str) -> str:
    label = str(row.get("label", "")).strip()
    if label not in LABELS:
        raise BenchmarkFormatError(f"{where}, column 'label': is {row.get('label')!r}; give 'A>B' or 'B>A'")
    return label


def _group(source: str) -> str:
    return next((s for s in SOURCES if source.startswith(s)), source)


def _responses(rows: List[Row]) -> pd.DataFrame:
    out = []
    for i, row in enumerate(rows):
        where = f"row {i + 1}"
        prompt, label = row_text(row, "question", where), _label(row, where)
        rid = row_label(row, "pair_id", row_label(row, "id", str(i)))
        subset = _group(row_label(row, "source", "default"))
        for k, side in enumerate("AB"):
            out.append(
                {
                    "row": i,
                    "id": rid,
                    "subset": subset,
                    "role": side,
                    "k": k,
                    "label": label,
                    "prompt": prompt,
                    "response": row_text(row, f"response_{side}", where),
                }
            )
    check_spelling([r["subset"] for r in out], SOURCES, "source", "JudgeBench")
    return pd.DataFrame(out)


def _flip(decision: str) -> str:
    return {"A>B": "B>A", "B>A": "A>B"}[decision]


def pair_correct(score_a: float, score_b: float, label: str) -> bool:
    """Both orders as the script plays them; correct when the decisions lean to the label."""
    first = "A>B" if score_a > score_b else "B>A"
    second = _flip("A>B" if score_b > score_a else "B>A")  # game (B, A), decision mapped back to A/B
    lean = sum(1 if d == label else -1 for d in (first, second))
    return lean > 0


def single_game_correct(score_a: float, score_b: float, label: str) -> bool:
    """`--single_game`: the one game (A, B), decided "A>B" only when A's reward is strictly higher."""
    return ("A>B" if score_a > score_b else "B>A") == label


def _summarize(frame: pd.DataFrame, single_game: bool = False) -> Tuple[pd.DataFrame, Dict[str, Any]]:
    a = frame[frame.role == "A"].set_index("row")
    b = frame[frame.role == "B"].set_index("row")
    rule = single_game_correct if single_game else pair_correct
    correct = pd.Series({r: rule(a.reward[r], b.reward[r], a.label[r]) for r in a.index}, dtype=bool)
    out = [
        summary_row(NAME, s, correct[a.subset == s].mean(), int((a.subset == s).sum()))
        for s in dict.fromkeys(a.subset)
    ]
    out.append(summary_row(NAME, "all", float(np.mean(correct)), len(correct)))
    games = "single game (A, B)" if single_game else "both orders"
    return pd.DataFrame(out), {"n_tied": int((a.reward == b.reward).sum()), "games": games}


def _pairs(rows: List[Row]) -> List[PreferencePair]:
    frame = _responses(rows)
    out = []
    for _, g in frame.groupby("row", sort=True):
        g = g.set_index("role")
        good, bad = ("A", "B") if g.label["A"] == "A>B" else ("B", "A")
        out.append(
            PreferencePair(
                g.prompt["A"], g.response[good], g.response[bad], subset=g.subset["A"], id=str(g.id["A"])
            )
        )
    return out


BENCHMARK = register(
    Benchmark(
        name=NAME,
        columns=("question", "response_A", "response_B", "label: A>B / B>A", "source", "pair_id"),
        rule=__doc__.split("\n\n", 1)[1].strip(),
        matches=_matches,
        responses=_responses,
        summarize=_summarize,
        pairs=_pairs,
        options=("single_game",),
    )
)
