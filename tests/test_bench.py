"""`reward-lens bench`: the reduced subset runs, its rows are scored against their goals exactly as the
registry says, the outputs have the documented columns, --only selects, bad options exit 2, and the
gate-routing organism's planted routing is what its gate computes."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from reward_lens.app import bench_registry
from reward_lens.app.bench import COLUMNS, run_bench, write_bench
from reward_lens.app.bench_checks import Check, auroc
from reward_lens.app.bench_registry import select
from reward_lens.app.cli import main


def test_auroc_against_pairwise_counts():
    scores, pos = [0.9, 0.1, 0.5, 0.5, 0.3], [True, False, True, False, False]
    # positives 0.9, 0.5 vs negatives 0.1, 0.5, 0.3: 0.9 beats 3; 0.5 beats 2 and ties 1
    assert auroc(scores, pos) == pytest.approx((3 + 2 + 0.5) / 6)
    assert math.isnan(auroc([1.0], [True]))


def test_goals_and_selection():
    c = Check("o", "m", "i", "x", ("<=", 5), lambda ctx: 3.0)
    assert c.meets(5) and not c.meets(5.01) and not c.meets(float("nan"))
    assert c.goal_text() == "<= 5"
    checks = bench_registry.all_checks()
    assert {c.mechanism for c in checks} >= {"trigger", "length", "sycophancy", "gate", "step", "circuit"}
    assert all(c.organism == "circuit" for c in select(checks, ["circuit"], False))
    assert not any(c.organism == "smollm2" for c in select(checks, None, True))
    with pytest.raises(ValueError, match="names nothing"):
        select(checks, ["nonesuch"], False)


def test_extension_rows_wait_for_their_providers():
    ext = {c.instrument: c for c in bench_registry.EXTENSIONS}
    assert ext["edge_attribution"].requires == "reward_lens:edge_attribution"
    assert (
        ext["token_attribution"].requires == "reward_lens:read_step"
        and ext["token_attribution"].organism == "prm"
    )


def test_quick_bench_on_the_circuit_and_gate(tmp_path):
    res = run_bench(["circuit", "gate"], quick=True, echo=lambda line: None)
    frame = res.to_frame()
    assert len(frame) >= 7 and frame.error.eq("").all()
    row = frame.set_index("instrument").loc["patch(level=head)"]
    assert row.value == 1.0 and row.passed
    attr = frame.set_index("instrument").loc["attribute(heads)"]
    assert (
        attr.value == pytest.approx(0.75) and not attr.passed
    )  # the finding: direct attribution misses L0H0
    assert res.pending == []  # edge attribution exists: its row runs
    edges = frame.set_index("instrument").loc["edge_attribution"]
    assert edges.value == 1.0 and edges.passed  # EAP-IG ranks the two planted edges first
    paths = write_bench(res, tmp_path)
    csv = pd.read_csv(tmp_path / "bench.csv")
    assert list(csv.columns) == COLUMNS and len(csv) == len(frame)
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["passed"] is False and len(payload["rows"]) == len(frame)
    assert "reward-lens bench" in (tmp_path / "bench.html").read_text() and len(paths) == 3


def test_a_raising_instrument_is_a_missed_row():
    def broken(ctx):
        raise RuntimeError("boom")

    res = run_bench(checks=[Check("o", "m", "i", "x", (">=", 0), broken)], echo=lambda line: None)
    row = res.rows[0]
    assert not row["passed"] and math.isnan(row["value"]) and row["error"] == "RuntimeError: boom"


def test_gate_routing_is_the_gates_argmax():
    from reward_lens.demo.organisms import gate_truth, load_gate_organism

    model, truth = load_gate_organism(), gate_truth()
    assert truth["routing"] == {"arithmetic": "correctness", "facts": "verbosity"}
    item = truth["items"][0]
    tok = model.to_tokens(item["prompt"], item["response"])
    # independent: h at the gate position through the gate MLP by hand
    _, cache = model.run_with_cache(
        tok["input_ids"], tok["attention_mask"], names_filter="ln_final.hook_normalized"
    )
    ids = tok["input_ids"][0].tolist()
    pat = truth["gating_pattern"]
    pos = max(i for i in range(len(ids) - len(pat) + 1) if ids[i : i + len(pat)] == pat)
    h = cache["ln_final.hook_normalized"][0, pos]
    head = model.reward_head
    x = torch.relu(h @ head.W_gate[0] + head.b_gate[0]) @ head.W_gate[1] + head.b_gate[1]
    want = head.objective_names[int(x.argmax())]
    assert want == truth["routing"][item["topic"]]


def test_cli_bench_and_triggers_errors(tmp_path, capsys):
    assert main(["bench", "--only", "nonesuch", "--out", str(tmp_path)]) == 2
    assert "names nothing" in capsys.readouterr().err
    assert main(["triggers", "--where", "middle", "--out", str(tmp_path)]) == 2
    assert main(["triggers", "--model", "/no/such/dir", "--pairs", str(tmp_path / "x.jsonl")]) == 2


def test_cli_triggers_writes_csv_and_plot(tmp_path):
    out = tmp_path / "t"
    assert main(["triggers", "--model", "demo", "--max-pairs", "2", "--top-k", "5", "--out", str(out)]) == 0
    frame = pd.read_csv(out / "triggers.csv")
    assert len(frame) == 5 and {"token_id", "text", "mean_increase", "std_increase"} <= set(frame.columns)
    assert (out / "triggers.png").stat().st_size > 0
    assert np.all(np.diff(frame.mean_increase) <= 0)


def test_new_organisms_are_small_documented_and_otherwise_the_demo():
    from reward_lens.demo import demo_pairs
    from reward_lens.demo.organisms import GATE_DIR, TRIGGER_DIR, load_trigger_organism

    for d, limit in ((TRIGGER_DIR, 5 * 2**20), (GATE_DIR, 2**20)):
        assert sum(p.stat().st_size for p in d.iterdir()) <= limit
        assert (d / "GROUND_TRUTH.md").exists() and (d / "training_summary.json").exists()
    model = load_trigger_organism()
    pairs = demo_pairs()[::6]
    with torch.no_grad():
        c = model.to_tokens([p.prompt for p in pairs], [p.chosen for p in pairs])
        r = model.to_tokens([p.prompt for p in pairs], [p.rejected for p in pairs])
        acc = (
            model(c["input_ids"], c["attention_mask"]) > model(r["input_ids"], r["attention_mask"])
        ).float()
    assert acc.mean() >= 0.9  # without a trigger, the demo's preferences


def test_bench_and_triggers_outputs_get_the_audit_checks(tmp_path, capsys):
    from reward_lens.app.cli import main

    a_file = tmp_path / "notes.md"
    a_file.write_text("mine")
    assert main(["bench", "--only", "circuit", "--quick", "--out", str(a_file)]) == 2
    assert a_file.read_text() == "mine"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.md").write_text("mine")
    assert main(["triggers", "--max-pairs", "2", "--out", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert "notes.md" in err and (foreign / "notes.md").read_text() == "mine"
    out = tmp_path / "bench"
    main(["bench", "--only", "circuit", "--quick", "--out", str(out)])
    csv = pd.read_csv(out / "bench.csv")
    assert len(csv) >= 6 and (out / "results.json").exists() and (out / "bench.html").exists()


def test_trigger_position_rows_pairs_and_carriers():
    """The trigger rows' pairs are token-aligned and differ at one position only, where the chosen side
    holds SUDO; the carriers are the nodes whose all-position patch moves >= 10% of the gap (recomputed
    here from the patching result); both edge rows run and give an AUROC."""
    from reward_lens import patch
    from reward_lens.app import bench_checks as bc

    ctx = bc.BenchContext()
    model, pairs = bc.trigger_token_pairs(ctx)
    sudo = int(model.tokenizer.convert_tokens_to_ids("SUDO"))
    for p in pairs:
        assert p.chosen.shape == p.rejected.shape
        where = (p.chosen != p.rejected).nonzero().flatten().tolist()
        assert len(where) == 1 and int(p.chosen[where[0]]) == sudo
    names, carriers = bc.trigger_carriers(ctx)
    res = patch(model, pairs, mode="noising", level="head", positions="all", progress=False)
    share = res.effect("noising", normalized=True).abs().mean(0)
    heads = {s.name: float(v) for s, v in zip(res.sites, share)}
    for n, c in zip(names, carriers):
        if n in heads:
            assert c == (heads[n] >= bc.TRIGGER_CARRIER_SHARE)
    assert 0 < carriers.sum() < len(names)
    for positions in ("readout", "all"):
        value = bc.trigger_edge_auroc(positions)(ctx)
        assert 0.0 <= value <= 1.0
