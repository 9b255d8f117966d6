"""The official scripts' rules where they are easy to get wrong: RM-Bench's per-domain files, JudgeBench's
single game, the hub ids' official splits, RewardBench 2's Ties ids, and non-finite rewards. Every
expected score is written here from the rule's definition on directly computed rewards."""

import json

import numpy as np
import pytest
import torch
from test_evaluate import STYLE, direct_reward, expected_rmbench, judgebench_rows, rb2_rows

import reward_lens as rl
from reward_lens.app.cli import main
from reward_lens.evaluation import BenchmarkFormatError, SourceError


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return rl.load_demo_model(device="cpu")


@pytest.fixture(scope="module")
def base():
    pairs = rl.demo_pairs()[::9][:8]
    return [
        (p.prompt, p.rejected, p.chosen, p.subset)
        if i % 3 == 0
        else (p.prompt, p.chosen, p.rejected, p.subset)
        for i, p in enumerate(pairs)
    ]


def per_domain_rows(base):
    """RM-Bench's `{domain}_filtered.json` layout: id, subset, prompt, chosen[3], rejected[3]; no domain."""
    return [
        {
            "id": i,
            "subset": "x",
            "prompt": p,
            "chosen": [s(g) for s in STYLE],
            "rejected": [s(b) for s in STYLE],
        }
        for i, (p, g, b, _) in enumerate(base)
    ]


def _table(result):
    return dict(zip(result.summary().subset, result.summary().accuracy))


def _close(got, want):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-12), k


# --------------------------------------------------------------------------- RM-Bench per-domain files
@pytest.mark.parametrize(
    "name, domain", [("chat_filtered.json", "chat"), ("safety-refuse_filtered.json", "safety-refuse")]
)
def test_a_per_domain_file_is_rmbench_of_its_domain(model, base, tmp_path, name, domain):
    rows = per_domain_rows(base)
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    result = rl.evaluate(model, str(path), progress=False)  # auto: never RewardBench 2 best-of-n
    assert result.benchmark == "rmbench"
    want = expected_rmbench(model, [dict(r, domain=domain) for r in rows])
    _close(_table(result), want)
    assert result.accuracy == pytest.approx(want[domain.split("-")[0]], abs=1e-12)  # one domain: its score


def test_per_domain_rows_take_the_domain_keyword_or_say_what_to_give(model, base):
    rows = per_domain_rows(base)
    got = _table(rl.evaluate(model, rows, domain="math", progress=False))
    _close(got, expected_rmbench(model, [dict(r, domain="math") for r in rows]))
    with pytest.raises(BenchmarkFormatError, match=r"row 1 has no domain.*domain='chat'.*rewardbench2"):
        rl.evaluate(model, rows, progress=False)
    with pytest.raises(BenchmarkFormatError, match="has its own domain 'chat'"):
        rl.evaluate(model, [dict(r, domain="chat") for r in rows], domain="math", progress=False)
    with pytest.raises(ValueError, match="domain= applies to RM-Bench rows"):
        rl.evaluate(model, judgebench_rows(base), domain="math", progress=False)
    # named explicitly, the same rows are RewardBench 2 rows (each row's first chosen against the rest)
    assert rl.evaluate(model, rows, benchmark="rewardbench2", progress=False).benchmark == "rewardbench2"


def test_cli_domain_option(model, base, tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in per_domain_rows(base)))
    assert main(["evaluate", str(path), "--domain", "code", "--out", str(tmp_path / "o")]) == 0
    summary = json.loads((tmp_path / "o" / "results.json").read_text())["summary"]
    assert {"code", "code/hard", "all"} <= {r["subset"] for r in summary}
    capsys.readouterr()


# --------------------------------------------------------------------------- JudgeBench single game
def expected_single_game(model, rows):
    correct = {}
    for r in rows:
        a = direct_reward(model, r["question"], r["response_A"])
        b = direct_reward(model, r["question"], r["response_B"])
        ok = ("A>B" if a > b else "B>A") == r["label"]  # --single_game: one game, a tie is B>A
        group = next(s for s in ("mmlu-pro", "livebench-math", "livecodebench") if r["source"].startswith(s))
        correct.setdefault(group, []).append(ok)
        correct.setdefault("all", []).append(ok)
    return {k: float(np.mean(v)) for k, v in correct.items()}


def test_judgebench_single_game(model, base, tmp_path, capsys):
    rows = judgebench_rows(base)
    rows[3]["label"] = "B>A"  # a tie labelled B>A: right in a single game, wrong in both orders
    assert rows[3]["response_A"] == rows[3]["response_B"]
    single = rl.evaluate(model, rows, benchmark="judgebench", single_game=True, progress=False)
    _close(_table(single), expected_single_game(model, rows))
    both = rl.evaluate(model, rows, progress=False)
    assert single.accuracy > both.accuracy  # the tie is the difference (the demo model is order-free)
    assert single.details["games"] == "single game (A, B)" and both.details["games"] == "both orders"
    with pytest.raises(ValueError, match="single_game= applies to JudgeBench"):
        rl.evaluate(model, rb2_rows(base), single_game=True, progress=False)
    with pytest.raises(ValueError, match="single_game must be True or False"):
        rl.evaluate(model, rows, single_game="yes", progress=False)
    path = tmp_path / "jb.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["evaluate", str(path), "--single-game", "--out", str(tmp_path / "o")]) == 0
    record = json.loads((tmp_path / "o" / "results.json").read_text())
    assert record["accuracy"] == pytest.approx(single.accuracy, abs=1e-12)
    capsys.readouterr()


