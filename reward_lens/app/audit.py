"""The main job: audit one reward model on preference pairs and write a report.

Pipeline: pair accuracy -> reward lens + crystallization depth -> exact attribution -> contrastive
readout patching (noising and denoising by default; zero and mean ablation on request; KV fast path) ->
faithfulness gap
(attribution vs patching, Spearman rho with CI) -> divergence-aware patching -> hacking probes ->
distortion index and misalignment cascades -> for ArmoRM, the gate, per-objective view and conflicts.

Outputs in `out_dir`: report.html (self-contained), results.json (machine-readable), tidy CSVs.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch

from reward_lens import distributed as dist
from reward_lens import instruments as ins
from reward_lens.app.audit_report import build_report, headline_frame, summary_table
from reward_lens.app.benchmark import benchmark_outputs
from reward_lens.app.head_family import DirectionsSpec, head_family_view
from reward_lens.app.options import PATCH_MODE_NAMES, canonical_patch_modes
from reward_lens.app.output import (
    ReportDir,
    check_finite_columns,
    clean_json,
    provenance,
    write_csv,
    write_json,
)
from reward_lens.core.autobatch import BatchSize
from reward_lens.core.readout import readout_run
from reward_lens.data.pairs import Pairs, PreferencePair, as_pairs
from reward_lens.data.validate import tie_indices
from reward_lens.instruments.tokens import supports_token_attribution, token_attribution
from reward_lens.model.frozen import with_frozen_weights
from reward_lens.model.tokenization import model_input_format
from reward_lens.model.truncation import one_truncation_warning
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import finish, panels
from reward_lens.probes.suite import run_probes
from reward_lens.theory import detect_cascades, reward_conflicts
from reward_lens.theory.distortion_model import StatesSpec, distortion_from_model

PATCH_MODES = PATCH_MODE_NAMES
# The default: both contrastive directions. Zero and mean ablation are asked for (`patch_modes`): each
# patches both responses, one readout sweep per response, ~0.3 bare forwards apiece on SmolLM2.
DEFAULT_PATCH_MODES = ("noising", "denoising")
TOKEN_PAIRS = 3  # pairs with the largest |reward gap| whose token heatmaps the report shows


@dataclass
class AuditResult:
    """Everything the audit computed: `record` is what results.json holds (nested dict), `frames` the CSVs,
    `results` each instrument's result object."""

    record: Dict[str, Any]
    frames: Dict[str, pd.DataFrame] = field(default_factory=dict)
    results: Dict[str, Any] = field(default_factory=dict)
    out_dir: Optional[Path] = None

    def to_frame(self) -> pd.DataFrame:
        """Every scalar of the record as one (metric, value) table (nested keys joined by dots)."""
        rows = [(k, v) for k, v in _flatten(self.record).items() if not isinstance(v, (list, dict))]
        return pd.DataFrame(rows, columns=["metric", "value"])

    def summary(self) -> pd.DataFrame:
        """The few numbers a reader needs first, as (metric, value) rows of text (the report's Summary
        table)."""
        return headline_frame(self)

    def summary_text(self) -> str:
        """The summary the CLI prints."""
        return summary_table(self)

    def plot(self, ax=None):
        """Three panels: the reward lens, the exact attribution of the gap, the hacking probes.
        `ax`: three Axes (or one, split in three)."""
        created = ax is None
        fig, axes = panels(ax, 3, (18, 4.2))
        for a, key in zip(axes, ("lens", "attribution", "probes")):
            self.results[key].plot(ax=a)
        return finish(fig, created)


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
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


class _Steps:
    """Runs named steps, timing each and echoing progress lines (`verbose`: each step's time too);
    `progress`: the label of a step's tqdm bar, or False for none."""

    def __init__(self, echo: Callable[[str], None], progress: bool = False, verbose: bool = False):
        self.echo = echo
        self.show_bars = progress
        self.verbose = verbose
        self.timings: Dict[str, float] = {}

    def progress(self, label: str):
        return label if self.show_bars else False

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        self.echo(f"[reward-lens] {name} ...")
        start = time.perf_counter()
        out = fn()
        self.timings[name] = round(time.perf_counter() - start, 3)
        if self.verbose:
            self.echo(f"[reward-lens]   {self.timings[name]:.2f} s")
        return out


def is_armorm(model) -> bool:
    return bool(model.reward_head.n_objectives)


def input_format_name(model) -> str:
    """The format the pairs were tokenised in ("auto" resolved as `to_tokens` resolves it)."""
    return model_input_format(model)


