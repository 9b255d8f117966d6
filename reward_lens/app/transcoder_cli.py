"""The `train-transcoders` subcommand of the CLI (`reward_lens.app.cli` adds it with `add_commands`).
Module-level imports stay torch-free: the parser answers --help without loading torch."""

from __future__ import annotations

import contextlib

from reward_lens.app.options import (
    CLIError,
    check_device,
    check_local_model_spec,
    check_pairs_file,
    check_positive_options,
    load_model,
    split_list,
)
from reward_lens.app.output import ReportDir

# the trainable families of reward_lens.representations.transcoders.FAMILIES, spelled here (it imports torch;
# a test keeps them equal)
FAMILY_NAMES = ("batchtopk", "topk")
DEMO_TEXT_SEED, DEMO_HELD_OUT_SEED = 41, 1  # scripts/train_demo_transcoders.py's


def add_commands(sub) -> None:
    tr = sub.add_parser(
        "train-transcoders",
        help="train per-layer skip transcoders of a reward model's MLPs (for attribution_graph's feature "
        "graph); writes transcoders.json + transcoders.safetensors; data-parallel under torchrun",
    )
    tr.add_argument("--model", default="demo", help="checkpoint directory or a named organism (demo, ...)")
    tr.add_argument(
        "--pairs",
        default=None,
        help="training pairs (.jsonl/.json/.csv/.parquet; both responses used); default for the demo: "
        "fresh draws of its generators (seed 41), never its bundled pairs",
    )
    tr.add_argument(
        "--eval-pairs",
        default=None,
        help="held-out pairs for FVU, L0, dead features and the replacement model's reward (default for "
        "the demo: its bundled pairs)",
    )
    tr.add_argument("--out", default="reward-lens-transcoders", help="output directory")
    tr.add_argument("--d-tc", type=int, default=512, help="features per layer")
    tr.add_argument("--k", type=int, default=16, help="active features per token (TopK's k)")
    tr.add_argument("--family", default="topk", choices=FAMILY_NAMES, help="activation family")
    tr.add_argument("--layers", default=None, help="comma-separated layers (default: all)")
    tr.add_argument("--steps", type=int, default=1500)
    tr.add_argument("--batch-size", type=int, default=1024, help="tokens per training step")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument(
        "--exclude-first-token",
        action="store_true",
        help="train and measure without each text's first token (a BOS attention sink whose outlier MLP "
        "outputs would take the features; the feature graph then leaves it to the error node)",
    )
    tr.add_argument("--device", default=None, help="cpu (default) or cuda[:i]")
    tr.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    tr.set_defaults(func=cmd_train_transcoders)


def _layers(text):
    if text is None:
        return None
    try:
        return [int(v) for v in split_list(text)]
    except ValueError:
        raise CLIError(f"--layers must be comma-separated integers, got {text!r}") from None


def _texts(args):
    from reward_lens.data.pairs import load_pairs

    if args.pairs is not None:
        train = load_pairs(args.pairs)
    elif args.model == "demo":
        from reward_lens.demo import synthetic

        held_out = synthetic.held_out_pairs(DEMO_HELD_OUT_SEED)
        train = synthetic.training_pairs(4000, DEMO_TEXT_SEED, exclude=held_out)
    else:
        raise CLIError(f"give --pairs for --model {args.model} (only the demo has default training texts)")
    if args.eval_pairs is not None:
        return train, load_pairs(args.eval_pairs)
    if args.model == "demo":
        from reward_lens.demo import demo_pairs

        return train, demo_pairs()
    return train, None


def cmd_train_transcoders(args) -> int:
    from reward_lens.representations.transcoders import train_transcoders

    check_device(args.device)
    check_positive_options(args, ("--d-tc", "--k", "--steps", "--batch-size"))
    if args.k > args.d_tc:
        raise CLIError(f"--k ({args.k}) must not exceed --d-tc ({args.d_tc})")
    layers = _layers(args.layers)
    check_local_model_spec(args.model)
    check_pairs_file(args.pairs)
    check_pairs_file(args.eval_pairs)
    from reward_lens.core.ranks import Ranks

    ranks = Ranks.from_env()  # torchrun: data-parallel training, rank 0 evaluates and writes
    out_dir = ReportDir(args.out) if ranks.is_main else contextlib.nullcontext()
    with out_dir as out:  # checked and locked before any work, swapped in whole at the end
        model, _ = load_model(args.model, ranks.device(args.device) or "cpu")
        train, held_out = _texts(args)
        tc = train_transcoders(
            model,
            train,
            d_tc=args.d_tc,
            k=args.k,
            kind=args.family,
            layers=layers,
            steps=args.steps,
            batch_size=args.batch_size,
            seed=args.seed,
            exclude_first_token=args.exclude_first_token,
            eval_texts=held_out,
            progress=not args.quiet,
        )
        if not ranks.is_main:
            return 0
        path = out.commit(lambda tmp: tc.save(tmp))
    if held_out is not None:
        print(tc.metrics.to_frame().to_string(index=False))
        s = tc.metrics.summary().iloc[0]
        print(
            f"mean FVU {s.mean_fvu:.4f} (worst {s.max_fvu:.4f}), L0 {s.mean_l0:.1f}, dead <= "
            f"{s.max_dead_fraction:.1%}, replacement reward r {s.reward_pearson:.3f}, decisions kept "
            f"{s.decision_agreement:.1%}"
        )
    print(f"wrote {path}")
    return 0