# --------------------------------------------------------------------------- hub ids: the official split
@pytest.fixture
def hub(monkeypatch):
    """`datasets.load_dataset` answering with a real DatasetDict (the hub is out of reach in tests)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    served = {}

    def load_dataset(name, *args, **kwargs):
        return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in served[name].items()})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return served


def test_reward_bench_hub_id_scores_its_filtered_split(model, base, hub):
    rows = [
        {"id": str(i), "prompt": p, "chosen": g, "rejected": b, "subset": "alpacaeval-easy"}
        for i, (p, g, b, _) in enumerate(base)
    ]
    hub["allenai/reward-bench"] = {
        "raw": rows + [dict(rows[0], chosen=rows[0]["rejected"])] * 5,
        "filtered": rows,
    }
    result = rl.evaluate(model, "allenai/reward-bench", progress=False)
    assert result.summary().n.iloc[-1] == len(rows)
    want = np.mean(
        [
            direct_reward(model, r["prompt"], r["chosen"]) > direct_reward(model, r["prompt"], r["rejected"])
            for r in rows
        ]
    )
    assert result.accuracy == pytest.approx(want, abs=1e-12)
    assert (
        rl.evaluate(model, "allenai/reward-bench", split="raw", progress=False).summary().n.iloc[-1]
        == len(rows) + 5
    )


def test_judgebench_hub_id_asks_for_one_split(model, base, hub):
    rows = judgebench_rows(base)
    hub["ScalerLab/JudgeBench"] = {"gpt": rows, "claude": rows[:3]}
    with pytest.raises(
        SourceError, match=r"splits gpt, claude; its splits gpt, claude are scored separately.*split="
    ) as e:
        rl.evaluate(model, "ScalerLab/JudgeBench", progress=False)
    assert "\n" not in str(e.value)
    assert (
        rl.evaluate(model, "ScalerLab/JudgeBench", split="claude", progress=False).summary().n.iloc[-1] == 3
    )
    hub["someone/pairs"] = {"train": rows, "test": rows}
    with pytest.raises(SourceError, match="pooling its splits is not a benchmark score"):
        rl.evaluate(model, "someone/pairs", progress=False)


# --------------------------------------------------------------------------- RewardBench 2 Ties ids
def _ties(base):
    return [r for r in rb2_rows(base) if r["subset"] == "Ties"]


@pytest.mark.parametrize("dup", ["ref:1", "tied:01"])
def test_a_ties_id_given_twice_is_refused_naming_it(model, base, dup):
    rows = _ties(base)
    kind = dup.split(":")[0]
    rows.append(
        dict(
            next(r for r in rows if r["id"] == f"{kind}:1"), id=dup, rejected=[r["prompt"] for r in rows[:2]]
        )
    )
    with pytest.raises(BenchmarkFormatError, match=f"Ties row id '{dup}' is given twice"):
        rl.evaluate(model, rows, progress=False)


@pytest.mark.parametrize("kind", ["ref", "tied"])
def test_a_ties_subset_of_one_kind_says_why_its_score_is_nan(model, base, kind):
    rows = [r for r in _ties(base) if r["id"].startswith(kind)]
    with pytest.warns(UserWarning, match=f"Ties score is NaN: it has only {kind}: rows"):
        result = rl.evaluate(model, rows, progress=False)
    assert np.isnan(result.accuracy)
    assert "only" in result.details["ties"]["nan_reason"]


def test_a_misnamed_ties_subset_is_not_scored_best_of_n(model, base):
    rows = [dict(r, subset="Tie") for r in _ties(base)]
    with pytest.raises(BenchmarkFormatError, match="subset 'Tie' has Ties ids"):
        rl.evaluate(model, rows, progress=False)
    spaced = [dict(r, subset=" Ties ") for r in _ties(base)]  # to run_v2 another subset than Ties
    with pytest.raises(BenchmarkFormatError, match="' Ties ' has surrounding spaces.*spell it 'Ties'"):
        rl.evaluate(model, spaced, progress=False)


# --------------------------------------------------------------------------- non-finite rewards
def _overflowing_fp16_model():
    m = rl.load_demo_model(dtype="float16")
    with torch.no_grad():
        m.blocks[0].mlp.W_out.mul_(3e4)
    return m


def test_non_finite_rewards_are_refused_naming_row_and_response(base, tmp_path, capsys, monkeypatch):
    broken = _overflowing_fp16_model()
    rows = judgebench_rows(base)
    with pytest.raises(
        ValueError, match=r"rows: non-finite reward \(-?inf|nan\) for row 1 \(id 'p0'\), A response 1"
    ):
        rl.evaluate(broken, rows, progress=False)
    import reward_lens.app.cli as cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: (broken, "broken"))
    path = tmp_path / "jb.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["evaluate", str(path), "--out", str(tmp_path / "o")]) == 2
    captured = capsys.readouterr()
    assert "non-finite reward" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "accuracy" not in captured.out and not (tmp_path / "o").exists()
