"""The shipped process-RM organism (reward_lens/demo/prm_organism/): it loads as a PRM, its step rewards are
finite up to each item's last step and NaN after, the shipped checkpoint is the one the training summary
hashed, the token attribution at the read step sums to that step's reward, and the bench's PRM rows run."""

import hashlib
import json

import pytest
import torch
from helpers import one_thread  # noqa: F401

from reward_lens import ProcessRewardHead, read_step
from reward_lens.app.bench import run_bench
from reward_lens.app.bench_prm import prm_items, response_mask, step_attribution
from reward_lens.demo import DEMO_DIR
from reward_lens.demo.organisms import load_prm_organism

PRM_DIR = DEMO_DIR / "prm_organism"


@pytest.fixture(scope="module")
def model():
    return load_prm_organism()


def test_loads_as_a_prm_with_the_tokenizers_step_tag(model):
    head = model.reward_head
    assert isinstance(head, ProcessRewardHead)
    assert head.step_tag_id == model.tokenizer.convert_tokens_to_ids("<extra_0>")
    summary = json.loads((PRM_DIR / "training_summary.json").read_text())
    assert head.step_tag_id == summary["step_tag_id"]


def test_step_rewards_finite_then_nan(model):
    items = prm_items()
    items = [i for i in items if len(i["labels"]) == 3][:3] + [i for i in items if len(i["labels"]) == 4][:3]
    tok = model.to_tokens([i["prompt"] for i in items], [i["response"] for i in items])
    rewards = model.step_rewards(tok["input_ids"], attention_mask=tok["attention_mask"])
    n = [len(i["labels"]) for i in items]
    assert rewards.shape == (6, max(n)) and min(n) < max(n)  # some rows have NaN padding steps
    for b, k in enumerate(n):
        assert torch.isfinite(rewards[b, :k]).all()
        assert torch.isnan(rewards[b, k:]).all()


def test_shipped_checkpoint_is_the_trained_one():
    summary = json.loads((PRM_DIR / "training_summary.json").read_text())
    digest = hashlib.sha256((PRM_DIR / "model.safetensors").read_bytes()).hexdigest()
    assert digest == summary["model_sha256"]
    assert summary["model_sha256"] in (PRM_DIR / "GROUND_TRUTH.md").read_text()


def test_items_are_one_first_wrong_step_with_a_later_step():
    for it in prm_items():
        j, labels = it["first_wrong"], it["labels"]
        assert 0 <= j < len(labels) - 1
        assert labels == [1] * j + [0] * (len(labels) - j)
        assert it["response"].count("<extra_0>") == len(labels)


@pytest.mark.parametrize("step", [-1, 1])
def test_token_attribution_sums_to_the_steps_reward(model, step):
    items = prm_items()[:4]
    tok, per_step = step_attribution(model, items, step)
    for i, it in enumerate(items):
        ids = model.to_tokens(it["prompt"], it["response"])
        expected = model.step_rewards(ids["input_ids"], attention_mask=ids["attention_mask"])[0]
        expected = expected[~torch.isnan(expected)][step]
        assert abs(float(tok.total("text")[i]) - float(expected)) < 1e-5
        assert abs(float(tok.reward["text"][i]) - float(expected)) < 1e-5
        # independently: the head terms of the response tokens, grouped by hand at each step tag
        values = torch.as_tensor(tok.token_values("text", i), dtype=torch.float64)
        row = ids["input_ids"][0][: len(values)]
        assert tok.tokens["text"][i][-1] == "<extra_0>"  # the attributed tokens end at the read step's tag
        tags = (row == model.reward_head.step_tag_id).tolist()
        keep = response_mask(model, row).tolist()
        by_hand, k = torch.zeros(len(per_step[i]), dtype=torch.float64), 0
        for v, is_tag, kept in zip(values.tolist(), tags, keep):
            by_hand[k] += v if kept else 0.0
            k += int(is_tag)
        assert torch.allclose(by_hand, per_step[i], atol=1e-12)
        k_read = len(it["labels"]) + step if step < 0 else step
        assert len(per_step[i]) == k_read + 1  # steps after the read one are not attributed (causal)


def test_read_step_reads_every_step(model):
    it = prm_items()[0]
    tok = model.to_tokens(it["prompt"], it["response"])
    rewards = model.step_rewards(tok["input_ids"], attention_mask=tok["attention_mask"])[0]
    for k in range(len(it["labels"])):
        with read_step(model, k), torch.no_grad():
            read = model(tok["input_ids"], attention_mask=tok["attention_mask"])[0]
            assert abs(float(read - rewards[k])) < 1e-5


def independent_shares(model):
    """(token-attribution share, first-negative-step share) recomputed without bench_prm: every step read
    by the model's own forward under read_step, the last step's token terms grouped at the step tags."""
    from reward_lens import token_attribution

    items = prm_items()
    with read_step(model, -1):
        tok = token_attribution(model, [(it["prompt"], it["response"]) for it in items])
    tag, marker = model.reward_head.step_tag_id, model.tokenizer.convert_tokens_to_ids("<|assistant|>")
    attr_hits, step_hits = [], []
    for i, it in enumerate(items):
        ids = model.to_tokens(it["prompt"], it["response"])
        row = ids["input_ids"][0].tolist()
        totals, k, start = [0.0] * len(it["labels"]), 0, row.index(marker) + 2  # after "<|assistant|>\n"
        for pos, v in enumerate(tok.token_values("text", i).tolist()):
            totals[k] += v if pos >= start else 0.0
            k += int(row[pos] == tag)
        attr_hits.append(totals.index(min(totals)) == it["first_wrong"])
        rewards = []
        for k in range(len(it["labels"])):
            with read_step(model, k), torch.no_grad():
                rewards.append(float(model(ids["input_ids"], attention_mask=ids["attention_mask"])[0]))
        step_hits.append(next((k for k, r in enumerate(rewards) if r < 0), None) == it["first_wrong"])
    return sum(attr_hits) / len(items), sum(step_hits) / len(items)


def test_bench_prm_rows_run_and_report(model):
    result = run_bench(["prm"], quick=True, echo=lambda line: None)
    rows = {r["instrument"]: r for r in result.rows}
    assert set(rows) == {"token_attribution", "step_rewards"} and not result.pending
    for r in rows.values():
        assert r["error"] == "" and 0.0 <= r["value"] <= 1.0
        assert r["passed"] == (r["value"] >= 0.9)
    attr, steps = independent_shares(model)
    assert rows["token_attribution"]["value"] == pytest.approx(attr, abs=1e-12)
    assert rows["step_rewards"]["value"] == pytest.approx(steps, abs=1e-12)
