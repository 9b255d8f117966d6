"""Preference data: `PreferencePair` and `load_pairs` for RewardBench-style files (JSONL/JSON/CSV/parquet),
`TokenPair` for pairs given as token ids, and `bundled_pairs()`, a small natural-language set for tests
and demos."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Sequence, Tuple, Union

from reward_lens.data.validate import (
    Text,
    normalize_label,
    normalize_text,
    read_records,
    validate_records,
    warn_ties,
)

if TYPE_CHECKING:  # torch is imported where a TokenPair is made: the CLI reads pairs' names without it
    import torch

REQUIRED_COLUMNS = ("prompt", "chosen", "rejected")
BUNDLED_PAIRS = Path(__file__).resolve().parent / "pairs.jsonl"


@dataclass(frozen=True)
class PreferencePair:
    """One preference comparison: the same prompt with a chosen (preferred) and a rejected response.

    Each text is a `str` or a conversation (a list of {"role", "content"} messages, stored as a tuple of
    dicts and rendered with the chat template); None / NaN / other types are refused."""

    prompt: Text
    chosen: Text
    rejected: Text
    subset: Optional[str] = None
    id: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("prompt", "chosen", "rejected"):
            object.__setattr__(self, name, normalize_text(getattr(self, name), f"PreferencePair.{name}"))
        for name in ("subset", "id"):
            object.__setattr__(self, name, normalize_label(getattr(self, name), f"PreferencePair.{name}"))

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
        import torch

        self.chosen = torch.as_tensor(self.chosen, dtype=torch.long).flatten()
        self.rejected = torch.as_tensor(self.rejected, dtype=torch.long).flatten()
        if len(self.chosen) == 0 or len(self.rejected) == 0:
            raise ValueError("a TokenPair needs at least one token in both chosen and rejected")


def load_pairs(path: Union[str, Path]) -> List[PreferencePair]:
    """Read pairs from .jsonl (also pretty-printed), .json (a list of objects, one object, {"pairs": [...]}
    or columns), .csv or .parquet with RewardBench's columns. Every row is validated
    (`reward_lens.data.validate`); errors name the file, line/row and column; ties are kept with a warning."""
    path = Path(path)
    pairs = validate_records(read_records(path), str(path), PreferencePair)
    warn_ties(pairs, str(path))
    return pairs


def bundled_pairs() -> List[PreferencePair]:
    """The 30 short natural-language pairs shipped with reward-lens (RewardBench columns and subset names,
    written for the package), for tests, demos and smoke runs. Not a benchmark."""
    return load_pairs(BUNDLED_PAIRS)


AnyPair = Union[PreferencePair, TokenPair]


def side_texts(items: Iterable[Any], accepted: str, tuples: bool = False) -> Tuple[List[str], List[str]]:
    """(prompts, responses) of every response of preference pairs (chosen, rejected) or contrast pairs
    (positive, negative), item by item; with `tuples`, a (prompt, response) tuple is one response. Any
    other item: a ValueError that ends "pass {accepted}"."""
    prompts: List[str] = []
    responses: List[str] = []
    for item in items:
        is_tuple = isinstance(item, (tuple, list)) and len(item) == 2
        if tuples and is_tuple and all(isinstance(s, str) for s in item):
            prompts.append(item[0])
            responses.append(item[1])
            continue
        sides = ("chosen", "rejected") if hasattr(item, "chosen") else ("positive", "negative")
        if not hasattr(item, "prompt") or not all(hasattr(item, s) for s in sides):
            raise ValueError(f"cannot read texts from {type(item).__name__}; pass {accepted}")
        for side in sides:
            prompts.append(item.prompt)
            responses.append(getattr(item, side))
    return prompts, responses


def pair_labels(pairs: Sequence[AnyPair]) -> List[str]:
    """Each pair's id as a string, or its index where it has none (the `pair` column of result frames)."""
    return [str(p.id) if getattr(p, "id", None) is not None else str(i) for i, p in enumerate(pairs)]


class Pairs(list):
    """Preference pairs checked once, by `as_pairs`: a list of PreferencePair or of TokenPair, never mixed.

    `as_pairs` returns one of these unchanged (only refusing it when empty), so the pairs are normalised
    where they enter (a public call) and passed down typed: the pipeline, the instruments and the audit's
    later steps do not check them again. A slice is `Pairs` too (a run of checked pairs stays checked)."""

    def __getitem__(self, index):
        got = super().__getitem__(index)
        return Pairs(got) if isinstance(index, slice) else got

    def take(self, indices: Iterable[int]) -> "Pairs":
        """The pairs at `indices`, in that order (still checked)."""
        return Pairs(super(Pairs, self).__getitem__(int(i)) for i in indices)


def as_pairs(pairs: Union[AnyPair, Iterable[AnyPair], str, Path]) -> Pairs:
    """Accept one pair, a list of pairs, or a path; return a non-empty `Pairs` (itself when given one)."""
    if isinstance(pairs, Pairs):
        if not pairs:
            raise ValueError("no preference pairs given; pass at least one PreferencePair")
        return pairs
    return checked_pairs(pairs)


def checked_pairs(pairs: Union[AnyPair, Iterable[AnyPair], str, Path]) -> Pairs:
    """The normalisation `as_pairs` does for input not yet checked: read a path, wrap one pair, refuse an
    empty list, other objects and a mix of text and token pairs."""
    if isinstance(pairs, (str, Path)):
        return Pairs(load_pairs(pairs))
    if isinstance(pairs, (PreferencePair, TokenPair)):
        return Pairs([pairs])
    if not isinstance(pairs, Iterable) or isinstance(pairs, (dict, bytes)):
        raise TypeError(
            "pairs must be a PreferencePair, a list of them, or a pairs file path; got "
            f"{type(pairs).__name__}"
        )
    pairs = list(pairs)
    if not pairs:
        raise ValueError("no preference pairs given; pass at least one PreferencePair")
    bad = [type(p).__name__ for p in pairs if not isinstance(p, (PreferencePair, TokenPair))]
    if bad:
        raise TypeError(f"pairs must be PreferencePair or TokenPair objects (or a file path); got {bad[0]}")
    kinds = {type(p) for p in pairs}
    if len(kinds) > 1:
        raise ValueError(
            "mixing PreferencePair (text) and TokenPair (token ids) in one call is not supported"
        )
    return Pairs(pairs)