@checked_arguments(counts={"max_pairs": 1}, flags=("progress", "verbose"))
@one_truncation_warning()  # the steps tokenise the same pairs again and again: one warning for the audit
@with_frozen_weights
def run_audit(
    model,
    pairs: Union[str, Path, Sequence[PreferencePair]],
    out_dir: Union[str, Path, None] = "reward-lens-report",
    *,
    max_pairs: Optional[int] = None,
    batch_size: Union[int, str, BatchSize] = 8,
    probe_items: Any = None,
    model_label: str = "",
    echo: Callable[[str], None] = print,
    run_info: Optional[Dict[str, Any]] = None,
    ranks: Optional[dist.Ranks] = None,
    benchmark: Any = None,
    progress: bool = False,
    verbose: bool = False,
    patch_modes: Sequence[str] = DEFAULT_PATCH_MODES,
) -> Optional[AuditResult]:
    """Run the whole audit; write report.html, results.json and CSVs into `out_dir` (None: write nothing).

    `out_dir` is checked (and locked) before any work and the report is swapped in whole at the end
    (`reward_lens.app.output.ReportDir`); `run_info` (pairs file, options) goes into results.json.
    `batch_size`: an int, or "auto" (halve on out-of-memory). Under torchrun (`ranks`, default: the joined
    process group) the pair-level instruments are sharded over ranks (`reward_lens.distributed`); rank 0
    computes everything else on the merged results and writes the report; the other ranks return None.
    `benchmark`: a `BenchmarkResult` of the file the pairs came from: its summary goes into the report and
    results.json (for RM-Bench with the hard-subset misses and their largest attribution terms).
    `echo` gets the progress lines; `progress`: tqdm bars (stderr) on the long steps; `verbose`: each step's
    time echoed. The summary is `AuditResult.summary_text()` (the CLI prints it). `patch_modes`: the
    contrastive patching modes (default noising and denoising; "zero" and "mean" add the ablations; noising
    is always run: the faithfulness gap and the effect decomposition read it)."""
    ranks = ranks or dist.current()
    patch_modes = canonical_patch_modes(patch_modes)
    if not ranks.is_main:
        shard_worker(
            model, pairs, max_pairs=max_pairs, batch_size=batch_size, ranks=ranks, patch_modes=patch_modes
        )
        return None
    report_dir = (
        None if out_dir is None else (out_dir if isinstance(out_dir, ReportDir) else ReportDir(out_dir))
    )
    if run_info is None:
        run_info = provenance(
            pairs if isinstance(pairs, (str, Path)) else None,
            {
                "max_pairs": max_pairs,
                "batch_size": batch_size if isinstance(batch_size, int) else str(batch_size),
            },
        )
    with report_dir or contextlib.nullcontext():
        audit = _audit(
            model,
            pairs,
            max_pairs=max_pairs,
            batch_size=batch_size,
            probe_items=probe_items,
            model_label=model_label,
            echo=echo,
            ranks=ranks,
            step=_Steps(echo, progress, verbose),
            patch_modes=patch_modes,
        )
        audit.record = {**clean_json(run_info), **audit.record}
        if benchmark is not None:
            add_benchmark(audit, model, benchmark, batch_size if isinstance(batch_size, int) else 8, echo)
        if report_dir is not None:
            write_outputs(audit, report_dir, echo)
    return audit


def add_benchmark(
    audit: AuditResult, model, result: Any, batch_size: int, echo: Callable[[str], None]
) -> None:
    """The benchmark's summary (and RM-Bench's attributed style misses) into the record, CSVs and report."""
    echo(f"[reward-lens] benchmark {result.benchmark}: summary and misses ...")
    record, frames = benchmark_outputs(model, result, batch_size)
    audit.record["benchmark"] = _jsonable(record)
    audit.frames.update(frames)
    audit.results["benchmark"] = result


def _audit_pairs(pairs, max_pairs: Optional[int]) -> Pairs:
    """The audit's pairs, checked here once and passed down typed (`as_pairs` returns `Pairs` unchanged)."""
    pairs = as_pairs(pairs)
    if max_pairs is not None:
        if max_pairs < 1:
            raise ValueError(f"--max-pairs must be >= 1, got {max_pairs}")
        pairs = pairs[:max_pairs]
    return pairs


