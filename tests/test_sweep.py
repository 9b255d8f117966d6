"""`reward-lens sweep`: the table equals the instruments called directly; an interrupted sweep resumes."""

import pandas as pd
import pytest
from test_distributed import token_pairs

from reward_lens.app import sweep as sweep_mod
from reward_lens.app.cli import main
from reward_lens.app.sweep import SweepSpec, run_sweep
from reward_lens.instruments import attribute, attribution_patch, patch, site_means
from reward_lens.instruments.sites import sites_for

SPEC = SweepSpec(
    instruments=("patch", "atp", "attribute"),
    levels=("component", "head"),
    modes=("noising", "denoising", "mean"),
    chunk_size=4,
)


def rows(table, instrument):
    part = table[table["instrument"] == instrument].drop(columns="instrument").dropna(axis=1, how="all")
    return part.reset_index(drop=True)


def test_sweep_equals_the_instruments_called_directly(llama_model, tmp_path):
    pairs = token_pairs(10)
    table = run_sweep(llama_model, pairs, tmp_path / "s", SPEC, batch_size=2, echo=lambda _: None)
    assert table.equals(pd.read_parquet(tmp_path / "s" / "sweep.parquet"))
    assert len(pd.read_csv(tmp_path / "s" / "sweep.csv")) == len(table)
    means = site_means(llama_model, pairs, sites_for(llama_model.cfg, ["component", "head"]), batch_size=2)
    kw = dict(
        mode=["noising", "denoising", "mean"],
        level=["component", "head"],
        means=means,
        batch_size=2,
        progress=False,
    )
    want = {
        "patch": patch(llama_model, pairs, **kw).to_frame(),
        "atp": attribution_patch(llama_model, pairs, **kw).to_frame(),
        "attribute": attribute(llama_model, pairs, batch_size=2, progress=False).to_frame("component"),
    }
    want["attribute"] = pd.concat(
        [want["attribute"], attribute(llama_model, pairs, batch_size=2, progress=False).to_frame("head")],
        ignore_index=True,
    )
    for name, frame in want.items():  # the same rows (the sweep's are ordered chunk by chunk)
        keys = ["pair", "component", "level"] + (["mode", "target"] if name != "attribute" else [])
        got = rows(table, name)[frame.columns].sort_values(keys, ignore_index=True)
        assert len(got) == len(frame) and set(got["pair"]) == {
            str(i) for i in range(10)
        }  # global pair labels
        pd.testing.assert_frame_equal(
            got, frame.sort_values(keys, ignore_index=True), check_dtype=False, rtol=1e-6, atol=1e-6
        )


def test_an_interrupted_sweep_resumes_and_skips_done_chunks(llama_model, tmp_path, monkeypatch):
    pairs = token_pairs(10)
    spec = SweepSpec(
        instruments=("patch", "attribute"), levels=("component",), modes=("noising", "mean"), chunk_size=3
    )
    whole = run_sweep(llama_model, pairs, tmp_path / "whole", spec, batch_size=3, echo=lambda _: None)
    real, calls = sweep_mod.chunk_frame, []

    def interrupted(model, pairs, ids, sl, *args):
        calls.append(sl.start)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, pairs, ids, sl, *args)

    monkeypatch.setattr(sweep_mod, "chunk_frame", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(llama_model, pairs, tmp_path / "s", spec, batch_size=3, echo=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "s" / "parts").iterdir()) == [
        "chunk-00000.parquet",
        "chunk-00001.parquet",
    ]
    assert not (tmp_path / "s" / "sweep.parquet").exists() and not (tmp_path / "s.lock").exists()
    calls.clear()
    monkeypatch.setattr(sweep_mod, "chunk_frame", lambda *a: (calls.append(a[3].start), real(*a))[1])
    resumed = run_sweep(llama_model, pairs, tmp_path / "s", spec, batch_size=3, echo=lambda _: None)
    assert calls == [6, 9]  # chunks 0 and 1 were skipped
    pd.testing.assert_frame_equal(resumed, whole)
    with pytest.raises(ValueError, match="holds a sweep with other spec"):  # another sweep is never mixed in
        run_sweep(llama_model, pairs, tmp_path / "s", SweepSpec(chunk_size=3), echo=lambda _: None)
    with pytest.raises(ValueError, match="other pairs sha256"):
        run_sweep(llama_model, token_pairs(10, seed=1), tmp_path / "s", spec, echo=lambda _: None)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--instruments", "patch,lens"], "--instruments: lens given"),
        (["--levels", "neuron"], "--levels: neuron given"),
        (["--modes", ""], "--modes: nothing given"),
        (["--instruments", "attribute", "--levels", "residual"], "attribute has no residual terms"),
        (["--positions", "end"], "--positions 'end'"),
        (["--chunk-size", "0"], "--chunk-size must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--batch-size", "many"], "invalid batch size 'many'"),
    ],
)
def test_sweep_options_are_checked_before_any_work(tmp_path, capsys, args, expected):
    try:
        rc = main(["sweep", "--out", str(tmp_path / "s"), *args])
    except SystemExit as exc:  # argparse's own usage errors
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


def test_sweep_refuses_a_directory_that_is_not_a_sweep(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    assert main(["sweep", "--out", str(tmp_path / "d")]) == 2
    assert "not a reward-lens sweep" in capsys.readouterr().err


def test_sweep_cli_on_the_demo_model(tmp_path):
    out = tmp_path / "s"
    assert (
        main(
            [
                "sweep",
                "--max-pairs",
                "4",
                "--chunk-size",
                "2",
                "--instruments",
                "patch,atp",
                "--modes",
                "noising,zero",
                "--batch-size",
                "auto",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = pd.read_parquet(out / "sweep.parquet")
    assert set(table["instrument"]) == {"patch", "atp"} and table["pair"].nunique() == 4
    assert set(table["mode"]) == {"noising", "zero"}
