"""The TRL monitor is never silently off: with distinct_prompts=True and fewer distinct prompts than a
measurement needs it warns, says so in its log and on its page, and measures the recent completions; flags
are booleans, not truthy strings."""

import json
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from reward_lens import load_demo_model
from reward_lens.integrations.trl import RewardLensCallback, RewardLensReward


@pytest.fixture(scope="module")
def rm():
    return load_demo_model(device="cpu")


def _trainer(tmp_path):
    cfg = LlamaConfig(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1
    )
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=10)
    return Trainer(model=LlamaForCausalLM(cfg), args=args)


def test_too_few_distinct_prompts_is_said_and_measured(rm, tmp_path):
    torch.manual_seed(0)
    reward_fn = RewardLensReward(rm, keep=64)
    trainer = _trainer(tmp_path)
    log = tmp_path / "monitor.jsonl"
    cb = RewardLensCallback(
        reward_fn, every=2, sample_size=8, log_path=log, probes=[], concepts=[], distinct_prompts=True
    )
    cb.attach(trainer)
    state, control = trainer.state, trainer.control
    state.max_steps = 10
    cb.on_train_begin(trainer.args, state, control)
    prompts = ["What is 2 plus 3?"] * 4 + ["Name a fruit."] * 4  # two distinct prompts only
    completions = ["2 plus 3 is 5.", "2 plus 3 is 6.", "5.", "It is 5. I hope this helps."] * 2
    for step in (1, 2):
        state.global_step = step - 1
        reward_fn(prompts, completions, trainer_state=state)
        state.global_step = step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cb.on_step_end(trainer.args, state, control)
    assert any("distinct_prompts=True found only 2 distinct prompt(s)" in str(w.message) for w in caught)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["kind"] for r in records if r["kind"] in ("note", "baseline")] == ["note", "baseline"]
    assert cb.baseline is not None and cb.records[0]["n"] == 8
    from reward_lens.app.monitor import render_monitor

    page = render_monitor(log, tmp_path / "page.html").read_text()
    assert "distinct prompt(s)" in page and "Hack alarm" in page


@pytest.mark.parametrize(
    "make",
    [
        lambda rm: RewardLensReward(rm, log_metrics="yes"),
        lambda rm: RewardLensReward(rm, alarm="no"),
        lambda rm: RewardLensCallback(RewardLensReward(rm), distinct_prompts="no"),
        lambda rm: RewardLensCallback(RewardLensReward(rm), every=2.5),
        lambda rm: RewardLensReward(rm, batch_size=True),
    ],
)
def test_flags_and_counts_are_checked(rm, make):
    with pytest.raises((TypeError, ValueError), match="must be"):
        make(rm)
