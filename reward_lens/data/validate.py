"""One validator for preference data, shared by `PreferencePair` and every file format of `load_pairs`.

A prompt / chosen / rejected value is either text (`str`) or a conversation: a list of chat messages
`{"role": ..., "content": ...}`, kept as a tuple of message dicts (never as its Python repr) so that
tokenisation renders it with the chat template. Missing values (None, NaN, pandas NA) and non-text values
are refused, never scored as the strings "None" / "nan". Errors from files name the file, the 1-based
line (JSONL/JSON) or row (CSV/parquet) and the column. Ties (chosen == rejected) are kept and reported.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

Messages = Tuple[Dict[str, str], ...]
Text = Union[str, Messages]
TEXT_FIELDS = ("prompt", "chosen", "rejected")
SIDES = ("chosen", "rejected")
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class PairDataError(ValueError):
    """A preference-data problem; the message says where (file, line/row, column) and what to fix."""


def is_missing(value: Any) -> bool:
    """None, float NaN, pandas NA/NaT: a cell with no value."""
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    try:
        import pandas as pd

        return value is pd.NA or value is pd.NaT
    except ImportError:  # pragma: no cover - pandas is a dependency
        return False


def _check_encodable(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PairDataError(
            f"{field} holds a lone surrogate {text[exc.start]!r} at character {exc.start} (half of an "
            "emoji or other character, e.g. a cut JSON escape); fix or remove it"
        ) from None


def _as_messages(value: Sequence[Any], field: str) -> Messages:
    if len(value) == 0:
        raise PairDataError(
            f"{field} is an empty message list; give text or at least one {{'role', 'content'}} message"
        )
    out = []
    for j, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise PairDataError(
                f"{field} message {j + 1} is {_describe(m)}; chat messages are dicts with string 'role' "
                "and 'content'"
            )
        _check_encodable(m["content"], f"{field} message {j + 1}")
        out.append(dict(m))
    return tuple(out)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def normalize_text(value: Any, field: str, *, allow_empty: bool = True) -> Text:
    """`value` as text or a tuple of message dicts; a PairDataError (a ValueError) that says what to give."""
    if isinstance(value, str):
        if not allow_empty and not value.strip():
            raise PairDataError(
                f"{field} is empty; every pair needs a non-empty chosen and rejected response"
            )
        _check_encodable(value, field)
        return value
    if is_missing(value):
        raise PairDataError(f"{field} is missing (None/null/NaN); give text or a list of chat messages")
    if hasattr(value, "tolist") and not isinstance(
        value, (int, float)
    ):  # numpy arrays from parquet list columns
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return _as_messages(value, field)
    raise PairDataError(f"{field} is {_describe(value)}; give text (str) or a list of chat messages")


def normalize_label(value: Any, field: str) -> Optional[str]:
    """Optional subset / id cells: missing -> None; integral floats (CSV ids read as 3.0) -> '3'."""
    if is_missing(value):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise PairDataError(f"{field} is {_describe(value)}; give a string (or leave it empty)")


# --------------------------------------------------------------------------- reading records
Record = Tuple[str, Any]  # (where, e.g. "line 3" / "row 2", the record)


def _json_values(text: str) -> Iterator[Tuple[int, Any]]:
    """Successive JSON values of `text` (one per line, pretty-printed, or concatenated): (1-based line,
    value)."""
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos >= len(text):
            return
        line = text.count("\n", 0, pos) + 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            noticed = "" if exc.lineno == line else f", noticed at line {exc.lineno} column {exc.colno}"
            col = f" column {exc.colno}" if exc.lineno == line else ""
            raise PairDataError(
                f"line {line}{col}: invalid JSON ({exc.msg}{noticed}; the value starting on line {line} "
                "is broken); fix or remove it"
            ) from None
        yield line, value


def _read_jsonl(text: str) -> List[Record]:
    records: List[Record] = []
    for line, value in _json_values(text):
        items = value if isinstance(value, list) else [value]  # a JSON array in a .jsonl: its objects
        records.extend((f"line {line}", v) for v in items)
    return records


def _read_json(text: str) -> List[Record]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PairDataError(
            f"line {exc.lineno} column {exc.colno}: invalid JSON ({exc.msg}); fix it"
        ) from None
    if isinstance(data, dict):
        if all(c in data for c in ("chosen", "rejected")):
            if all(
                isinstance(data[c], list) and data[c] and not isinstance(data[c][0], dict)
                for c in ("chosen", "rejected")
            ):
                return _columns_to_records(data)  # {"prompt": [...], "chosen": [...], ...}
            return [("the object", data)]  # one pair
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) == 1:  # {"pairs": [...]} / {"data": [...]}
            data = data[lists[0]]
        else:
            raise PairDataError(
                f"holds a JSON object with keys {sorted(data)[:8]}; give a list of pair objects, one pair "
                "object, or an object with one list of pairs (e.g. {'pairs': [...]})"
            )
    if not isinstance(data, list):
        raise PairDataError(
            f"holds a JSON {type(data).__name__}; give a list of objects with prompt, chosen, rejected"
        )
    return [(f"item {i + 1}", v) for i, v in enumerate(data)]


def _columns_to_records(data: Dict[str, Any]) -> List[Record]:
    lengths = {k: len(v) for k, v in data.items() if isinstance(v, list)}
    if len(set(lengths.values())) != 1:
        raise PairDataError(f"holds columns of different lengths {lengths}; give equally long columns")
    n = next(iter(lengths.values()))
    return [(f"item {i + 1}", {k: v[i] for k, v in data.items() if k in lengths}) for i in range(n)]


def _read_table(path: Path) -> List[Record]:
    import pandas as pd

    if path.suffix.lower() == ".csv":
        # Every cell as text: "NA", "null" or "42" are texts, an empty cell is empty (refused below).
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[], encoding="utf-8-sig")
    else:
        frame = pd.read_parquet(path)
    return [(f"row {i + 1}", r) for i, r in enumerate(frame.to_dict("records"))]


def _json_messages(cell: Any) -> Any:
    """Text holding a JSON list of chat messages (how CSV, parquet and some JSON exports store
    conversations) as that list, so it is rendered by the chat template, not scored as JSON text."""
    if not isinstance(cell, str) or not cell.lstrip().startswith("[") or '"role"' not in cell:
        return cell
    try:
        value = json.loads(cell)
    except json.JSONDecodeError as exc:
        raise PairDataError(
            f"holds a JSON message list that is not valid JSON ({exc.msg}, column {exc.colno}); fix the cell"
        ) from None
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return value
    return cell


HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"


def dialogue_messages(text: str) -> Optional[List[Dict[str, str]]]:
    """A whole dialogue in the Anthropic HH format ("\\n\\nHuman: ...\\n\\nAssistant: ...") as chat
    messages; None for text that is not one."""
    body = "\n\n" + text.lstrip("\n") if text.lstrip("\n").startswith(HUMAN.strip()) else text
    if not body.startswith(HUMAN) or ASSISTANT not in body:
        return None
    messages, rest = [], body
    while rest:
        role = "user" if rest.startswith(HUMAN) else "assistant"
        rest = rest[len(HUMAN if role == "user" else ASSISTANT) :]
        cut = min((i for i in (rest.find(HUMAN), rest.find(ASSISTANT)) if i >= 0), default=len(rest))
        messages.append({"role": role, "content": rest[:cut].strip()})
        rest = rest[cut:]
    return messages


def implicit_prompt_record(r: Dict[str, Any], where: str) -> Dict[str, Any]:
    """A record without a prompt: chosen and rejected must be whole conversations (message lists, or dialogue
    text in the HH format, converted to messages); plain text would be scored as one assistant turn of an
    empty conversation, which is refused."""
    out = {**r, "prompt": ""}
    for column in ("chosen", "rejected"):
        value = r[column]
        if isinstance(value, str):
            messages = dialogue_messages(value)
            if messages is None:
                raise PairDataError(
                    f"{where}: has no 'prompt' column and column {column!r} is plain text, which would be "
                    "scored as a reply to an empty prompt; add a prompt column, or give chosen/rejected "
                    "as whole conversations (lists of role/content messages, or 'Human: ... Assistant: "
                    "...' dialogues)"
                )
            out[column] = messages
    return out


def read_records(path: Path) -> List[Record]:
    """The raw records of a pairs file, each with where it is; errors name the file."""
    if path.is_dir():
        raise PairDataError(f"{path} is a directory; give a pairs file ({', '.join(SUFFIXES)})")
    if not path.exists():
        raise FileNotFoundError(f"no pairs file at {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise PairDataError(
            f"{path}: unsupported pairs file type {suffix!r}; use .jsonl, .json, .csv or .parquet"
        )
    try:
        if suffix in (".csv", ".parquet"):
            return _read_table(path)
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not data
        return _read_jsonl(text) if suffix == ".jsonl" else _read_json(text)
    except PairDataError as exc:
        raise PairDataError(f"{path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise PairDataError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from None
    except Exception as exc:  # pandas / pyarrow parse errors: name the file
        if isinstance(exc, (KeyboardInterrupt, MemoryError)):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PairDataError(f"{path}: cannot read it as {suffix[1:]} ({message})") from None


def validate_records(records: Sequence[Record], source: str, pair_cls: Any) -> List[Any]:
    """Every record checked and turned into `pair_cls` (PreferencePair); errors name source, row, column."""
    if not records:
        raise PairDataError(
            f"{source} holds no preference pairs; give at least one row with prompt, chosen, rejected"
        )
    pairs = []
    for i, (where, r) in enumerate(records):
        if not isinstance(r, dict):
            raise PairDataError(
                f"{source}, {where}: is {_describe(r)}; each pair is an object with prompt, chosen, rejected"
            )
        missing = [c for c in TEXT_FIELDS if c not in r]
        if missing == ["prompt"]:
            r = implicit_prompt_record(r, f"{source}, {where}")  # chosen / rejected are whole conversations
        elif (
            not missing
            and r["prompt"] == ""
            and all(isinstance(r[c], str) and dialogue_messages(r[c]) for c in SIDES)
        ):
            r = {**r, **{c: dialogue_messages(r[c]) for c in SIDES}}  # HH dialogues, empty prompt
        elif missing:
            raise PairDataError(
                f"{source}, {where}: lacks column(s) {missing}; preference files need columns prompt, "
                f"chosen, rejected (optional: subset, id); found {sorted(map(str, r))}"
            )
        column = "prompt"
        try:
            values = {}
            for column in TEXT_FIELDS:
                value = _json_messages(r[column])
                values[column] = normalize_text(value, column, allow_empty=column == "prompt")
            for column in ("subset", "id"):
                values[column] = normalize_label(r.get(column), column)
        except PairDataError as exc:
            raise PairDataError(f"{source}, {where}, column {column!r}: {exc}") from None
        if values["id"] is None:
            values["id"] = str(i)
        pairs.append(pair_cls(**values))
    return pairs


def tie_indices(pairs: Sequence[Any]) -> List[int]:
    """Indices of pairs whose chosen and rejected are identical (a tie: their reward gap is 0)."""
    return [
        i for i, p in enumerate(pairs) if getattr(p, "chosen", None) is not None and p.chosen == p.rejected
    ]


def warn_ties(pairs: Sequence[Any], source: str) -> List[int]:
    """Keep ties but say so once: their normalised quantities (effect / gap) are NaN."""
    ties = tie_indices(pairs)
    if ties:
        shown = ", ".join(str(pairs[i].id) for i in ties[:5]) + (", ..." if len(ties) > 5 else "")
        warnings.warn(
            f"{source}: {len(ties)} of {len(pairs)} pairs are ties (chosen == rejected; ids {shown}); "
            "they are kept, and every quantity normalised by their zero reward gap is NaN",
            stacklevel=3,
        )
    return ties
