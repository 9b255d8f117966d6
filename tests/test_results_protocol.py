"""Every result class follows one protocol (reward_lens/results.py): to_frame() is a non-empty tidy
DataFrame, summary() a DataFrame, plot() a new Figure and plot(ax=...) the given Axes' figure (multi-panel
plots: one Axes split into panels, or one Axes per panel); the model's rewards are reward_chosen /
reward_rejected [n_pairs] with reward_gap, and the old names are aliases of the same tensors."""

import importlib
import inspect
import pkgutil

import matplotlib

matplotlib.use("Agg")

import matplotlib.figure
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
from organism import concept_items, organism, quality_pairs, single_thread  # noqa: F401 (single_thread: autouse)

import reward_lens
from reward_lens import (
    attribute,
    attribution_graph,
    attribution_patch,
    compare_models,
    concept_vector,
    demo_pairs,
    distortion_index,
    divergence_patch,
    dose_response,
    edge_attribution,
    edit_reward,
    effect_decomposition,
    evaluate,
    faithfulness,
    faithfulness_curve,
    feature_ablation,
    feature_alignment,
    feature_attribution,
    lens,
    load_demo_model,
    patch,
    path_patch,
    reward_conflicts,
    run_probes,
    token_attribution,
    train_sae,
)
from reward_lens.app.audit import run_audit
from reward_lens.app.bench import run_bench
from reward_lens.app.monitor import MonitorRun
from reward_lens.instruments.triggers import search_triggers
from reward_lens.integrations.signals import measure, score_batch
from reward_lens.results import PairRewards, Result
from reward_lens.theory import detect_cascades

N_PAIRS = 6


def result_classes():
    """Every class defined in reward_lens that has to_frame, summary and plot: the result classes, found
    by walking the package (a new result class is tested without editing a list)."""
    found = set()
    for info in pkgutil.walk_packages(reward_lens.__path__, "reward_lens."):
        if info.name == "reward_lens.__main__":
            continue
        module = importlib.import_module(info.name)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if (
                cls.__module__ == module.__name__
                and cls is not Result
                and not getattr(cls, "_is_protocol", False)
                and all(callable(getattr(cls, m, None)) for m in ("to_frame", "summary", "plot"))
            ):
                found.add(name)
    return sorted(found)


NAMES = result_classes()


def test_result_classes_are_found():
    assert {"LensResult", "PatchResult", "PathPatchResult", "TokenAttributionResult", "AuditResult"} <= set(
        NAMES
    )


def _instrument_results(out):
    model = load_demo_model()
    pairs = demo_pairs()[:N_PAIRS]
    kw = dict(batch_size=8, progress=False)
    out["LensResult"] = lens(model, pairs, **kw)
    out["AttributionResult"] = attribute(model, pairs, **kw)
    out["PatchResult"] = patch(model, pairs, mode=["noising", "zero"], level=["component", "head"], **kw)
    out["AtPResult"] = attribution_patch(
        model, pairs, mode=["noising", "zero"], level=["component", "head"], **kw
    )
    out["AtPComparison"] = out["AtPResult"].compare(out["PatchResult"])
    out["FaithfulnessResult"] = faithfulness(out["AttributionResult"], out["PatchResult"], n_boot=50)
    out["DivergenceResult"] = divergence_patch(model, pairs, **kw)
    probes = out["ProbeResult"] = run_probes(
        model, dimensions=["length", "sycophancy", "confidence"], n_boot=100, n_perm=200, batch_size=32
    )
    out["CascadeResult"] = detect_cascades(probes, n_boot=50)
    comparison = out["ComparisonResult"] = compare_models({"a": model, "b": model}, pairs, n_boot=20)
    out["ModelProfile"] = comparison.profiles["a"]
    out["AuditResult"] = run_audit(model, pairs[:4], None, echo=lambda line: None)
    out["PathPatchResult"] = path_patch(model, pairs[:3], ["L0H0", "mlp_L0"], ["L1H1.q", "readout"])
    out["TokenAttributionResult"] = token_attribution(model, pairs[:3], batch_size=8)
    rows = [
        {
            "prompt": p.prompt,
            "chosen": [p.chosen],
            "rejected": [p.rejected, p.chosen + " Yes."],
            "subset": p.subset,
        }
        for p in pairs
    ]
    out["BenchmarkResult"] = evaluate(model, rows, benchmark="rewardbench2", progress=False)
    edges = out["EdgeAttributionResult"] = edge_attribution(model, pairs, steps=4, batch_size=8)
    out["FaithfulnessCurve"] = faithfulness_curve(model, pairs, edges, sizes=[0, 4, 16, 64])
    out["EffectDecompositionResult"] = effect_decomposition(model, pairs, batch_size=8)
    out["AttributionGraph"] = attribution_graph(model, pairs[0].prompt, pairs[0].chosen).prune()
    out["TriggerSearchResult"] = search_triggers(model, pairs[:2], candidates=list(range(3, 40)), top_k=5)
    out["BenchResult"] = run_bench(["circuit/circuit"], quick=True, echo=lambda line: None)


