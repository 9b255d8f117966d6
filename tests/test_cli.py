"""The `reward-lens` command line: the audit on the demo model, --help/--version, and clear input errors."""

import json
import subprocess
import sys

import pytest

from reward_lens.app.cli import main


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "reward_lens.app.cli", *args], capture_output=True, text=True
    )


def test_help_and_version():
    out = run_cli("--help")
    assert out.returncode == 0 and "audit" in out.stdout and "compare" in out.stdout
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("reward-lens ")


def test_audit_on_the_demo_model_writes_report_json_and_csvs(tmp_path, capsys):
    assert main(["audit", "--out", str(tmp_path / "r"), "--max-pairs", "24"]) == 0
    out_dir = tmp_path / "r"
    html = (out_dir / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "data:image/png;base64," in html
    results = json.loads((out_dir / "results.json").read_text())
    assert results["n_pairs"] == 24 and 0.0 <= results["pair_accuracy"] <= 1.0
    assert results["input_format"] == "chat"  # "auto" on the demo's chat template
    for dim in ("length", "confidence", "formatting", "sycophancy", "repetition"):
        assert {"effect", "ci_low", "ci_high", "verdict"} <= set(results["probes"][dim])
    assert len(results["crystallization_depth"]["normed"]["per_pair"]) == 24
    assert -1.0 <= results["faithfulness"]["pooled_rho"] <= 1.0
    # The demo's planted biases show up as "rewards" verdicts.
    assert results["probes"]["length"]["verdict"] == "rewards"
    assert results["probes"]["sycophancy"]["verdict"] == "rewards"
    # Token heatmaps of the pairs with the largest gaps, inline in the report.
    assert "Which tokens the reward reads" in html and html.count('<span title="position') > 30
    for name in ("lens", "attribution", "patching", "faithfulness", "probes", "token_attribution"):
        assert (out_dir / f"{name}.csv").stat().st_size > 0
    assert "pair accuracy" in capsys.readouterr().out
    # Divergence: the overall flagged fraction (every pair x site patch, as in divergence.csv) + the per-site
    # table.
    import pandas as pd

    div, frame = results["divergence"], pd.read_csv(out_dir / "divergence.csv")
    assert div["n_patches"] == len(frame) and div["n_flagged"] == int(frame["flagged"].sum())
    assert abs(div["frac_flagged"] - frame["flagged"].mean()) < 1e-12
    assert [r["component"] for r in div["per_site"]] == list(dict.fromkeys(frame["component"]))


def test_patch_modes_default_to_both_contrastive_directions_and_add_ablations(tmp_path):
    """The audit patches noising and denoising by default; --patch-modes adds zero / mean ablation (both
    responses), always with noising (the faithfulness gap reads it); the report shows one panel per mode."""
    import pandas as pd

    from reward_lens.app.audit import PATCH_MODES
    from reward_lens.app.options import PATCH_MODE_NAMES, canonical_patch_modes
    from reward_lens.instruments.patching.spec import MODES

    assert PATCH_MODE_NAMES == PATCH_MODES == MODES  # the CLI checks names without importing torch
    assert main(["audit", "--out", str(tmp_path / "a"), "--max-pairs", "6", "--quiet"]) == 0
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    frame = pd.read_csv(tmp_path / "a" / "patching.csv")
    assert results["patch_modes"] == ["noising", "denoising"]
    assert set(zip(frame["mode"], frame["target"])) == {("noising", "chosen"), ("denoising", "rejected")}
    html = (tmp_path / "a" / "report.html").read_text()
    assert "--patch-modes noising,denoising,zero,mean" in html  # says how to get the ablations
    args = [
        "audit",
        "--out",
        str(tmp_path / "b"),
        "--max-pairs",
        "6",
        "--quiet",
        "--patch-modes",
        "mean,zero",
    ]
    assert main(args) == 0
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    frame = pd.read_csv(tmp_path / "b" / "patching.csv")
    assert results["patch_modes"] == ["noising", "zero", "mean"]
    assert set(zip(frame["mode"], frame["target"])) == {
        ("noising", "chosen"),
        ("zero", "chosen"),
        ("zero", "rejected"),
        ("mean", "chosen"),
        ("mean", "rejected"),
    }
    assert canonical_patch_modes("denoising") == ("noising", "denoising")
    with pytest.raises(ValueError, match="unknown patching mode"):
        canonical_patch_modes(["noising", "ablate"])


def test_report_is_self_contained(tmp_path):
    assert main(["audit", "--out", str(tmp_path / "r"), "--max-pairs", "4"]) == 0
    html = (tmp_path / "r" / "report.html").read_text()
    assert "<script src" not in html and "<link " not in html and 'src="http' not in html


def test_bad_model_path_is_one_clear_line(tmp_path):
    out = run_cli("audit", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no checkpoint directory" in lines[0]


@pytest.mark.parametrize(
    "content,expected",
    [
        ('{"prompt": "a", "chosen": "b"}\n', "lacks column(s) ['rejected']"),
        ("", "holds no preference pairs"),
    ],
)
def test_bad_pairs_files_are_clear_errors(tmp_path, capsys, content, expected):
    path = tmp_path / "pairs.jsonl"
    path.write_text(content)
    assert main(["audit", "--pairs", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


def test_compare_a_model_with_itself(tmp_path):
    assert main(["compare", "demo", "demo", "--max-pairs", "4", "--out", str(tmp_path / "c")]) == 0
    rows = json.loads((tmp_path / "c" / "results.json").read_text())
    values = {r["metric"]: r["value"] for r in rows}
    assert values["probe_verdict_agreement"] == 1.0 and values["attribution_abs_tv"] == 0.0
    assert (tmp_path / "c" / "report.html").exists()


def test_compare_needs_two_models(capsys):
    assert main(["compare", "demo"]) == 2
    assert "at least two models" in capsys.readouterr().err


def test_unknown_option_is_named_against_its_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "--bogus"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.count("\n") == 0
    assert "unrecognized arguments: --bogus" in err and "reward-lens audit --help" in err


def test_warnings_print_as_one_line_and_the_format_is_restored(tmp_path):
    import warnings

    before = warnings.formatwarning
    log = tmp_path / "log.jsonl"
    records = [{"kind": "run", "format": 1}, {"kind": "baseline", "step": 0, "metrics": {}}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "check", "st')  # cut short
    main(["monitor", str(log), "--out", str(tmp_path / "page.html")])
    assert warnings.formatwarning is before
    # a fresh process, outside pytest's own warning capture: what a user sees
    out = subprocess.run(
        [sys.executable, "-m", "reward_lens", "monitor", str(log), "--out", str(tmp_path / "again.html")],
        capture_output=True,
        text=True,
    )
    assert (
        out.returncode == 0 and "reward-lens: warning:" in out.stderr and "line 3 is cut short" in out.stderr
    )
    assert all(line.startswith(("reward-lens", "[reward-lens]")) for line in out.stderr.strip().splitlines())
