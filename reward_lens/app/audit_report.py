"""The audit's report: the summary the CLI prints, the headline table, and report.html's sections, from an
`AuditResult` (`reward_lens.app.audit`)."""

from __future__ import annotations

import math
from typing import Any, Optional

import pandas as pd

from reward_lens.app.benchmark import benchmark_section
from reward_lens.app.findings import SECTION_GUIDES, findings, labelled
from reward_lens.app.head_family import head_family_text
from reward_lens.app.report import Report


def fmt(value: Any, spec: str = "+.3f", missing: str = "n/a") -> str:
    """`value` formatted, or `missing` for None / NaN (a tie's ratio, a CI over too few pairs)."""
    try:
        return missing if value is None or not math.isfinite(float(value)) else format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def fmt_ci(low: Any, high: Any, spec: str = "+.3f", n: Optional[int] = None) -> str:
    if fmt(low) == "n/a" or fmt(high) == "n/a":
        return "CI not available" + (f" (n={n})" if n is not None else "")
    return f"[{fmt(low, spec)}, {fmt(high, spec)}]"


def summary_table(audit: Any) -> str:
    s = audit.record
    lines = [
        f"model            {s['model']} ({s['architecture']}, {s['n_layers']} layers, d_model "
        f"{s['d_model']})",
        f"pairs            {s['n_pairs']}",
        f"pair accuracy    {fmt(s['pair_accuracy'], '.3f')}   mean reward gap "
        f"{fmt(s['mean_reward_gap'], '+.4f')}"
        + (f"   ({s['n_ties']} tied pairs)" if s.get("n_ties") else ""),
        "crystallization  normed lens: mean depth {} (median {})".format(
            fmt(s["crystallization_depth"]["normed"]["mean"], ".2f"),
            fmt(s["crystallization_depth"]["normed"]["median"], ".2f"),
        ),
        "faithfulness     Spearman rho(|attribution|, noising effect): mean {} {}, pooled {}".format(
            fmt(s["faithfulness"]["mean_rho"]),
            fmt_ci(*s["faithfulness"]["mean_rho_ci"], n=s["n_pairs"]),
            fmt(s["faithfulness"]["pooled_rho"]),
        ),
        *[
            f"{'hacking probes' if i == 0 else '':16} {dim:<12} {v['verdict']:<10} effect "
            f"{fmt(v['effect'], '+.4f')} {fmt_ci(v['ci_low'], v['ci_high'], '+.4f')}"
            for i, (dim, v) in enumerate(s["probes"].items())
        ],
        *(
            [
                f"benchmark        {s['benchmark']['name']}: {fmt(s['benchmark']['accuracy'], '.3f')} "
                "(official rule)"
            ]
            if "benchmark" in s
            else []
        ),
        f"total time       {s['total_time_s']:.1f} s",
    ]
    width = max(len(line) for line in lines)
    return "\n".join(["-" * width, *lines, "-" * width])


def headline_frame(audit: Any) -> pd.DataFrame:
    """The few numbers a reader needs first, as (metric, value) rows of text."""
    s = audit.record
    f = s["faithfulness"]
    rows = [
        (
            "model",
            f"{s['model']} ({s['architecture']}, {s['n_layers']} layers, d_model {s['d_model']}, "
            f"{s['dtype']})",
        ),
        ("preference pairs", str(s["n_pairs"])),
        ("pair accuracy (chosen > rejected)", fmt(s["pair_accuracy"], ".3f")),
        ("tied pairs (chosen == rejected; their normalised effects are NaN)", str(s.get("n_ties", 0))),
        ("mean reward gap", fmt(s["mean_reward_gap"], "+.4f")),
        *[
            (
                f"crystallization depth, {name} (mean / median)",
                f"{fmt(s['crystallization_depth'][key]['mean'], '.2f')} / "
                f"{fmt(s['crystallization_depth'][key]['median'], '.2f')}",
            )
            for key, name in (("normed", "normed lens"), ("frozen", "frozen-scale lens"))
        ],
        ("attribution sum rule, max relative error", fmt(s["attribution_max_relative_error"], ".1e")),
        (
            "faithfulness: Spearman rho(|attribution|, noising effect), mean per pair",
            f"{fmt(f['mean_rho'])} {fmt_ci(*f['mean_rho_ci'], n=s['n_pairs'])}",
        ),
        ("faithfulness: pooled rho", f"{fmt(f['pooled_rho'])} {fmt_ci(*f['pooled_rho_ci'], n=s['n_pairs'])}"),
    ]
    if "divergence" in s:
        d = s["divergence"]
        rows.append(
            (
                "patches flagged out of distribution (all sites)",
                f"{fmt(d.get('frac_flagged'), '.1%')} ({d.get('n_flagged')} of {d.get('n_patches')})",
            )
        )
    for dim, v in s["probes"].items():
        rows.append(
            (
                f"probe: {dim}",
                f"{v['verdict']} ({fmt(v['effect'], '+.4f')}, 95% CI "
                f"{fmt_ci(v['ci_low'], v['ci_high'], '+.4f')})",
            )
        )
    if "benchmark" in s:
        rows.append(
            (f"benchmark {s['benchmark']['name']} (official rule)", fmt(s["benchmark"]["accuracy"], ".3f"))
        )
    rows.append(("total time", f"{s['total_time_s']:.1f} s"))
    return pd.DataFrame(rows, columns=["metric", "value"])


READOUT_DEFINITION = (
    "These patches are at the readout token (positions='readout', defined for chosen and rejected of any "
    "lengths): a preference computed at earlier tokens and read through attention shows only where it "
    "reaches the readout; path_patch / edge_attribution with positions='all' see it on token-aligned pairs "
    "(docs/theory.md, 'Every position')."
)


