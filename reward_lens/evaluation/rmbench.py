"""RM-Bench (THU-KEG/RM-Bench): each row has three chosen and three rejected responses, in the styles
concise, detailed (plain text), detailed (markdown), and a `domain` (chat, code, math, safety-refuse,
safety-response).

The rule of RM-Bench's `compute_accuracy`: M[i, j] = the fraction of rows whose chosen response in style i
scores strictly higher than the rejected response in style j (equal scores count wrong); hard = the mean
of the upper triangle (i < j: a plainer chosen against a fancier rejected), normal = the mean of the
diagonal, easy = the mean of the lower triangle. Each domain is scored on its rows (the script runs one
domain file at a time, or the total dataset); "all" is the mean of hard, normal and easy over all rows (the
script on total_dataset.json), i.e. the mean of the nine cells of the pooled M.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pandas as pd

from reward_lens.data.pairs import PreferencePair
from reward_lens.evaluation.base import Benchmark, Row, register, row_label, row_list, row_text, summary_row

NAME = "rmbench"
STYLES = ("concise", "detailed", "markdown")
LEVELS = ("hard", "normal", "easy")


def _matches(columns: Sequence[str], row: Row) -> bool:
    return {"prompt", "chosen", "rejected", "domain"} <= set(columns)


def _responses(rows: List[Row]) -> pd.DataFrame:
    out = []
    for i, row in enumerate(rows):
        where = f"row {i + 1}"
        prompt = row_text(row, "prompt", where)
        rid, domain = row_label(row, "id", str(i)), row_label(row, "domain", "default")
        for role in ("chosen", "rejected"):
            for k, t in enumerate(row_list(row, role, where, n=len(STYLES))):
                out.append(
                    {
                        "row": i,
                        "id": rid,
                        "subset": domain,
                        "role": role,
                        "k": k,
                        "style": STYLES[k],
                        "prompt": prompt,
                        "response": t,
                    }
                )
    return pd.DataFrame(out)


def win_matrices(frame: pd.DataFrame) -> Tuple[np.ndarray, List[int]]:
    """[rows, 3, 3] booleans W[r, i, j] = chosen style i > rejected style j, and the row numbers."""
    rows = sorted(frame.row.unique())
    c = frame[frame.role == "chosen"].pivot(index="row", columns="k", values="reward").loc[rows].to_numpy()
    w = frame[frame.role == "rejected"].pivot(index="row", columns="k", values="reward").loc[rows].to_numpy()
    return c[:, :, None] > w[:, None, :], [int(r) for r in rows]


def levels(matrix: np.ndarray) -> Dict[str, float]:
    """hard / normal / easy of a 3x3 accuracy matrix (RM-Bench's triangles and diagonal)."""
    n = matrix.shape[0]
    tri = n * (n - 1) / 2
    return {
        "hard": float(np.triu(matrix, 1).sum() / tri),
        "normal": float(np.mean(np.diag(matrix))),
        "easy": float(np.tril(matrix, -1).sum() / tri),
    }


def _summarize(frame: pd.DataFrame) -> Tuple[pd.DataFrame, Dict[str, Any]]:
    wins, rows = win_matrices(frame)
    domain_of = frame.drop_duplicates("row").set_index("row").subset
    domains = list(dict.fromkeys(domain_of.loc[rows]))
    out, details = [], {"matrix": {}}
    for name, mask in [(d, (domain_of.loc[rows] == d).to_numpy()) for d in domains] + [("all", None)]:
        part = wins if mask is None else wins[mask]
        m = part.mean(0)
        lv = levels(m)
        details["matrix"][name] = m.tolist()
        prefix = "" if name == "all" else f"{name}/"
        out.extend(summary_row(NAME, f"{prefix}{lv_name}", lv[lv_name], len(part)) for lv_name in LEVELS)
        out.append(summary_row(NAME, name, float(np.mean(list(lv.values()))), len(part)))
    return pd.DataFrame(out), details  # per domain, then hard / normal / easy / all over every row


def hard_misses(result_frame: pd.DataFrame) -> pd.DataFrame:
    """The hard comparisons (chosen style i < rejected style j) the model got wrong: row, id, domain, i, j,
    reward_chosen, reward_rejected."""
    wins, rows = win_matrices(result_frame)
    c = result_frame[result_frame.role == "chosen"].pivot(index="row", columns="k", values="reward").loc[rows]
    w = (
        result_frame[result_frame.role == "rejected"]
        .pivot(index="row", columns="k", values="reward")
        .loc[rows]
    )
    meta = result_frame.drop_duplicates("row").set_index("row")
    out = []
    for a, r in enumerate(rows):
        for i in range(len(STYLES)):
            for j in range(i + 1, len(STYLES)):
                if not wins[a, i, j]:
                    out.append(
                        {
                            "row": r,
                            "id": meta.id[r],
                            "domain": meta.subset[r],
                            "chosen_style": STYLES[i],
                            "rejected_style": STYLES[j],
                            "reward_chosen": float(c.loc[r, i]),
                            "reward_rejected": float(w.loc[r, j]),
                        }
                    )
    return pd.DataFrame(
        out,
        columns=["row", "id", "domain", "chosen_style", "rejected_style", "reward_chosen", "reward_rejected"],
    )


def pair_id(rid: str, i: int, j: int) -> str:
    return f"{rid}:{STYLES[i]}-vs-{STYLES[j]}"


def _pairs(rows: List[Row]) -> List[PreferencePair]:
    """All nine (chosen style i, rejected style j) pairs of each row; subset the row's domain."""
    frame = _responses(rows)
    out = []
    for _, g in frame.groupby("row", sort=True):
        c, w = g[g.role == "chosen"].set_index("k"), g[g.role == "rejected"].set_index("k")
        for i in range(len(STYLES)):
            for j in range(len(STYLES)):
                out.append(
                    PreferencePair(
                        c.prompt[i],
                        c.response[i],
                        w.response[j],
                        subset=c.subset[i],
                        id=pair_id(c.id[i], i, j),
                    )
                )
    return out


BENCHMARK = register(
    Benchmark(
        name=NAME,
        columns=("prompt", "chosen: 3 responses", "rejected: 3 responses", "domain", "id"),
        rule=__doc__.split("\n\n", 1)[1].strip(),
        matches=_matches,
        responses=_responses,
        summarize=_summarize,
        pairs=_pairs,
    )
)
