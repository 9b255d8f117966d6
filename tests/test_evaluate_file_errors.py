"""A benchmark file's row errors name the file (as `load_pairs`'s do), and `split=` on a file (which has no
splits) is refused instead of silently ignored: in Python and from the shell (one line, exit code 2)."""

import json

import pytest

import reward_lens as rl
from reward_lens.app.cli import main
from reward_lens.evaluation import BenchmarkFormatError, SourceError

JUDGE_ROW = {
    "question": "q",
    "response_A": "a",
    "response_B": "b",
    "label": "A=B",
    "source": "x",
    "pair_id": "1",
}
RMBENCH_ROW = {"prompt": "q", "chosen": ["a", "b"], "rejected": ["c", "d", "e"], "domain": "x", "id": 1}


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


@pytest.fixture(scope="module")
def model():
    return rl.load_demo_model(device="cpu")


def test_row_errors_name_the_file(model, tmp_path):
    path = _jsonl(tmp_path / "judge.jsonl", [JUDGE_ROW])
    with pytest.raises(BenchmarkFormatError, match=r"judge\.jsonl, row 1, column 'label'"):
        rl.evaluate(model, str(path), progress=False)
    path = _jsonl(tmp_path / "rmb.jsonl", [RMBENCH_ROW])
    with pytest.raises(BenchmarkFormatError, match=r"rmb\.jsonl, row 1, column 'chosen': has 2 responses"):
        rl.benchmark_pairs(str(path), benchmark="rmbench")
    with pytest.raises(BenchmarkFormatError, match=r"^row 1, column 'label'"):  # row dicts: no source name
        rl.evaluate(model, [JUDGE_ROW], progress=False)


def test_split_of_a_file_is_refused(model, tmp_path):
    row = dict(JUDGE_ROW, label="A>B")
    path = _jsonl(tmp_path / "judge.jsonl", [row])
    with pytest.raises(SourceError, match="has no splits"):
        rl.evaluate(model, str(path), split="test", progress=False)
    with pytest.raises(SourceError, match="a list of rows has none"):
        rl.evaluate(model, [row], split="test", progress=False)
    assert rl.evaluate(model, str(path), progress=False).summary().accuracy.iloc[-1] in (0.0, 1.0)


@pytest.mark.parametrize(
    "rows, extra, expected",
    [
        ([JUDGE_ROW], [], "judge.jsonl, row 1, column 'label'"),
        ([dict(JUDGE_ROW, label="A>B")], ["--split", "train"], "has no splits"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, rows, extra, expected):
    path = _jsonl(tmp_path / "judge.jsonl", rows)
    code = main(["evaluate", str(path), *extra, "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
