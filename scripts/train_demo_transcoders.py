"""Train the demo reward model's transcoders and write them into reward_lens/demo/transcoders/.

    python scripts/train_demo_transcoders.py                    # ~4 CPU-minutes; writes the shipped set
    python scripts/train_demo_transcoders.py --out /tmp/tc --steps 100   # a quick smoke run elsewhere

One TopK skip transcoder per layer (d_tc 512, k 16) trained on activations streamed from texts the
generators draw with their own seed (reward_lens.demo.synthetic.training_pairs, excluding the held-out pairs),
then evaluated on the bundled pairs (`demo_pairs()`), which training never sees: per-layer FVU, L0 and dead
fraction, and the replacement model's reward (every MLP replaced, no error terms) against the original.
Deterministic for a fixed thread count on one torch build (seeded texts, seeded batches).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import reward_lens as rl  # noqa: E402
from reward_lens.demo import DEMO_TRANSCODERS_DIR, synthetic  # noqa: E402

HELD_OUT_SEED = 1  # scripts/train_demo_model.py's: the bundled pairs
TEXT_SEED, TORCH_SEED = 41, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEMO_TRANSCODERS_DIR))
    ap.add_argument("--d-tc", type=int, default=512)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--n-pairs", type=int, default=4000, help="training pairs drawn (both sides used)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(TORCH_SEED)
    model = rl.load_demo_model(device="cpu")
    held_out = synthetic.held_out_pairs(HELD_OUT_SEED)
    train = synthetic.training_pairs(args.n_pairs, TEXT_SEED, exclude=held_out)
    start = time.perf_counter()
    tc = rl.train_transcoders(
        model,
        train,
        d_tc=args.d_tc,
        k=args.k,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=TORCH_SEED,
        eval_texts=rl.demo_pairs(),
    )
    seconds = time.perf_counter() - start
    tc.config["training"].update(text_seed=TEXT_SEED, held_out_seed=HELD_OUT_SEED, n_pairs=args.n_pairs)
    tc.save(args.out)
    summary = tc.metrics.summary().iloc[0].to_dict()
    print(tc.metrics.to_frame().to_string(index=False))
    print(json.dumps({**summary, "train_seconds": round(seconds, 1), "out": args.out}, indent=1))


if __name__ == "__main__":
    main()
