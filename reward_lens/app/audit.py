"""The main job: audit one reward model on preference pairs and write a report.

Pipeline: pair accuracy -> reward lens + crystallization depth -> exact attribution -> contrastive
readout patching (noising, denoising, zero and mean ablation; KV fast path) -> faithfulness gap
(attribution vs patching, Spearman rho with CI) -> divergence-aware patching -> hacking probes ->
distortion index and misalignment cascades -> for ArmoRM, the gate, per-objective view and conflicts.

Outputs in `out_dir`: report.html (self-contained), results.json (machine-readable), tidy CSVs.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch

from reward_lens.data.pairs import PreferencePair, as_pairs

PATCH_MODES = ("noising", "denoising", "zero", "mean")


@dataclass
class AuditResult:
    """Everything the audit computed; `summary` is what results.json holds."""

    summary: Dict[str, Any]
    frames: Dict[str, pd.DataFrame] = field(default_factory=dict)
    results: Dict[str, Any] = field(default_factory=dict)
    out_dir: Optional[Path] = None

    def to_frame(self) -> pd.DataFrame:
        """The headline numbers as one (metric, value) table."""
        rows = [(k, v) for k, v in _flatten(self.summary).items() if not isinstance(v, (list, dict))]
        return pd.DataFrame(rows, columns=["metric", "value"])


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _jsonable(x.detach().cpu().tolist())
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        return None if math.isnan(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


class _Steps:
    """Runs named steps, timing each and echoing progress lines."""

    def __init__(self, echo: Callable[[str], None]):
        self.echo = echo
        self.timings: Dict[str, float] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        self.echo(f"[reward-lens] {name} ...")
        start = time.perf_counter()
        out = fn()
        self.timings[name] = round(time.perf_counter() - start, 3)
        return out


def is_armorm(model) -> bool:
    return bool(model.reward_head.n_objectives)


def run_audit(
    model,
    pairs: Union[str, Path, Sequence[PreferencePair]],
    out_dir: Union[str, Path, None] = "reward-lens-report",
    *,
    max_pairs: Optional[int] = None,
    batch_size: int = 8,
    probe_items: Any = None,
    model_label: str = "",
    echo: Callable[[str], None] = print,
) -> AuditResult:
    """Run the whole audit; write report.html, results.json and CSVs into `out_dir` (None: write nothing)."""
    from reward_lens import instruments as ins
    from reward_lens.probes.suite import run_probes
    from reward_lens.theory import detect_cascades
    from reward_lens.theory.distortion import distortion_from_model

    pairs = as_pairs(pairs)
    if max_pairs is not None:
        if max_pairs < 1:
            raise ValueError(f"--max-pairs must be >= 1, got {max_pairs}")
        pairs = pairs[:max_pairs]
    step = _Steps(echo)
    t0 = time.perf_counter()
    summary: Dict[str, Any] = {
        "model": model_label or model.cfg.model_name, "architecture": model.cfg.original_architecture,
        "n_layers": model.cfg.n_layers, "d_model": model.cfg.d_model, "n_pairs": len(pairs),
        "head": model.cfg.head_type, "dtype": str(model.cfg.dtype).replace("torch.", ""), "device": str(model.cfg.device),
    }
    results: Dict[str, Any] = {}

    lens_res = results["lens"] = step("reward lens", lambda: ins.lens(model, pairs, batch_size=batch_size))
    gap = lens_res.reward_chosen - lens_res.reward_rejected
    summary["pair_accuracy"] = float((gap > 0).float().mean())
    summary["mean_reward_gap"] = float(gap.mean())
    depth = {}
    for variant in ("normed", "frozen"):
        d = lens_res.crystallization_depth(variant).numpy()
        depth[variant] = {"mean": float(np.nanmean(d)), "median": float(np.nanmedian(d)),
                          "std": float(np.nanstd(d)), "per_pair": d.tolist()}
    summary["crystallization_depth"] = depth
    summary["crystallization_rule"] = ("first fractional depth from which the lens gap stays within 10% of the final "
                                       "gap with the final gap's sign (LensResult.crystallization_depth)")

    attr = results["attribution"] = step("exact attribution", lambda: ins.attribute(model, pairs, batch_size=batch_size))
    summary["attribution_max_relative_error"] = float(attr.max_relative_error())

    patch_res = results["patching"] = step(
        "contrastive patching (noising, denoising, zero, mean; fast path)",
        lambda: ins.patch(model, pairs, mode=list(PATCH_MODES), level="component", batch_size=batch_size))

    faith = results["faithfulness"] = step("faithfulness gap", lambda: ins.faithfulness(attr, patch_res, mode="noising"))
    summary["faithfulness"] = {
        "mode": "noising", "mean_rho": faith.mean_rho, "mean_rho_ci": list(faith.mean_rho_ci),
        "pooled_rho": faith.pooled_rho, "pooled_rho_ci": list(faith.pooled_rho_ci),
    }
    if len(pairs) >= 2:
        div = results["divergence"] = step("divergence-aware patching",
                                           lambda: ins.divergence_patch(model, pairs, batch_size=batch_size))
        summary["divergence"] = _jsonable(div.summary().iloc[0].to_dict())

    probes = results["probes"] = step("hacking probes", lambda: run_probes(model, items=probe_items,
                                                                           batch_size=batch_size))
    summary["probes"] = probes.to_dict()["dimensions"]
    summary["probe_verdict_rule"] = probes.to_dict()["verdict_rule"]
    casc = results["cascades"] = step("misalignment cascades", lambda: detect_cascades(probes))
    summary["cascades"] = {"clusters": _jsonable(getattr(casc, "clusters", None))}
    try:
        dist = results["distortion"] = step("distortion index", lambda: distortion_from_model(
            model, pairs, probes, batch_size=batch_size))
        summary["distortion"] = _jsonable(dist.to_frame().to_dict("records"))
    except ValueError as exc:  # e.g. too few pairs per subset: reported, the rest of the audit stands
        summary["distortion"] = {"skipped": str(exc)}

    if is_armorm(model):
        from reward_lens.theory import reward_conflicts

        results["armorm"] = step("ArmoRM gate and objectives", lambda: _armorm_view(model, pairs, batch_size))
        summary["armorm"] = results["armorm"]["summary"]
        conf = results["conflicts"] = step("reward-term conflicts", lambda: reward_conflicts(model, pairs,
                                                                                             batch_size=batch_size))
        summary["conflicts"] = _jsonable(conf.to_frame().to_dict("records"))

    summary["timings_s"] = step.timings
    summary["total_time_s"] = round(time.perf_counter() - t0, 3)
    frames = {
        "lens": lens_res.to_frame(), "attribution": attr.to_frame(), "patching": patch_res.to_frame(),
        "faithfulness": faith.to_frame(), "probes": probes.to_frame(), "probe_items": probes.per_item,
    }
    if "divergence" in results:
        frames["divergence"] = results["divergence"].to_frame()
    if "armorm" in results:
        frames["armorm_objectives"] = results["armorm"]["frame"]
    audit = AuditResult(summary=_jsonable(summary), frames=frames, results=results)
    if out_dir is not None:
        write_outputs(audit, Path(out_dir), echo)
    return audit


@torch.no_grad()
def _armorm_view(model, pairs: Sequence[PreferencePair], batch_size: int) -> Dict[str, Any]:
    """Gate weights per pair and each objective's reward for chosen and rejected."""
    from reward_lens.core.readout import readout_run

    names = ["reward_head.hook_gate", "reward_head.hook_pooled"]
    prompts = [p.prompt for p in pairs]
    chosen = readout_run(model, prompts, [p.chosen for p in pairs], names, batch_size=batch_size)
    rejected = readout_run(model, prompts, [p.rejected for p in pairs], names, batch_size=batch_size)
    objectives = list(model.reward_head.objective_names or
                      [f"objective_{j}" for j in range(chosen.acts["reward_head.hook_pooled"].shape[-1])])
    oc, orr = chosen.acts["reward_head.hook_pooled"], rejected.acts["reward_head.hook_pooled"]
    gate = chosen.acts["reward_head.hook_gate"]
    frame = pd.DataFrame({
        "objective": objectives,
        "mean_gate": gate.mean(0).cpu().numpy(),
        "pair_accuracy": (oc > orr).float().mean(0).cpu().numpy(),
        "mean_gap": (oc - orr).mean(0).cpu().numpy(),
    })
    return {"frame": frame, "summary": _jsonable({"objectives": frame.to_dict("records")})}


