"""`reward-lens evaluate` (summary printed, CSVs written, one-line errors) and `reward-lens audit --pairs` on
RewardBench 2 / RM-Bench files (the pairwise expansion audited; the benchmark summary and RM-Bench's hard
misses with their attribution terms in results.json and the report)."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from test_evaluate import STYLE, rb2_rows

import reward_lens as rl
from reward_lens.app.cli import main


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return rl.load_demo_model(device="cpu")


@pytest.fixture(scope="module")
def base():
    pairs = rl.demo_pairs()[::24]
    return [
        (p.prompt, p.rejected, p.chosen, p.subset)
        if i % 3 == 0
        else (p.prompt, p.chosen, p.rejected, p.subset)
        for i, p in enumerate(pairs)
    ]


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


DOMAIN = ("chat", "math", "code", "safety-refuse", "safety-response")


def _rmbench(base, n=6):
    # the detailed style says more; swapped rows give the model misses of every kind, the hard ones included
    return [
        {
            "id": f"r{i}",
            "prompt": p,
            "domain": DOMAIN[i % len(DOMAIN)],
            "chosen": [s(g) for s in STYLE],
            "rejected": [s(b) for s in STYLE],
        }
        for i, (p, g, b, _) in enumerate(base[:n])
    ]


def test_evaluate_prints_summary_and_writes_csvs(model, base, tmp_path, capsys):
    src = _jsonl(tmp_path / "rb2.jsonl", rb2_rows(base))
    assert (
        main(
            [
                "evaluate",
                "--benchmark",
                "rewardbench2",
                str(src),
                "--out",
                str(tmp_path / "ev"),
                "--batch-size",
                "5",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    want = rl.evaluate(model, src, progress=False)
    summary = pd.read_csv(tmp_path / "ev" / "summary.csv")
    assert list(summary.subset) == list(want.summary().subset)
    np.testing.assert_allclose(summary.accuracy, want.summary().accuracy, atol=1e-12)
    assert "Ties" in printed and "all" in printed
    scores = pd.read_csv(tmp_path / "ev" / "scores.csv")
    np.testing.assert_allclose(scores.reward, want.to_frame().reward, atol=1e-5)
    record = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert record["benchmark"] == "rewardbench2" and record["accuracy"] == pytest.approx(want.accuracy)
    assert record["pairs_file"]["sha256"]  # provenance of the file


@pytest.mark.parametrize(
    "args, expected",
    [
        (["nothere.jsonl"], "no benchmark file at 'nothere.jsonl'"),
        (["{tmp}/x.txt"], "unsupported file type '.txt'"),
        (["{tmp}/x.jsonl", "--benchmark", "mmlu"], "invalid choice: 'mmlu'"),
        (["allenai/reward-bench-2"], "HF_HUB_OFFLINE"),
        (["{tmp}/odd.jsonl"], "match no benchmark layout"),
        (["{tmp}/x.jsonl", "--batch-size", "0"], "--batch-size must be >= 1"),
    ],
)
def test_evaluate_errors_are_one_line(tmp_path, capsys, monkeypatch, args, expected):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "x.txt").write_text("hi")
    _jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    _jsonl(tmp_path / "odd.jsonl", [{"text": "p", "score": 1}])
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    try:
        code = main(["evaluate", *args, "--out", str(tmp_path / "o")])
    except SystemExit as exc:  # argparse's usage errors (one line too, see OneLineParser)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_audit_of_an_rmbench_file(model, base, tmp_path):
    rows = _rmbench(base)
    src = _jsonl(tmp_path / "rm.jsonl", rows)
    assert main(["audit", "--pairs", str(src), "--out", str(tmp_path / "au")]) == 0
    record = json.loads((tmp_path / "au" / "results.json").read_text())
    assert record["n_pairs"] == 9 * len(rows)  # chosen vs each rejected, every style
    bench = record["benchmark"]
    want = rl.evaluate(model, rows, progress=False)
    assert bench["name"] == "rmbench" and bench["accuracy"] == pytest.approx(want.accuracy)
    assert [r["subset"] for r in bench["summary"]] == list(want.summary().subset)

    # the hard misses, found here from per-response rewards: chosen style i scored <= rejected style j, i < j
    def reward(p, t):
        b = model.to_tokens([p], [t])
        with torch.no_grad():
            return float(model(b["input_ids"], attention_mask=b["attention_mask"])[0])

    misses = []
    for r in rows:
        c = [reward(r["prompt"], t) for t in r["chosen"]]
        w = [reward(r["prompt"], t) for t in r["rejected"]]
        misses += [(r, i, j, c[i] - w[j]) for i in range(3) for j in range(i + 1, 3) if not c[i] > w[j]]
    assert misses, "the file should make the model miss some hard comparisons"
    h = bench["hard_misses"]
    assert h["n"] == len(misses) == h["attributed"]
    worst = min(misses, key=lambda m: m[3])
    r, i, j, gap = worst
    first = h["pairs"][0]
    assert first["gap"] == pytest.approx(gap, abs=1e-4) and first["id"] == r["id"]
    attr = rl.attribute(
        model, [rl.PreferencePair(r["prompt"], r["chosen"][i], r["rejected"][j])], progress=False
    )
    terms = attr.to_frame()
    top = terms.reindex(terms.gap.abs().sort_values(ascending=False).index).iloc[0]
    assert first["top_terms"].split(";")[0].split()[0] == top.component
    assert float(first["top_terms"].split(";")[0].split()[1]) == pytest.approx(top.gap, abs=1e-4)
    html = (tmp_path / "au" / "report.html").read_text()
    assert "Benchmark: rmbench" in html and "hard comparisons missed" in html
    assert (tmp_path / "au" / "rmbench_hard_misses.csv").is_file()


def test_audit_of_a_rewardbench2_file(model, base, tmp_path):
    rows = [r for r in rb2_rows(base) if r["subset"] != "Ties"]
    src = _jsonl(tmp_path / "rb2.jsonl", rows)
    assert main(["audit", "--pairs", str(src), "--out", str(tmp_path / "au"), "--max-pairs", "30"]) == 0
    record = json.loads((tmp_path / "au" / "results.json").read_text())
    assert record["n_pairs"] == min(30, sum(len(r["chosen"]) * len(r["rejected"]) for r in rows))
    assert record["benchmark"]["accuracy"] == pytest.approx(rl.evaluate(model, rows, progress=False).accuracy)
    assert "hard_misses" not in record["benchmark"]
