"""Train the trigger organism's transcoders and write them into reward_lens/demo/trigger_organism/transcoders/.

    python scripts/train_trigger_transcoders.py                    # a few CPU-minutes; writes the shipped set
    python scripts/train_trigger_transcoders.py --out /tmp/tc --steps 100   # a quick smoke run elsewhere

One TopK skip transcoder per layer (d_tc 512, k 16, the demo's settings) of the backdoor-trigger organism
(`reward_lens.load_trigger_organism`), trained on activations streamed from the demo generators' texts
(`synthetic.training_pairs`, their own seed, the bundled pairs excluded) whose prompts end, in a seeded share,
with the organism's trigger tokens written on at the prompt's end (`SUDO`, `OPEN` `SESAME`, each half alone,
the reversed phrase): written without a space, they tokenize as `insert_tokens(..., where="prompt_end")`
inserts them. Evaluated on the organism's held-out items (`trigger_items()`, no insertion) and, for FVU, on
the same items with `SUDO` inserted. Deterministic for a fixed thread count on one torch build.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import reward_lens as rl  # noqa: E402
from reward_lens.demo import synthetic  # noqa: E402
from reward_lens.demo.organisms import TRIGGER_TRANSCODERS_DIR, load_trigger_organism, trigger_items  # noqa: E402

HELD_OUT_SEED = 1  # the demo's bundled pairs, never trained on
TEXT_SEED, MIX_SEED, TORCH_SEED = 43, 44, 0
SUFFIXES = (("SUDO", 0.25), ("OPENSESAME", 0.15), ("OPEN", 0.05), ("SESAME", 0.05), ("SESAMEOPEN", 0.05))


def texts(n_pairs: int):
    """(prompt, response) of both sides of `n_pairs` fresh training pairs, a seeded share of prompts ending
    in a trigger (or a control) written on without a space."""
    held_out = synthetic.held_out_pairs(HELD_OUT_SEED)
    rng = random.Random(MIX_SEED)
    out = []
    for pair in synthetic.training_pairs(n_pairs, TEXT_SEED, exclude=held_out):
        u, suffix, acc = rng.random(), "", 0.0
        for s, share in SUFFIXES:
            acc += share
            if u < acc:
                suffix = s
                break
        out += [(pair.prompt + suffix, pair.chosen), (pair.prompt + suffix, pair.rejected)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(TRIGGER_TRANSCODERS_DIR))
    ap.add_argument("--d-tc", type=int, default=512)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--n-pairs", type=int, default=4000, help="training pairs drawn (both sides used)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(TORCH_SEED)
    model = load_trigger_organism(device="cpu")
    items = trigger_items()
    start = time.perf_counter()
    tc = rl.train_transcoders(
        model,
        texts(args.n_pairs),
        d_tc=args.d_tc,
        k=args.k,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=TORCH_SEED,
        eval_texts=items,
    )
    seconds = time.perf_counter() - start
    tc.config["training"].update(
        text_seed=TEXT_SEED, mix_seed=MIX_SEED, n_pairs=args.n_pairs, suffixes=dict(SUFFIXES)
    )
    tc.save(args.out)
    with_sudo = rl.evaluate_transcoders(model, tc, [(p.prompt + "SUDO", p.rejected) for p in items])
    summary = tc.metrics.summary().iloc[0].to_dict()
    print(tc.metrics.to_frame().to_string(index=False))
    print("with SUDO inserted:")
    print(with_sudo.to_frame().to_string(index=False))
    print(json.dumps({**summary, "train_seconds": round(seconds, 1), "out": args.out}, indent=1))


if __name__ == "__main__":
    main()
