r"""Distortion index: which quality dimensions does an evaluation leave unexamined, weighted by how far an
optimiser could push the reward along them?

An optimiser climbing the reward moves wherever the reward responds; an evaluation only sees the
differences its probes present. Where the two disagree the reward can be gamed unseen. Definitions
(also in ``docs/theory.md``); the model adapter (readout states, probe-result dimensions) is
`reward_lens.theory.distortion_model`:

Data. Quality dimensions k = 1..K. Evaluation probes p = 1..P, probe p a set of n_p pairs. For pair i of
probe p: its reward difference Δr_{p,i} and its difference along every dimension, Δq_{p,i,k} (annotated,
designed, or a coordinate in the reward model's activation space; all dimensions in comparable units).
The reward's sensitivity g_k: reward change per unit of dimension k (given, e.g. the hacking probe
suite's per-dimension effect; from the geometry, g_k = w_r · u_k for a unit concept direction u_k; or
estimated by pooled least squares Δr ≈ Δq g over all evaluation pairs).

1. Attributable reward difference  a_{p,i,k} = g_k Δq_{p,i,k}  (the part of pair i's reward difference
   that runs through dimension k).
2. Coverage (loading) matrix  C[p, k] = Σ_i a²_{p,i,k} / Σ_i Σ_j a²_{p,i,j}  ∈ [0, 1]: the share of probe
   p's dimension-attributable reward-difference energy that loads on dimension k (rows sum to 1; a probe
   whose pairs move no dimension has a zero row).
3. Effective coverage  E_k = Σ_p Σ_i a²_{p,i,k}  (the evaluation's reward-difference energy running
   through dimension k) and the coverage share  c_k = E_k / Σ_j E_j. Also reported, descriptively:
   effective pairs  Σ_p n_p C[p, k]  (evaluation pairs' worth devoted to dimension k).
4. Push share  π_k = ḡ_k² / Σ_j ḡ_j²  with ḡ_k² the mean of g_k² (over pairs, when g varies by pair):
   the share of a unit gradient step's reward gain that lands on dimension k.
5. Coverage ratio  ρ_k = c_k / π_k  (1: the evaluation looks at k exactly as much as the reward can be
   pushed along it), deficit  δ_k = max(0, π_k − c_k).
6. Distortion index  D = Σ_k δ_k = ½ Σ_k |π_k − c_k| = TV(π, c) ∈ [0, 1]: the fraction of the optimiser's
   push that the evaluation under-weights. D = 0 when the evaluation's reward signal is spread over the
   dimensions exactly as the reward's gradient is, e.g. one pure probe per dimension, all of the same
   size and magnitude (then c_k = π_k). With pure probes of sizes n_k and unit moves, ρ_k = n_k / Σ_j π_j n_j.
7. Dimension k is flagged **under-covered** when π_k ≥ ``min_push`` and ρ_k < ``threshold`` (defaults
   0.01 and 0.5: it carries at least 1% of the push and gets less than half the evaluation attention
   its push warrants).

When g is estimated and a dimension is never varied by any probe (or only in fixed combination with
others), its sensitivity cannot be identified; it is then *assumed* as large as the largest identified
one (worst case: unexamined means unknown, not harmless) and marked ``sensitivity_assumed``.
Bootstrap: pairs are resampled within each probe (sensitivity re-estimated when it was estimated),
giving percentile intervals for D and every c_k.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import finish, panels
from reward_lens.stats import (
    as_float_matrix,
    bootstrap_indices,
    check_level,
    named_rows,
    percentile_ci,
    to_float64,
)

ArrayLike = Any


@dataclass
class DistortionResult:
    """Coverage of quality dimensions by evaluation probes, and the distortion index (see module doc)."""

    dimensions: List[str]
    probes: List[str]
    coverage_matrix: pd.DataFrame  # probes x dimensions, C[p, k]
    n_pairs: pd.Series  # per probe
    sensitivity: np.ndarray  # [K] root-mean-square g_k
    sensitivity_source: str  # "given", "estimated" or "geometry"
    sensitivity_assumed: np.ndarray  # [K] bool: unidentifiable, set to the worst case
    effective_energy: np.ndarray  # [K] E_k
    effective_pairs: np.ndarray  # [K] Σ_p n_p C[p, k]
    coverage_share: np.ndarray  # [K] c_k
    push_share: np.ndarray  # [K] π_k
    ratio: np.ndarray  # [K] ρ_k
    deficit: np.ndarray  # [K] δ_k
    under_covered: np.ndarray  # [K] bool
    index: float  # D
    index_ci: Tuple[float, float]
    coverage_share_ci: np.ndarray  # [K, 2]
    explained: Optional[pd.Series]  # per probe: R² of Δr by Σ_k a_k (None without reward differences)
    threshold: float
    min_push: float
    level: float = 0.95
    notes: List[str] = field(default_factory=list)

    @property
    def flagged(self) -> List[str]:
        """Names of the under-covered dimensions."""
        return [d for d, f in zip(self.dimensions, self.under_covered) if f]

    def to_frame(self) -> pd.DataFrame:
        """One row per dimension: sensitivity, push and coverage shares, ratio, deficit, flag."""
        return pd.DataFrame(
            {
                "dimension": self.dimensions,
                "sensitivity": self.sensitivity,
                "sensitivity_assumed": self.sensitivity_assumed,
                "push_share": self.push_share,
                "effective_energy": self.effective_energy,
                "effective_pairs": self.effective_pairs,
                "coverage_share": self.coverage_share,
                "coverage_share_ci_low": self.coverage_share_ci[:, 0],
                "coverage_share_ci_high": self.coverage_share_ci[:, 1],
                "coverage_ratio": self.ratio,
                "deficit": self.deficit,
                "under_covered": self.under_covered,
            }
        )

    def matrix_frame(self) -> pd.DataFrame:
        """The coverage matrix, tidy: probe, dimension, loading, n_pairs."""
        long = self.coverage_matrix.rename_axis(index="probe", columns="dimension").stack().rename("loading")
        out = long.reset_index()
        out["n_pairs"] = out["probe"].map(self.n_pairs)
        return out

    def summary(self) -> pd.DataFrame:
        """One row: the distortion index D with its interval, the number and names of under-covered
        dimensions."""
        lo, hi = self.index_ci
        return pd.DataFrame(
            [
                {
                    "index": self.index,
                    "ci_low": lo,
                    "ci_high": hi,
                    "level": self.level,
                    "n_dimensions": len(self.dimensions),
                    "n_probes": len(self.probes),
                    "n_under_covered": len(self.flagged),
                    "under_covered": ", ".join(self.flagged),
                    "sensitivity_source": self.sensitivity_source,
                }
            ]
        )

    def summary_text(self) -> str:
        """The summary as one sentence (what `summary()` returned before it became a DataFrame)."""
        lo, hi = self.index_ci
        flagged = ", ".join(self.flagged) or "none"
        return (
            f"distortion index D = {self.index:.3f} ({int(self.level * 100)}% CI {lo:.3f}..{hi:.3f}); "
            f"under-covered: {flagged}"
        )

    def plot(self, ax=None):
        """Left: the probe x dimension coverage matrix. Right: push share vs coverage share per dimension
        (flagged dimensions in red). `ax`: two Axes (or one, split in two)."""
        K, P = len(self.dimensions), len(self.probes)
        created = ax is None
        fig, (ax0, ax1) = panels(ax, 2, (5 + 0.6 * K + 4, 1.5 + 0.45 * max(P, 4)), width_ratios=[1.2, 1])
        im = ax0.imshow(self.coverage_matrix.values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax0.set_xticks(range(K), self.dimensions, rotation=45, ha="right")
        ax0.set_yticks(range(P), [f"{p} (n={self.n_pairs[p]})" for p in self.probes])
        for (i, j), v in np.ndenumerate(self.coverage_matrix.values):
            ax0.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
        ax0.set_title("coverage matrix C[probe, dimension]")
        fig.colorbar(im, ax=ax0, fraction=0.046)
        x = np.arange(K)
        ax1.bar(x - 0.2, self.push_share, 0.4, label="push share π", color="0.6")
        err = np.abs(self.coverage_share_ci.T - self.coverage_share)
        colors = ["tab:red" if f else "tab:blue" for f in self.under_covered]
        ax1.bar(
            x + 0.2, self.coverage_share, 0.4, yerr=err, label="coverage share c", color=colors, capsize=2
        )
        ax1.set_xticks(x, self.dimensions, rotation=45, ha="right")
        for label, flagged in zip(ax1.get_xticklabels(), self.under_covered):
            if flagged:
                label.set_color("tab:red")
                label.set_fontweight("bold")
        ax1.set_ylabel("share")
        ax1.set_title(f"D = {self.index:.3f}; red: under-covered")
        ax1.legend(fontsize=8)
        return finish(fig, created)


# ------------------------------------------------------------------------------------------- the core


def _coverage(contrib: Sequence[np.ndarray]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coverage matrix C [P, K], energy E [K] and effective pairs [K] from contributions a [n_p, K]."""
    rows = []
    for a in contrib:
        energy = (a**2).sum(0)
        total = energy.sum()
        rows.append(energy / total if total > 0 else np.zeros_like(energy))
    C = np.stack(rows)
    n = np.array([a.shape[0] for a in contrib], dtype=np.float64)
    E = np.stack([(a**2).sum(0) for a in contrib]).sum(0)
    return C, E, (n[:, None] * C).sum(0)