def shard_worker(
    model,
    pairs,
    *,
    max_pairs: Optional[int],
    batch_size,
    ranks: dist.Ranks,
    patch_modes: Sequence[str] = DEFAULT_PATCH_MODES,
) -> None:
    """What a rank other than 0 does in an audit: its shard of every pair-level step, in rank 0's order."""
    pairs = _audit_pairs(pairs, max_pairs)
    batch = BatchSize.parse(batch_size, model.cfg.device)
    sharded_steps(model, pairs, batch, ranks, _Steps(lambda _: None), canonical_patch_modes(patch_modes))


def sharded_steps(
    model,
    pairs,
    batch: BatchSize,
    ranks: dist.Ranks,
    step: "_Steps",
    patch_modes: Sequence[str] = DEFAULT_PATCH_MODES,
) -> Dict[str, Any]:
    """The pair-level instruments, called in this one order on every rank (a collective each under
    torchrun): rank 0 gets the results over all pairs, the other ranks None."""
    specs = [
        ins.LensSpec(),
        ins.AttributionSpec(),
        ins.PatchSpec(mode=list(patch_modes), level="component"),
        StatesSpec(),
    ]  # the distortion index's readout states
    label = f"reward lens, exact attribution, contrastive patching ({', '.join(patch_modes)}; fast path)"
    if len(pairs) >= 2:
        specs.append(ins.DivergenceSpec())
        label += ", divergence-aware patching"
    if model.has_readout_fast_path and not model.reward_head.is_gated:  # the readout recomputed alone
        specs.append(ins.EffectSpec("noising"))
        label += ", effect decomposition"
    if model.reward_head.is_gated:  # per-sequence directions: their spread, for the head-family view
        specs.append(DirectionsSpec())
    # one pipeline: the clean passes of every batch shared by the instruments
    bar = step.progress("audit: pair-level instruments")
    got = step(label, lambda: dist.run(model, pairs, specs, ranks=ranks, batch_size=batch, progress=bar))
    if got is None:
        return {}
    names = {
        "lens": "lens",
        "attribution": "attribution",
        "patching": "patch",
        "divergence": "divergence",
        "disagreement": "effect_decomposition",
        "readout_states": "readout_states",
        "directions": "directions",
    }
    return {key: got[name] for key, name in names.items() if name in got}


def _audit(
    model, pairs, *, max_pairs, batch_size, probe_items, model_label, echo, ranks, step, patch_modes
) -> AuditResult:
    """The audit's steps; `run_audit` checks the output first and writes it after."""
    pairs = _audit_pairs(pairs, max_pairs)
    batch = BatchSize.parse(batch_size, model.cfg.device, echo)
    t0 = time.perf_counter()
    record: Dict[str, Any] = {
        "model": model_label or model.cfg.model_name,
        "architecture": model.cfg.original_architecture,
        "n_layers": model.cfg.n_layers,
        "d_model": model.cfg.d_model,
        "n_pairs": len(pairs),
        "head": model.cfg.head_type,
        "dtype": str(model.cfg.dtype).replace("torch.", ""),
        "device": str(model.cfg.device),
        "n_ties": len(tie_indices(pairs)),
        "input_format": input_format_name(model),
        "world_size": ranks.world_size,
        "patch_modes": list(patch_modes),
    }
    results: Dict[str, Any] = sharded_steps(model, pairs, batch, ranks, step, patch_modes)
    if results.get("patching") is not None:
        check_finite_columns(
            results["patching"].to_frame(),
            ("clean_reward", "patched_reward", "effect"),
            "contrastive patching",
            model.cfg.dtype,
        )
    _instrument_steps(model, pairs, batch, step, record, results)
    _probe_steps(model, pairs, batch, probe_items, step, record, results)
    if is_armorm(model):
        _armorm_steps(model, pairs, batch, step, record, results)
    _head_family_step(model, pairs, batch, step, record, results)
    if batch.backoff:
        record["batch_size_used"] = batch.size
    record["timings_s"] = step.timings
    record["total_time_s"] = round(time.perf_counter() - t0, 3)
    return AuditResult(record=_jsonable(record), frames=_frames(results), results=results)


