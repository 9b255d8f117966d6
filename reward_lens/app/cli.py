"""The `reward-lens` command line: `audit` (the main job), `evaluate`, `compare`, `sweep` and `monitor`.

`audit`, `compare` and `sweep` run data-parallel when launched by torchrun (`reward_lens.distributed`).
Parsing, `--help` and argument errors import no torch: every heavy import is inside the command functions
(`tests/test_cli_speed.py`). Results go to stdout; progress lines and bars to stderr (`--quiet`: none;
`--verbose`: each step's time as well)."""

from __future__ import annotations

import argparse
import pickle
import sys
import warnings
from pathlib import Path
from typing import List, Optional

from reward_lens.app.bench_cli import add_commands as add_bench_commands
from reward_lens.app.cli_help import add_examples_and_verbosity, global_flags, progress_echo
from reward_lens.app.options import CLIError, load_model, validate_args
from reward_lens.app.preflight_cli import add_preflight_command
from reward_lens.app.transcoder_cli import add_commands as add_transcoder_commands
from reward_lens.version import __version__

# Options that change what is printed, not what is computed: left out of results.json's options
RUN_ONLY = ("func", "debug", "quiet", "verbose")

# What a user can cause (bad paths, values, files, checkpoints): one line, exit 2. Anything else is a bug
# and keeps its traceback; --debug shows the traceback of user errors too.
USER_ERRORS = (ValueError, OSError, MemoryError, CLIError, pickle.UnpicklingError)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its usage errors as one line (exit 2) like every other input error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


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


def _audit_input(path: Optional[str], model, batch_size):
    """(pairs, BenchmarkResult or None): a RewardBench 2 / RM-Bench / JudgeBench file is audited as its
    pairwise expansion (each chosen against each rejected) and scored by its official rule."""
    if path is not None:
        from reward_lens.app.benchmark import is_benchmark_file

        if is_benchmark_file(path):
            from reward_lens.evaluation import benchmark_pairs, evaluate

            size = batch_size if isinstance(batch_size, int) else 16
            # other subsets / domains on their own rows, out of "all" (audit has no --extra-subsets to ask)
            return benchmark_pairs(path), evaluate(model, path, batch_size=size, extra_subsets=True)
    return _load_pairs(path, model), None


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


def _report_dir(out: str, ranks, sweep: bool = False):
    """The locked output directory on rank 0 (the only writer); nothing on the other ranks of a torchrun."""
    import contextlib

    from reward_lens.app.output import ReportDir

    return ReportDir(out, sweep=sweep) if ranks.is_main else contextlib.nullcontext()


def cmd_audit(args) -> int:
    from reward_lens.app.audit import run_audit
    from reward_lens.app.output import provenance
    from reward_lens.distributed import Ranks

    ranks = Ranks.from_env()  # torchrun: this process's rank; one rank otherwise
    echo = progress_echo(args) if ranks.is_main else (lambda _: None)
    with _report_dir(args.out, ranks) as out:  # checked and locked before any work
        model, label = load_model(args.model, ranks.device(args.device), args.dtype, args.input_format)
        _set_threads(args.threads, model)
        pairs, bench = _audit_input(args.pairs, model, args.batch_size)
        info = provenance(args.pairs, {k: v for k, v in vars(args).items() if k not in RUN_ONLY})
        audit = run_audit(
            model,
            pairs,
            out,
            max_pairs=args.max_pairs,
            batch_size=args.batch_size,
            model_label=label,
            run_info=info,
            ranks=ranks,
            benchmark=bench,
            echo=echo,
            progress=not args.quiet,
            verbose=args.verbose,
            patch_modes=args.patch_modes,
        )
    if audit is not None:
        print(audit.summary_text())
    return 0


