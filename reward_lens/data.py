"""Preference data: `PreferencePair` and `load_pairs` for RewardBench-style files (JSONL/JSON/CSV/parquet)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

REQUIRED_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """One preference comparison: the same prompt with a chosen (preferred) and a rejected response."""

    prompt: str
    chosen: str
    rejected: str
    subset: Optional[str] = None
    id: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


def _records_to_pairs(records: Sequence[dict], source: str) -> List[PreferencePair]:
    if not records:
        raise ValueError(f"{source} holds no preference pairs; give at least one row with prompt, chosen, rejected")
    missing = [c for c in REQUIRED_COLUMNS if c not in records[0]]
    if missing:
        raise ValueError(
            f"{source} lacks column(s) {missing}; preference files need columns prompt, chosen, rejected "
            f"(optional: subset, id); found {sorted(records[0])}"
        )
    pairs = []
    for i, r in enumerate(records):
        sid = r.get("id")
        pairs.append(
            PreferencePair(
                prompt=str(r["prompt"]), chosen=str(r["chosen"]), rejected=str(r["rejected"]),
                subset=None if r.get("subset") is None else str(r["subset"]),
                id=str(sid) if sid is not None and sid == sid else str(i),
            )
        )
    return pairs


def load_pairs(path: Union[str, Path]) -> List[PreferencePair]:
    """Read pairs from .jsonl, .json (a list of objects), .csv or .parquet with RewardBench's columns."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no pairs file at {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif suffix == ".json":
        data = json.loads(path.read_text())
        records = data if isinstance(data, list) else data.get("pairs", [])
    elif suffix in (".csv", ".parquet"):
        import pandas as pd

        frame = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
        records = frame.to_dict("records")
    else:
        raise ValueError(f"unsupported pairs file type {suffix!r}; use .jsonl, .json, .csv or .parquet")
    return _records_to_pairs(records, str(path))


def as_pairs(pairs: Union[PreferencePair, Iterable[PreferencePair], str, Path]) -> List[PreferencePair]:
    """Accept one pair, a list of pairs, or a path; return a non-empty list."""
    if isinstance(pairs, (str, Path)):
        return load_pairs(pairs)
    if isinstance(pairs, PreferencePair):
        return [pairs]
    pairs = list(pairs)
    if not pairs:
        raise ValueError("no preference pairs given; pass at least one PreferencePair")
    return pairs
