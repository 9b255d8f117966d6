"""What every `reward-lens` subcommand shares on top of its own options: examples at the end of its --help,
each option's default stated, `--quiet` / `--verbose`, and progress lines on stderr (results go to stdout).

Imports nothing heavy: the parser is built, and --help answered, without torch."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict

EXAMPLES: Dict[str, tuple] = {
    "audit": (
        "reward-lens audit                                  # the embedded demo model, its 240 pairs",
        "reward-lens audit --model smollm2-organism --max-pairs 16",
        "reward-lens audit --model Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 --pairs pairs.jsonl \\\n"
        "    --dtype bfloat16 --batch-size auto --out skywork-report",
    ),
    "evaluate": (
        "reward-lens evaluate rmbench.jsonl                  # layout recognised by its columns",
        "reward-lens evaluate --benchmark rewardbench2 rb2.parquet --model ./my-rm --out rb2-eval",
    ),
    "compare": ("reward-lens compare demo ./my-rm --max-pairs 64",),
    "sweep": (
        "reward-lens sweep --instruments patch,atp --levels component,head --out sweep",
        "reward-lens sweep --modes noising,denoising,zero,mean --pairs pairs.jsonl --out sweep  # resumes",
    ),
    "monitor": ("reward-lens monitor rm_monitor.jsonl              # writes rm_monitor.html",),
    "preflight": ("reward-lens preflight --policy organism --prompts prompts.jsonl --out preflight",),
    "bench": ("reward-lens bench --quick", "reward-lens bench --only trigger,circuit"),
    "triggers": (
        "reward-lens triggers --model trigger-organism --where prompt_end",
        "reward-lens triggers --length 3 --top-k 10        # GCG for 3-token strings",
    ),
    "train-transcoders": (
        "reward-lens train-transcoders --out demo-tc        # the demo RM, its generators' fresh draws",
        "reward-lens train-transcoders --model ./my-rm --pairs train.jsonl --eval-pairs held.jsonl --out tc",
    ),
}

VERBOSITY_HELP = {
    "--quiet": "print only the results (no progress lines or bars on stderr)",
    "--verbose": "also print each step's time on stderr",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks; wraps option help as argparse does."""


def add_examples_and_verbosity(parser: argparse.ArgumentParser, commands: Dict[str, argparse.ArgumentParser]):
    """For each subcommand: --quiet / --verbose (exclusive), its examples as the --help epilog, and every
    option's default stated where its help does not say it already."""
    parser.formatter_class = HelpFormatter
    parser.epilog = "examples:\n  reward-lens audit\n  reward-lens audit --help"
    # also before the command, as git and pip take them (`reward-lens --quiet audit`); merged by global_flags
    top = parser.add_mutually_exclusive_group()
    top.add_argument(
        "-q", "--quiet", dest="global_quiet", action="store_true", help=VERBOSITY_HELP["--quiet"]
    )
    top.add_argument(
        "-v", "--verbose", dest="global_verbose", action="store_true", help=VERBOSITY_HELP["--verbose"]
    )
    parser.add_argument(
        "--debug", dest="global_debug", action="store_true", help="show the full traceback of an error"
    )
    for name, command in commands.items():
        group = command.add_mutually_exclusive_group()
        group.add_argument("-q", "--quiet", action="store_true", help=VERBOSITY_HELP["--quiet"])
        group.add_argument("-v", "--verbose", action="store_true", help=VERBOSITY_HELP["--verbose"])
        command.formatter_class = HelpFormatter
        if name in EXAMPLES:
            command.epilog = "examples:\n" + "\n".join("  " + line for line in EXAMPLES[name])
        for action in command._actions:
            state_default(action)


def state_default(action: argparse.Action) -> None:
    """' (default: X)' after an option's help when it has a default and the help does not mention one."""
    if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
        return
    if action.help == argparse.SUPPRESS or "default" in (action.help or ""):
        return
    action.help = (
        f"{action.help} (default: {action.default})" if action.help else f"default: {action.default}"
    )


def progress_echo(args: argparse.Namespace) -> Callable[[str], None]:
    """Where a command's progress lines go: stderr, or nowhere with --quiet."""
    if getattr(args, "quiet", False):
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)


def global_flags(args: argparse.Namespace, command: argparse.ArgumentParser) -> None:
    """--quiet / --verbose / --debug given before the command count as given after it; --quiet with
    --verbose (one on each side) is refused as argparse refuses them together."""
    quiet = bool(getattr(args, "quiet", False) or args.global_quiet)
    verbose = bool(getattr(args, "verbose", False) or args.global_verbose)
    if quiet and verbose:
        command.error("argument -v/--verbose: not allowed with argument -q/--quiet")
    args.quiet, args.verbose = quiet, verbose
    args.debug = bool(getattr(args, "debug", False) or args.global_debug)
    for name in ("global_quiet", "global_verbose", "global_debug"):
        delattr(args, name)
