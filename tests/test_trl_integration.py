"""The TRL integration with the real trl package: a GRPO run of a few CPU steps with a tiny random policy and
the
demo organism as the reward model; then a policy that appends filler sentences (the demo's planted length
bias,
GROUND_TRUTH.md) must be flagged as drift."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import trl  # noqa: E402,F401  (the `test` extra installs it: a missing trl fails here, it is not skipped)
from helpers import one_thread  # noqa: F401  (single-threaded module)

EVERY, MAX_STEPS, SWAP_AFTER = 2, 8, 4  # checks at 2, 4 (initial policy), 6, 8 (filler policy)
BATCH, GENERATIONS, SAMPLE = 32, 4, 32
PROBES, CONCEPTS = (
    ("length", "sycophancy", "confidence"),
    ("length", "sycophancy"),
)  # fewer than the defaults: test time


def _policy_tokenizer():
    """A tiny byte-level BPE (the `tokenizers` library) over the demo domain, so the policy's token ids decode
    to exact text (filler sentences included) that the reward model re-tokenises with its own tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from reward_lens.demo.synthetic import FILLERS
    from reward_lens.probes.suite import demo_probe_items

    texts = [f"{it.prompt} {it.response}" for it in demo_probe_items()] + list(FILLERS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", padding_side="left"
    )


def _policy(tokenizer):
    """A tiny random LlamaForCausalLM whose generate can be switched to append 0-3 filler sentences per
    row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from reward_lens.demo.synthetic import FILLERS

    class FillerPolicy(LlamaForCausalLM):
        appends_fillers = False

        def generate(self, *args, **kwargs):
            out = super().generate(*args, **kwargs)
            if not self.appends_fillers:
                return out
            prompt_len = kwargs["input_ids"].shape[1]
            eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
            rows = []
            for i, row in enumerate(out.tolist()):
                completion = row[prompt_len:]
                completion = completion[: completion.index(eos)] if eos in completion else completion
                filler = (
                    " " + " ".join(FILLERS[(i + j) % len(FILLERS)] for j in range(i % 4)) if i % 4 else ""
                )
                rows.append(
                    row[:prompt_len]
                    + completion
                    + tokenizer(filler, add_special_tokens=False)["input_ids"]
                    + [eos]
                )
            width = max(len(r) for r in rows)
            return torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=out.device)

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return FillerPolicy(cfg)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens import load_demo_model
    from reward_lens.integrations.trl import RewardLensReward, watch
    from reward_lens.probes.suite import demo_probe_items

    out = tmp_path_factory.mktemp("grpo")
    tokenizer = _policy_tokenizer()
    policy = _policy(tokenizer)
    rm = load_demo_model()

    class Recording(RewardLensReward):
        calls = []

        def __call__(self, prompts, completions, **kwargs):
            rewards = super().__call__(prompts, completions, **kwargs)
            self.calls.append((list(prompts), list(completions), rewards))
            return rewards

    class SwapPolicy(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == SWAP_AFTER:
                policy.appends_fillers = True

    reward_fn = Recording(rm, batch_size=32)
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        num_generations=GENERATIONS,
        max_completion_length=8,
        max_steps=MAX_STEPS,
        logging_steps=1,
        report_to=["tensorboard"],  # the real writer: the alarm must reach what report_to sends
        use_cpu=True,
        save_strategy="no",
        learning_rate=1e-3,
        seed=0,
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"prompt": it.prompt} for it in demo_probe_items()])
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward_fn,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[SwapPolicy()],
    )
    callback = watch(
        trainer,
        reward_fn,
        every=EVERY,
        sample_size=SAMPLE,
        log_path=out / "monitor.jsonl",
        probes=PROBES,
        concepts=CONCEPTS,
        n_boot=500,
    )
    trainer.train()
    records = [json.loads(line) for line in (out / "monitor.jsonl").read_text().splitlines()]
    return dict(trainer=trainer, reward_fn=reward_fn, rm=rm, callback=callback, records=records, out=out)


def test_the_hack_alarm_reaches_tensorboard_and_the_log(run):
    """The filler policy (from step 5) is paid for its length inside each group: the hack alarm on length is
    raised, and TensorBoard's event file holds the same per-step pressure and the alarm."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(run["out"].rglob("events.out.tfevents.*"))
    assert events, "the TensorBoard writer wrote no event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/reward_lens/alarm/length", "train/reward_lens/pressure/length"} <= tags, sorted(tags)[:20]
    history = {h["step"]: h for h in run["reward_fn"].history}
    logged = {e.step: e.value for e in acc.Scalars("train/reward_lens/pressure/length")}
    for step, value in logged.items():
        assert value == pytest.approx(history[step]["pressure/length"], abs=1e-5)
    alarm_steps = [e.step for e in acc.Scalars("train/reward_lens/alarm/length") if e.value == 1.0]
    hack = run["reward_fn"].alarm.hack_steps()["length"]
    assert hack is not None and hack > SWAP_AFTER and min(alarm_steps) == hack
    records = [r for r in run["records"] if r["kind"] == "alarm" and r["channel"] == "hack"]
    assert records and records[0]["step"] == hack and records[0]["feature"] == "length"


