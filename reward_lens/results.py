"""The result protocol every instrument's result follows.

    to_frame()      a tidy pandas DataFrame, one row per observation (pair x site, feature, dimension, ...)
    summary()       a small DataFrame of the headline numbers (a text summary, where a class has one, is
                    `summary_text()`)
    plot(ax=None)   a matplotlib Figure: drawn into `ax` when given (its figure is returned), a new figure
                    otherwise; multi-panel plots take a sequence of Axes, or split the one Axes given

Chosen and rejected rewards have one shape everywhere: `reward_chosen` and `reward_rejected` are float
tensors [n_pairs] (the model's clean rewards) and `reward_gap` their difference. Older names
(`clean_chosen`, `clean_gap`, `rewards["chosen"]`, ...) stay as read-only aliases.
"""

from __future__ import annotations

from typing import Any, Dict, Protocol, Sequence, runtime_checkable

import numpy as np
import pandas as pd
import torch


@runtime_checkable
class Result(Protocol):
    """What every result class provides (checked by tests/test_results_protocol.py)."""

    def to_frame(self) -> pd.DataFrame: ...

    def summary(self) -> pd.DataFrame: ...

    def plot(self, ax: Any = None) -> Any: ...


class PairRewards:
    """Mixin for results holding the model's rewards of each pair: `reward_gap` = chosen - rejected."""

    reward_chosen: torch.Tensor
    reward_rejected: torch.Tensor

    @property
    def reward_gap(self) -> torch.Tensor:
        """[n_pairs] reward(chosen) - reward(rejected)."""
        return self.reward_chosen - self.reward_rejected

    def rewards_frame(self) -> pd.DataFrame:
        """One row per pair: pair, reward_chosen, reward_rejected, reward_gap."""
        ids = getattr(self, "pair_ids", None) or [str(i) for i in range(len(self.reward_chosen))]
        c, r = to_numpy(self.reward_chosen), to_numpy(self.reward_rejected)
        return pd.DataFrame(
            {"pair": list(ids), "reward_chosen": c, "reward_rejected": r, "reward_gap": c - r}
        )


class CleanPairRewards(PairRewards):
    """Mixin for patching results: the clean runs' rewards `clean_chosen` / `clean_rejected` [n_pairs] are
    the model's rewards (`reward_chosen` / `reward_rejected`); `clean_gap` = chosen - rejected."""

    clean_chosen: torch.Tensor
    clean_rejected: torch.Tensor

    @property
    def reward_chosen(self) -> torch.Tensor:
        return self.clean_chosen

    @property
    def reward_rejected(self) -> torch.Tensor:
        return self.clean_rejected

    @property
    def clean_gap(self) -> torch.Tensor:
        return self.clean_chosen - self.clean_rejected


def to_numpy(x: Any) -> np.ndarray:
    """A tensor (any dtype, any device) or array-like as a float32/float64 numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)


def edge_frame(
    pair_ids: Sequence[str],
    senders: Sequence[str],
    receivers: Sequence[str],
    kept: np.ndarray,
    columns: Dict[str, Any],
) -> pd.DataFrame:
    """One row per (pair, sender, receiver) cell of a [pair, sender, receiver] grid where `kept` is true
    (the paths that exist), in pair, sender, receiver order: the three names, then each of `columns`: a
    string (the same in every row), an array per pair [n_pairs], or one per cell [pair, sender,
    receiver]. Path patching's effects and edge attribution's estimates share this layout."""
    i, j, k = np.nonzero(kept)
    data: Dict[str, Any] = {
        "pair": [pair_ids[a] for a in i],
        "sender": [senders[a] for a in j],
        "receiver": [receivers[a] for a in k],
    }
    for name, value in columns.items():
        if isinstance(value, str):
            data[name] = [value] * len(i)
        else:
            value = np.asarray(value)
            data[name] = value[i] if value.ndim == 1 else value[i, j, k]
    return pd.DataFrame(data, columns=list(data))


def edge_means(frame: pd.DataFrame, value: str) -> pd.DataFrame:
    """Per (sender, receiver) edge over pairs: mean_<value>, mean_normalized_<value>, std_<value> (from
    `frame`'s `value` and `normalized_<value>` columns), largest |mean| first."""
    out = (
        frame.groupby(["sender", "receiver"], sort=False)
        .agg(
            **{
                f"mean_{value}": (value, "mean"),
                f"mean_normalized_{value}": (f"normalized_{value}", "mean"),
                f"std_{value}": (value, "std"),
            }
        )
        .reset_index()
    )
    order = out[f"mean_{value}"].abs().sort_values(ascending=False).index
    return out.reindex(order).reset_index(drop=True)
