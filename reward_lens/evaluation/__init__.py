"""Benchmark evaluation: a reward model scored on RewardBench 2, RM-Bench, JudgeBench or RewardBench (v1)
exactly as each benchmark's official script scores it.

One module per benchmark (its columns, its rule, its pairwise expansion for the audit) behind a small
registry (`BENCHMARKS`); `sources` reads files, `datasets` objects and hub ids; `scoring` scores every
response with the model's own tokenisation. Ties in rewards count as each official script counts them:
RewardBench 2 splits a best-of-n win between the tied top responses (1/k); RM-Bench, JudgeBench and
RewardBench v1 count a tie as wrong.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Union

from reward_lens.evaluation import judgebench, rewardbench, rewardbench2, rmbench  # noqa: F401 (registers them)
from reward_lens.evaluation.base import (
    BENCHMARKS,
    Benchmark,
    BenchmarkFormatError,
    BenchmarkResult,
    check_official_names,
    detect,
    formats_text,
    get,
)
from reward_lens.evaluation.scoring import check_finite, score_texts
from reward_lens.evaluation.sources import SourceError, read_source

AUTO = "auto"


def resolve(rows: List[dict], benchmark: str, source: str) -> Benchmark:
    """The benchmark named, or the one whose columns the rows have (`benchmark="auto"`)."""
    if benchmark == AUTO:
        return detect(rows, source)
    b = get(benchmark)
    if rows and not b.takes([str(c) for c in rows[0]], rows[0]):
        raise BenchmarkFormatError(
            f"{source}: columns {sorted(map(str, rows[0]))[:10]} are not {b.name}'s layout "
            f"({', '.join(b.columns)}); the formats are {formats_text()}"
        )
    return b


def _prepare(rows: List[dict], bench: Benchmark, label: str, domain: Optional[str]) -> List[dict]:
    """RM-Bench rows with their domain (from `domain=` or a per-domain file's name); `domain` elsewhere is
    refused."""
    if bench.name == rmbench.NAME:
        with _naming(label):
            return rmbench.with_domain(rows, domain, label)
    if domain is not None:
        raise ValueError(f"domain= applies to RM-Bench rows; {label} is {bench.name}, leave domain out")
    return rows


def evaluate(
    model,
    source: Any,
    *,
    benchmark: str = AUTO,
    batch_size: int = 16,
    progress: Union[bool, str] = True,
    split: Optional[str] = None,
    single_game: bool = False,
    domain: Optional[str] = None,
    extra_subsets: bool = False,
) -> BenchmarkResult:
    """Score `model` on a benchmark by its official rule.

    `source`: a .jsonl / .json / .csv / .parquet file, a `datasets.Dataset` or `DatasetDict` (every split), a
    hub dataset id (needs the hub; offline, a one-line error naming HF_HUB_OFFLINE), or a list of row dicts;
    `split` picks one split of a DatasetDict (default: all splits, in order) or of a hub dataset (default:
    the benchmark's official split, e.g. allenai/reward-bench's `filtered`; asked for where the benchmark
    scores its splits separately, as JudgeBench's `gpt` and `claude`).
    `benchmark`: "rewardbench2", "rmbench", "judgebench", "rewardbench", or "auto" (recognised by the
    columns). Every response is tokenised by `model.to_tokens` and scored by `model(ids, attention_mask=...)`
    in batches of `batch_size` (identical texts once, so they tie exactly).

    Ties in rewards count as the official scripts count them: RewardBench 2 gives a row 1/k when its chosen
    response shares the top reward with k - 1 others (Ties subset: equal rewards count wrong); RM-Bench,
    JudgeBench (both orders played: one vote each way, not a win) and RewardBench v1 count a tie as wrong.
    `single_game=True` (JudgeBench only): one order per pair, as `run_judge.py --single_game`, the mode
    JudgeBench recommends for reward models (a tie counts as B>A). `domain` (RM-Bench only): the domain of
    rows without one, as in RM-Bench's per-domain files (else taken from a `{domain}_filtered` file name).
    A subset (RewardBench 2) or domain (RM-Bench) that is not the benchmark's own is refused where it would
    enter the benchmark's "all"; `extra_subsets=True` scores it apart (its own rows, not in "all").
    Non-finite rewards (e.g. a float16 overflow) are refused, naming the row and response.

    The rules in full: each benchmark module's docstring, also in `BenchmarkResult.rule`."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    for flag, value in (
        ("single_game", single_game),
        ("progress", progress),
        ("extra_subsets", extra_subsets),
    ):
        if not isinstance(value, bool) and not (flag == "progress" and isinstance(value, str)):
            raise ValueError(f"{flag} must be True or False, got {value!r}")
    rows, label = read_source(source, split)
    bench = resolve(rows, benchmark, label)
    options = {"single_game": single_game} if single_game else {}
    unused = [k for k in options if k not in bench.options]
    if unused:
        raise ValueError(f"{unused[0]}= applies to JudgeBench; {label} is {bench.name}, leave it out")
    rows = _prepare(rows, bench, label, domain)
    with _naming(label):
        frame = bench.responses(rows)
        check_official_names(frame, bench, extra_subsets)
    frame["reward"] = score_texts(
        model,
        list(frame.prompt),
        list(frame.response),
        batch_size=batch_size,
        progress=f"{bench.name}: scoring" if progress else False,
    )
    check_finite(frame, label)
    with _naming(label):
        table, details = bench.summarize(frame, **options)
    scores = frame.drop(columns=["prompt", "response"])
    scores.insert(0, "benchmark", bench.name)
    return BenchmarkResult(
        benchmark=bench.name,
        scores=scores,
        table=table,
        source=label,
        rule=bench.rule,
        details=details,
        rows=rows,
    )


def benchmark_pairs(source: Any, benchmark: str = AUTO, domain: Optional[str] = None) -> list:
    """A benchmark's rows as pairwise preference pairs (each chosen against each rejected), for the audit."""
    rows, label = read_source(source)
    bench = resolve(rows, benchmark, label)
    rows = _prepare(rows, bench, label, domain)
    with _naming(label):
        return bench.pairs(rows)


@contextmanager
def _naming(label: str) -> Iterator[None]:
    """A row's format error names its source too ("FILE, row 3, column ..."), as `load_pairs`'s errors do."""
    try:
        yield
    except BenchmarkFormatError as exc:
        message = str(exc)
        if label == "rows" or message.startswith(label):
            raise
        raise BenchmarkFormatError(f"{label}, {message}") from None


__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "BenchmarkFormatError",
    "BenchmarkResult",
    "SourceError",
    "benchmark_pairs",
    "evaluate",
    "read_source",
    "resolve",
    "score_texts",
]
