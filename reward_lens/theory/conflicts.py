r"""Reward-term conflict analyzer: are several reward terms on one backbone aligned, orthogonal or in
conflict?

Terms: ArmoRM's objectives (``W_reg[:, j]``), the outputs of a multi-output head, user-given directions,
or several reward models that share one backbone (so their residual bases coincide). Two views of
every pair of terms (also in ``docs/theory.md``):

1. **Geometry**: the cosine of their *norm-aware* directions, i.e. the vectors w_t with
   r_t = w_t · (resid_final[readout] / ln_final scale) + b_t (the final norm's weight folded in, as
   ``model.reward_direction`` gives), so the cosine compares what the terms actually read.
2. **Behaviour**: the Pearson correlation, over preference pairs, of their reward differences
   Δr_t = r_t(chosen) − r_t(rejected), with a Fisher-z interval.

Verdict of a statistic s (cosine or correlation), threshold τ (default 0.3):
``aligned`` if s ≥ τ, ``conflicting`` if s ≤ −τ, ``orthogonal`` otherwise. τ = 0.3 means at least
about 9% shared variance (s² ≥ 0.09). Random directions in d dimensions have cosines of order 1/√d
(≈ 0.016 at d = 4096), far below τ, so any cosine beyond τ is structure, not chance; the noise floor
3/√d is reported and a warning issued when τ falls below it (tiny models). The headline verdict uses the
behavioural correlation when reward differences are available (it is what an optimiser trades off on the
data), else the cosine; ``disagree`` marks pairs whose two verdicts differ: directions can be orthogonal
yet move together on real data because activation differences are anisotropic, or the reverse.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from reward_lens.core.batching import pair_batches
from reward_lens.core.readout import readout_cache
from reward_lens.data.pairs import as_pairs
from reward_lens.model.heads.base import read_objective
from reward_lens.model.hooks import final_resid_name
from reward_lens.model.native import NativeRewardModel
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import diverging_heatmap, finish, panels
from reward_lens.stats import (
    as_float_matrix,
    check_level,
    column_correlations,
    fisher_ci,
    named_rows,
    to_float64,
)

VERDICTS = ("aligned", "orthogonal", "conflicting")


def classify(s: np.ndarray, threshold: float) -> np.ndarray:
    """'aligned' (s ≥ τ), 'conflicting' (s ≤ −τ), 'orthogonal' (|s| < τ), '' where s is NaN."""
    s = np.asarray(s, dtype=np.float64)
    out = np.full(s.shape, "orthogonal", dtype=object)
    out[s >= threshold] = "aligned"
    out[s <= -threshold] = "conflicting"
    out[np.isnan(s)] = ""
    return out


@dataclass
class ConflictResult:
    """Cosines and reward-difference correlations of reward terms, with verdicts (see module doc)."""

    names: List[str]
    cosine: np.ndarray  # [m, m]
    correlation: Optional[np.ndarray]  # [m, m] or None without reward differences
    corr_ci_low: Optional[np.ndarray]
    corr_ci_high: Optional[np.ndarray]
    threshold: float
    noise_floor: float  # 3 / sqrt(d_model): |cosine| of random directions stays below this
    n_pairs: int
    d_model: int
    level: float = 0.95
    notes: List[str] = field(default_factory=list)

    @property
    def headline(self) -> np.ndarray:
        """The statistic behind the headline verdict: correlation when available, else cosine."""
        return self.correlation if self.correlation is not None else self.cosine

    def verdicts(self) -> pd.DataFrame:
        """m x m frame of headline verdicts."""
        return pd.DataFrame(classify(self.headline, self.threshold), index=self.names, columns=self.names)

    def to_frame(self) -> pd.DataFrame:
        """One row per pair of terms: cosine, correlation (+ interval), both verdicts, headline, disagree."""
        rows = []
        m = len(self.names)
        cos_v = classify(self.cosine, self.threshold)
        cor_v = classify(self.correlation, self.threshold) if self.correlation is not None else None
        for a in range(m):
            for b in range(a + 1, m):
                row = {
                    "term_a": self.names[a],
                    "term_b": self.names[b],
                    "cosine": self.cosine[a, b],
                    "cosine_verdict": cos_v[a, b],
                }
                if cor_v is not None:
                    row.update(
                        {
                            "correlation": self.correlation[a, b],
                            "corr_ci_low": self.corr_ci_low[a, b],
                            "corr_ci_high": self.corr_ci_high[a, b],
                            "correlation_verdict": cor_v[a, b],
                        }
                    )
                    row["verdict"] = cor_v[a, b] or cos_v[a, b]
                    row["disagree"] = bool(cor_v[a, b] and cor_v[a, b] != cos_v[a, b])
                else:
                    row["verdict"] = cos_v[a, b]
                rows.append(row)
        return pd.DataFrame(rows)

    def counts(self) -> Dict[str, int]:
        frame = self.to_frame()
        return (
            {v: int((frame["verdict"] == v).sum()) for v in VERDICTS}
            if len(frame)
            else {v: 0 for v in VERDICTS}
        )

    def summary(self) -> pd.DataFrame:
        """One row: number of terms and of term pairs, the basis of the verdicts, and the count of each
        verdict."""
        c = self.counts()
        return pd.DataFrame(
            [
                {
                    "n_terms": len(self.names),
                    "n_term_pairs": sum(c.values()),
                    "basis": "correlation" if self.correlation is not None else "cosine",
                    "threshold": self.threshold,
                    **c,
                    "n_pairs": self.n_pairs,
                    "noise_floor": self.noise_floor,
                }
            ]
        )

    def summary_text(self) -> str:
        """The summary as one sentence (what `summary()` returned before it became a DataFrame)."""
        c = self.counts()
        basis = "reward-difference correlation" if self.correlation is not None else "direction cosine"
        return (
            f"{len(self.names)} reward terms, {sum(c.values())} pairs by {basis} (τ = {self.threshold}): "
            f"{c['aligned']} aligned, {c['orthogonal']} orthogonal, {c['conflicting']} conflicting"
        )

    def plot(self, ax=None):
        """Heatmaps of the cosines and (when available) the correlations; cells marked A / O / C.
        `ax`: one Axes per heatmap (or one, split)."""
        mats = [("cosine of norm-aware directions", self.cosine)]
        if self.correlation is not None:
            mats.append((f"correlation of reward differences (n={self.n_pairs})", self.correlation))
        m = len(self.names)
        size = 2.5 + 0.45 * m
        created = ax is None
        fig, axes = panels(ax, len(mats), (size * len(mats) + 1, size))
        letter = {"aligned": "A", "orthogonal": "O", "conflicting": "C", "": ""}
        for ax, (title, M) in zip(axes, mats):
            marks = np.vectorize(letter.get)(classify(M, self.threshold)) if m <= 24 else None
            if marks is not None:
                np.fill_diagonal(marks, "")
            diverging_heatmap(
                ax,
                M,
                xlabels=self.names,
                ylabels=self.names,
                limit=1.0,
                annotations=marks,
                fontsize=7 if m <= 10 else 6,
                xrotation=60,
            )
            ax.set_title(title, fontsize=9)
        if created:
            fig.suptitle(
                f"reward-term conflicts: A aligned (≥ {self.threshold}), C conflicting (≤ "
                f"−{self.threshold}), O orthogonal",
                fontsize=9,
            )
        return finish(fig, created)


# ------------------------------------------------------------------------------------------- plain data


def conflicts_from_directions(
    directions: Union[Any, Mapping[str, Any]],
    reward_deltas: Optional[Any] = None,
    *,
    names: Optional[Sequence[str]] = None,
    threshold: float = 0.3,
    level: float = 0.95,
) -> ConflictResult:
    """Conflicts of m reward terms from their norm-aware directions [m, d_model] (or name -> vector) and,
    optionally, their per-pair reward differences [n_pairs, m] (a frame's columns are matched by name)."""
    check_level(level)
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1) (a cosine / correlation), got {threshold}")
    W, names = named_rows(directions, names, "term", "directions")
    m, d = W.shape
    if len(names) != m:
        raise ValueError(f"{len(names)} names for {m} directions")
    if m < 2:
        raise ValueError("need at least two reward terms to compare")
    norms = np.linalg.norm(W, axis=1)
    if not np.all(np.isfinite(W)) or np.any(norms == 0):
        raise ValueError(
            f"direction(s) {[n for n, v in zip(names, norms) if not v > 0]} are zero or not finite"
        )
    U = W / norms[:, None]
    cos = np.clip(U @ U.T, -1.0, 1.0)
    floor = 3.0 / np.sqrt(d)
    notes = []
    if threshold < floor:
        msg = (
            f"threshold {threshold} is below the random-direction noise floor 3/sqrt(d_model) = "
            f"{floor:.3f}; cosine verdicts at this width can be chance"
        )
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    corr = lo = hi = None
    n = 0
    if reward_deltas is not None:
        if isinstance(reward_deltas, pd.DataFrame):
            missing = [c for c in names if c not in reward_deltas.columns]
            if missing:
                raise ValueError(f"reward_deltas frame lacks column(s) {missing} (one per term: {names})")
            reward_deltas = reward_deltas[names].to_numpy()
        R = as_float_matrix(to_float64(reward_deltas), "reward_deltas", m)
        n = R.shape[0]
        if n < 3:
            raise ValueError(f"reward-difference correlations need at least 3 pairs, got {n}")
        corr = column_correlations(R)
        lo, hi = fisher_ci(corr, n, level)
        const = [nm for nm, s in zip(names, R.std(0)) if s == 0]
        if const:
            notes.append(f"constant reward differences (correlation undefined): {', '.join(const)}")
    return ConflictResult(names, cos, corr, lo, hi, threshold, floor, n, d, level, notes)


