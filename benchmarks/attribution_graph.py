"""The attribution graph's cost: one demo text and one 128-token SmolLM2 text, build (linearise + edge rows +
influence) and prune, in seconds and as a ratio to one forward of the same text, with the exactness checks
of the built graph. Goals: a demo text <= 10 s, a 128-token SmolLM2 text <= 120 s on 2 CPU cores.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/attribution_graph.py [--threads 2] [--skip-smollm2]
"""

from __future__ import annotations

import argparse
import time

import torch

import reward_lens as rl


def measure(model, ids: torch.Tensor, label: str, goal_s: float, max_nodes: int = 1024) -> None:
    with torch.no_grad():
        model(ids)  # warm-up
        t0 = time.perf_counter()
        model(ids)
        forward = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = rl.attribution_graph(model, input_ids=ids, max_nodes=max_nodes)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    pruned = graph.prune()
    prune = time.perf_counter() - t0
    checks = graph.completeness()
    total = build + prune
    print(
        f"{label}: T={ids.shape[-1]} nodes={len(graph.nodes)} rows={graph.rows.shape[0]} | build {build:.2f} "
        f"s + prune {prune:.2f} s = {total:.2f} s ({total / forward:.0f} forwards of {forward * 1e3:.1f} ms) "
        f"| pruned: {len(pruned.nodes)} nodes, {len(pruned.edges)} edges | reward_error "
        f"{checks['reward_error']:.2e}, max_error {checks['max_error']:.2e} | goal <= {goal_s:.0f} s: "
        f"{'met' if total <= goal_s else 'MISSED'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads: {torch.get_num_threads()}")
    demo = rl.load_demo_model()
    pair = rl.demo_pairs()[0]
    ids = demo.to_tokens(pair.prompt, pair.chosen)["input_ids"][0]
    measure(demo, ids, "demo text", 10.0)
    if args.skip_smollm2:
        return
    from reward_lens.demo.smollm2 import load_smollm2_organism

    model = load_smollm2_organism()
    text = " ".join(["The river runs past the old mill, and the town counts its bridges one by one."] * 12)
    ids = model.to_tokens("Describe the town.", text)["input_ids"][0][-128:]
    measure(model, ids, "SmolLM2 text", 120.0)


if __name__ == "__main__":
    main()
