"""The `bench` and `triggers` subcommands of the CLI (`reward_lens.app.cli` adds them with `add_commands`)."""

from __future__ import annotations

import sys
from pathlib import Path

from reward_lens.app.options import (
    NAMED_MODELS,
    CLIError,
    check_device,
    check_local_model_spec,
    check_pairs_file,
    check_positive_options,
    load_model,
    split_list,
)
from reward_lens.app.output import ReportDir, write_csv


def add_commands(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="score every instrument against the organisms' planted mechanisms (bench.csv, results.json, "
        "bench.html; exit 0 when every row meets its goal)",
    )
    bench.add_argument(
        "--out", default="reward-lens-bench", help="output directory (default: reward-lens-bench)"
    )
    bench.add_argument(
        "--only",
        default=None,
        help="comma-separated organisms, mechanisms or instruments (e.g. trigger,circuit or demo/length)",
    )
    bench.add_argument("--device", default=None, help="cpu (default) or cuda[:i]")
    bench.add_argument("--quick", action="store_true", help="the reduced subset (no SmolLM2, no GCG)")
    bench.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    bench.set_defaults(func=cmd_bench)

    trig = sub.add_parser(
        "triggers", help="search the strings that most raise a reward when inserted (CSV + plot)"
    )
    trig.add_argument(
        "--model", default="demo", help=f"checkpoint directory or one of {', '.join(NAMED_MODELS)}"
    )
    trig.add_argument(
        "--pairs",
        default=None,
        help="pairs file (prompt + response, or preference pairs: their rejected response); default: the "
        "named organism's items",
    )
    trig.add_argument("--where", default="response_end", help="response_end (default) or prompt_end")
    trig.add_argument("--length", type=int, default=1, help="tokens per string (1: exhaustive; more: GCG)")
    trig.add_argument("--top-k", type=int, default=20)
    trig.add_argument("--method", default="fast", help="fast (shared-prefix cache) or naive (full forwards)")
    trig.add_argument("--max-pairs", type=int, default=None, help="use only the first N items")
    trig.add_argument("--batch-size", type=int, default=256, help="candidates per forward (default 256)")
    trig.add_argument("--device", default=None, help="cpu (default) or cuda[:i]")
    trig.add_argument("--out", default="reward-lens-triggers", help="output directory")
    trig.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    trig.set_defaults(func=cmd_triggers)


def cmd_bench(args) -> int:
    from reward_lens.app.bench import run_bench, write_bench
    from reward_lens.app.bench_registry import all_checks, select

    check_device(args.device)
    only = split_list(args.only) if args.only else None
    try:
        select(all_checks(), only, args.quick)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    with ReportDir(args.out) as out:  # checked and locked before any work, swapped in whole at the end
        result = run_bench(only, device=args.device or "cpu", quick=args.quick)
        path = out.commit(lambda tmp: write_bench(result, tmp))
    print(f"wrote {path / 'bench.csv'}, results.json and bench.html")
    s = result.summary().to_dict("records")[0]
    print(f"{s['passed']} of {s['rows']} rows meet their goal; {s['pending']} pending; {s['seconds']} s")
    return 0 if result.passed else 1


def load_named(spec: str, device):
    """The model a --model names (`reward_lens.app.options.load_model`)."""
    return load_model(spec, device)[0]


def default_items(spec: str):
    if spec == "trigger-organism":
        from reward_lens.demo.organisms import trigger_items

        return trigger_items()
    if spec == "demo":
        from reward_lens.demo import demo_pairs

        return demo_pairs()
    raise CLIError(f"give --pairs for --model {spec} (only the named organisms have default items)")


def cmd_triggers(args) -> int:
    from reward_lens.data.pairs import load_pairs
    from reward_lens.instruments.triggers import INSERTION_POINTS, METHODS, search_triggers

    check_device(args.device)
    check_positive_options(args, ("--length", "--top-k", "--max-pairs", "--batch-size"))
    if args.where not in INSERTION_POINTS:
        raise CLIError(f"--where must be one of {', '.join(INSERTION_POINTS)}, got {args.where!r}")
    if args.method not in METHODS:
        raise CLIError(f"--method must be one of {', '.join(METHODS)}, got {args.method!r}")
    check_local_model_spec(args.model)
    check_pairs_file(args.pairs)
    with ReportDir(args.out) as out:  # checked and locked before any work, swapped in whole at the end
        items = load_pairs(args.pairs) if args.pairs else default_items(args.model)
        items = list(items)[: args.max_pairs] if args.max_pairs else list(items)
        model = load_named(args.model, args.device or "cpu")
        res = search_triggers(
            model,
            items,
            where=args.where,
            length=args.length,
            top_k=args.top_k,
            method=args.method,
            batch_size=args.batch_size,
        )

        def write(tmp: Path) -> None:
            write_csv(tmp / "triggers.csv", res.to_frame())
            res.plot().savefig(tmp / "triggers.png", dpi=120, bbox_inches="tight")

        path = out.commit(write)
    print(res.to_frame().head(10).to_string(index=False))
    print(
        f"wrote {path / 'triggers.csv'} and {path / 'triggers.png'} ({res.cost['seconds']:.1f} s)",
        file=sys.stderr,
    )
    return 0