# ------------------------------------------------------------------------------------------- models


def _readout_states(model, pairs, batch_size: int):
    """x = resid_final[readout] / ln_final scale for chosen and rejected ([n, d] each), and the outputs of
    `reward_head.hook_pooled` ([n, n_out] each) when the head has that hook."""
    import torch

    last = final_resid_name(model.cfg.n_layers)
    names = [last, "ln_final.hook_scale"]
    has_pooled = "reward_head.hook_pooled" in model.hook_dict
    if has_pooled:
        names.append("reward_head.hook_pooled")
    xs = {"chosen": [], "rejected": []}
    pooled = {"chosen": [], "rejected": []}
    # A multi-objective head (ArmoRM): read one objective so the forward skips the gate (hook_pooled still
    # holds every objective, and the gate's token pattern is then not needed in the pairs).
    with torch.no_grad(), read_objective(model, 0 if model.reward_head.n_objectives else None):
        for pb in pair_batches(model, as_pairs(pairs), batch_size):
            for side, tok in (("chosen", pb.chosen), ("rejected", pb.rejected)):
                _, cache = readout_cache(model, tok, names)
                xs[side].append(cache[last][:, 0].double() / cache["ln_final.hook_scale"][:, 0].double())
                if has_pooled:
                    pooled[side].append(cache["reward_head.hook_pooled"].double())
    out = {s: torch.cat(v).cpu().numpy() for s, v in xs.items()}
    pool = {s: torch.cat(v).cpu().numpy() for s, v in pooled.items()} if has_pooled else None
    return out, pool