def _estimate_sensitivity(
    dq: Sequence[np.ndarray], dr: Sequence[np.ndarray]
) -> Tuple[np.ndarray, np.ndarray]:
    """Pooled least squares Δr ≈ Δq g; unidentifiable dimensions get the largest identified |g|."""
    Q, r = np.concatenate(dq), np.concatenate(dr)
    K = Q.shape[1]
    norms = (Q**2).sum(0)
    identified = np.zeros(K, dtype=bool)
    for k in range(K):
        if norms[k] <= 0:
            continue
        others = np.delete(Q, k, axis=1)
        if others.shape[1]:
            beta = np.linalg.lstsq(others, Q[:, k], rcond=None)[0]
            resid = Q[:, k] - others @ beta
        else:
            resid = Q[:, k]
        identified[k] = (resid**2).sum() > 1e-8 * norms[k]  # the Schur complement: separable from the rest
    g = np.zeros(K)
    if identified.any():
        g[identified] = np.linalg.lstsq(Q[:, identified], r, rcond=None)[0]
    worst = np.abs(g[identified]).max() if identified.any() and np.abs(g[identified]).max() > 0 else 1.0
    g[~identified] = worst
    return g, ~identified


def _shares(E: np.ndarray, g2: np.ndarray) -> Dict[str, np.ndarray]:
    c = E / E.sum() if E.sum() > 0 else np.zeros_like(E)
    push = g2 / g2.sum() if g2.sum() > 0 else np.full_like(g2, 1.0 / len(g2))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(push > 0, c / np.where(push > 0, push, 1.0), np.where(c > 0, np.inf, np.nan))
    deficit = np.maximum(0.0, push - c)
    return {"c": c, "push": push, "ratio": ratio, "deficit": deficit, "index": float(deficit.sum())}