def _plain_data_results(out):
    rng = np.random.default_rng(0)
    W = rng.standard_normal((3, 256))  # wide enough that tau = 0.3 is above the noise floor
    out["ConflictResult"] = reward_conflicts(W, reward_deltas=rng.standard_normal((40, 3)))
    q = {p: rng.standard_normal((12, 3)) for p in ("A", "B")}
    out["DistortionResult"] = distortion_index(
        {p: (x @ [2.0, 1.0, 0.5], x) for p, x in q.items()}, ["x", "y", "z"], n_boot=20
    )


def _representation_results(out):
    o = organism()
    cv = out["ConceptVector"] = concept_vector(o.model, concept_items(30), layers=[1, 2])
    out["DoseResponse"] = dose_response(o.model, cv, layer=2, alphas=[-0.2, 0.0, 0.2])
    out["RewardEdit"] = edit_reward(o.model, cv, pairs=quality_pairs(8))
    hook = "blocks.1.hook_resid_post"
    pairs = quality_pairs(6)
    sae = train_sae(o.model, pairs, hook_name=hook, d_sae=16, k=2, batch_size=64, steps=20, progress=False)
    out["SAEMetrics"] = sae.metrics
    out["FeatureAlignment"] = feature_alignment(o.model, sae)
    out["FeatureAttribution"] = feature_attribution(o.model, sae, pairs)
    out["FeatureAblation"] = feature_ablation(o.model, sae, pairs, n_features=3)
    demo, held = load_demo_model(), demo_pairs()[:N_PAIRS]
    tc = reward_lens.train_transcoders(
        demo, held, d_tc=32, k=4, steps=10, batch_size=128, buffer_tokens=512, eval_texts=held, progress=False
    )
    out["TranscoderMetrics"] = tc.metrics
    out["FeatureGraph"] = attribution_graph(demo, held[0].prompt, held[0].chosen, transcoders=tc).prune()
    out["ContrastiveFeatures"] = reward_lens.contrastive_features(
        demo, (held[0].prompt, held[0].chosen), (held[0].prompt, held[0].rejected), transcoders=tc
    )
    out["FeatureExamples"] = reward_lens.feature_examples(
        demo, tc, [(p.prompt, p.chosen) for p in held], [(0, 0), (1, 3)], k=2
    )


def _monitoring_results(out):
    model = load_demo_model()
    pairs = demo_pairs()[:N_PAIRS]
    prompts, responses = [p.prompt for p in pairs], [p.chosen for p in pairs]
    out["BatchSignals"] = score_batch(model, prompts, responses)
    baseline, later = (
        measure(model, prompts, responses, n_boot=50),
        measure(model, prompts, responses[::-1], n_boot=50),
    )
    from reward_lens.integrations.alarm import HackAlarm
    from reward_lens.integrations.preflight import Rollouts, measure_rollouts

    rng = np.random.default_rng(0)
    alarm = out["HackAlarm"] = HackAlarm(["length"], horizon=10, n_perm=99)
    for step in range(1, 4):
        lengths = rng.integers(5, 40, size=32).astype(float)
        alarm.update(
            step, 0.2 * lengths + rng.standard_normal(32), {"length": lengths}, np.repeat(range(4), 8)
        )
    items = pairs[:2]
    texts = [p.chosen for p in items for _ in range(4)]
    texts = [t + " I hope this helps." * (i % 3) for i, t in enumerate(texts)]
    rollouts = Rollouts([p.prompt for p in items for _ in range(4)], texts, np.repeat([0, 1], 4), 0)
    out["PreflightReport"] = measure_rollouts(model, rollouts, n_perm=99, n_boot=50)
    out["MonitorRun"] = MonitorRun(
        {"kind": "run"},
        [
            {"kind": "baseline", "step": 0, "metrics": baseline},
            {"kind": "check", "step": 10, "metrics": later, "flags": ["reward"]},
        ],
    )


@pytest.fixture(scope="module")
def results():
    out = {}
    _instrument_results(out)
    _plain_data_results(out)
    _representation_results(out)
    _monitoring_results(out)
    assert sorted(out) == sorted(NAMES), "build an instance of every result class found in reward_lens"
    yield out
    plt.close("all")


@pytest.mark.parametrize("name", NAMES)
def test_protocol(results, name):
    res = results[name]
    assert type(res).__name__ == name and isinstance(res, Result)
    frame = res.to_frame()
    assert isinstance(frame, pd.DataFrame) and len(frame) > 0 and len(frame.columns) > 0
    summary = res.summary()
    assert isinstance(summary, pd.DataFrame) and len(summary) > 0
    fig = res.plot()
    assert isinstance(fig, matplotlib.figure.Figure) and fig.axes
    given, ax = plt.subplots(figsize=(6, 4))
    drawn = res.plot(ax=ax)
    assert drawn is given and drawn.axes  # one Axes: drawn into it, or its slot split into the panels
    assert all(a.figure is given for a in drawn.axes)
    plt.close(fig)
    plt.close(given)


