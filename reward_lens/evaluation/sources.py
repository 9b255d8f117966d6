"""Benchmark sources as plain rows: a local file (jsonl / json / csv / parquet), a `datasets.Dataset` or
`DatasetDict`, or a hub dataset id (read with `datasets.load_dataset`; offline, a one-line error).

Rows are dicts of column -> value. List cells are plain Python lists whatever the source stored them as
(a parquet numpy array, a CSV cell holding a JSON or Python list literal)."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from reward_lens.data.validate import SUFFIXES, PairDataError, read_records

Row = Dict[str, Any]
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# The split each benchmark's official script scores (RewardBench v1's run_rm.py: `filtered`; `raw` holds
# the unfiltered prompts), and the benchmarks whose splits are scored one at a time, never pooled
# (JudgeBench: its responses by GPT-4o and by Claude are two leaderboards).
OFFICIAL_SPLIT = {"allenai/reward-bench": "filtered"}
SEPARATE_SPLITS = {"scalerlab/judgebench": ("gpt", "claude")}


class SourceError(ValueError):
    """A benchmark source that cannot be read; the message says what to give instead."""


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARS)


def looks_like_hub_id(text: str) -> bool:
    """'org/name' that is not a local path: what `datasets.load_dataset` would fetch from the hub."""
    return (
        text.count("/") == 1
        and not text.startswith((".", "/", "~"))
        and Path(text).suffix.lower() not in SUFFIXES
    )


def _plain(value: Any) -> Any:
    """numpy arrays / scalars from parquet and Arrow as Python lists and scalars (recursively)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _parse_cell(value: Any) -> Any:
    """A CSV cell that holds a list literal (pandas writes lists as their repr) as the list."""
    if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        for parse in (json.loads, ast.literal_eval):
            try:
                parsed = parse(value)
            except (ValueError, SyntaxError, RecursionError):
                continue
            if isinstance(parsed, list) and all(isinstance(v, (str, dict)) for v in parsed):
                return parsed  # a list of responses or messages; "[1, 2]" stays text
    return value


def _dataset_rows(data: Any, split: Optional[str] = None) -> List[Row]:
    """Rows of a `datasets.Dataset`, or of a `DatasetDict`: its `split`, else every split in order."""
    if isinstance(data, dict):  # a DatasetDict (a dict of split -> Dataset)
        if split is not None:
            if split not in data:
                raise SourceError(
                    f"no split {split!r} in the dataset; its splits are {', '.join(map(str, data))}"
                )
            return _dataset_rows(data[split])
        rows: List[Row] = []
        for part in data.values():
            rows.extend(_dataset_rows(part))
        return rows
    if split is not None:
        raise SourceError(
            f"split={split!r} applies to a DatasetDict or a hub dataset; this source has no splits"
        )
    return [_plain(dict(r)) for r in data]


def _hub_rows(name: str, split: Optional[str]) -> List[Row]:
    if _offline():
        raise SourceError(
            f"{name!r} is a hub dataset id, but HF_HUB_OFFLINE is set (no hub access); download the "
            "dataset where the hub is reachable and pass the local file (jsonl/json/csv/parquet)"
        )
    try:
        import datasets
    except ImportError:
        raise SourceError(
            f"reading hub dataset {name!r} needs `datasets`; pip install datasets, or pass a local file"
        ) from None
    try:
        data = datasets.load_dataset(name)
    except Exception as exc:  # connection, missing repo, gated: one line naming what to do
        if isinstance(exc, (KeyboardInterrupt, MemoryError)):
            raise
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SourceError(
            f"cannot load hub dataset {name!r} ({text}); offline (HF_HUB_OFFLINE=1) pass a local file instead"
        ) from None
    if split is None and isinstance(data, dict) and len(data) > 1:
        split = _official_split(name, list(data))
    return _dataset_rows(data, split)


def _official_split(name: str, splits: List[str]) -> str:
    """The split a hub id's benchmark scores; a one-line request for `split=` where it has none."""
    key = name.lower()
    if key in OFFICIAL_SPLIT and OFFICIAL_SPLIT[key] in splits:
        return OFFICIAL_SPLIT[key]
    if key in SEPARATE_SPLITS:
        why = f"its splits {', '.join(SEPARATE_SPLITS[key])} are scored separately, as its script does"
    else:
        why = "pooling its splits is not a benchmark score"
    raise SourceError(
        f"hub dataset {name!r} has splits {', '.join(splits)}; {why}: give split=NAME (--split NAME)"
    )


def read_source(source: Any, split: Optional[str] = None) -> Tuple[List[Row], str]:
    """(rows, label) of `source`: a path, a Dataset / DatasetDict (`split`: one of its splits, default all),
    a hub id, or a list of row dicts."""
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.exists() and isinstance(source, str) and looks_like_hub_id(source):
            return _hub_rows(source, split), source
        if not path.exists():
            raise SourceError(
                f"no benchmark file at {str(source)!r}; give a .jsonl/.json/.csv/.parquet file, a "
                "datasets.Dataset, or a hub dataset id (org/name)"
            )
        if split is not None:
            raise SourceError(
                f"split={split!r} applies to a DatasetDict or a hub dataset; {str(source)!r} is a file, "
                "which has no splits (leave split out)"
            )
        try:
            records = read_records(path)
        except PairDataError as exc:
            raise SourceError(str(exc)) from None
        rows = []
        for where, r in records:
            if not isinstance(r, dict):
                raise SourceError(
                    f"{path}, {where}: is {type(r).__name__}; each benchmark row is an object of columns"
                )
            rows.append({k: _parse_cell(_plain(v)) for k, v in r.items()})
        return rows, str(path)
    if hasattr(source, "column_names"):  # a datasets.Dataset or DatasetDict
        return _dataset_rows(source, split), type(source).__name__ + (f"[{split}]" if split else "")
    if isinstance(source, list) and all(isinstance(r, dict) for r in source):
        if split is not None:
            raise SourceError(
                f"split={split!r} applies to a DatasetDict or a hub dataset; a list of rows has none"
            )
        return [_plain(dict(r)) for r in source], "rows"
    raise SourceError(
        f"cannot read a benchmark from {type(source).__name__}; give a file path (.jsonl/.json/.csv/"
        ".parquet), a datasets.Dataset / DatasetDict, a hub dataset id, or a list of row dicts"
    )