def _distortion(
    probes: List[str],
    dims: List[str],
    dq: List[np.ndarray],
    dr: Optional[List[np.ndarray]],
    g_rows: Optional[List[np.ndarray]],
    *,
    source: str,
    threshold: float,
    min_push: float,
    n_boot: int,
    seed: int,
    level: float,
) -> DistortionResult:
    """Everything from per-probe Δq [n_p, K], Δr [n_p] and per-pair sensitivities g [n_p, K] (None:
    estimate g by pooled least squares, which needs Δr)."""
    check_level(level)
    if not 0 < threshold:
        raise ValueError(f"threshold must be > 0 (a coverage ratio, default 0.5), got {threshold}")
    K = len(dims)
    assumed = np.zeros(K, dtype=bool)

    def compute(dq_s, dr_s, g_s):
        if g_s is None:
            g, unassumed = _estimate_sensitivity(dq_s, dr_s)
            g_s = [np.broadcast_to(g, q.shape) for q in dq_s]
        else:
            unassumed = np.zeros(K, dtype=bool)
        contrib = [q * g for q, g in zip(dq_s, g_s)]
        C, E, pairs = _coverage(contrib)
        g2 = np.concatenate([g**2 for g in g_s]).mean(0)
        return C, E, pairs, g2, contrib, unassumed

    C, E, eff_pairs, g2, contrib, assumed = compute(dq, dr, g_rows)
    sh = _shares(E, g2)

    boot_index, boot_c = [], []
    if n_boot:
        idx = [bootstrap_indices(q.shape[0], n_boot, seed + j) for j, q in enumerate(dq)]
        for b in range(n_boot):
            dq_b = [q[ix[b]] for q, ix in zip(dq, idx)]
            dr_b = None if dr is None else [r[ix[b]] for r, ix in zip(dr, idx)]
            g_b = None if g_rows is None else [g[ix[b]] for g, ix in zip(g_rows, idx)]
            _, Eb, _, g2b, _, _ = compute(dq_b, dr_b, g_b)
            s = _shares(Eb, g2b)
            boot_index.append(s["index"])
            boot_c.append(s["c"])
    if boot_index:
        ilo, ihi = percentile_ci(np.array(boot_index), level)
        clo, chi = percentile_ci(np.stack(boot_c), level)
        index_ci, c_ci = (float(ilo), float(ihi)), np.stack([clo, chi], axis=1)
    else:
        index_ci, c_ci = (np.nan, np.nan), np.full((K, 2), np.nan)

    explained = None
    if dr is not None:
        vals = []
        for a, r in zip(contrib, dr):
            ss = (r**2).sum()
            vals.append(1.0 - ((r - a.sum(1)) ** 2).sum() / ss if ss > 0 else np.nan)
        explained = pd.Series(vals, index=probes, name="explained")

    under = (sh["push"] >= min_push) & ~(sh["ratio"] >= threshold)  # NaN/low ratio with real push -> flagged
    notes = []
    if assumed.any():
        notes.append(
            "sensitivity not identifiable from the probes (never varied, or only together with others), "
            "assumed worst case for: " + ", ".join(d for d, a in zip(dims, assumed) if a)
        )
    return DistortionResult(
        dimensions=dims,
        probes=probes,
        coverage_matrix=pd.DataFrame(C, index=probes, columns=dims),
        n_pairs=pd.Series([q.shape[0] for q in dq], index=probes, name="n_pairs"),
        sensitivity=np.sqrt(g2),
        sensitivity_source=source,
        sensitivity_assumed=assumed,
        effective_energy=E,
        effective_pairs=eff_pairs,
        coverage_share=sh["c"],
        push_share=sh["push"],
        ratio=sh["ratio"],
        deficit=sh["deficit"],
        under_covered=under,
        index=sh["index"],
        index_ci=index_ci,
        coverage_share_ci=c_ci,
        explained=explained,
        threshold=threshold,
        min_push=min_push,
        level=level,
        notes=notes,
    )