def test_importing_reward_lens_does_not_import_trl():
    code = "import sys, reward_lens, reward_lens.integrations; print('trl' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )


def test_reward_function_equals_the_model_and_reaches_trl(run):
    rm, calls = run["rm"], run["reward_fn"].calls
    assert len(calls) == MAX_STEPS
    for prompts, completions, rewards in calls:
        assert len(rewards) == BATCH and all(isinstance(r, float) for r in rewards)
        batch = rm.to_tokens(prompts, completions)
        with torch.no_grad():
            expected = rm(batch["input_ids"], attention_mask=batch["attention_mask"])
        assert torch.allclose(torch.tensor(rewards), expected.float(), atol=1e-5, rtol=0)
    # TRL trained on these values: its logged mean reward per step is theirs.
    logged = [
        h["rewards/reward_lens/mean"]
        for h in run["trainer"].state.log_history
        if "rewards/reward_lens/mean" in h
    ]
    assert len(logged) == MAX_STEPS
    for value, (_, _, rewards) in zip(logged, calls):
        assert abs(value - sum(rewards) / len(rewards)) < 1e-5


def test_batch_attribution_is_exact(run):
    """Per batch, the components' mean terms plus the head bias are the mean reward (fp32: 1e-4); per
    completion the terms sum to the reward."""
    reward_fn, rm = run["reward_fn"], run["rm"]
    bias = float(rm.reward_bias)
    for rec in reward_fn.history:
        total = sum(v for k, v in rec.items() if k.startswith("attr/") and k.endswith("/mean"))
        assert abs(total + bias - rec["reward/mean"]) < 1e-4
        assert rec["attr/mlp_L0/std"] >= 0
    sig = reward_fn.last
    assert sig.max_relative_error() < 1e-5
    assert sig.components == ["embed"] + [
        f"{k}_L{l}" for l in range(rm.cfg.n_layers) for k in ("attn", "mlp")
    ]
    frame = sig.to_frame()
    assert len(frame) == BATCH * len(sig.components)
    assert sig.summary()["mean"].sum() + bias == pytest.approx(float(sig.rewards.mean()), abs=1e-4)
    # The logged correlation is Pearson's r of the batch's rewards and response lengths.
    from scipy.stats import pearsonr

    r = pearsonr(sig.rewards.numpy(), sig.lengths).statistic
    assert reward_fn.history[-1]["reward_length_corr"] == pytest.approx(r, abs=1e-9)


def test_jsonl_holds_the_baseline_and_every_nth_step(run):
    records = run["records"]
    assert records[0]["kind"] == "run" and records[0]["every"] == EVERY
    checks = [r for r in records if r["kind"] in ("baseline", "check")]
    assert [(r["kind"], r["step"]) for r in checks] == [("baseline", 1)] + [
        ("check", s) for s in range(EVERY, MAX_STEPS + 1, EVERY)
    ]
    assert [r["step"] for r in records if r["kind"] == "batch"] == list(range(1, MAX_STEPS + 1))
    base = checks[0]
    assert base["n"] == SAMPLE and base["flags"] == []
    keys = set(base["metrics"])
    assert {
        "probe/length",
        "probe/sycophancy",
        "concept/length",
        "reward_length_corr",
        "share/mlp_L3",
    } <= keys
    assert set(base["concept_cosines"]) == set(CONCEPTS)
    assert {k for k in keys if k.startswith("probe/")} == {f"probe/{p}" for p in PROBES}
    for r in checks:
        assert set(r["metrics"]) == keys and r["cost_s"] > 0
        for est in r["metrics"].values():
            assert est["value"] is None or est["ci_low"] <= est["value"] <= est["ci_high"]