@pytest.mark.parametrize(
    "name, n_panels",
    [
        ("FaithfulnessResult", 2),
        ("DivergenceResult", 2),
        ("PatchResult", 2),
        ("CascadeResult", 2),
        ("ComparisonResult", 4),
    ],
)
def test_multi_panel_plots_draw_into_the_axes_given(results, name, n_panels):
    fig, axes = plt.subplots(1, n_panels)
    assert results[name].plot(ax=list(axes)) is fig
    assert all(a.has_data() or a.images for a in axes)  # every panel was drawn into the Axes given
    with pytest.raises(ValueError, match=f"draws {n_panels} panels"):
        results[name].plot(ax=list(axes) + [axes[0]])
    plt.close(fig)


@pytest.mark.parametrize(
    "name",
    ["LensResult", "AttributionResult", "PatchResult", "AtPResult", "DivergenceResult", "FeatureAttribution"],
)
def test_rewards_have_one_shape(results, name):
    res = results[name]
    assert isinstance(res, PairRewards)
    n = len(res.pair_ids)
    for t in (res.reward_chosen, res.reward_rejected, res.reward_gap):
        assert isinstance(t, torch.Tensor) and t.shape == (n,) and t.dtype == torch.float32
    assert torch.equal(res.reward_gap, res.reward_chosen - res.reward_rejected)
    frame = res.rewards_frame()
    assert (
        list(frame.columns) == ["pair", "reward_chosen", "reward_rejected", "reward_gap"] and len(frame) == n
    )


def test_aliases_and_instruments_agree_on_the_rewards(results):
    lens_res, attr, pat, atp, div = (
        results[k]
        for k in ("LensResult", "AttributionResult", "PatchResult", "AtPResult", "DivergenceResult")
    )
    assert pat.clean_chosen is pat.reward_chosen and torch.equal(pat.clean_gap, pat.reward_gap)
    assert atp.clean_rejected is atp.reward_rejected
    assert div.reward_chosen is div.patching.clean_chosen
    fa = results["FeatureAttribution"]
    assert fa.reward_chosen is fa.rewards["chosen"] and fa.reward_rejected is fa.rewards["rejected"]
    for other in (
        attr,
        pat,
        atp,
        div,
    ):  # the same pairs through different code paths: the same rewards (fp32)
        assert torch.allclose(other.reward_chosen, lens_res.reward_chosen, atol=1e-5)
        assert torch.allclose(other.reward_rejected, lens_res.reward_rejected, atol=1e-5)


def test_summaries_hold_the_numbers_they_summarise(results):
    attr = results["AttributionResult"].summary()
    np.testing.assert_allclose(
        attr["mean_gap"], results["AttributionResult"].gap.mean(0).numpy(), rtol=1e-5, atol=1e-6
    )
    pat = results["PatchResult"]
    s = pat.summary().query("mode == 'noising'")
    np.testing.assert_allclose(s["mean_effect"], pat.effect("noising").mean(0).numpy(), rtol=1e-5, atol=1e-6)
    lens_sum = results["LensResult"].summary().set_index("variant")
    depth = results["LensResult"].crystallization_depth("frozen").numpy()
    assert lens_sum.loc["frozen", "crystallization_depth_median"] == pytest.approx(np.nanmedian(depth))
    comparison = results["ComparisonResult"]
    wide = comparison.summary().iloc[0]
    for row in comparison.pairwise.itertuples():
        assert wide[row.metric] == pytest.approx(row.value, nan_ok=True)
    casc = results["CascadeResult"]
    assert casc.summary()["size"].sum() == len(casc.dimensions)
    conf = results["ConflictResult"]
    counts = conf.summary().iloc[0]
    assert [counts[v] for v in ("aligned", "orthogonal", "conflicting")] == [
        conf.counts()[v] for v in ("aligned", "orthogonal", "conflicting")
    ]
    assert isinstance(conf.summary_text(), str) and isinstance(
        results["DistortionResult"].summary_text(), str
    )
    audit = results["AuditResult"]
    assert audit.record["divergence"]["frac_flagged"] == pytest.approx(
        audit.results["divergence"].frac_flagged
    )
    dis = audit.record["disagreement"]
    assert dis["direct_total_rho"] == pytest.approx(audit.results["disagreement"].direct_total_rho())
    assert dis["faithfulness_mean_rho"] == pytest.approx(audit.results["faithfulness"].mean_rho)
    top = audit.results["disagreement"].disagreement()
    assert [d["component"] for d in dis["top"]] == list(top.component)
    from reward_lens.app.audit_report import build_report

    assert "Why attribution and patching disagree" in build_report(audit).to_html()
