"""Edge attribution at every position against exact path patching: accuracy and cost of each method.

For each organism's token-aligned minimal pairs (`demo.organisms.minimal_pairs`: the chosen answer with its
result replaced by a wrong number of the same token count; noising, target = chosen), exact all-position path
patching of every edge (`path_patch(..., positions="all")`) is the reference, and each estimate is scored
by the mean over pairs of the Spearman correlation over every edge, and the sign agreement on the 20
largest |exact| edges of each pair (the figures in docs/theory.md and benchmarks/RESULTS.md). Cost: wall
time (one run after a warm-up), and that time over one no-grad forward of the pairs' chosen side (min of 3).

- demo: every edge of the demo organism (embed has no path patch, so its edges are left out: 306 edges);
  `--demo-pairs 3,8` (the first n minimal pairs of the demo's held-out pairs, in file order);
- smollm2: the SmolLM2 organism's first 2 minimal pairs from `smollm2_pairs()`, the late subgraph (senders:
  heads and MLPs of layers L-3, L-2; receivers of layers >= L-2 and the readout), batch_size 1, max_rows 64
  (as `tests/test_circuits_smollm2.py`); skipped without the organism's wheel.

Nothing here is random (the pairs are the files' first ones, the methods deterministic); the seed is set
and printed so that a rerun states it. Run:
    OMP_NUM_THREADS=1 python benchmarks/edge_accuracy.py [--seed 0] [--steps 16] [--demo-pairs 3,8]
        [--organisms demo,smollm2] [--threads 1]
"""

import argparse

import torch
from harness import timed

import reward_lens
from reward_lens import edge_attribution, path_patch
from reward_lens.core.batching import pair_batches
from reward_lens.demo.organisms import minimal_pairs
from reward_lens.instruments.circuits.edges import agreement
from reward_lens.instruments.circuits.graph import default_senders
from reward_lens.instruments.patching.path import default_receivers, parse_receiver

METHODS = ("eap", "eap-ig", "eap-ig-joint", "eap-ig-inputs")


def batched_forward(model, pairs, batch_size: int):
    """One no-grad forward over the pairs' chosen side, in the methods' batches (what a ratio is over)."""
    batches = [b.chosen for b in pair_batches(model, pairs, batch_size, False, None)]

    def forward():
        with torch.no_grad():
            for tok in batches:
                model(tok.input_ids, tok.attention_mask)

    return forward


def run_and_time(fn, forward):
    """(fn's result from a warm-up call, fn's wall time, the forward's min of 3), timed interleaved."""
    out = fn()
    (fw, _), (t, _) = timed([forward, fn], 1)
    fw = min([fw] + [s for s, _ in timed([forward], 2)])
    return out, t, fw


def report(name: str, model, pairs, senders, receivers, steps: int, batch_size: int, max_rows: int):
    """Print exact path patching's cost, then each method's cost and agreement with it. `senders=None`:
    every sender (edge attribution's embed sender has no path patch and is left out)."""
    at = {"positions": "all", "batch_size": batch_size}
    exact_senders = default_senders(model)[1:] if senders is None else senders
    forward = batched_forward(model, pairs, batch_size)
    exact, t_exact, fw = run_and_time(
        lambda: path_patch(model, pairs, exact_senders, receivers, **at).effect(), forward
    )
    n_edges = int(torch.isfinite(exact[0]).sum())
    print(
        f"\n{name}: {len(pairs)} minimal pairs, noising, {n_edges} edges; one forward of the pairs {fw:.3f} s"
    )
    print(f"  {'path_patch (exact)':18s} {t_exact:8.2f} s = {t_exact / fw:8.1f} forward equivalents")
    for method in METHODS:
        kw = {} if method == "eap" else {"steps": steps}
        res, t, _ = run_and_time(
            lambda: edge_attribution(
                model,
                pairs,
                method=method,
                senders=senders,
                receivers=receivers,
                max_rows=max_rows,
                **kw,
                **at,
            ),
            forward,
        )
        skip = len(res.senders) - len(exact_senders)  # the embed sender, when every sender is asked for
        rho, sign = agreement(exact, res.scores[:, skip:])
        label = method if method == "eap" else f"{method}({steps})"
        print(
            f"  {label:18s} {t:8.2f} s = {t / fw:8.1f} forward equivalents   Spearman {rho:.3f}   "
            f"sign agreement (top 20) {sign:.3f}"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--demo-pairs", default="3,8")
    ap.add_argument("--organisms", default="demo,smollm2")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(
        f"seed {args.seed}, steps {args.steps}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, fp32; script benchmarks/edge_accuracy.py"
    )
    organisms = args.organisms.split(",")
    if "demo" in organisms:
        model = reward_lens.load_demo_model()
        for n in (int(k) for k in args.demo_pairs.split(",")):
            report("demo", model, minimal_pairs(model, n), None, None, args.steps, 8, 256)
    if "smollm2" in organisms:
        try:
            model = reward_lens.load_smollm2_organism()
        except (ImportError, FileNotFoundError, OSError) as e:
            print(f"\nsmollm2: skipped ({e})")
            return
        L, H = model.cfg.n_layers, model.cfg.n_heads
        senders = [f"L{l}H{h}" for l in range(L - 3, L - 1) for h in range(H)]
        senders += [f"mlp_L{l}" for l in range(L - 3, L - 1)]
        receivers = [
            r
            for r in default_receivers(model.cfg)
            if r == "readout" or parse_receiver(model.cfg, r).layer >= L - 2
        ]
        pairs = minimal_pairs(model, 2, reward_lens.smollm2_pairs())
        report("smollm2 (late subgraph)", model, pairs, senders, receivers, args.steps, 1, 64)


if __name__ == "__main__":
    main()