# ------------------------------------------------------------------------------------------- plain data


def _sensitivity_vector(sensitivity: Any, dims: List[str]) -> np.ndarray:
    """A [K] sensitivity from a mapping, an array, a frame with dimension/effect columns, or an object
    with `.to_frame()` (a probe-suite result: its per-dimension `effect`)."""
    if hasattr(sensitivity, "to_frame") and not isinstance(sensitivity, (pd.DataFrame, pd.Series)):
        sensitivity = sensitivity.to_frame()
    if isinstance(sensitivity, pd.DataFrame):
        col = next(
            (c for c in ("effect", "mean_delta", "delta", "sensitivity") if c in sensitivity.columns), None
        )
        if "dimension" not in sensitivity.columns or col is None:
            raise ValueError(
                "a sensitivity frame needs columns 'dimension' and 'effect' (per-dimension reward change "
                f"per unit); got {list(sensitivity.columns)}"
            )
        sensitivity = dict(zip(sensitivity["dimension"], sensitivity[col]))
    if isinstance(sensitivity, (Mapping, pd.Series)):
        missing = [d for d in dims if d not in sensitivity]
        if missing:
            raise ValueError(
                f"sensitivity has no value for dimension(s) {missing}; give one per dimension {dims}"
            )
        return np.array([float(sensitivity[d]) for d in dims])
    g = np.asarray(sensitivity, dtype=np.float64).reshape(-1)
    if g.shape[0] != len(dims):
        raise ValueError(f"sensitivity has {g.shape[0]} values for {len(dims)} dimensions {dims}")
    if not np.all(np.isfinite(g)):
        raise ValueError(
            "sensitivity holds NaN or inf; give a finite reward change per unit of every dimension"
        )
    return g