def cmd_evaluate(args) -> int:
    from pathlib import Path as _Path

    from reward_lens.app.output import ReportDir, provenance, write_csv, write_json
    from reward_lens.evaluation import evaluate

    with ReportDir(args.out) as out:  # checked and locked before any work
        model, label = load_model(args.model, args.device, args.dtype, args.input_format)
        _set_threads(args.threads, model)
        result = evaluate(
            model,
            args.source,
            benchmark=args.benchmark,
            batch_size=args.batch_size,
            split=args.split,
            single_game=args.single_game,
            domain=args.domain,
            extra_subsets=args.extra_subsets,
        )
        is_file = _Path(args.source).expanduser().exists()
        info = provenance(
            args.source if is_file else None,
            {k: v for k, v in vars(args).items() if k not in RUN_ONLY},
        )
        record = {
            **info,
            "model": label,
            "benchmark": result.benchmark,
            "source": result.source,
            "rule": result.rule,
            "accuracy": result.accuracy,
            "summary": result.summary().to_dict("records"),
            "details": result.details,
        }

        def write(tmp: Path) -> None:
            write_csv(tmp / "summary.csv", result.summary())
            write_csv(tmp / "scores.csv", result.to_frame())
            write_json(tmp / "results.json", record)

        path = out.commit(write)
    print(result.summary_text())
    progress_echo(args)(f"[reward-lens] wrote {path / 'summary.csv'}, scores.csv and results.json")
    return 0


def cmd_compare(args) -> int:
    from reward_lens.app.output import provenance
    from reward_lens.distributed import Ranks

    ranks = Ranks.from_env()
    with _report_dir(args.out, ranks) as out:  # checked and locked before any work
        models = {}
        for spec in args.models:
            model, label = load_model(spec, ranks.device(args.device), args.dtype, args.input_format)
            name = Path(label).name or label
            while name in models:
                name += "'"
            models[name] = model
        _set_threads(args.threads, max(models.values(), key=lambda m: m.cfg.d_model))
        pairs = _load_pairs(args.pairs, next(iter(models.values())))
        if args.max_pairs:
            pairs = pairs[: args.max_pairs]
        info = provenance(args.pairs, {k: v for k, v in vars(args).items() if k not in RUN_ONLY})
        info["world_size"] = ranks.world_size
        _write_comparison(models, pairs, args, out, info, ranks)
    return 0


def _write_comparison(models, pairs, args, out, info, ranks) -> None:
    from reward_lens.app.compare import compare_models
    from reward_lens.app.output import write_csv, write_json
    from reward_lens.app.report import Report

    result = compare_models(
        models, pairs, probes=True, batch_size=args.batch_size, progress=True, ranks=ranks
    )
    if result is None:  # a rank other than 0: its shards are in rank 0's result
        return
    report = Report("reward-lens comparison: " + " vs ".join(models))
    sec = report.section("Summary")
    sec.text(
        "Only basis-free quantities are compared: residual bases differ between models, so directions "
        "and raw activations are never compared across models; agreement, lens curves on fractional "
        "depth, crystallization depths, attribution profiles by fractional depth and probe effects are.",
        note=True,
    )
    summary = result.to_frame("summary")
    sec.table(summary)
    sec.figure(result.plot())

    def write(tmp: Path) -> None:
        report.save(tmp / "report.html")
        write_csv(tmp / "summary.csv", summary)
        write_json(tmp / "results.json", summary.to_dict("records"))
        write_json(tmp / "run.json", {**info, "models": list(models)})

    path = out.commit(write)
    print(summary.to_string(index=False))
    progress_echo(args)(f"[reward-lens] wrote {path / 'report.html'}")


def cmd_sweep(args) -> int:
    from reward_lens.distributed import Ranks

    ranks = Ranks.from_env()
    with _report_dir(args.out, ranks, sweep=True) as out:  # checked and locked before any work
        _run_sweep(args, ranks, out if ranks.is_main else args.out)
    return 0


def _run_sweep(args, ranks, out) -> None:
    from reward_lens.app.options import sweep_spec
    from reward_lens.app.output import provenance
    from reward_lens.app.sweep import run_sweep

    model, label = load_model(args.model, ranks.device(args.device), args.dtype, args.input_format)
    _set_threads(args.threads, model)
    pairs = _load_pairs(args.pairs, model)
    if args.max_pairs:
        pairs = pairs[: args.max_pairs]
    info = provenance(args.pairs, {k: v for k, v in vars(args).items() if k not in RUN_ONLY})
    run_sweep(
        model,
        pairs,
        out,
        sweep_spec(args),
        batch_size=args.batch_size,
        model_label=label,
        ranks=ranks,
        run_info=info,
        echo=progress_echo(args) if ranks.is_main else (lambda _: None),
    )


