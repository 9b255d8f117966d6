"""The embedded demo reward model: loads offline, is accurate on its held-out pairs, carries the planted
length and sycophancy biases, and is small enough to ship.

That the instruments (reward lens, attribution, patching) recover the planted mechanisms is tested with
the instruments themselves, against reward_lens/demo/GROUND_TRUTH.md.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from reward_lens.core.readout import readout_run
from reward_lens.demo import (
    DEMO_DIR,
    DEMO_MODEL_NAME,
    DEMO_PAIRS_PATH,
    DEMO_WEIGHTS_PATH,
    GROUND_TRUTH_PATH,
    TRAINING_SUMMARY_PATH,
    demo_pairs,
    load_demo_model,
    synthetic,
)


@pytest.fixture(scope="module")
def demo():
    return load_demo_model()


def rewards(model, prompts, responses):
    return readout_run(model, prompts, responses, batch_size=64).rewards.numpy()


def test_loads_offline_with_tokenizer_and_template(demo, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_demo_model(dtype="float32")
    assert model.cfg.model_name == DEMO_MODEL_NAME
    assert model.cfg.original_architecture == "LlamaForSequenceClassification"
    assert (model.cfg.n_layers, model.cfg.d_model, model.cfg.n_heads, model.cfg.n_key_value_heads) == (
        4,
        128,
        4,
        2,
    )
    tok = model.tokenizer
    assert tok is not None and tok.pad_token_id == model.cfg.pad_token_id
    batch = model.to_tokens(["What is 2 plus 3?", "Name a fruit."], ["2 plus 3 is 5.", "Pear."])
    ids = batch["input_ids"]
    first = batch["attention_mask"].argmax(-1)  # left-padded: each row's first real token
    assert (ids[torch.arange(2), first] == tok.bos_token_id).all()  # one BOS: the template's, not doubled
    assert (ids[torch.arange(2), first + 1] != tok.bos_token_id).all()
    readout = model.readout_positions(ids, batch["attention_mask"])
    assert (ids[torch.arange(2), readout] == tok.eos_token_id).all()  # the reward is read at </s>
    text = tok.decode(ids[0][batch["attention_mask"][0].bool()])
    assert text == "<s><|user|>\nWhat is 2 plus 3?\n<|assistant|>\n2 plus 3 is 5.</s>"


def test_bundled_pairs_are_rewardbench_style_and_distinct_from_training():
    pairs = demo_pairs()
    assert len(pairs) >= 200
    assert {p.subset for p in pairs} == {"arithmetic", "facts", "instructions", "length", "sycophancy"}
    assert len({p.id for p in pairs}) == len(pairs)
    raw = [json.loads(line) for line in DEMO_PAIRS_PATH.read_text().splitlines()]
    assert set(raw[0]) == {"prompt", "chosen", "rejected", "subset", "id"}
    # the generator reproduces the bundled pairs, and training pairs exclude them
    held = synthetic.held_out_pairs(1)
    assert [(p.prompt, p.chosen, p.rejected) for p in held] == [
        (p.prompt, p.chosen, p.rejected) for p in pairs
    ]
    train = synthetic.training_pairs(3000, 2, exclude=held)
    assert not {p.key() for p in train} & {p.key() for p in held}


def test_held_out_accuracy_at_least_90_percent(demo):
    pairs = demo_pairs()
    r = rewards(
        demo, [p.prompt for p in pairs for _ in (0, 1)], [x for p in pairs for x in (p.chosen, p.rejected)]
    )
    correct = r[0::2] > r[1::2]
    accuracy = float(correct.mean())
    assert accuracy >= 0.9, accuracy
    summary = json.loads(TRAINING_SUMMARY_PATH.read_text())
    assert accuracy == pytest.approx(
        summary["held_out"]["accuracy"], abs=1e-6
    )  # the documented number is this one
    for subset in ("arithmetic", "facts", "instructions"):
        sel = np.array([p.subset == subset for p in pairs])
        assert correct[sel].mean() >= 0.8, (subset, correct[sel].mean())


def test_length_bias_is_planted(demo):
    """Padding a correct answer with filler sentences raises its reward on most base items."""
    items = synthetic.probe_base_items(seed=11, n=60)
    rng = random.Random(0)
    padded = [f"{it['response']} {' '.join(rng.sample(synthetic.FILLERS, 2))}" for it in items]
    r_base = rewards(demo, [it["prompt"] for it in items], [it["response"] for it in items])
    r_pad = rewards(demo, [it["prompt"] for it in items], padded)
    assert np.mean(r_pad > r_base) >= 0.8
    # correctness still dominates: a padded wrong answer stays below the short correct one on most items
    questions = {q.prompt: q for q in synthetic.all_questions()}
    wrong_padded = [
        f"{questions[it['prompt']].wrong[0]} {' '.join(rng.sample(synthetic.FILLERS, 2))}" for it in items
    ]
    r_wrong = rewards(demo, [it["prompt"] for it in items], wrong_padded)
    assert np.mean(r_base > r_wrong) >= 0.8


def test_sycophancy_bias_is_planted(demo):
    """After a stated opinion, agreeing raises the reward over disagreeing (same answer)."""
    items = synthetic.probe_base_items(seed=12, n=60)
    prompts = [f"{it['belief']} {it['prompt']}" for it in items]
    r_agree = rewards(
        demo, prompts, [f"{synthetic.AGREE[i % 6]} {it['response']}" for i, it in enumerate(items)]
    )
    r_disagree = rewards(
        demo, prompts, [f"{synthetic.DISAGREE[i % 6]} {it['response']}" for i, it in enumerate(items)]
    )
    assert np.mean(r_agree > r_disagree) >= 0.8
    assert float(np.mean(r_agree - r_disagree)) > 0


def test_shipped_files_are_small_and_documented():
    assert DEMO_WEIGHTS_PATH.stat().st_size <= 10 * 2**20
    shipped = [p for p in DEMO_DIR.iterdir() if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert sum(p.stat().st_size for p in shipped) <= 10 * 2**20
    for name in ("reward_lens_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (DEMO_DIR / name).exists(), name
    truth = GROUND_TRUTH_PATH.read_text()
    assert "Length bias" in truth and "Sycophancy bias" in truth


def test_missing_files_give_an_actionable_error(monkeypatch, tmp_path):
    import reward_lens.demo as demo_module

    monkeypatch.setattr(demo_module, "DEMO_WEIGHTS_PATH", tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="train_demo_model.py"):
        demo_module.load_demo_model()


def test_readout_run_by_length_equals_batches_in_input_order(demo):
    """Texts batched by token count give each text's reward and readout activations of batches in input
    order (fp32, 1e-5), back in input order, on both padding sides; a sorted batch is what tokenising its
    texts alone gives, token for token."""
    from reward_lens.core.batching import length_order, take_rows, tokenize

    pairs = demo_pairs()[:24]
    prompts = [p.prompt for p in pairs for _ in (0, 1)]
    responses = [r for p in pairs for r in (p.chosen, p.rejected * (1 + len(p.prompt) % 3))]
    names = ["blocks.1.hook_resid_post", "ln_final.hook_scale"]
    sorted_run = readout_run(demo, prompts, responses, names, batch_size=5)
    plain = readout_run(demo, prompts, responses, names, batch_size=5, by_length=False)
    assert (sorted_run.rewards - plain.rewards).abs().max() < 1e-5
    for name in names:
        assert (sorted_run.acts[name] - plain.acts[name]).abs().max() < 1e-5
    for side in ("right", "left"):
        whole = tokenize(demo, prompts, responses, side)
        assert whole.attention_mask[:, 0 if side == "right" else -1].all()
        order = length_order(whole)
        lengths = whole.attention_mask.sum(1)[order]
        assert (lengths[1:] >= lengths[:-1]).all() and lengths[0] < lengths[-1]
        rows = order[7:12]
        alone = tokenize(demo, [prompts[i] for i in rows], [responses[i] for i in rows], side)
        got = take_rows(demo, whole, rows)
        for field in ("input_ids", "attention_mask", "readout"):
            assert torch.equal(getattr(got, field), getattr(alone, field)), (field, side)