@checked_arguments(counts={"n_boot": 0, "seed": 0})
def distortion_index(
    data: Union[pd.DataFrame, Mapping[str, Tuple[ArrayLike, ArrayLike]]],
    dimensions: Optional[Sequence[str]] = None,
    *,
    sensitivity: Any = None,
    probe_col: str = "probe",
    reward_col: str = "reward_delta",
    threshold: float = 0.5,
    min_push: float = 0.01,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
) -> DistortionResult:
    """Coverage matrix, effective coverage and distortion index of evaluation probes (definitions: module
    doc).

    `data`: a frame with one row per evaluation pair, a `probe_col` column, a `reward_col` column (the
    pair's reward difference) and one column per quality dimension (the pair's difference along it); or a
    mapping probe -> (reward_deltas [n_p], dimension_deltas [n_p, K]) with `dimensions` naming the K columns.
    `sensitivity`: reward change per unit of each dimension (mapping, array, a frame with dimension/effect
    columns, or a hacking-probe result); None estimates it from the data by pooled least squares.
    """
    if isinstance(data, pd.DataFrame):
        for col in (probe_col, reward_col):
            if col not in data.columns:
                raise ValueError(
                    f"the data frame has no column {col!r}; it needs a probe column, a reward-difference "
                    f"column and one column per dimension (found {list(data.columns)})"
                )
        dims = (
            list(dimensions)
            if dimensions is not None
            else [
                c
                for c in data.columns
                if c not in (probe_col, reward_col) and pd.api.types.is_numeric_dtype(data[c])
            ]
        )
        missing = [d for d in dims if d not in data.columns]
        if missing:
            raise ValueError(
                f"dimension column(s) {missing} not in the data frame (columns: {list(data.columns)})"
            )
        probes = list(dict.fromkeys(data[probe_col].tolist()))
        groups = {p: data[data[probe_col] == p] for p in probes}
        dr = [as_float_matrix(groups[p][reward_col].to_numpy(), reward_col, 1)[:, 0] for p in probes]
        dq = [
            as_float_matrix(groups[p][dims].to_numpy(), f"dimension columns of probe {p!r}", len(dims))
            for p in probes
        ]
    elif isinstance(data, Mapping):
        probes = list(data)
        dr, dq = [], []
        for p in probes:
            try:
                r, q = data[p]
            except (TypeError, ValueError):
                raise ValueError(f"probe {p!r}: give (reward_deltas [n], dimension_deltas [n, K])") from None
            q = as_float_matrix(q, f"dimension deltas of probe {p!r}")
            r = as_float_matrix(np.asarray(r).reshape(-1, 1), f"reward deltas of probe {p!r}", 1)[:, 0]
            if r.shape[0] != q.shape[0]:
                raise ValueError(
                    f"probe {p!r}: {r.shape[0]} reward deltas but {q.shape[0]} rows of dimension deltas"
                )
            dr.append(r)
            dq.append(q)
        K = dq[0].shape[1] if dq else 0
        if any(q.shape[1] != K for q in dq):
            raise ValueError(
                "every probe's dimension deltas need the same number of columns (one per dimension)"
            )
        dims = list(dimensions) if dimensions is not None else [f"dim_{k}" for k in range(K)]
        if len(dims) != K:
            raise ValueError(f"{len(dims)} dimension names for {K} dimension columns")
    else:
        raise TypeError(
            "data must be a DataFrame (probe, reward_delta, one column per dimension) or a mapping probe "
            "-> (reward_deltas, dimension_deltas)"
        )
    if not probes or not dims:
        raise ValueError("need at least one probe and one dimension")
    if any(q.shape[0] == 0 for q in dq):
        raise ValueError("a probe has no pairs; drop it or give it pairs")
    if sensitivity is None:
        g_rows, source = None, "estimated"
    else:
        g = _sensitivity_vector(sensitivity, dims)
        g_rows, source = [np.broadcast_to(g, q.shape) for q in dq], "given"
    return _distortion(
        probes,
        dims,
        dq,
        dr,
        g_rows,
        source=source,
        threshold=threshold,
        min_push=min_push,
        n_boot=n_boot,
        seed=seed,
        level=level,
    )


