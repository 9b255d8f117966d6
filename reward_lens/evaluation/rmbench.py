"""RM-Bench (THU-KEG/RM-Bench): each row has three chosen and three rejected responses, in the styles
concise, detailed (plain text), detailed (markdown), and a `domain` (chat, code, math, safety-refuse,
safety-response). The repository's per-domain files (`{domain}_filtered.json`: id, subset, prompt,
chosen[3], rejected[3], no `domain` column) take their domain from the file name or `domain=`.

The rule of RM-Bench's `compute_accuracy` (scripts/utils.py) on a total file: rows are split into the
domains chat, math, code and safety by the prefix of their `domain` (safety-refuse and safety-response
are one `safety`). Per domain, M[i, j] = the fraction of its rows whose chosen response in style i scores
strictly higher than the rejected response in style j (equal scores count wrong); hard = the mean of the
upper triangle (i < j: a plainer chosen against a fancier rejected), normal = the mean of the diagonal,
easy = the mean of the lower triangle, and the domain's score the mean of the three. Overall, hard /
normal / easy are each the mean over the domains, and "all" the mean of the domain scores (so every domain
weighs the same, whatever its number of rows; rows are not pooled). A per-domain file is that one domain.
A domain with none of the four prefixes (a typo such as "chta") is refused, naming the four; with
`evaluate(extra_subsets=True)` it is scored apart, as a domain of its own that is not in the overall means
(the script leaves such rows out). The overall means are over the four domains present (the script needs
all four in a total file: an absent one fails there). A domain is compared as written: one with
surrounding spaces is refused, naming the official spelling.
The two safety parts are also reported on their own (extra rows, not in the
overall means). Checked against the text of compute_accuracy / split_dataset_by_domain as copied into a
public fork's scripts (the THU-KEG repository's scripts/utils.py itself was not at hand), not by running it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

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

NAME = "rmbench"
STYLES = ("concise", "detailed", "markdown")
LEVELS = ("hard", "normal", "easy")
DOMAINS = ("chat", "math", "code", "safety")  # compute_accuracy's domains, matched by prefix
FILE_DOMAIN = re.compile(r"^(chat|math|code|safety-refuse|safety-response|safety)(?=$|[_.-])")
BEST_OF_N_COLUMNS = ("num_correct", "total_completions")  # RewardBench 2's, never RM-Bench's


def _matches(columns: Sequence[str], row: Row) -> bool:
    """A total file (with `domain`), or a per-domain file: three chosen and three rejected responses and
    none of RewardBench 2's best-of-n columns."""
    cols = set(columns)
    if not {"prompt", "chosen", "rejected"} <= cols:
        return False
    if "domain" in cols:
        return True
    return not cols & set(BEST_OF_N_COLUMNS) and all(
        is_text_list(row.get(c)) and len(row[c]) == len(STYLES) for c in ("chosen", "rejected")
    )


def domain_group(domain: str) -> str:
    """The compute_accuracy domain a row's `domain` belongs to (its prefix); other names stay themselves."""
    return next((d for d in DOMAINS if str(domain).startswith(d)), str(domain))


def file_domain(label: str) -> Optional[str]:
    """The domain an RM-Bench per-domain file's name gives (`chat_filtered.json` -> chat), else None."""
    match = FILE_DOMAIN.match(Path(str(label)).name.lower())
    return match.group(1) if match else None


def with_domain(rows: List[Row], domain: Optional[str], label: str) -> List[Row]:
    """Rows with a `domain`: `domain=` if given (rows must not have their own), else the file name's."""
    has = [i for i, r in enumerate(rows) if r.get("domain") not in (None, "")]
    if domain is not None:
        if not isinstance(domain, str) or not domain.strip():
            raise ValueError(f"domain must be a non-empty string such as 'chat', got {domain!r}")
        if has:
            raise BenchmarkFormatError(
                f"row {has[0] + 1} has its own domain {rows[has[0]]['domain']!r}; give domain= only for "
                "RM-Bench rows without a domain column (a per-domain file)"
            )
        return [dict(r, domain=domain.strip()) for r in rows]
    if len(has) == len(rows):
        return rows
    named = file_domain(label)
    if named is None:
        missing = next(i for i in range(len(rows)) if i not in set(has))
        raise BenchmarkFormatError(
            f"row {missing + 1} has no domain: RM-Bench scores by domain; give domain='chat' (math, code, "
            "safety-refuse, safety-response), name the file {domain}_filtered.json as RM-Bench does, or "
            "add a domain column (if these are RewardBench 2 rows, pass benchmark='rewardbench2')"
        )
    return [r if i in set(has) else dict(r, domain=named) for i, r in enumerate(rows)]


def _responses(rows: List[Row]) -> pd.DataFrame:
    out = []
    for i, row in enumerate(rows):
        where = f"row {i + 1}"
        prompt = row_text(row, "prompt", where)
        check_label_spaces(row, "domain", where, (*DOMAINS, "safety-refuse", "safety-response"), "RM-Bench")
        rid, domain = row_label(row, "id", str(i)), row_label(row, "domain")
        if domain is None:
            raise BenchmarkFormatError(f"{where}: lacks column 'domain'; give domain='chat' (or math, ...)")
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
    check_spelling([domain_group(r["subset"]) for r in out], DOMAINS, "domain", "RM-Bench")
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


def _level_rows(name: str, lv: Dict[str, float], n: int) -> List[Dict[str, Any]]:
    out = [summary_row(NAME, f"{name}/{k}", lv[k], n) for k in LEVELS]
    return out + [summary_row(NAME, name, float(np.mean([lv[k] for k in LEVELS])), n)]


def _summarize(frame: pd.DataFrame) -> Tuple[pd.DataFrame, Dict[str, Any]]:
    wins, rows = win_matrices(frame)
    domain_of = frame.drop_duplicates("row").set_index("row").subset.loc[rows].astype(str).to_numpy()
    group_of = np.array([domain_group(d) for d in domain_of])
    out, details = [], {"matrix": {}, "domains": {}}
    for group in dict.fromkeys(group_of):
        parts = [d for d in dict.fromkeys(domain_of[group_of == group]) if d != group]
        for name, mask in [(d, domain_of == d) for d in parts] + [(group, group_of == group)]:
            m = wins[mask].mean(0)
            lv = levels(m)
            details["matrix"][name] = m.tolist()
            out.extend(_level_rows(name, lv, int(mask.sum())))
        details["domains"][group] = lv
    # compute_accuracy: each level the mean over the domains, the total the mean of the domain scores
    own = official_part(list(details["domains"]), DOMAINS)
    details["scored_apart"] = [d for d in details["domains"] if d not in own]
    by_domain = [details["domains"][d] for d in own]
    overall = {k: float(np.mean([lv[k] for lv in by_domain])) for k in LEVELS}
    total = float(np.mean([np.mean([lv[k] for k in LEVELS]) for lv in by_domain]))
    n_own = int(np.isin(group_of, own).sum())
    out.extend(summary_row(NAME, k, overall[k], n_own) for k in LEVELS)
    out.append(summary_row(NAME, "all", total, n_own))
    return pd.DataFrame(out), details


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
        official=DOMAINS,
        group=domain_group,
        what="domain",
        official_only=True,
    )
)
