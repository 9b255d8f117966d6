"""Every command that writes files (`audit`, `evaluate`, `bench`, `triggers`, `compare`, `sweep`,
`monitor`) follows the audit's report-directory rules, each checked per command. Each case is tagged with
its class:

- ``data-loss``: the user's files are kept (an earlier report holding them is refused, naming them), a
  full disk leaves the earlier report whole (nothing half-written, no temporary left behind);
- ``traceback``: a held lock, a dangling symlink or a read-only place is one line, before any work.

A refusal "before any work" is checked by the model loader not being called.
"""

import errno
import json
import os
from pathlib import Path

import pytest

import reward_lens as rl
import reward_lens.app.cli as cli
from reward_lens.app import output, sweep
from reward_lens.app.cli import main
from reward_lens.app.output import MARKER, ReportDir

COMMANDS = ["audit", "evaluate", "bench", "triggers", "compare", "sweep", "monitor"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    pairs = rl.demo_pairs()[:2]
    (root / "pairs.jsonl").write_text(
        "".join(
            json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}) + "\n" for p in pairs
        )
    )
    rows = [
        {
            "pair_id": f"p{i}",
            "question": p.prompt,
            "response_A": p.chosen,
            "response_B": p.rejected,
            "label": "A>B",
        }
        for i, p in enumerate(pairs)
    ]
    (root / "judge.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = {"kind": "run", "format": 1, "model": "m", "every": 2, "sample_size": 4}
    check = {
        "kind": "baseline",
        "step": 1,
        "n": 4,
        "metrics": {"reward/mean": {"value": 0.5, "ci_low": 0.1, "ci_high": 0.9}},
        "flags": [],
        "cost_s": 0.1,
    }
    (root / "rm.jsonl").write_text(json.dumps(run) + "\n" + json.dumps(check) + "\n")
    return root


def argv(command, inputs, out):
    p = str(inputs / "pairs.jsonl")
    return {
        "audit": ["audit", "--pairs", p, "--max-pairs", "1", "--out", out],
        "evaluate": ["evaluate", str(inputs / "judge.jsonl"), "--out", out],
        "bench": ["bench", "--only", "demo/length", "--quick", "--out", out],
        "triggers": ["triggers", "--pairs", p, "--length", "1", "--top-k", "2", "--out", out],
        "compare": ["compare", "demo", "demo", "--pairs", p, "--max-pairs", "1", "--out", out],
        "sweep": ["sweep", "--pairs", p, "--chunk-size", "1", "--levels", "component", "--out", out],
        "monitor": ["monitor", str(inputs / "rm.jsonl"), "--out", out],
    }[command]


def out_path(command, tmp_path):
    return tmp_path / ("page.html" if command == "monitor" else "out")


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command gets as far as loading a model or running its work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the output was not checked before the work started")

    monkeypatch.setattr(cli, "load_model", refuse)
    import reward_lens.app.bench as bench
    import reward_lens.app.bench_cli as bench_cli
    import reward_lens.app.monitor as monitor
    import reward_lens.app.preflight_cli as preflight_cli
    import reward_lens.app.transcoder_cli as transcoder_cli

    monkeypatch.setattr(bench, "run_bench", refuse)
    monkeypatch.setattr(bench_cli, "load_named", refuse)
    for module in (preflight_cli, transcoder_cli):
        monkeypatch.setattr(module, "load_model", refuse)
    monkeypatch.setattr(monitor, "load_monitor", refuse)


def refused(capsys, code, words):
    captured = capsys.readouterr()
    lines = [line for line in captured.err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert all(w in lines[0] for w in words), lines[0]


def earlier_report(command, out: Path, inputs) -> dict:
    """An earlier output of `command` at `out` (as reward-lens writes it): {relative path: bytes}."""
    if command == "monitor":
        assert main(argv("monitor", inputs, str(out))) == 0
    elif command == "sweep":
        assert main(argv("sweep", inputs, str(out))) == 0
        (out / "parts" / "chunk-00001.parquet").unlink()  # one part still to do
        (out / "sweep.parquet").unlink()
    else:
        with ReportDir(out) as rd:
            rd.commit(
                lambda d: (
                    (d / "results.json").write_text('{"run": 1}'),
                    (d / "summary.csv").write_text("a\n1\n"),
                )
            )
    files = [out] if out.is_file() else [f for f in out.rglob("*") if f.is_file()]
    return {str(f.relative_to(out.parent)): f.read_bytes() for f in files}


def snapshot(root: Path) -> dict:
    return {
        str(f.relative_to(root)): f.read_bytes()
        for f in root.rglob("*")
        if f.is_file() and ".lock" not in f.name
    }


# --------------------------------------------------------------------------- refused before any work
@pytest.mark.parametrize("command", COMMANDS)
def test_a_held_lock_is_refused_before_any_work(command, inputs, tmp_path, capsys, no_work):
    out = out_path(command, tmp_path)
    lock = out.with_name(out.name + ".lock")
    lock.write_text(str(os.getppid()))  # a live process holds it
    refused(capsys, main(argv(command, inputs, str(out))), ["another reward-lens run", "lock"])
    assert lock.read_text() == str(os.getppid()) and not out.exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_the_users_files_are_never_replaced(command, inputs, tmp_path, capsys, no_work):
    out = out_path(command, tmp_path)
    if command == "monitor":
        out.write_text("<html>my thesis</html>")
        words = ["not written by reward-lens"]
    elif command == "sweep":
        out.mkdir()
        (out / "notes.md").write_text("mine")
        words = ["not a reward-lens sweep"]
    else:
        out.mkdir()
        (out / MARKER).write_text(json.dumps({"written_by": "reward-lens", "files": ["results.json"]}))
        (out / "results.json").write_text("{}")
        (out / "notes.md").write_text("mine")
        words = ["notes.md", "move them out"]
    before = snapshot(tmp_path)
    refused(capsys, main(argv(command, inputs, str(out))), words)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", COMMANDS)
def test_a_dangling_symlink_is_refused_before_any_work(command, inputs, tmp_path, capsys, no_work):
    out = out_path(command, tmp_path)
    out.symlink_to(tmp_path / "gone")
    refused(capsys, main(argv(command, inputs, str(out))), ["dangling" if command != "monitor" else "gone"])
    assert out.is_symlink() and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_read_only_place_is_refused_before_any_work(
    command, inputs, tmp_path, capsys, no_work, monkeypatch
):
    place = tmp_path / "ro"
    place.mkdir()
    real = output.tempfile.TemporaryFile

    def read_only(*args, dir=None, **kwargs):  # a read-only mount (chmod does not stop root)
        if dir is not None and Path(dir).resolve() == place.resolve():
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(output.tempfile, "TemporaryFile", read_only)
    out = out_path(command, place)
    refused(capsys, main(argv(command, inputs, str(out))), ["cannot write in", "read-only"])
    assert list(place.iterdir()) == []


# --------------------------------------------------------------------------- a full disk
def _disk_full(monkeypatch):
    """The last write of every output fails with ENOSPC, after the command's real writes."""

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    real_commit = ReportDir.commit

    def commit(self, write):
        return real_commit(self, lambda tmp: (write(tmp), full(tmp / "results.json")))

    real_atomic = sweep.write_atomic
    monkeypatch.setattr(ReportDir, "commit", commit)
    monkeypatch.setattr(
        sweep, "write_atomic", lambda path, write: real_atomic(path, lambda t: (write(t), full(t)))
    )
    real_chmod = output.os.chmod

    def chmod(path, mode, *args, **kwargs):  # write_text_atomic: the page written, then the disk is full
        if ".tmp-" in Path(path).name:
            full(path)
        return real_chmod(path, mode, *args, **kwargs)

    monkeypatch.setattr(output.os, "chmod", chmod)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_full_disk_leaves_the_earlier_report_whole(command, inputs, tmp_path, capsys, monkeypatch):
    out = out_path(command, tmp_path)
    before = earlier_report(command, out, inputs)
    capsys.readouterr()
    _disk_full(monkeypatch)
    code = main(argv(command, inputs, str(out)) + ["--quiet"])  # progress lines aside, the error is one line
    refused(capsys, code, ["No space left on device"])
    after = {k: v for k, v in snapshot(tmp_path).items()}
    assert after == before, sorted(set(after) ^ set(before))  # nothing half-written, no temporary left
    assert not out.with_name(out.name + ".lock").exists()
