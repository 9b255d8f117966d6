"""The command line answers at once: --help and argument errors import no torch (checked in a fresh
interpreter: which modules got imported, not a timing); results on stdout, progress on stderr; --quiet and
--verbose; examples and defaults in each --help."""

import argparse
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "transformer_lens", "pandas", "scipy", "matplotlib")

PROBE = """
import json, sys
from reward_lens.app.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
print(json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
""".format(HEAVY=HEAVY)


def run_probe(*args):
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True)
    return json.loads(out.stderr.strip().splitlines()[-1]), out


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["audit", "--help"],
        ["evaluate", "--help"],
        ["sweep", "--help"],
        ["bench", "--help"],
        ["--version"],
        ["audit", "--max-pairs", "0"],
        ["audit", "--bogus"],
        ["audit", "--pairs", "no-such-file.jsonl"],
        ["evaluate", "no-such-file.jsonl"],
        ["audit", "--quiet", "--verbose"],
        ["audit", "--patch-modes", "noising,zeros"],
    ],
)
def test_help_and_argument_errors_import_no_torch(args):
    got, out = run_probe(*args)
    assert got["heavy"] == [], f"{args} imported {got['heavy']}"
    assert got["code"] in (0, 2)
    if got["code"] == 2:  # one line naming the problem
        assert len([line for line in out.stderr.splitlines() if "error" in line]) == 1


def test_every_help_has_examples_and_states_defaults():
    from reward_lens.app.cli import build_parser

    parser = build_parser()
    for name, command in parser.subcommands.items():
        text = command.format_help()
        assert "examples:\n  reward-lens " + name in text, name
        assert "--quiet" in text and "--verbose" in text, name
        for action in command._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                assert "default" in action.help, f"{name} {action.option_strings[0]}: no default stated"


def test_benchmark_names_match_the_registry():
    from reward_lens.app.cli import BENCHMARK_NAMES
    from reward_lens.evaluation import BENCHMARKS

    assert tuple(sorted(BENCHMARKS)) == BENCHMARK_NAMES


def test_results_on_stdout_progress_on_stderr(tmp_path, capsys):
    from reward_lens.app.cli import main

    assert main(["audit", "--out", str(tmp_path / "r"), "--max-pairs", "4", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert "pair accuracy" in out and "[reward-lens]" not in out
    assert "[reward-lens] hacking probes ..." in err and " s\n" in err  # --verbose: each step's time
    assert main(["audit", "--out", str(tmp_path / "r"), "--max-pairs", "4", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "pair accuracy" in out and err == ""