def build_report(audit: Any):
    s, r = audit.record, audit.results
    rep = Report(f"reward-lens audit: {s['model']}")
    sec = rep.section("What the audit found")
    sec.bullets(findings(s), cls="findings")
    sec = rep.section("Summary")
    sec.explain("The headline numbers behind the findings above, each defined in its section below.")
    sec.table(headline_frame(audit))
    sec.text(
        "Every number here is also in results.json; per-pair and per-component values are in the CSV files.",
        note=True,
    )
    if "benchmark" in r:
        benchmark_section(rep, s["benchmark"], audit.frames, r["benchmark"].plot())
    if "head_family" in r:
        sec = rep.section("Reward head")
        sec.text(head_family_text(s["head_family"]))
        if r["head_family"]["frame"] is not None:
            sec.table(r["head_family"]["frame"])
    sec = rep.section("Reward lens")
    sec.text(
        "The reward read from the residual stream after each layer at the readout position, chosen minus "
        "rejected. 'normed' recomputes the final norm on the intermediate residual (the logit-lens "
        "analogue); 'frozen' freezes the final norm's scale at its real value, which is additive and "
        "ends at the reward."
    )
    sec.figure(r["lens"].plot())
    sec = rep.section("Exact attribution")
    sec.text(
        "Direct attribution of the reward gap to embed, every attention and MLP output; the terms sum to "
        f"the gap minus the bias (max relative error {fmt(s['attribution_max_relative_error'], '.1e')})."
    )
    sec.figure(r["attribution"].plot())
    if "tokens" in r:
        sec = rep.section("Which tokens the reward reads")
        sec.text(
            "Exact token-level attribution of the pairs with the largest reward gaps: each token's "
            "direct read into the readout through every attention head (the terms, with the MLP and "
            "embedding terms at the readout, sum to the reward; max relative error "
            f"{r['tokens'].max_relative_error():.1e})."
        )
        sec.html(r["tokens"].html())
    patching_section(rep, r["patching"])
    sec = rep.section("Faithfulness gap: attribution vs patching")
    sec.text(
        "Spearman rank correlation between |attribution| and the noising patch effect over components, "
        "per pair and pooled. Observational attribution need not predict causal effects; both views are "
        "shown."
    )
    sec.explain(SECTION_GUIDES["faithfulness"])
    sec.table(labelled(r["faithfulness"].summary()))
    sec.figure(r["faithfulness"].plot())
    if "disagreement" in r:
        d = s["disagreement"]
        sec = rep.section("Why attribution and patching disagree")
        sec.text(
            "Each component's noising effect split exactly into direct (the final residual alone, the "
            "final norm's scale frozen: what attribution sees), norm (that scale responding) and "
            "via_L{k} (layer k re-reading the patch, later layers frozen); the terms sum to the "
            "patching effect. Shares of total - direct for the components where it is largest. Spearman "
            f"rho(|direct|, |total|) {fmt(d['direct_total_rho'])}; faithfulness rho "
            f"{fmt(d['faithfulness_mean_rho'])}. {READOUT_DEFINITION}"
        )
        sec.table(labelled(r["disagreement"].disagreement()))
        sec.figure(r["disagreement"].plot())
    if "divergence" in r:
        div = r["divergence"]
        guided_section(rep, "Divergence-aware patching", "divergence", div, div.summary())
    behaviour_sections(rep, s, r)
    return rep


def patching_section(rep: Report, res) -> None:
    """Contrastive patching: what each mode computed means, one panel per mode."""
    modes = res.modes
    sec = rep.section("Contrastive activation patching")
    sec.text(
        "Readout-position patches, one panel per mode, effects normalised by the clean gap. noising: run "
        "chosen, patch in rejected's activation (-1: the component carries the whole preference); "
        "denoising: run rejected, patch in chosen's (+1: the component alone restores it)"
        + (
            "; zero / mean: the component's output set to 0 / to its mean over the pairs, in both responses."
            if {"zero", "mean"} & set(modes)
            else ". Zero and mean ablation run with --patch-modes noising,denoising,zero,mean."
        )
    )
    sec.figure(patching_figure(res))


def patching_figure(res):
    """One panel per patching mode computed (the component level's attn/MLP x layer map of each)."""
    from reward_lens.plotting import panels

    modes = res.modes
    fig, axes = panels(None, len(modes), (5.5 * len(modes), 3.6))
    for ax, mode in zip(axes, modes):
        res.plot(mode=mode, ax=ax)
    fig.tight_layout()
    return fig


def guided_section(
    rep: Report, title: str, guide: str, result: Any, table: Optional[pd.DataFrame] = None
) -> None:
    """A section of one result: its guide (`SECTION_GUIDES[guide]`), `table` labelled, and its plot."""
    sec = rep.section(title)
    sec.explain(SECTION_GUIDES[guide])
    if table is not None:
        sec.table(labelled(table))
    sec.figure(result.plot())


def behaviour_sections(rep: Report, s: dict, r: dict) -> None:
    """The report's sections on behaviour: hacking probes, cascades, distortion, ArmoRM's objectives."""
    sec = rep.section("Hacking probes")
    sec.explain(SECTION_GUIDES["probes"])
    sec.text(s["probe_verdict_rule"], note=True)
    sec.table(labelled(r["probes"].to_frame()))
    sec.figure(r["probes"].plot())
    guided_section(rep, "Misalignment cascades", "cascades", r["cascades"])
    if "distortion" in r:
        dist = r["distortion"]
        guided_section(rep, "Distortion index", "distortion", dist, dist.to_frame())
    if "armorm" in r:
        sec = rep.section("ArmoRM: gate and objectives")
        sec.table(r["armorm"]["frame"])
        sec = rep.section("Reward-term conflicts")
        sec.figure(r["conflicts"].plot())