def _norm_gain(model):
    """The final norm's (unfolded) gain that multiplies a head's raw weights, or None when folded."""
    gain = model.ln_final.gain
    return None if gain is None else gain.detach().double().cpu().numpy()


def term_directions(model) -> Tuple[np.ndarray, List[str]]:
    """Norm-aware directions [m, d_model] and names of a model's reward terms: ArmoRM's objectives, or the
    outputs of a multi-output head."""
    head = model.reward_head
    if head.n_objectives:
        W = head.objective_directions().detach().double().cpu().numpy()
        names = list(head.objective_names)
    else:
        n_out = model.cfg.n_outputs
        if n_out < 2:
            raise ValueError(
                "this model has one reward output, so one term: pass directions={name: vector, ...}, or "
                "a dict of reward models that share its backbone"
            )
        W = np.stack([head.direction(j).detach().double().cpu().numpy() for j in range(n_out)])
        names = [f"output_{j}" for j in range(n_out)]
    gain = _norm_gain(model)
    return (W * gain if gain is not None else W), names


def _same_backbone(models: Mapping[str, Any]) -> Optional[str]:
    """None when every model has the first one's backbone weights; else the first mismatch, in words."""
    import torch

    names = list(models)
    ref = dict(models[names[0]].named_parameters())
    for n in names[1:]:
        for pname, p in models[n].named_parameters():
            if pname.startswith("reward_head.") or pname.startswith("ln_final."):
                continue
            q = ref.get(pname)
            if q is None or q.shape != p.shape or not torch.equal(q.detach().cpu(), p.detach().cpu()):
                return f"{n!r} differs from {names[0]!r} at {pname}"
    return None


