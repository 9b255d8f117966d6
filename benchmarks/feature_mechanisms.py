"""The planted mechanisms found as transcoder features: the `reward-lens bench` rows on the feature graph
(`reward_lens.app.bench_features`), with what the bench table leaves out: the planted features found, each
text's best rank of one, and the top features of one text with their signed values; the same planted
features ranked contrastively (`contrastive_features`: push change against each text's control).

    python benchmarks/feature_mechanisms.py                 # demo length + sycophancy, and the trigger
    python benchmarks/feature_mechanisms.py --only demo     # or --only trigger
    python benchmarks/feature_mechanisms.py --only trigger --all-rows  # every feature's row: the cap's effect

Deterministic (no sampling: fixed probe items, fixed trigger texts, shipped transcoders)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reward_lens.app import bench_features as bf  # noqa: E402
from reward_lens.app.bench_checks import BenchContext  # noqa: E402
from reward_lens.app.bench_registry import CHECKS  # noqa: E402
from reward_lens.instruments.circuits.contrastive_features import contrast_graphs  # noqa: E402


def abs_delta_rank(contrast, features) -> float:
    """Post hoc: the best rank of `features` with the contrast ranked by |delta| instead of delta."""
    frame = contrast.to_frame()
    frame = frame.assign(size=frame.delta.abs()).sort_values("size", ascending=False, kind="stable")
    wanted = {(int(l), int(i)) for l, i in features}
    hit = [i for i, (l, f) in enumerate(zip(frame.layer, frame.feature)) if (int(l), int(f)) in wanted]
    return float(hit[0] + 1) if hit else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["demo", "trigger"], default=None)
    ap.add_argument("--all-rows", action="store_true", help="every feature's row (the rows cap 256)")
    args = ap.parse_args()
    if args.all_rows:
        bf.MAX_FEATURES = None
    torch.set_num_threads(1)
    ctx = BenchContext("cpu")
    feature_rows = ("attribution_graph(transcoders=", "contrastive_features(transcoders=")
    rows = [c for c in CHECKS if c.instrument.startswith(feature_rows)]
    rows = [c for c in rows if args.only is None or c.organism == args.only]
    out = {}
    for check in rows:
        start = time.perf_counter()
        value = check.run(ctx)
        out[check.name] = {
            "value": value,
            "goal": check.goal_text(),
            "met": check.meets(value),
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(
            f"{check.name}: {value:g} (goal {check.goal_text()}, {'met' if check.meets(value) else 'MISSED'})"
        )
    if args.only in (None, "demo"):
        table = bf.planted_feature_table(ctx)
        for dimension, rec in table.items():
            found = f"{len(rec['features'])} planted features {rec['features'][:12]}"
            print(f"{dimension}: {found}; best rank per text {rec['ranks']}")
            print(f"  post hoc, ranked by |value| instead: {rec['ranks_by_abs_value']}")
            print(bf.top_features(bf.probe_graphs(ctx, dimension)[0]).to_string(index=False))
        out["planted"] = table
        for dimension in ("length", "sycophancy"):
            ranks = bf.contrastive_ranks(ctx, dimension)
            out[f"contrastive_ranks_{dimension}"] = ranks
            print(f"{dimension}: best contrastive rank of a planted feature per text {ranks}")
            pairs = list(zip(bf.probe_graphs(ctx, dimension), bf.control_graphs(ctx, dimension)))
            planted = bf.planted_features(ctx, dimension)
            by_abs = [abs_delta_rank(contrast_graphs(g, c), planted) for g, c in pairs]
            print(f"  post hoc, ranked by |delta| instead: {by_abs}")
            frame = contrast_graphs(*pairs[0]).to_frame()
            hit = [(int(l), int(i)) in planted for l, i in zip(frame.layer, frame.feature)]
            print("  the planted features on text 0:\n" + frame[hit].to_string(index=False))
            c = contrast_graphs(bf.probe_graphs(ctx, dimension)[0], bf.control_graphs(ctx, dimension)[0])
            print(c.summary().to_string(index=False))
    if args.only in (None, "trigger"):
        from reward_lens.demo.organisms import trigger_token_ids

        sudo = trigger_token_ids(ctx.organism("trigger"))["SUDO"]
        graphs = bf.trigger_feature_graphs(ctx)
        ranks = [bf.best_rank(g, None, g.token_ids.index(sudo)) for g in graphs]
        print(f"SUDO-position feature: best rank per text {ranks}")
        by_value = [bf.best_rank(g, None, g.token_ids.index(sudo), by="abs_value") for g in graphs]
        print(f"  post hoc, ranked by |value| instead: {by_value}")
        for g in graphs:  # SUDO's token node against the features at its position, by influence
            nodes = g.to_frame()
            at = g.token_ids.index(sudo)
            here = nodes[nodes.position == at]
            embed = float(here.influence[here.kind == "embed"].iloc[0])
            feats = here.influence[here.kind == "feature"]
            errors = float(here.influence[here.kind == "error"].sum())
            print(
                f"  SUDO token node influence {embed:.4f}; features at SUDO: best {feats.max():.4f}, sum "
                f"{feats.sum():.4f}; error nodes at SUDO: sum {errors:.4f}"
            )
        print(bf.top_features(graphs[0]).to_string(index=False))
        out["sudo_ranks"] = ranks
        contrastive = bf.sudo_contrastive_ranks(ctx)
        out["sudo_contrastive_ranks"] = contrastive
        print(f"SUDO-position feature: best contrastive rank per text {contrastive}")
        by_abs = []
        for g, c in zip(graphs, bf.trigger_control_graphs(ctx)):
            nodes = g.nodes[(g.nodes.kind == "feature") & (g.nodes.position == g.token_ids.index(sudo))]
            by_abs.append(abs_delta_rank(contrast_graphs(g, c), set(zip(nodes.layer, nodes.feature))))
        print(f"  post hoc, ranked by |delta| instead: {by_abs}")
        c = contrast_graphs(graphs[0], bf.trigger_control_graphs(ctx)[0])
        print(c.summary().to_string(index=False))
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
