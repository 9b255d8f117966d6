"""The statistics every instrument shares, one implementation each: the percentile bootstrap (indices,
interval,
CI of a statistic), Pearson / Spearman correlations of rows and columns, the crystallization rule, and input
checks. Each is tested against scipy (tests/test_stats.py)."""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np


def bootstrap_indices(n: int, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n] row indices drawn with replacement (one resample of the n units per row)."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def bootstrap_ci(
    values: Any,
    statistic: Callable[[np.ndarray], np.ndarray] = None,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Tuple[float, float]:
    """Percentile bootstrap interval of `statistic` over the units (rows) of `values`.

    `statistic` maps a batch of resamples [n_boot, n, ...] to [n_boot] (default: the mean over units);
    NaN statistics are ignored. The resamples are `bootstrap_indices(n, n_boot, seed)`."""
    check_level(level)
    values = np.asarray(values, dtype=np.float64)
    idx = bootstrap_indices(len(values), n_boot, seed)
    stat = (
        values[idx].mean(axis=1)
        if statistic is None
        else np.asarray(statistic(values[idx]), dtype=np.float64)
    )
    lo, hi = percentile_ci(stat, level)
    return float(lo), float(hi)


def ranks(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Average ranks along `axis` (ties share their mean rank), equal to scipy.stats.rankdata (tested), in
    numpy: importing scipy.stats costs about one forward of the demo's audit pairs."""
    x = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    if np.isnan(x).any():  # scipy's NaN rule (a row holding NaN ranks as NaN)
        from scipy.stats import rankdata

        return np.moveaxis(rankdata(x, axis=-1), -1, axis)
    n = x.shape[-1]
    order = np.argsort(x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, -1)
    pos = np.broadcast_to(np.arange(n), xs.shape)
    starts = np.ones(xs.shape, dtype=bool)  # each tie group's first sorted position ...
    starts[..., 1:] = xs[..., 1:] != xs[..., :-1]
    ends = np.ones(xs.shape, dtype=bool)  # ... and its last
    ends[..., :-1] = starts[..., 1:]
    first = np.maximum.accumulate(np.where(starts, pos, 0), axis=-1)
    last = np.flip(np.minimum.accumulate(np.flip(np.where(ends, pos, n), -1), axis=-1), -1)
    out = np.empty_like(xs)
    np.put_along_axis(out, order, (first + last) / 2.0 + 1.0, -1)
    return np.moveaxis(out, -1, axis)


def pearson_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair of x and y [..., k] -> [...] (NaN where a row is constant)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    xc = x - x.mean(-1, keepdims=True)
    yc = y - y.mean(-1, keepdims=True)
    denom = np.sqrt((xc**2).sum(-1) * (yc**2).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (xc * yc).sum(-1) / np.where(denom > 0, denom, 1), np.nan)


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman rho of each row pair of x and y [..., k] -> [...] (NaN where a row is constant)."""
    return pearson_rows(ranks(x, -1), ranks(y, -1))


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rho of all values of x against all of y (flattened; NaN when either is constant)."""
    return float(spearman_rows(np.ravel(x)[None], np.ravel(y)[None])[0])


# A reward gap is a difference of two float results, so "no preference" is not an exact 0: one input scored
# in two batches (at different padding offsets) differs by ~4e-7 of the rewards' size in float32 (measured:
# a tiny Llama, torch 2.14). Gaps within this fraction of the rewards' scale count as zero (ties, responses
# tokenised alike); a real preference is orders of magnitude larger.
ZERO_GAP_RTOL = 1e-5


def reward_scale(*rewards: Any) -> float:
    """The size of a set of rewards, the unit of `zero_gaps`: the RMS of all values given (0 for none)."""
    values = np.concatenate([to_float64(r).ravel() for r in rewards]) if rewards else np.zeros(0)
    values = values[np.isfinite(values)]
    return float(np.sqrt(np.mean(values**2))) if len(values) else 0.0


def zero_gaps(gap: Any, scale: Optional[float] = None, rtol: float = ZERO_GAP_RTOL) -> np.ndarray:
    """Which reward gaps are zero up to float noise: |gap| <= rtol * scale (an exact 0 always is).
    `scale`: `reward_scale` of the rewards the gaps are differences of; default the RMS of the gaps
    themselves, for callers that hold gaps only."""
    gap = to_float64(gap)
    if scale is None:
        scale = reward_scale(gap)
    return np.abs(gap) <= rtol * scale


def crystallization_depth(
    gap: np.ndarray,
    depths: Sequence[float],
    rtol: float = 0.1,
    atol: float = 0.0,
    scale: Optional[float] = None,
) -> np.ndarray:
    """The crystallization rule. Per row of `gap` [n, S] (a lens of the reward gap at sites of fractional
    depth `depths` [S], the last site the reward itself): the first depth from which the gap stays within
    `rtol * |final| + atol` of the final gap with the final gap's sign at every later site; NaN where the
    final gap is zero (`zero_gaps(final, scale)`: float noise, not a preference). The last site always
    qualifies, so the depth is at most depths[-1]."""
    if rtol < 0 or atol < 0:
        raise ValueError(f"crystallization tolerances must be >= 0, got rtol={rtol}, atol={atol}")
    gap = to_float64(gap)
    if gap.ndim != 2 or gap.shape[1] != len(depths):
        raise ValueError(
            f"gap must be [n_pairs, {len(depths)}] (one column per depth), got shape {gap.shape}"
        )
    final = gap[:, -1:]
    ok = (np.abs(gap - final) <= rtol * np.abs(final) + atol) & (np.sign(gap) == np.sign(final))
    stays = np.flip(np.logical_and.accumulate(np.flip(ok, 1), axis=1), 1)  # ok at every site from k on
    out = np.asarray(depths, dtype=np.float64)[np.argmax(stays, axis=1)]
    out[zero_gaps(final[:, 0], scale)] = np.nan
    return out


def column_correlations(x: np.ndarray) -> np.ndarray:
    """Pearson correlations between the columns of x, batched: x [..., n, k] -> [..., k, k].

    A column with zero variance has NaN correlations (with everything, itself included)."""
    x = np.asarray(x, dtype=np.float64)
    xc = x - x.mean(axis=-2, keepdims=True)
    cov = np.einsum("...ni,...nj->...ij", xc, xc)
    sd = np.sqrt(np.einsum("...ii->...i", cov))
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = cov / (sd[..., :, None] * sd[..., None, :])
    return np.clip(corr, -1.0, 1.0)


def percentile_ci(samples: np.ndarray, level: float = 0.95, axis: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of `samples` along `axis` (NaN samples ignored)."""
    import warnings

    alpha = (1.0 - level) / 2.0
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices (undefined correlations) stay NaN
        lo = np.nanquantile(samples, alpha, axis=axis)
        hi = np.nanquantile(samples, 1.0 - alpha, axis=axis)
    return lo, hi


def fisher_ci(r: np.ndarray, n: int, level: float = 0.95) -> Tuple[np.ndarray, np.ndarray]:
    """Fisher-z interval for Pearson correlations from n observations (NaN where n <= 3)."""
    from scipy.stats import norm

    r = np.asarray(r, dtype=np.float64)
    if n <= 3:
        nan = np.full_like(r, np.nan)
        return nan, nan
    z = np.arctanh(np.clip(r, -0.999999, 0.999999))
    half = norm.ppf(0.5 + level / 2.0) / np.sqrt(n - 3)
    return np.tanh(z - half), np.tanh(z + half)


def check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), e.g. 0.95; got {level}")


def as_float_matrix(x, name: str, ncols: Optional[int] = None) -> np.ndarray:
    """A 2-D float64 array with a clear error for the wrong shape or non-finite values."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().double().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 1 and ncols == 1:
        arr = arr[:, None]
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows x columns), got shape {arr.shape}")
    if ncols is not None and arr.shape[1] != ncols:
        raise ValueError(f"{name} must have {ncols} columns, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds NaN or inf values; drop or fill them before the analysis")
    return arr


def to_float64(x: Any) -> np.ndarray:
    """A tensor or array-like as a float64 numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def named_rows(
    items: Any, names: Optional[Sequence[str]], prefix: str, what: str
) -> Tuple[np.ndarray, List[str]]:
    """Stack directions given as name -> vector or as an [m, d] matrix; unnamed rows get `prefix_{j}`."""
    if isinstance(items, Mapping):
        names = list(items) if names is None else list(names)
        return np.stack([to_float64(items[n]).reshape(-1) for n in names]), names
    matrix = to_float64(items)
    if matrix.ndim != 2:
        raise ValueError(f"{what} must be [n, d_model], got shape {matrix.shape}")
    return matrix, [f"{prefix}_{j}" for j in range(matrix.shape[0])] if names is None else list(names)