def _instrument_steps(
    model, pairs, batch: BatchSize, step: _Steps, record: Dict[str, Any], results: Dict[str, Any]
) -> None:
    """Record entries of the lens + crystallization, attribution, patching and divergence results (over all
    pairs, from `sharded_steps`); token heatmaps and the faithfulness gap, on the full set."""
    from reward_lens import instruments as ins

    lens_res = results["lens"]
    record["pair_accuracy"] = float((lens_res.reward_gap > 0).float().mean())
    record["mean_reward_gap"] = float(lens_res.reward_gap.mean())
    record["crystallization_depth"] = depth_summary(lens_res)
    record["crystallization_rule"] = (
        "first fractional depth from which the lens gap stays within 10% of the final gap with the final "
        "gap's sign (LensResult.crystallization_depth)"
    )
    attr, patch_res = results["attribution"], results["patching"]
    record["attribution_max_relative_error"] = float(attr.max_relative_error())
    results.update(_token_heatmaps(model, pairs, lens_res.reward_gap, step, batch))
    faith = results["faithfulness"] = step(
        "faithfulness gap", lambda: ins.faithfulness(attr, patch_res, mode="noising")
    )
    record["faithfulness"] = {
        "mode": "noising",
        "mean_rho": faith.mean_rho,
        "mean_rho_ci": list(faith.mean_rho_ci),
        "pooled_rho": faith.pooled_rho,
        "pooled_rho_ci": list(faith.pooled_rho_ci),
    }
    if "divergence" in results:
        record["divergence"] = divergence_summary(results["divergence"])
    if "disagreement" in results:
        record["disagreement"] = disagreement_summary(results["disagreement"], faith)


def disagreement_summary(dec, faith, top: int = 5) -> Dict[str, Any]:
    """The effect decomposition's headline: the components with the largest |total - direct| and the shares
    of that gap from the final norm and from each later layer; rho(|direct|, |total|) beside
    faithfulness's."""
    table = dec.disagreement(top)
    return {
        "direct_total_rho": dec.direct_total_rho(),
        "faithfulness_mean_rho": faith.mean_rho,
        "top": [
            {k: (v if k == "component" else float(v)) for k, v in row.items()}
            for row in table.to_dict("records")
        ],
    }


def _probe_steps(
    model,
    pairs,
    batch: BatchSize,
    probe_items: Any,
    step: _Steps,
    record: Dict[str, Any],
    results: Dict[str, Any],
) -> None:
    """Hacking probes, misalignment cascades and the distortion index."""

    probes = results["probes"] = step(
        "hacking probes",
        lambda: batch.run(
            lambda bs: run_probes(model, items=probe_items, batch_size=bs, progress=step.show_bars)
        ),
    )
    record["probes"] = probes.to_dict()["dimensions"]
    record["probe_verdict_rule"] = probes.to_dict()["verdict_rule"]
    casc = results["cascades"] = step("misalignment cascades", lambda: detect_cascades(probes))
    record["cascades"] = {"clusters": _jsonable(casc.clusters)}
    try:
        distortion = results["distortion"] = step(
            "distortion index",
            lambda: batch.run(
                lambda bs: distortion_from_model(
                    model, pairs, probes, batch_size=bs, states=results.get("readout_states")
                )
            ),
        )
        record["distortion"] = _jsonable(distortion.to_frame().to_dict("records"))
    except ValueError as exc:  # e.g. too few pairs per subset: reported, the rest of the audit stands
        record["distortion"] = {"skipped": str(exc)}


def _armorm_steps(
    model, pairs, batch: BatchSize, step: _Steps, record: Dict[str, Any], results: Dict[str, Any]
) -> None:
    """ArmoRM's gate and per-objective view, and the conflicts between its objectives (on rank 0)."""

    results["armorm"] = step(
        "ArmoRM gate and objectives", lambda: batch.run(lambda bs: _armorm_view(model, pairs, bs))
    )
    record["armorm"] = results["armorm"]["summary"]
    conf = results["conflicts"] = step(
        "reward-term conflicts", lambda: batch.run(lambda bs: reward_conflicts(model, pairs, batch_size=bs))
    )
    record["conflicts"] = _jsonable(conf.to_frame().to_dict("records"))


def _head_family_step(
    model, pairs, batch: BatchSize, step: _Steps, record: Dict[str, Any], results: Dict[str, Any]
) -> None:
    """The head family read, and the cosine spread of per-sequence directions (app/head_family.py)."""

    view = results["head_family"] = step(
        "head family",
        lambda: batch.run(lambda bs: head_family_view(model, pairs, bs, results.get("directions"))),
    )
    record["head_family"] = view["summary"]


