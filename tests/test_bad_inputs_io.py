"""Careless inputs that could destroy or expose the user's data: report directories, `--out` of every
command, symlinks, permissions, monitor logs. Each case is tagged with its class:

- ``data-loss``: a run must never delete or overwrite a file it did not write;
- ``traceback``: a damaged input gives one clear line, never a traceback.
"""

import json
import os
import stat
from pathlib import Path

import pytest

from reward_lens.app.cli import main
from reward_lens.app.output import MARKER, ReportDir, check_out_dir


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def _report(out: Path) -> Path:
    with ReportDir(out) as rd:
        rd.commit(
            lambda d: ((d / "results.json").write_text('{"run": 1}'), (d / "report.html").write_text("r1"))
        )
    return out


# ------------------------------------------------------------------------------- report directories
def _notes(out):
    (out / "notes.md").write_text("my notes")


def _pairs_inside(out):
    (out / "pairs.jsonl").write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n')


def _subdir(out):
    (out / "figures").mkdir()
    (out / "figures" / "mine.png").write_bytes(b"png")


FOREIGN = [  # (class, name, what the user added to an earlier report, the files the message must name)
    ("data-loss", "notes.md", _notes, ["notes.md"]),
    ("data-loss", "pairs file inside", _pairs_inside, ["pairs.jsonl"]),
    ("data-loss", "a sub-directory", _subdir, ["figures"]),
]


@pytest.mark.parametrize("cls,name,add,names", FOREIGN, ids=[c[1] for c in FOREIGN])
def test_a_report_dir_holding_the_users_files_is_refused_naming_them(tmp_path, capsys, cls, name, add, names):
    out = _report(tmp_path / "o")
    add(out)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(ValueError) as info:
        check_out_dir(out)
    message = one_line(str(info.value))
    assert all(n in message for n in names) and "did not write" in message
    assert main(["audit", "--out", str(out), "--max-pairs", "1"]) == 2  # refused before the model is loaded
    assert all(n in one_line(capsys.readouterr().err) for n in names)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_the_marker_lists_what_the_report_wrote_and_only_that_is_replaced(tmp_path):
    out = _report(tmp_path / "o")
    assert json.loads((out / MARKER).read_text())["files"] == ["report.html", "results.json"]
    with ReportDir(out) as rd:  # a file the user adds while the run is going is kept, not deleted
        rd.commit(
            lambda d: ((out / "notes.md").write_text("mine"), (d / "results.json").write_text('{"run": 2}'))
        )
    assert (out / "notes.md").read_text() == "mine"
    assert json.loads((out / "results.json").read_text()) == {"run": 2}
    assert not (out / "report.html").exists()  # written by the earlier report: replaced as a set
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_the_pairs_file_inside_out_is_refused_before_any_work(tmp_path, capsys):
    out = _report(tmp_path / "o")
    pairs = out / "results.json"  # a file the report wrote, given as --pairs
    pairs.write_text('[{"prompt": "q", "chosen": "a", "rejected": "b"}]')
    assert main(["audit", "--pairs", str(pairs), "--out", str(out)]) == 2
    assert "lies inside --out" in one_line(capsys.readouterr().err)
    assert pairs.exists()