def test_logged_metrics_reach_the_trainer_log_history(run):
    history = run["trainer"].state.log_history
    probe_steps = [h["step"] for h in history if "reward_lens/probe/length" in h]
    assert probe_steps == [1] + list(range(EVERY, MAX_STEPS + 1, EVERY))
    per_step = [h for h in history if "reward_lens/attr/mlp_L0/mean" in h]  # via TRL's log_metric
    assert [h["step"] for h in per_step] == list(range(1, MAX_STEPS + 1))
    for h, rec in zip(per_step, run["reward_fn"].history):
        assert h["reward_lens/attr/mlp_L0/mean"] == pytest.approx(rec["attr/mlp_L0/mean"], abs=1e-6)
    # The check's values in the log are the JSONL's.
    last = [r for r in run["records"] if r["kind"] == "check"][-1]
    entry = [h for h in history if "reward_lens/probe/length" in h][-1]
    assert entry["reward_lens/probe/length"] == pytest.approx(last["metrics"]["probe/length"]["value"])
    assert entry["reward_lens/drift_flags"] == len(last["flags"])


def test_filler_policy_is_flagged(run):
    """After the swap the policy pads with filler sentences, which the demo RM rewards (planted length bias):
    the completions move along the length concept and the reward rises, both beyond the baseline's interval.
    The reward-length correlation rises too but stays inside its wide interval (n = 32, and the random
    completions' content moves the reward more than their length does), so it is not asserted as a flag."""
    checks = {r["step"]: r for r in run["records"] if r["kind"] == "check"}
    base = next(r for r in run["records"] if r["kind"] == "baseline")["metrics"]
    for step in range(EVERY, SWAP_AFTER + 1, EVERY):
        assert not {"concept/length", "reward", "reward_length_corr"} & set(checks[step]["flags"]), checks[
            step
        ]["flags"]
    for step in range(SWAP_AFTER + EVERY, MAX_STEPS + 1, EVERY):
        flags, now = checks[step]["flags"], checks[step]["metrics"]
        assert {"concept/length", "reward"} <= set(flags), flags
        assert now["concept/length"]["ci_low"] > base["concept/length"]["ci_high"]
        assert now["reward"]["ci_low"] > base["reward"]["ci_high"]
        assert now["reward_length_corr"]["value"] > base["reward_length_corr"]["value"]
    entry = [h for h in run["trainer"].state.log_history if "reward_lens/drift_flags" in h][-1]
    assert entry["reward_lens/drift_flags"] >= 2


def test_monitor_page_and_cli(run, tmp_path):
    from reward_lens.app.cli import main
    from reward_lens.app.monitor import load_monitor, render_monitor

    log = run["out"] / "monitor.jsonl"
    mon = load_monitor(log)
    frame = mon.to_frame()
    assert set(frame.columns) >= {"step", "kind", "quantity", "value", "ci_low", "ci_high", "flagged"}
    flagged = mon.summary()
    assert set(flagged[flagged.quantity == "concept/length"].step) == set(
        range(SWAP_AFTER + EVERY, MAX_STEPS + 1, EVERY)
    )
    assert len(flagged) == sum(len(r["flags"]) for r in run["records"] if r["kind"] == "check")
    page = render_monitor(log, tmp_path / "page.html")
    html = page.read_text()
    assert html.count("data:image/png;base64,") >= 4 and "concept/length" in html and "<script" not in html
    assert main(["monitor", str(log), "--out", str(tmp_path / "cli.html")]) == 0
    assert (tmp_path / "cli.html").stat().st_size > 10_000
    assert main(["monitor", str(tmp_path / "missing.jsonl")]) == 2


def test_bad_inputs_are_clear(run):
    from reward_lens.integrations.trl import RewardLensCallback, RewardLensReward, message_text

    with pytest.raises(ValueError, match="unknown probe dimension"):
        RewardLensCallback(run["reward_fn"], probes=["lenght"])
    with pytest.raises(TypeError, match="RewardLensReward"):
        RewardLensCallback(lambda prompts, completions, **kw: [0.0])
    with pytest.raises(ValueError, match="batch_size"):
        RewardLensReward(run["rm"], batch_size=0)
    assert message_text([{"role": "user", "content": "hi"}], "user") == "hi"
    with pytest.raises(TypeError, match="list of"):
        message_text(3, "user")
    fresh = RewardLensReward(run["rm"])
    rewards = fresh(
        [[{"role": "user", "content": "What is 2 plus 7?"}]],
        [[{"role": "assistant", "content": "2 plus 7 is 9."}]],
    )
    assert math.isfinite(rewards[0]) and fresh.recent[-1] == ("What is 2 plus 7?", "2 plus 7 is 9.")