def _frames(results: Dict[str, Any]) -> Dict[str, pd.DataFrame]:
    """The CSV files: name -> tidy frame."""
    frames = {
        "lens": results["lens"].to_frame(),
        "attribution": results["attribution"].to_frame(),
        "patching": results["patching"].to_frame(),
        "faithfulness": results["faithfulness"].to_frame(),
        "probes": results["probes"].to_frame(),
        "probe_items": results["probes"].per_item,
    }
    if "divergence" in results:
        frames["divergence"] = results["divergence"].to_frame()
    if "disagreement" in results:
        frames["effect_decomposition"] = results["disagreement"].to_frame()
    if "tokens" in results:
        frames["token_attribution"] = results["tokens"].token_totals()
    if "armorm" in results:
        frames["armorm_objectives"] = results["armorm"]["frame"]
    if results.get("head_family", {}).get("frame") is not None:
        frames["head_direction_cosines"] = results["head_family"]["frame"]
    return frames


def _token_heatmaps(model, pairs, gap: torch.Tensor, step: _Steps, batch: BatchSize) -> Dict[str, Any]:
    """{"tokens": TokenAttributionResult} of the pairs with the largest |reward gap| ({} on the generic
    path)."""
    if not supports_token_attribution(model):
        return {}
    top = pairs.take(torch.argsort(gap.abs(), descending=True)[:TOKEN_PAIRS].tolist())
    return {
        "tokens": step(
            "token attribution (largest gaps)",
            lambda: batch.run(lambda bs: token_attribution(model, top, batch_size=bs)),
        )
    }


def depth_summary(lens_res) -> Dict[str, Any]:
    """Crystallization depth per lens variant: mean, median, std over pairs and the per-pair values."""
    depth = {}
    for variant in ("normed", "frozen"):
        d = lens_res.crystallization_depth(variant).numpy()
        with warnings.catch_warnings():  # all pairs tied: every depth is NaN, and so are these (no warning)
            warnings.simplefilter("ignore", RuntimeWarning)
            depth[variant] = {
                "mean": float(np.nanmean(d)),
                "median": float(np.nanmedian(d)),
                "std": float(np.nanstd(d)),
                "per_pair": d.tolist(),
            }
    return depth


@torch.no_grad()
def divergence_summary(div) -> Dict[str, Any]:
    """Flagged patches over every (pair, site), and the per-site table (the embed row alone says little)."""
    n_flagged, n_patches = int(div.flagged.sum()), div.flagged.numel()
    return _jsonable(
        {
            "n_patches": n_patches,
            "n_flagged": n_flagged,
            "frac_flagged": n_flagged / n_patches,
            "per_site": div.summary().to_dict("records"),
        }
    )


def _armorm_view(model, pairs: Sequence[PreferencePair], batch_size: int) -> Dict[str, Any]:
    """Gate weights per pair and each objective's reward for chosen and rejected."""
    names = ["reward_head.hook_gate", "reward_head.hook_pooled"]
    prompts = [p.prompt for p in pairs]
    chosen = readout_run(model, prompts, [p.chosen for p in pairs], names, batch_size=batch_size)
    rejected = readout_run(model, prompts, [p.rejected for p in pairs], names, batch_size=batch_size)
    objectives = list(
        model.reward_head.objective_names
        or [f"objective_{j}" for j in range(chosen.acts["reward_head.hook_pooled"].shape[-1])]
    )
    oc, orr = chosen.acts["reward_head.hook_pooled"], rejected.acts["reward_head.hook_pooled"]
    gate = chosen.acts["reward_head.hook_gate"]
    frame = pd.DataFrame(
        {
            "objective": objectives,
            "mean_gate": gate.mean(0).cpu().numpy(),
            "pair_accuracy": (oc > orr).float().mean(0).cpu().numpy(),
            "mean_gap": (oc - orr).mean(0).cpu().numpy(),
        }
    )
    return {"frame": frame, "summary": _jsonable({"objectives": frame.to_dict("records")})}


def write_outputs(
    audit: AuditResult, out_dir: Union[str, Path, ReportDir], echo: Callable[[str], None] = print
) -> None:
    """report.html, results.json and the CSVs, swapped into `out_dir` as one set (no NaN/inf in any file)."""
    report_dir = out_dir if isinstance(out_dir, ReportDir) else ReportDir(out_dir)
    report = build_report(audit)  # built before anything is written: a failure here leaves no files

    def write(tmp: Path) -> None:
        write_json(tmp / "results.json", audit.record)
        for name, frame in audit.frames.items():
            write_csv(tmp / f"{name}.csv", frame)
        report.save(tmp / "report.html")

    with report_dir:
        audit.out_dir = report_dir.commit(write)
    echo(
        f"[reward-lens] wrote {audit.out_dir / 'report.html'}, results.json and {len(audit.frames)} CSV files"
    )
