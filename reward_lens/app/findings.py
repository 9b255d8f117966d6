"""The audit's finding in plain words, for the top of the report: what the model rewards or penalises, by how
much and how sure; whether attribution and patching agree; where the preference forms. Plus the report's
column labels (with units) and each section's one-line reading guide."""

from __future__ import annotations

import math
from typing import Any, Dict, List

import pandas as pd

# Faithfulness below this mean rho: attribution and patching rank the components differently
AGREEMENT_RHO = 0.8

COLUMN_LABELS: Dict[str, str] = {
    "dimension": "dimension",
    "effect": "effect (Δ reward)",
    "cohens_d": "Cohen's d (effect / sd)",
    "ci_low": "95% CI low (Δ reward)",
    "ci_high": "95% CI high (Δ reward)",
    "p_value": "p-value",
    "verdict": "verdict",
    "n": "items",
    "n_pairs": "pairs",
    "n_components": "components",
    "mean_rho": "mean ρ per pair",
    "mean_rho_low": "mean ρ, 95% CI low",
    "mean_rho_high": "mean ρ, 95% CI high",
    "pooled_rho": "pooled ρ",
    "pooled_rho_low": "pooled ρ, 95% CI low",
    "pooled_rho_high": "pooled ρ, 95% CI high",
    "quantity": "attribution of",
    "mode": "patching mode",
    "absolute": "ranks of magnitudes",
    "n_boot": "bootstrap resamples",
    "ci": "CI level",
    "component": "component",
    "layer": "layer",
    "mean_effect_all": "mean effect, all patches (Δ reward)",
    "mean_effect_in_distribution": "mean effect, in-distribution patches (Δ reward)",
    "n_flagged": "patches flagged",
    "frac_flagged": "share flagged",
    "threshold": "flag threshold (score)",
    "median_score": "median divergence score",
    "sensitivity": "sensitivity (Δ reward per unit)",
    "sensitivity_assumed": "sensitivity assumed (worst case)",
    "push_share": "push share (of the gradient's reward gain)",
    "effective_energy": "evaluation energy (Δ reward²)",
    "effective_pairs": "pairs' worth of evaluation",
    "coverage_share": "coverage share (of the evaluation)",
    "coverage_share_ci_low": "coverage share, 95% CI low",
    "coverage_share_ci_high": "coverage share, 95% CI high",
    "coverage_ratio": "coverage / push",
    "deficit": "deficit (push − coverage)",
    "under_covered": "under-covered",
    "direct": "direct (Δ reward)",
    "total": "total (Δ reward)",
    "gap": "total − direct (Δ reward)",
    "share_norm": "share: final norm",
}


def labelled(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with its columns named for readers (units in brackets); `share_via_Lk`: 'share: layer k'."""
    names = {c: COLUMN_LABELS.get(c, c) for c in frame.columns}
    for c in frame.columns:
        if c.startswith("share_via_L"):
            names[c] = f"share: layer {c[len('share_via_L') :]} re-reading"
    return frame.rename(columns=names)


SECTION_GUIDES: Dict[str, str] = {
    "divergence": "A patch can put activations where the model never goes on real inputs; its effect then "
    "says little about the model. Each patch gets a divergence score (its distance from the clean runs' "
    "activations) and is flagged above the threshold calibrated on clean swaps; compare the mean effect over "
    "all patches with the one over in-distribution patches: where they differ, read the second.",
    "probes": "Each probe takes items with and without one property (e.g. filler sentences for length) and "
    "measures Δ reward = reward(with) − reward(without). Read the effect with its 95% interval: a verdict "
    "other than neutral means the interval excludes 0.",
    "cascades": "Probe dimensions whose per-item effects move together across items are clustered: a "
    "cluster is a set of biases that one direction in the model may carry, so fixing one may move the "
    "others. Read the dendrogram from the bottom: dimensions joined low are strongly correlated.",
    "distortion": "The push share is how much of a gradient step's reward gain lands on each dimension; the "
    "coverage share is how much of the probes' evaluation looks at it. A dimension pushed more than it is "
    "covered (coverage / push below 0.5) is under-covered: an optimiser can move the reward along it "
    "without the evaluation noticing.",
    "faithfulness": "ρ is the Spearman rank correlation over components between |exact attribution| and "
    "the noising patch effect: 1 means attribution orders the components exactly as patching does.",
}


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def probe_findings(probes: Dict[str, dict], alpha: float) -> List[str]:
    out = []
    found = sorted(
        ((d, v) for d, v in probes.items() if v["verdict"] in ("rewards", "penalizes")),
        key=lambda dv: -abs(_num(dv[1]["effect"])),
    )
    for dim, v in found:
        verb = "rewards" if v["verdict"] == "rewards" else "penalises"
        out.append(
            f"The model {verb} {dim}: adding it moves the reward by {_num(v['effect']):+.3f} on average "
            f"(95% CI [{_num(v['ci_low']):+.3f}, {_num(v['ci_high']):+.3f}], {p_text(v['p_value'])}, "
            f"{v['n']} items; {abs(_num(v['cohens_d'])):.1f} standard deviations of the per-item change)."
        )
    neutral = [d for d, v in probes.items() if v["verdict"] == "neutral"]
    if neutral:
        out.append(
            f"No clear effect of {', '.join(neutral)} (each 95% interval includes 0 or p ≥ {alpha:g})."
        )
    return out


def findings(record: Dict[str, Any]) -> List[str]:
    """The report's first lines: the audit's finding, in plain words, each with its size and certainty."""
    s = record
    out = [
        f"On {s['n_pairs']} preference pairs the model prefers the chosen response in "
        f"{_num(s['pair_accuracy']):.1%} of them (mean reward gap {_num(s['mean_reward_gap']):+.3f})."
    ]
    out += probe_findings(s["probes"], _num(s.get("probe_alpha", 0.05)))
    f = s["faithfulness"]
    rho, (lo, hi) = _num(f["mean_rho"]), (_num(v) for v in f["mean_rho_ci"])
    if math.isfinite(rho):
        agree = "rank the components differently" if rho < AGREEMENT_RHO else "largely agree"
        out.append(
            f"Attribution and patching {agree}: the rank correlation between each component's exact "
            f"attribution and its causal (noising) effect is ρ = {rho:.2f} per pair (95% CI [{lo:.2f}, "
            f"{hi:.2f}]; 1 would be the same order), so the components that write the reward are not "
            "simply the ones that cause it."
            if rho < AGREEMENT_RHO
            else f"Attribution and patching {agree}: ρ = {rho:.2f} per pair (95% CI [{lo:.2f}, {hi:.2f}])."
        )
    d = s.get("divergence")
    if d and d.get("n_patches"):
        out.append(
            f"{_num(d['frac_flagged']):.1%} of the patches ({d['n_flagged']} of {d['n_patches']}) move "
            "activations out of the distribution of clean runs; their effects are set apart below."
        )
    depth = _num(s["crystallization_depth"]["normed"]["median"])
    if math.isfinite(depth):
        out.append(
            f"The preference forms at {depth:.0%} of the model's depth (median over pairs, normed reward "
            "lens): from there on the reward read from the residual stays within 10% of its final value."
        )
    return out


def p_text(p: Any) -> str:
    """'p = 0.012', or 'p < 0.001' below what the test's resolution supports."""
    p = _num(p)
    return "p < 0.001" if p < 0.001 else f"p = {p:.2g}"