def write_outputs(audit: AuditResult, out_dir: Path, echo: Callable[[str], None] = print) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(audit.summary, indent=1))
    for name, frame in audit.frames.items():
        frame.to_csv(out_dir / f"{name}.csv", index=False)
    build_report(audit).save(out_dir / "report.html")
    audit.out_dir = out_dir
    echo(summary_table(audit))
    echo(f"[reward-lens] wrote {out_dir / 'report.html'}, results.json and {len(audit.frames)} CSV files")


def summary_table(audit: AuditResult) -> str:
    s = audit.summary
    lines = [
        f"model            {s['model']} ({s['architecture']}, {s['n_layers']} layers, d_model {s['d_model']})",
        f"pairs            {s['n_pairs']}",
        f"pair accuracy    {s['pair_accuracy']:.3f}   mean reward gap {s['mean_reward_gap']:+.4f}",
        "crystallization  normed lens: mean depth {mean:.2f} (median {median:.2f})".format(
            **s["crystallization_depth"]["normed"]),
        "faithfulness     Spearman rho(|attribution|, noising effect): mean {m:+.3f} [{l:+.3f}, {h:+.3f}], pooled {p:+.3f}".format(
            m=s["faithfulness"]["mean_rho"], l=s["faithfulness"]["mean_rho_ci"][0],
            h=s["faithfulness"]["mean_rho_ci"][1], p=s["faithfulness"]["pooled_rho"]),
        *[f"{'hacking probes' if i == 0 else '':16} {dim:<12} {v['verdict']:<10} effect {v['effect']:+.4f} "
          f"[{v['ci_low']:+.4f}, {v['ci_high']:+.4f}]" for i, (dim, v) in enumerate(s["probes"].items())],
        f"total time       {s['total_time_s']:.1f} s",
    ]
    width = max(len(line) for line in lines)
    return "\n".join(["-" * width, *lines, "-" * width])


