"""Preference data (`PreferencePair`, `TokenPair`, `load_pairs`) and the bundled data files."""

from reward_lens.data.pairs import (
    BUNDLED_PAIRS,
    REQUIRED_COLUMNS,
    AnyPair,
    Pairs,
    PreferencePair,
    TokenPair,
    as_pairs,
    bundled_pairs,
    load_pairs,
)

__all__ = [
    "AnyPair",
    "BUNDLED_PAIRS",
    "Pairs",
    "PreferencePair",
    "REQUIRED_COLUMNS",
    "TokenPair",
    "as_pairs",
    "bundled_pairs",
    "load_pairs",
]
