"""Preference data: `PreferencePair` and `load_pairs` for RewardBench-style files (JSONL/JSON/CSV/parquet),
`TokenPair` for pairs given as token ids, and `bundled_pairs()`, a small natural-language set for tests
and demos."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

REQUIRED_COLUMNS = ("prompt", "chosen", "rejected")
BUNDLED_PAIRS = Path(__file__).resolve().parent / "pairs.jsonl"


Messages = Tuple[Mapping[str, Any], ...]  # TRL's conversational format: ({"role": ..., "content": ...}, ...)


def as_text_or_messages(value: Any) -> Union[str, Messages]:
    """A str stays a str; a list of {"role", "content"} messages becomes a tuple of dicts (conversational)."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
        return tuple(dict(m) for m in value)
    return str(value)


@dataclass(frozen=True)
class PreferencePair:
    """One preference comparison: the same prompt with a chosen (preferred) and a rejected response.

    Each part is a string or, in TRL's conversational format, a tuple of {"role", "content"} messages
    (`model.to_tokens` renders those with the chat template)."""

    prompt: Union[str, Messages]
    chosen: Union[str, Messages]
    rejected: Union[str, Messages]
    subset: Optional[str] = None
    id: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(eq=False)
class TokenPair:
    """A preference pair given directly as token ids (no tokenizer needed), e.g. for random-id benchmarks.

    `prompt_len` is the number of shared prompt tokens at the start of both sequences; by default the
    longest common prefix of the two.
    """

    chosen: Union[Sequence[int], torch.Tensor]
    rejected: Union[Sequence[int], torch.Tensor]
    prompt_len: Optional[int] = None
    subset: Optional[str] = None
    id: Optional[str] = None

    def __post_init__(self) -> None:
        self.chosen = torch.as_tensor(self.chosen, dtype=torch.long).flatten()
        self.rejected = torch.as_tensor(self.rejected, dtype=torch.long).flatten()
        if len(self.chosen) == 0 or len(self.rejected) == 0:
            raise ValueError("a TokenPair needs at least one token in both chosen and rejected")


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
                prompt=as_text_or_messages(r["prompt"]), chosen=as_text_or_messages(r["chosen"]),
                rejected=as_text_or_messages(r["rejected"]),
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


def bundled_pairs() -> List[PreferencePair]:
    """The 30 short natural-language pairs shipped with reward-lens (RewardBench columns and subset names,
    written for the package), for tests, demos and smoke runs. Not a benchmark."""
    return load_pairs(BUNDLED_PAIRS)


AnyPair = Union[PreferencePair, TokenPair]


def as_pairs(pairs: Union[AnyPair, Iterable[AnyPair], str, Path]) -> List[AnyPair]:
    """Accept one pair, a list of pairs, or a path; return a non-empty list."""
    if isinstance(pairs, (str, Path)):
        return load_pairs(pairs)
    if isinstance(pairs, (PreferencePair, TokenPair)):
        return [pairs]
    pairs = list(pairs)
    if not pairs:
        raise ValueError("no preference pairs given; pass at least one PreferencePair")
    bad = [type(p).__name__ for p in pairs if not isinstance(p, (PreferencePair, TokenPair))]
    if bad:
        raise TypeError(f"pairs must be PreferencePair or TokenPair objects (or a file path); got {bad[0]}")
    kinds = {type(p) for p in pairs}
    if len(kinds) > 1:
        raise ValueError("mixing PreferencePair (text) and TokenPair (token ids) in one call is not supported")
    return pairs
