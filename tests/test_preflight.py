"""Pre-flight on the demo RM and the policy organism: it names the planted length bias before any training,
its numbers equal independent computations (the pressure by a plain loop, the padding sensitivity by one
forward per padded text), an edit fitted on the policy's own rollouts leaves no within-group length slope
on them, and the CLI writes the page and the JSON."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from reward_lens import load_demo_model
from reward_lens.demo.organisms import load_policy_organism
from reward_lens.integrations.preflight import measure_rollouts, pad_completion, preflight, rollout
from reward_lens.integrations.trl import as_model_input

ROOT = Path(__file__).resolve().parents[1]


def _prompts():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rl_hack

    return [r["prompt"] for r in rl_hack.prompt_rows()]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    rm = load_demo_model(device="cpu")
    policy, tokenizer = load_policy_organism()
    report = preflight(rm, policy, _prompts(), n=96, tokenizer=tokenizer, seed=3)
    return rm, policy, tokenizer, report


def test_preflight_names_the_planted_length_bias(setup):
    _, _, _, report = setup
    assert report.named() == ["length"]
    row = report.summary().iloc[0]
    assert row.ci_low > 0 and row.p_value < 0.05
    filler = report.sensitivity[0]
    assert filler["padding"] == "filler" and filler["ci_low"] > 0  # padding pays, in advantage units
    assert len(report.rewards) == 96 and len(np.unique(report.rollouts.groups)) == 12


def test_pressure_and_sensitivity_equal_independent_computations(setup):
    rm, _, _, report = setup
    r, x, g = report.rewards, report.values["length"], report.rollouts.groups
    num = den_a = den_x = 0.0
    for v in np.unique(g):
        rr, xx = r[g == v], x[g == v]
        a = (rr - rr.mean()) / (rr.std(ddof=1) + 1e-4)
        num += a @ (xx - xx.mean())
        den_a += a @ a
        den_x += (xx - xx.mean()) @ (xx - xx.mean())
    assert report.features[0]["pressure"] == pytest.approx(num / np.sqrt(den_a * den_x), rel=1e-9)
    # the rewards and the padded rewards by one forward per text
    texts = report.rollouts.texts()
    sd = np.sqrt(np.mean([r[g == v].var(ddof=1) for v in np.unique(g)]))
    deltas = []
    with torch.no_grad():
        for i, text in enumerate(texts):
            p, c = as_model_input(report.rollouts.prompts[i], text)
            tok = rm.to_tokens([p, p], [c, pad_completion(c, "filler", i)])
            out = rm(tok["input_ids"], attention_mask=tok["attention_mask"]).reshape(-1)
            assert float(out[0]) == pytest.approx(r[i], abs=1e-4)
            deltas.append(float(out[1] - out[0]) / sd)
    assert report.reward_sd == pytest.approx(sd, rel=1e-9)
    assert report.sensitivity[0]["delta_advantage"] == pytest.approx(np.mean(deltas), abs=1e-4)


def test_an_edit_fitted_on_the_rollouts_leaves_no_within_group_slope_on_them(setup):
    from reward_lens.integrations.signals import response_lengths
    from reward_lens.representations.erasure import erase_at_head, fit_leace, head_inputs

    rm, _, _, report = setup
    inputs = [as_model_input(p, c) for p, c in zip(report.rollouts.prompts, report.rollouts.completions)]
    P, R = [p for p, _ in inputs], [c for _, c in inputs]
    z = response_lengths(rm, R)
    edited = erase_at_head(rm, fit_leace(head_inputs(rm, P, R), torch.tensor(z), report.rollouts.groups))
    after = measure_rollouts(edited, report.rollouts, n_perm=99, paddings=())
    before_slope = report.features[0]["slope"]
    assert abs(after.features[0]["slope"]) < 1e-4 * abs(before_slope)


def test_rollouts_split_into_whole_groups(setup):
    _, _, _, report = setup
    a, b = report.rollouts.split(0.5)
    assert set(a.groups.tolist()).isdisjoint(b.groups.tolist())
    assert len(a.prompts) + len(b.prompts) == 96


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 100}, "multiple of group"),
        ({"n": 8 * 1000}, "cannot give"),
        ({"group": 1}, "group must be"),
        ({"n": 2.5}, "n must be"),
    ],
)
def test_bad_inputs_are_one_line(setup, kwargs, match):
    _, policy, tokenizer, _ = setup
    with pytest.raises(ValueError, match=match):
        rollout(policy, tokenizer, _prompts(), **{"n": 16, **kwargs})


def test_cli_writes_the_page_and_the_json(tmp_path):
    from reward_lens.app.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts()[:40]))
    out = tmp_path / "pre"
    code = main(
        ["preflight", "--policy", "organism", "--prompts", str(prompts), "--n", "32", "--out", str(out)]
    )
    assert code == 0
    saved = json.loads((out / "preflight.json").read_text())
    assert saved["n"] == 32 and saved["features"][0]["feature"] == "length"
    assert "pre-flight" in (out / "preflight.html").read_text()
    assert len((out / "rollouts.jsonl").read_text().splitlines()) == 32
    assert main(["preflight", "--policy", "organism", "--prompts", str(prompts), "--n", "30"]) == 2
    assert main(["preflight", "--policy", str(tmp_path / "none"), "--prompts", str(prompts)]) == 2
