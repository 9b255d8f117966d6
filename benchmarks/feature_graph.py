"""The feature attribution graph with trained transcoders: circuit-tracer's replacement and completeness
scores, unpruned and after prune(0.8, 0.98), median over 20 held-out texts, with each graph's exactness
checks and build time. Goals (medians): unpruned >= 0.60 / 0.85, pruned >= 0.50 / 0.80.

- The demo RM with its shipped transcoders: the bundled pairs, which the transcoders never saw (every 12th
  pair, both sides alternating); build time also as a ratio to the component graph of the same text.
- `--transcoders DIR`: the SmolLM2 organism with a set from scripts/train_smollm2_transcoders.py, on its
  held-out pairs (sides alternating, texts of <= 128 tokens, evenly spread over all subsets),
  `--max-features` rows (default 1,024: circuit-tracer's rows-by-influence rule; the scores are those of
  that graph).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/feature_graph.py [--texts 20] [--threads 1]
    PYTHONPATH=. python benchmarks/feature_graph.py --transcoders /tmp/smollm2_tc --threads 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd
import torch

import reward_lens as rl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--transcoders", default=None, help="a SmolLM2 organism set (default: the demo's)")
    ap.add_argument("--max-features", type=int, default=1024, help="feature rows (SmolLM2 only)")
    ap.add_argument("--max-tokens", type=int, default=128, help="longest text (SmolLM2 only)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.transcoders is None:
        model, tc, max_features = rl.load_demo_model(device="cpu"), rl.load_transcoders("demo"), None
        texts = [(p, "chosen" if j % 2 == 0 else "rejected") for j, p in enumerate(rl.demo_pairs()[::12])]
    else:
        model, max_features = rl.load_smollm2_organism(device="cpu"), args.max_features
        tc = rl.load_transcoders(args.transcoders)
        sides = [(p, "chosen" if j % 2 == 0 else "rejected") for j, p in enumerate(rl.smollm2_pairs())]
        fit = [
            (p, side)
            for p, side in sides
            if model.to_tokens(p.prompt, getattr(p, side))["input_ids"].shape[1] <= args.max_tokens
        ]
        texts = [fit[int(i)] for i in np.linspace(0, len(fit) - 1, min(args.texts, len(fit))).round()]
    rows = []
    for pair, side in texts[: args.texts]:
        ids = model.to_tokens(pair.prompt, getattr(pair, side))["input_ids"][0]
        t0 = time.perf_counter()
        g = rl.attribution_graph(model, input_ids=ids, transcoders=tc, max_features=max_features)
        build = time.perf_counter() - t0
        component = float("nan")
        if args.transcoders is None:  # the component graph of a 30-layer text is its own benchmark
            t0 = time.perf_counter()
            rl.attribution_graph(model, input_ids=ids)
            component = time.perf_counter() - t0
        small = g.prune(0.8, 0.98)
        s, p, c = g.scores(), small.scores(), g.completeness()
        rows.append(
            {
                "text": f"{pair.subset}/{side}",
                "T": ids.shape[0],
                "features": g.meta["n_features"],
                "replacement": s["replacement"],
                "completeness": s["completeness"],
                "pruned_nodes": len(small.nodes),
                "pruned_replacement": p["replacement"],
                "pruned_completeness": p["completeness"],
                "reward_error": c["reward_error"],
                "feature_error": c["feature_error"],
                "build_s": build,
                "vs_component_graph": build / component,
            }
        )
    frame = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(frame.round(4).to_string(index=False))
    med = frame.median(numeric_only=True)
    goals = {
        "replacement": 0.60,
        "completeness": 0.85,
        "pruned_replacement": 0.50,
        "pruned_completeness": 0.80,
    }
    for key, goal in goals.items():
        print(f"median {key}: {med[key]:.3f} (goal >= {goal}: {'met' if med[key] >= goal else 'MISSED'})")
    print(
        f"max reward_error {frame.reward_error.max():.2e}, "
        f"max feature_error {frame.feature_error.max():.2e}, "
        f"median build {med.build_s:.2f} s ({med.vs_component_graph:.1f}x the component graph), "
        f"median {med.features:.0f} active features, T median {np.median(frame['T']):.0f}"
    )


if __name__ == "__main__":
    main()
