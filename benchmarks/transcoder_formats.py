"""The demo transcoders in circuit-tracer's and SAELens's formats: the TopK -> JumpReLU conversion both tools
need, measured on held-out text, and the exported files with our activations for the tools' own loaders.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/transcoder_formats.py --out /tmp/tc_formats

1. Calibrates JumpReLU thresholds for the shipped TopK set (`jumprelu_from_topk`) on fresh generator draws
   (`synthetic.training_pairs(--calibration-pairs, seed 41)`, excluding the held-out pairs), then compares it
   with TopK on the bundled pairs (`demo_pairs()`, never seen by training or calibration): per-layer FVU and
   L0, the share of TopK's active (token, feature) entries the JumpReLU keeps and of its own that TopK has,
   the relative difference of the activations, and the replacement model's reward (every MLP replaced, no
   error terms) against the original. A single per-layer threshold (the mean k-th largest pre-activation,
   as BatchTopK's inference rule) is measured beside it for comparison.
2. Writes the JumpReLU set to OUT/circuit_tracer (config.yaml + layer_{l}.safetensors) and OUT/saelens
   (layer_{l}/cfg.json + sae_weights.safetensors), and OUT/expected.safetensors: held-out MLP inputs `x.{l}`
   with our encode `acts.{l}`, decode without the skip `decode.{l}` and forward `out.{l}`, which
   benchmarks/saelens_transcoders.py and benchmarks/circuit_tracer_transcoders.py reproduce with the tools.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import reward_lens as rl
from reward_lens.demo import synthetic
from reward_lens.representations.transcoders.convert import _jumprelu_copy
from reward_lens.representations.transcoders.train import stream_mlp_io, text_pairs

HELD_OUT_SEED, TEXT_SEED = 1, 41


def mlp_inputs(model, texts, layers, max_tokens=None):
    prompts, responses = text_pairs(texts)
    xs, ys = [], []
    for x, y in stream_mlp_io(model, prompts, responses, layers, 32):
        xs.append(x)
        ys.append(y)
    x, y = torch.cat(xs), torch.cat(ys)
    return (x, y) if max_tokens is None else (x[:max_tokens], y[:max_tokens])


def global_thresholds(tc, x):
    """Per layer one threshold: the mean over tokens of the k-th largest pre-activation (ReLU'd)."""
    out = {}
    for i, l in enumerate(tc.layers):
        t = tc[l]
        kth = t.pre(x[:, i]).topk(t.k, dim=-1).values[:, -1].relu()
        out[l] = _jumprelu_copy(t, torch.full((t.d_tc,), float(kth.mean())))
    return rl.TranscoderSet(out, dict(tc.config))


def compare(model, topk, jr, x, y, pairs):
    rows = []
    for i, l in enumerate(topk.layers):
        a, b = topk[l].encode(x[:, i]), jr[l].encode(x[:, i])
        on_a, on_b = a > 0, b != 0
        yc = y[:, i] - y[:, i].mean(0)
        fvu = lambda t: float((y[:, i] - t(x[:, i])).pow(2).sum() / yc.pow(2).sum())  # noqa: E731
        rows.append(
            {
                "layer": l,
                "fvu_topk": fvu(topk[l]),
                "fvu_jumprelu": fvu(jr[l]),
                "l0_topk": float(on_a.sum(-1).float().mean()),
                "l0_jumprelu": float(on_b.sum(-1).float().mean()),
                "topk_kept": float((on_a & on_b).sum() / on_a.sum()),
                "jumprelu_in_topk": float((on_a & on_b).sum() / on_b.sum().clamp(min=1)),
                "rel_act_diff": float((a - b).norm() / a.norm()),
            }
        )
    m = rl.evaluate_transcoders(model, jr, pairs)
    return rows, m.reward_pearson, m.decision_agreement


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/tc_formats")
    ap.add_argument("--calibration-pairs", type=int, default=1000)
    ap.add_argument(
        "--expected-tokens", type=int, default=512, help="held-out tokens in expected.safetensors"
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = Path(args.out)
    model = rl.load_demo_model(device="cpu")
    tc = rl.load_transcoders("demo")
    held = synthetic.held_out_pairs(HELD_OUT_SEED)
    calibration = synthetic.training_pairs(args.calibration_pairs, TEXT_SEED, exclude=held)
    pairs = rl.demo_pairs()
    jr = rl.jumprelu_from_topk(tc, model, calibration)
    x, y = mlp_inputs(model, pairs, tc.layers)
    base = rl.evaluate_transcoders(model, tc, pairs)
    report = {
        "calibration": jr.config["jumprelu"],
        "held_out_tokens": int(x.shape[0]),
        "topk": {"reward_pearson": base.reward_pearson, "decision_agreement": base.decision_agreement},
    }
    xc, _ = mlp_inputs(model, calibration, tc.layers, jr.config["jumprelu"]["calibration_tokens"])
    for name, candidate in (("per_feature", jr), ("global", global_thresholds(tc, xc))):
        rows, r, agree = compare(model, tc, candidate, x, y, pairs)
        report[name] = {"layers": rows, "reward_pearson": r, "decision_agreement": agree}
        print(
            f"\n{name} thresholds (held-out, {x.shape[0]} tokens): reward r {r:.4f}, "
            f"decisions kept {agree:.4f}"
        )
        print(
            f"{'layer':>5} {'FVU topk':>9} {'FVU jr':>8} {'L0 topk':>8} {'L0 jr':>7} {'kept':>6} "
            f"{'in topk':>8} {'rel diff':>9}"
        )
        for row in rows:
            print(
                f"{row['layer']:>5} {row['fvu_topk']:>9.4f} {row['fvu_jumprelu']:>8.4f} "
                f"{row['l0_topk']:>8.2f} "
                f"{row['l0_jumprelu']:>7.2f} {row['topk_kept']:>6.3f} {row['jumprelu_in_topk']:>8.3f} "
                f"{row['rel_act_diff']:>9.4f}"
            )
    print(f"\nTopK itself: reward r {base.reward_pearson:.4f}, decisions kept {base.decision_agreement:.4f}")
    thresholds = torch.cat([jr[l].threshold for l in jr.layers])
    report["thresholds"] = {
        "min": float(thresholds.min()),
        "median": float(thresholds.median()),
        "max": float(thresholds.max()),
    }
    print("per-feature thresholds:", json.dumps(report["thresholds"]))

    jr.save(out / "circuit_tracer", format="circuit-tracer")
    jr.save(out / "saelens", format="saelens")
    sel = x[: args.expected_tokens]
    expected = {}
    for i, l in enumerate(jr.layers):
        t = jr[l]
        acts = t.encode(sel[:, i])
        expected.update({f"x.{l}": sel[:, i], f"acts.{l}": acts, f"decode.{l}": t.decode(acts)})
        expected[f"out.{l}"] = t(sel[:, i])
    save_file({k: v.contiguous() for k, v in expected.items()}, str(out / "expected.safetensors"))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out}/circuit_tracer, {out}/saelens, {out}/expected.safetensors, {out}/report.json")
    assert np.isfinite(report["per_feature"]["reward_pearson"])


if __name__ == "__main__":
    main()