# ------------------------------------------------------------------------------------------- geometry


def _direction_matrix(directions: Any, names: Optional[Sequence[str]]) -> Tuple[np.ndarray, List[str]]:
    U, names = named_rows(directions, names, "dim", "dimension directions")
    if len(names) != U.shape[0]:
        raise ValueError(f"{len(names)} names for {U.shape[0]} dimension directions")
    norms = np.linalg.norm(U, axis=1)
    if np.any(norms == 0) or not np.all(np.isfinite(U)):
        bad = [n for n, v in zip(names, norms) if not v > 0]
        raise ValueError(
            f"dimension direction(s) {bad} are zero or not finite; every dimension needs a direction"
        )
    return U / norms[:, None], names


def _coordinates(delta: np.ndarray, U: np.ndarray) -> np.ndarray:
    """Coordinates c [n, K] of each row's projection onto span(U) in the (unit, possibly oblique) basis U."""
    return np.linalg.lstsq(U.T, delta.T, rcond=None)[0].T


def distortion_from_directions(
    reward_direction: ArrayLike,
    dimension_directions: Any,
    probe_deltas: Mapping[str, ArrayLike],
    *,
    names: Optional[Sequence[str]] = None,
    **options: Any,
) -> DistortionResult:
    """The distortion index in the reward model's norm-aware readout space.

    `reward_direction` w [d_model] or, per probe, [n_p, d_model] (ArmoRM's prompt-conditioned direction);
    `dimension_directions` u_k ([K, d_model] or name -> vector; normalised here); `probe_deltas` probe ->
    δ [n_p, d_model], each pair's chosen-minus-rejected readout state resid_final / ln_final scale, so that
    Δr = w·δ exactly. Δq are δ's coordinates in the u basis (its projection on span(u)), g_k = w·u_k, and
    Σ_k a_k = w·(projection of δ): the dimensions' exact share of each reward difference.
    Options as in `distortion_index` (threshold, min_push, n_boot, seed, level).
    """
    U, dims = _direction_matrix(dimension_directions, names)
    probes = list(probe_deltas)
    if not probes:
        raise ValueError("no probes given; pass probe name -> activation differences [n, d_model]")
    dq, dr, g_rows = [], [], []
    for p in probes:
        delta = to_float64(probe_deltas[p])
        if delta.ndim != 2 or delta.shape[1] != U.shape[1] or delta.shape[0] == 0:
            raise ValueError(
                f"probe {p!r}: activation differences must be [n >= 1, {U.shape[1]}], got {delta.shape}"
            )
        w = to_float64(reward_direction[p] if isinstance(reward_direction, Mapping) else reward_direction)
        w = np.broadcast_to(w, delta.shape) if w.ndim == 1 else w
        if w.shape != delta.shape:
            raise ValueError(
                f"probe {p!r}: reward direction of shape {w.shape} does not match the differences "
                f"{delta.shape}"
            )
        dq.append(_coordinates(delta, U))
        dr.append((w * delta).sum(1))
        g_rows.append(w @ U.T)
    return _distortion(probes, dims, dq, dr, g_rows, source="geometry", **_index_options(options))


_INDEX_OPTIONS = ("threshold", "min_push", "n_boot", "seed", "level")


def _index_options(given: Mapping[str, Any]) -> Dict[str, Any]:
    """`distortion_index`'s options from `given`, the defaults of its signature for the others (one set of
    defaults); an unknown name is refused."""
    unknown = sorted(set(given) - set(_INDEX_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected option(s) {unknown}; known: {', '.join(_INDEX_OPTIONS)}")
    defaults = inspect.signature(distortion_index).parameters
    return {name: given.get(name, defaults[name].default) for name in _INDEX_OPTIONS}


# ------------------------------------------------------------------------------------------- a model