def headline_frame(audit: AuditResult) -> pd.DataFrame:
    """The few numbers a reader needs first, as (metric, value) rows of text."""
    s = audit.summary
    f = s["faithfulness"]
    rows = [
        ("model", f"{s['model']} ({s['architecture']}, {s['n_layers']} layers, d_model {s['d_model']}, {s['dtype']})"),
        ("preference pairs", str(s["n_pairs"])),
        ("pair accuracy (chosen > rejected)", f"{s['pair_accuracy']:.3f}"),
        ("mean reward gap", f"{s['mean_reward_gap']:+.4f}"),
        ("crystallization depth, normed lens (mean / median)",
         "{mean:.2f} / {median:.2f}".format(**s["crystallization_depth"]["normed"])),
        ("crystallization depth, frozen-scale lens (mean / median)",
         "{mean:.2f} / {median:.2f}".format(**s["crystallization_depth"]["frozen"])),
        ("attribution sum rule, max relative error", f"{s['attribution_max_relative_error']:.1e}"),
        ("faithfulness: Spearman rho(|attribution|, noising effect), mean per pair",
         f"{f['mean_rho']:+.3f} [{f['mean_rho_ci'][0]:+.3f}, {f['mean_rho_ci'][1]:+.3f}]"),
        ("faithfulness: pooled rho", f"{f['pooled_rho']:+.3f} [{f['pooled_rho_ci'][0]:+.3f}, {f['pooled_rho_ci'][1]:+.3f}]"),
    ]
    if "divergence" in s:
        rows.append(("patches flagged out of distribution", f"{s['divergence'].get('frac_flagged', float('nan')):.1%}"))
    for dim, v in s["probes"].items():
        rows.append((f"probe: {dim}", f"{v['verdict']} ({v['effect']:+.4f}, 95% CI [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}])"))
    rows.append(("total time", f"{s['total_time_s']:.1f} s"))
    return pd.DataFrame(rows, columns=["metric", "value"])


def build_report(audit: AuditResult):
    from reward_lens.app.report import Report

    s, r = audit.summary, audit.results
    rep = Report(f"reward-lens audit: {s['model']}")
    sec = rep.section("Summary")
    sec.table(headline_frame(audit))
    sec.text("Every number here is also in results.json; per-pair and per-component values are in the CSV files.",
             note=True)
    sec = rep.section("Reward lens")
    sec.text("The reward read from the residual stream after each layer at the readout position, chosen minus "
             "rejected. 'normed' recomputes the final norm on the intermediate residual (the logit-lens analogue); "
             "'frozen' freezes the final norm's scale at its real value, which is additive and ends at the reward.")
    sec.figure(r["lens"].plot())
    sec = rep.section("Exact attribution")
    sec.text(f"Direct attribution of the reward gap to embed, every attention and MLP output; the terms sum to the "
             f"gap minus the bias (max relative error {s['attribution_max_relative_error']:.1e}).")
    sec.figure(r["attribution"].plot())
    sec = rep.section("Contrastive activation patching")
    sec.text("Readout-position patches, effects normalised by the clean gap. noising: run chosen, patch in rejected's "
             "activation; denoising: run rejected, patch in chosen's; zero / mean: ablations.")
    sec.figure(r["patching"].plot())
    sec = rep.section("Faithfulness gap: attribution vs patching")
    sec.text("Spearman rank correlation between |attribution| and the noising patch effect over components, per "
             "pair and pooled. Observational attribution need not predict causal effects; both views are shown.")
    sec.table(r["faithfulness"].summary())
    sec.figure(r["faithfulness"].plot())
    if "divergence" in r:
        sec = rep.section("Divergence-aware patching")
        sec.table(r["divergence"].summary())
        sec.figure(r["divergence"].plot())
    sec = rep.section("Hacking probes")
    sec.text(s["probe_verdict_rule"])
    sec.table(r["probes"].to_frame())
    sec.figure(r["probes"].plot())
    sec = rep.section("Misalignment cascades")
    sec.figure(r["cascades"].plot())
    if "distortion" in r:
        sec = rep.section("Distortion index")
        sec.table(r["distortion"].to_frame())
        sec.figure(r["distortion"].plot())
    if "armorm" in r:
        sec = rep.section("ArmoRM: gate and objectives")
        sec.table(r["armorm"]["frame"])
        sec = rep.section("Reward-term conflicts")
        sec.figure(r["conflicts"].plot())
    return rep