def cmd_monitor(args) -> int:
    from reward_lens.app.monitor import render_monitor

    progress_echo(args)(f"[reward-lens] wrote {render_monitor(args.log, args.out, check=True)}")
    return 0


def batch_size_arg(text: str):
    """--batch-size: an integer, or "auto"."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid batch size {text!r} (give an integer >= 1 or auto)"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="reward-lens",
        description="Mechanistic interpretability for reward models: reward lens, exact attribution, "
        "contrastive patching, hacking probes, along the reward direction w_r.",
    )
    parser.add_argument("--version", action="version", version=f"reward-lens {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    parser.subcommands = sub.choices  # name -> subparser, for errors named against the subcommand

    audit = sub.add_parser(
        "audit", help="audit one reward model (default: the embedded demo model and its pairs)"
    )
    audit.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or hub id (default: the demo model; 'smollm2-organism': the SmolLM2 "
        "organism)",
    )
    audit.add_argument(
        "--out", default="reward-lens-report", help="output directory (default: reward-lens-report)"
    )
    audit.add_argument(
        "--patch-modes",
        default="noising,denoising",
        help="comma-separated patching modes: noising, denoising, zero, mean (default noising,denoising; "
        "zero and mean ablation each add about 0.3 forwards of the pairs; noising always runs)",
    )
    add_common_options(audit)
    audit.set_defaults(func=cmd_audit)

    _add_evaluate(sub)

    compare = sub.add_parser(
        "compare", help="compare reward models on the same pairs (basis-free quantities)"
    )
    compare.add_argument(
        "models", nargs="+", metavar="MODEL", help="two or more checkpoints ('demo' for the demo)"
    )
    compare.add_argument(
        "--out", default="reward-lens-compare", help="output directory (default: reward-lens-compare)"
    )
    add_common_options(compare)
    compare.set_defaults(func=cmd_compare)

    _add_sweep_and_monitor(sub)
    add_bench_commands(sub)
    add_transcoder_commands(sub)
    add_examples_and_verbosity(parser, sub.choices)
    return parser


def add_common_options(p: argparse.ArgumentParser) -> None:
    """The options audit, compare, sweep and evaluate share."""
    p.add_argument(
        "--pairs",
        help="preference pairs (.jsonl/.json/.csv/.parquet with prompt, chosen, rejected; each a "
        "string or a list of role/content messages)",
    )
    p.add_argument(
        "--input-format",
        default="auto",
        help="how pairs become token ids: auto (default: chat if the tokenizer has a template, else "
        "plain), chat, concat (TRL standard data), openrlhf, plain, or a template string with "
        "{prompt} and {response}",
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16 or float64")
    p.add_argument("--max-pairs", type=int, default=None, help="use only the first N pairs")
    p.add_argument(
        "--batch-size",
        type=batch_size_arg,
        default=8,
        help="pairs per batch (default 8), or auto: start by device and halve on out-of-memory",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 for models with d_model <= 1024 on CPU, else torch's)",
    )
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")


def _add_sweep_and_monitor(sub) -> None:
    sweep = sub.add_parser(
        "sweep",
        help="ablation sweep (patching / AtP / attribution) into one tidy parquet; resumable, torchrun-aware",
    )
    sweep.add_argument(
        "--model", default=None, help="checkpoint directory or hub id (default: the demo model)"
    )
    sweep.add_argument("--out", default="reward-lens-sweep", help="output directory; rerun into it to resume")
    sweep.add_argument(
        "--instruments", default="patch", help="comma-separated: patch, atp, attribute (default patch)"
    )
    sweep.add_argument("--levels", default="component", help="comma-separated: component, head, residual")
    sweep.add_argument("--modes", default="noising", help="comma-separated: noising, denoising, zero, mean")
    sweep.add_argument("--positions", default="readout", help="readout (default), prompt or all")
    sweep.add_argument(
        "--method", default="fast", help="patching method: fast (KV-cache readout path) or naive"
    )
    sweep.add_argument("--chunk-size", type=int, default=64, help="pairs per resumable part (default 64)")
    add_common_options(sweep)
    sweep.set_defaults(func=cmd_sweep)

    monitor = sub.add_parser(
        "monitor", help="render a RewardLensCallback training log (JSONL) as an HTML page"
    )
    monitor.add_argument(
        "log", metavar="LOG.jsonl", help="the log_path of reward_lens.integrations.trl's callback"
    )
    monitor.add_argument("--out", default=None, help="output HTML file (default: LOG with .html)")
    monitor.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    monitor.set_defaults(func=cmd_monitor)

    add_preflight_command(sub)


# reward_lens.evaluation.BENCHMARKS' names (spelled here: importing it imports torch; a test keeps them equal)
BENCHMARK_NAMES = ("judgebench", "rewardbench", "rewardbench2", "rmbench")


def _add_evaluate(sub) -> None:
    ev = sub.add_parser(
        "evaluate",
        help="score a reward model on RewardBench 2, RM-Bench, JudgeBench or RewardBench by the official "
        "rules; prints the summary, writes CSVs",
    )
    ev.add_argument(
        "source", metavar="FILE", help="benchmark file (.jsonl/.json/.csv/.parquet) or hub dataset id"
    )
    ev.add_argument(
        "--benchmark",
        default="auto",
        choices=["auto", *BENCHMARK_NAMES],
        help="the benchmark's layout and rule (default auto: recognised by the columns)",
    )
    ev.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the demo model)")
    ev.add_argument("--out", default="reward-lens-eval", help="output directory (default: reward-lens-eval)")
    ev.add_argument("--batch-size", type=int, default=16, help="responses per forward pass (default 16)")
    ev.add_argument(
        "--split", default=None, help="one split of a hub dataset (default: the benchmark's official split)"
    )
    ev.add_argument(
        "--single-game",
        action="store_true",
        help="JudgeBench: one order per pair, as run_judge.py --single_game (default: both orders)",
    )
    ev.add_argument(
        "--domain", default=None, help="RM-Bench: the domain of a per-domain file's rows (chat, math, ...)"
    )
    ev.add_argument(
        "--extra-subsets",
        action="store_true",
        help="score subsets (RewardBench 2) or domains (RM-Bench) that are not the benchmark's own apart: "
        "their own rows, not in 'all' (default: refused)",
    )
    ev.add_argument("--input-format", default="auto", help="how texts become token ids (as for audit)")
    ev.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available, else cpu)")
    ev.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16 or float64")
    ev.add_argument("--threads", type=int, default=None, help="torch CPU threads (as for audit)")
    ev.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    ev.set_defaults(func=cmd_evaluate, pairs=None, max_pairs=None)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings as the CLI's other messages: one line, no source excerpt."""
    return f"reward-lens: warning: {message}\n"