@checked_arguments(counts={"batch_size": 1}, flags=("allow_different_backbones",))
def reward_conflicts(
    source: Any,
    pairs: Any = None,
    *,
    directions: Optional[Mapping[str, Any]] = None,
    reward_deltas: Any = None,
    names: Optional[Sequence[str]] = None,
    threshold: float = 0.3,
    level: float = 0.95,
    batch_size: int = 8,
    allow_different_backbones: bool = False,
) -> ConflictResult:
    """Aligned / orthogonal / conflicting reward terms (definitions and thresholds: module doc).

    - `reward_conflicts(directions[, reward_deltas])`: plain data, directions [m, d] or name -> vector.
    - `reward_conflicts(armorm_model, pairs)`: ArmoRM's objectives (directions W_reg[:, j], per-pair
      objective reward differences from `reward_head.hook_pooled`); also any multi-output head.
    - `reward_conflicts(model, pairs, directions={name: vector})`: arbitrary norm-aware directions on one
      model; each term's reward difference is w·(x_chosen − x_rejected).
    - `reward_conflicts({"rm_a": model_a, "rm_b": model_b}, pairs)`: reward models on one backbone (weights
      outside the head and final norm must be equal; `allow_different_backbones=True` overrides, at the
      cost of comparing directions in bases that only approximately coincide).
    `pairs` may be omitted for models (geometry only).
    """
    opts = dict(threshold=threshold, level=level)
    if isinstance(source, NativeRewardModel):
        model = source
        if directions is not None:
            W, names_ = np.stack([to_float64(v).reshape(-1) for v in directions.values()]), list(directions)
            if W.shape[1] != model.cfg.d_model:
                raise ValueError(
                    f"directions have width {W.shape[1]}, the model's residual is {model.cfg.d_model}"
                )
        else:
            W, names_ = term_directions(model)
        deltas = None
        if pairs is not None:
            x, pooled = _readout_states(model, pairs, batch_size)
            if directions is None and pooled is not None and pooled["chosen"].shape[1] == W.shape[0]:
                deltas = pooled["chosen"] - pooled["rejected"]  # the head's own outputs (bias cancels)
            else:
                deltas = (x["chosen"] - x["rejected"]) @ W.T
        return conflicts_from_directions(W, deltas, names=names or names_, **opts)
    if (
        isinstance(source, Mapping)
        and source
        and all(isinstance(v, NativeRewardModel) for v in source.values())
    ):
        models = dict(source)
        if len(models) < 2:
            raise ValueError("give at least two reward models to compare")
        widths = {n: m.cfg.d_model for n, m in models.items()}
        if len(set(widths.values())) > 1:
            raise ValueError(
                f"models have different residual widths {widths}: they do not share a backbone; use "
                "reward_lens.compare_models for basis-free comparison"
            )
        mismatch = _same_backbone(models)
        if mismatch and not allow_different_backbones:
            raise ValueError(
                f"these models do not share a backbone ({mismatch}), so their directions live in "
                "different bases; use reward_lens.compare_models, or pass allow_different_backbones=True"
            )
        W, deltas = [], []
        for n, m in models.items():
            if m.reward_head.n_objectives:
                raise ValueError(
                    f"model {n!r} is an ArmoRM: analyse its objectives with reward_conflicts(model, pairs)"
                )
            W.append(m.reward_direction.detach().double().cpu().numpy())
            if pairs is not None:
                x, _ = _readout_states(m, pairs, batch_size)
                deltas.append((x["chosen"] - x["rejected"]) @ W[-1])
        notes_extra = [f"backbones differ ({mismatch}); compared anyway"] if mismatch else []
        res = conflicts_from_directions(
            np.stack(W), np.stack(deltas, 1) if deltas else None, names=names or list(models), **opts
        )
        res.notes += notes_extra
        return res
    if pairs is not None:
        raise TypeError(
            "pairs were given but no model: pass a HookedRewardModel or a dict of them as the first argument"
        )
    return conflicts_from_directions(source, reward_deltas, names=names, **opts)