def test_a_symlinked_out_is_followed_and_a_dangling_one_refused_up_front(tmp_path, capsys):
    target = _report(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(target)
    with ReportDir(link) as rd:
        rd.commit(lambda d: (d / "results.json").write_text('{"run": 2}'))
    assert link.is_symlink() and link.resolve() == target  # the link is kept, its target has the new report
    assert json.loads((target / "results.json").read_text()) == {"run": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no .link.old-* left
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert main(["audit", "--out", str(dangling)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "symbolic link" in line and "does not exist" in line and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("mode", [0o2775, 0o755, 0o750])
def test_a_rerun_keeps_the_report_dirs_permissions(tmp_path, mode):
    out = _report(tmp_path / "o")
    os.chmod(out, mode)
    _report(out)
    assert stat.S_IMODE(out.stat().st_mode) == mode


def test_a_new_report_dir_gets_the_umasks_mode(tmp_path):
    old = os.umask(0o022)
    try:
        out = _report(tmp_path / "new")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


# ------------------------------------------------------------------------------- monitor --out and logs
def _log(path: Path, *records) -> Path:
    base = {"kind": "run", "format": 1, "model": "m", "every": 2, "sample_size": 4}
    check = {
        "kind": "baseline",
        "step": 1,
        "n": 4,
        "metrics": {"reward/mean": {"value": 0.5, "ci_low": 0.1, "ci_high": 0.9}},
        "flags": [],
        "cost_s": 0.1,
    }
    batch = {"kind": "batch", "step": 1, "n": 4, "reward/mean": 0.4}
    rows = [base, check, batch] + list(records)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_monitor_renders_a_good_log_and_rerenders_its_own_page(tmp_path, capsys):
    log = _log(tmp_path / "rm.jsonl")
    assert main(["monitor", str(log)]) == 0
    page = tmp_path / "rm.html"
    assert "reward-lens training monitor" in page.read_text()
    assert main(["monitor", str(log), "--out", str(page)]) == 0  # its own earlier page: replaced


MONITOR_OUT = [  # (class, name, --out given, words)
    ("data-loss", "--out is the log", lambda t: t / "rm.jsonl", "is the input file itself"),
    (
        "data-loss",
        "--out is a symlink to the log",
        lambda t: _link(t / "alias.html", t / "rm.jsonl"),
        "is the input file itself",
    ),
    (
        "data-loss",
        "--out is the user's file",
        lambda t: _file(t / "thesis.html", "<html>my thesis</html>"),
        "not written by reward-lens",
    ),
    ("data-loss", "--out is a directory", lambda t: _dir(t / "pages"), "is a directory"),
]


def _link(link, target):
    link.symlink_to(target)
    return link


def _file(path, text):
    path.write_text(text)
    return path


def _dir(path):
    path.mkdir()
    return path


@pytest.mark.parametrize("cls,name,out,words", MONITOR_OUT, ids=[c[1] for c in MONITOR_OUT])
def test_monitor_out_gets_the_same_checks_as_audit(tmp_path, capsys, cls, name, out, words):
    log = _log(tmp_path / "rm.jsonl")
    target = out(tmp_path)
    before = {p.name: (p.read_bytes() if p.is_file() else None) for p in tmp_path.iterdir()}
    assert main(["monitor", str(log), "--out", str(target)]) == 2
    assert words in one_line(capsys.readouterr().err)
    assert {p.name: (p.read_bytes() if p.is_file() else None) for p in tmp_path.iterdir()} == before


def _bytes(data):
    return lambda p: p.write_bytes(data)


def _lines(*lines):
    return lambda p: p.write_text("".join(line + "\n" for line in lines))


_GOOD = json.dumps(
    {"kind": "baseline", "step": 1, "metrics": {"reward/mean": {"value": 0.5, "ci_low": 0.1, "ci_high": 0.9}}}
)
MONITOR_LOGS = [  # (class, name, how the log is written, words)
    ("traceback", "empty", _bytes(b""), "is empty"),
    ("traceback", "only blank lines", _bytes(b"\n\n"), "is empty"),
    ("traceback", "non-UTF-8", _bytes(b'{"kind": "run", "model": "caf\xe9"}\n'), "not UTF-8"),
    ("traceback", "not JSON", _lines('{"kind": "run"}', "garbage"), "line 2 is not JSON"),
    ("traceback", "check without metrics", _lines('{"kind": "check", "step": 3}'), "without 'metrics'"),
    ("traceback", "step as text", _lines('{"kind": "batch", "step": "three"}'), "'step' is 'three'"),
    (
        "traceback",
        "metric without interval",
        _lines('{"kind": "check", "step": 3, "metrics": {"r": {"value": 1}}}'),
        "metric 'r' needs numeric value, ci_low and ci_high",
    ),
    ("traceback", "newer format", _lines('{"kind": "run", "format": 9}', _GOOD), "log format 9 is newer"),
    ("traceback", "a list per line", _lines("[1, 2]"), "has kind None"),
    ("traceback", "a directory", lambda p: p.mkdir(), "is a directory"),
]


@pytest.mark.parametrize("cls,name,write,words", MONITOR_LOGS, ids=[c[1] for c in MONITOR_LOGS])
def test_damaged_monitor_logs_are_one_line(tmp_path, capsys, cls, name, write, words):
    log = tmp_path / "rm.jsonl"
    write(log)
    assert main(["monitor", str(log), "--out", str(tmp_path / "page.html")]) == 2
    assert words in one_line(capsys.readouterr().err)
    assert not (tmp_path / "page.html").exists()


def test_a_log_cut_short_by_a_running_or_killed_job_renders_what_is_whole(tmp_path, capsys):
    log = _log(tmp_path / "rm.jsonl")
    with open(log, "a") as f:
        f.write('{"kind": "check", "step": 2, "metr')
    with pytest.warns(UserWarning, match="line 4 is cut short"):
        assert main(["monitor", str(log)]) == 0
    assert (tmp_path / "rm.html").exists()


def test_a_log_with_only_batch_records_renders(tmp_path, capsys):
    log = tmp_path / "rm.jsonl"
    log.write_text('{"kind": "run", "format": 1}\n{"kind": "batch", "step": 1, "reward/mean": 0.1}\n')
    assert main(["monitor", str(log)]) == 0
    assert "0 flag(s)" in (tmp_path / "rm.html").read_text()


def test_a_damaged_sweep_part_is_one_line_and_recomputed_once_deleted(tmp_path, capsys):
    out = tmp_path / "sw"
    argv = ["sweep", "--out", str(out), "--max-pairs", "2", "--chunk-size", "1"]
    assert main(argv) == 0
    table = (out / "sweep.csv").read_text()
    part = out / "parts" / "chunk-00000.parquet"
    part.write_bytes(b"garbage")
    capsys.readouterr()
    assert main(argv + ["--quiet"]) == 2  # progress lines aside, the error is one line
    assert "chunk-00000.parquet is damaged" in one_line(capsys.readouterr().err)
    part.unlink()
    assert main(argv) == 0
    assert (out / "sweep.csv").read_text() == table