def main(argv: Optional[List[str]] = None) -> int:
    """The `reward-lens` command (and `python -m reward_lens`): exit 0, 2 for a user error, 130 on Ctrl-C."""
    previous = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    try:
        return run_command(argv)
    finally:
        warnings.formatwarning = previous


def run_command(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named against the subcommand, whose --help lists its options
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    global_flags(args, parser.subcommands[args.command])
    if getattr(args, "models", None) is not None and len(args.models) < 2:
        print("reward-lens compare: error: give at least two models to compare", file=sys.stderr)
        return 2
    from reward_lens.app.output import WRITTEN

    written_before = len(WRITTEN)
    try:
        if args.command in ("audit", "evaluate", "compare", "sweep"):  # every option checked before any work
            validate_args(args)
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        if len(WRITTEN) > written_before and args.command != "sweep":  # after the swap: the report is whole
            print(
                f"reward-lens {args.command}: interrupted after the report was written; {WRITTEN[-1]} is "
                "complete",
                file=sys.stderr,
            )
            return 0
        done = (
            "finished chunks are kept; rerun the same command to resume"
            if args.command == "sweep"
            else "no partial report was written"
        )
        print(f"reward-lens {args.command}: interrupted; {done}", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        if args.debug:
            raise
        text = str(exc).strip()
        message = text.splitlines()[0] if text else type(exc).__name__
        if (
            isinstance(exc, OSError)
            and not isinstance(exc, FileNotFoundError)
            and exc.filename
            and exc.filename not in message
        ):
            message += f" ({exc.filename})"
        print(f"reward-lens {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
