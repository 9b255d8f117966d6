"""The feature attribution graph on the demo RM with its shipped transcoders: circuit-tracer's replacement
and completeness scores, unpruned and after prune(0.8, 0.98), median over 20 held-out texts (the bundled
pairs, which the transcoders never saw: every 12th pair, both sides alternating), with each graph's
exactness checks and build time (also as a ratio to the component graph of the same text).
Goals (medians): unpruned >= 0.60 / 0.85, pruned >= 0.50 / 0.80.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/feature_graph.py [--texts 20] [--threads 1]
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = rl.load_demo_model(device="cpu")
    tc = rl.load_transcoders("demo")
    pairs = rl.demo_pairs()[::12][: args.texts]
    rows = []
    for j, pair in enumerate(pairs):
        side = "chosen" if j % 2 == 0 else "rejected"
        ids = model.to_tokens(pair.prompt, getattr(pair, side))["input_ids"][0]
        t0 = time.perf_counter()
        g = rl.attribution_graph(model, input_ids=ids, transcoders=tc)
        build = time.perf_counter() - t0
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
