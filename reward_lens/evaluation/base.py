"""What a benchmark is (its columns, how a row becomes scored responses, its official scoring rule), the
registry of benchmarks, and `BenchmarkResult`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pandas as pd

from reward_lens.data.validate import PairDataError, normalize_label, normalize_text
from reward_lens.plotting import figure_axes, finish

Row = Dict[str, Any]
SUMMARY_COLUMNS = ["benchmark", "subset", "accuracy", "n"]


class BenchmarkFormatError(ValueError):
    """Rows that do not fit the benchmark's layout; the message names the row, the column and the fix."""


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: `columns` it needs, `matches(columns)` (does a row's column set look like it),
    `responses(rows)` (one frame row per response to score: row, id, subset, role, k, prompt, response),
    `summarize(frame)` (the frame with `reward` -> (summary frame, details)) and `pairs(rows)` (pairwise
    preference pairs, chosen vs each rejected, for the audit's instruments); `accepts(columns, row)`: the
    rows it scores when named explicitly (default `matches`; wider where auto-detection must not guess);
    `options`: the keyword options of `evaluate` its `summarize` takes. `official`: its own subset (or
    domain) names, by `group`; `check_official_names` refuses others (or lets them be scored apart)."""

    name: str
    columns: Tuple[str, ...]
    rule: str
    matches: Callable[[Sequence[str], Row], bool]
    responses: Callable[[List[Row]], pd.DataFrame]
    summarize: Callable[[pd.DataFrame], Tuple[pd.DataFrame, Dict[str, Any]]]
    pairs: Optional[Callable[[List[Row]], list]] = None
    accepts: Optional[Callable[[Sequence[str], Row], bool]] = None
    options: Tuple[str, ...] = ()
    official: Tuple[str, ...] = ()  # its own subsets (or domains); others are refused or scored apart
    group: Optional[Callable[[str], str]] = None  # a name's official group (RM-Bench: by prefix)
    what: str = "subset"
    official_only: bool = False  # refuse other names even in a file of other names only

    def takes(self, columns: Sequence[str], row: Row) -> bool:
        return (self.accepts or self.matches)(columns, row)


BENCHMARKS: Dict[str, Benchmark] = {}


def register(benchmark: Benchmark) -> Benchmark:
    BENCHMARKS[benchmark.name] = benchmark
    return benchmark


def formats_text() -> str:
    """Every registered format and its columns, for error messages."""
    return "; ".join(f"{b.name} ({', '.join(b.columns)})" for b in BENCHMARKS.values())


def detect(rows: List[Row], source: str) -> Benchmark:
    """The benchmark whose layout the first row has (checked in registry order)."""
    if not rows:
        raise BenchmarkFormatError(f"{source} holds no rows; give at least one benchmark row")
    first = rows[0]
    cols = [str(c) for c in first]
    for b in BENCHMARKS.values():
        if b.matches(cols, first):
            return b
    raise BenchmarkFormatError(
        f"{source}: columns {sorted(cols)[:10]} match no benchmark layout; the formats are "
        f"{formats_text()}; or pass benchmark=NAME"
    )


def get(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose auto or one of {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


# --------------------------------------------------------------------------- row checks
def row_text(row: Row, column: str, where: str) -> Any:
    """A prompt / response cell as text or a message tuple; a one-line error naming row and column."""
    if column not in row:
        raise BenchmarkFormatError(f"{where}: lacks column {column!r}; found {sorted(map(str, row))[:10]}")
    try:
        return normalize_text(row[column], column)
    except PairDataError as exc:
        raise BenchmarkFormatError(f"{where}, column {column!r}: {exc}") from None


def row_list(row: Row, column: str, where: str, n: Optional[int] = None) -> List[Any]:
    """A list-of-responses cell (each text or a message list); `n`: its required length."""
    value = row.get(column)
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise BenchmarkFormatError(
            f"{where}, column {column!r}: is {type(value).__name__}; give a non-empty list of responses"
        )
    if n is not None and len(value) != n:
        raise BenchmarkFormatError(
            f"{where}, column {column!r}: has {len(value)} responses; this benchmark needs {n}"
        )
    out = []
    for j, v in enumerate(value):
        try:
            out.append(normalize_text(v, f"{column}[{j}]"))
        except PairDataError as exc:
            raise BenchmarkFormatError(f"{where}: {exc}") from None
    return out


def row_label(row: Row, column: str, default: Optional[str] = None) -> Optional[str]:
    """An id / subset / domain cell as text, stripped (a stray space must not change which rule scores a
    subset); missing or blank -> `default`."""
    try:
        value = normalize_label(row.get(column), column)
    except PairDataError:
        value = str(row.get(column))
    value = None if value is None else value.strip()
    return default if not value else value


def check_label_spaces(row: Row, column: str, where: str, known: Sequence[str], benchmark: str) -> None:
    """A subset / domain cell with surrounding spaces is another name to the official scripts (they compare
    the text as it is), so it is refused, naming the official spelling, never stripped into it."""
    value = row.get(column)
    if isinstance(value, str) and value.strip() and value != value.strip():
        near = next((k for k in known if k.lower() == value.strip().lower()), None)
        what = (
            f"the official scripts would score it as another {column} than {near!r}: spell it {near!r}"
            if near
            else "the official scripts would score it as it is spelled: remove the spaces"
        )
        raise BenchmarkFormatError(f"{where}: {benchmark} {column} {value!r} has surrounding spaces; {what}")


def check_official_names(frame: pd.DataFrame, bench: "Benchmark", extra: bool) -> None:
    """Subsets (domains) that are not the benchmark's own, in a file with some of its own, would be averaged
    into its 'all': refused (naming the nearest official name) unless `extra` (then they are scored apart:
    their own rows, not in 'all'). A file of other subsets only is scored plainly, except where
    `official_only` (RM-Bench: the script leaves any other domain out)."""
    if not bench.official:
        return
    group = bench.group or str
    names = list(dict.fromkeys(map(str, frame["subset"])))
    unknown = [n for n in names if group(n) not in bench.official]
    if not unknown or extra or (len(unknown) == len(names) and not bench.official_only):
        return
    near = difflib.get_close_matches(unknown[0].lower(), [k.lower() for k in bench.official], n=1, cutoff=0.6)
    hint = f"did you mean {next(k for k in bench.official if k.lower() == near[0])!r}? " if near else ""
    more = f" ({len(unknown)} such {bench.what}s)" if len(unknown) > 1 else ""
    raise BenchmarkFormatError(
        f"{bench.what} {unknown[0]!r}{more} is not one of {bench.name}'s {bench.what}s and would be scored "
        f"into its 'all'; {hint}the {bench.what}s are {', '.join(bench.official)}; to score other "
        f"{bench.what}s apart (their own rows, not in 'all') pass extra_subsets=True (CLI: --extra-subsets)"
    )


def official_part(
    names: Sequence[str], bench_official: Sequence[str], group: Callable[[str], str] = str
) -> list:
    """The names of the benchmark's own that its 'all' averages: the official ones present, else all of
    them (a file of other subsets only)."""
    own = [n for n in names if group(n) in bench_official]
    return own if own else list(names)


def check_spelling(names: Sequence[str], known: Sequence[str], what: str, benchmark: str) -> None:
    """Two spellings of one of the benchmark's `known` names (another case, a typo) would be scored as two
    groups, changing an unweighted mean: refused, naming both and the official spelling. One spelling
    alone is scored as it is (by the rule that name gets)."""
    lowered = {k.lower(): k for k in known}
    spelled: Dict[str, List[str]] = {}
    for name in dict.fromkeys(map(str, names)):
        key = name.lower()
        near = (
            key
            if key in lowered
            else next(iter(difflib.get_close_matches(key, list(lowered), n=1, cutoff=0.8)), None)
        )
        if near is not None:
            spelled.setdefault(lowered[near], []).append(name)
    for official, variants in spelled.items():
        if len(variants) > 1:
            raise BenchmarkFormatError(
                f"{what}s {', '.join(map(repr, variants))} are one {benchmark} {what} spelled "
                f"{len(variants)} ways and would be scored as {len(variants)}; spell them {official!r}"
            )


def is_text_list(value: Any) -> bool:
    """A list of responses (strings or message lists), as opposed to one conversation (a list of dicts)."""
    return isinstance(value, (list, tuple)) and bool(value) and not isinstance(value[0], dict)


def summary_row(benchmark: str, subset: str, accuracy: float, n: int) -> Dict[str, Any]:
    return {"benchmark": benchmark, "subset": subset, "accuracy": float(accuracy), "n": int(n)}


# --------------------------------------------------------------------------- the result
@dataclass
class BenchmarkResult:
    """A reward model's score on a benchmark, by the benchmark's official rule.

    `scores`: one row per scored response (row, id, subset, role, k, reward; RM-Bench adds style);
    `table`: benchmark, subset, accuracy, n (subset "all" is the overall score); `details`: the rule's
    intermediate values (RM-Bench's 3x3 matrices, RewardBench 2's Ties terms, ...)."""

    benchmark: str
    scores: pd.DataFrame
    table: pd.DataFrame
    source: str = ""
    rule: str = ""
    details: Dict[str, Any] = field(default_factory=dict)
    rows: List[Row] = field(default_factory=list, repr=False)

    @property
    def accuracy(self) -> float:
        """The overall score (the summary's "all" row)."""
        return float(self.table.loc[self.table["subset"] == "all", "accuracy"].iloc[0])

    def to_frame(self) -> pd.DataFrame:
        """One row per scored response: benchmark, row, id, subset, role, k, (style), reward."""
        return self.scores.copy()

    def summary(self) -> pd.DataFrame:
        """benchmark, subset, accuracy, n; subset "all" is the overall score."""
        return self.table.copy()

    def summary_text(self) -> str:
        return self.table.to_string(index=False, float_format=lambda x: f"{x:.4f}")

    def plot(self, ax: Any = None) -> Any:
        """Accuracy per subset (horizontal bars; the overall score dark)."""
        created = ax is None
        t = self.table.iloc[::-1]
        fig, ax = figure_axes(ax, (6.5, max(2.0, 0.3 * len(t) + 1)))
        colors = ["#333" if s == "all" else "#5b8fc9" for s in t["subset"]]
        ax.barh(list(t["subset"]), list(t["accuracy"]), color=colors)
        ax.set_xlim(0, 1)
        ax.set_xlabel("accuracy")
        ax.set_title(f"{self.benchmark}: accuracy by subset")
        return finish(fig, created)
