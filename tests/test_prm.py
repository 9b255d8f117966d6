"""Process reward models (Qwen2.5-Math-PRM, `Qwen2ForProcessRewardModel`) from a tiny random checkpoint saved
with the authors' names: every step's reward against the reference forward (tests/mlp_reference.py, the
model card's softmax at each `<extra_0>`), step selection (`read_step`), and exactness at a chosen step."""

import pytest
import torch
from helpers import one_thread, word_tokenizer  # noqa: F401
from mlp_reference import STEP_TAG, VOCAB, Reference, padded, random_rows, save_tiny

from reward_lens import HookedRewardModel, ProcessRewardHead, attribute, patch, read_step, token_attribution
from reward_lens.data.pairs import TokenPair

TOL = 1e-5
LENGTHS = (9, 14, 6, 12)


def prm_tokenizer():
    words = ["<pad>", "<unk>", "<s>"] + [f"w{i}" for i in range(3, STEP_TAG)] + ["<extra_0>"]
    assert len(words) == VOCAB and words[STEP_TAG] == "<extra_0>"
    return word_tokenizer(words, bos="<s>", pad="<pad>", unk="<unk>", specials=["<extra_0>"])


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    return save_tiny("qwen2_prm", tmp_path_factory.mktemp("prm"), seed=5)


@pytest.fixture(scope="module")
def models(prm_dir):
    return {
        fold: HookedRewardModel.from_pretrained(prm_dir, fold_ln=fold, tokenizer=prm_tokenizer())
        for fold in (False, True)
    }


def batch(side):
    return padded(random_rows(LENGTHS, seed=2, steps=True), side)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("fold", [False, True])
def test_every_step_matches_the_model_card(prm_dir, models, side, fold):
    ref = Reference.from_directory(prm_dir)
    model = models[fold]
    assert isinstance(model.reward_head, ProcessRewardHead) and model.reward_head.step_tag_id == STEP_TAG
    ids, mask = batch(side)
    out = ref(ids, mask)
    steps = model.step_rewards(ids, attention_mask=mask)
    assert steps.shape == (4, max(len(s) for s in out["steps"]))
    for b, expected in enumerate(out["steps"]):
        n = len(expected)
        assert (steps[b, :n] - expected).abs().max() < TOL
        assert torch.isnan(steps[b, n:]).all()
        assert (torch.sigmoid(steps[b, :n]) - out["step_probs"][b]).abs().max() < TOL
    last = torch.stack([s[-1] for s in out["steps"]])
    assert (model(ids, attention_mask=mask) - last).abs().max() < TOL


def test_read_step_selects_the_readout(models):
    model = models[True]
    ids, mask = batch("left")
    steps = model.step_rewards(ids, attention_mask=mask)
    n = (~torch.isnan(steps)).sum(-1)
    for k in (0, 1, -2):
        with read_step(model, k):
            expected = steps[torch.arange(4), k if k >= 0 else n + k]
            assert (model(ids, attention_mask=mask) - expected).abs().max() < TOL
    assert model.reward_head.step == -1
    with read_step(model, 3), pytest.raises(ValueError, match=r"rows \[0, 2, 3\] .* step 3 does not exist"):
        model(ids, attention_mask=mask)


def test_step_tag_from_tokenizer_and_override(prm_dir):
    model = HookedRewardModel.from_pretrained(prm_dir, step_tag=5)
    assert model.reward_head.step_tag_id == 5
    untagged = HookedRewardModel.from_pretrained(prm_dir)  # no tokenizer: the tag must be named before use
    with pytest.raises(ValueError, match="no step tag id"):
        untagged(batch("left")[0])
    with pytest.raises(ValueError, match="step_tag=5 is for process reward models"):
        from mlp_reference import save_tiny as again

        HookedRewardModel.from_pretrained(again("inform", prm_dir.parent / "inform_for_prm_test"), step_tag=5)


def step_pairs():
    rows = random_rows((11, 13, 9, 15, 10, 12), seed=7, steps=True)
    return [TokenPair(torch.tensor(rows[2 * i]), torch.tensor(rows[2 * i + 1]), id=f"p{i}") for i in range(3)]


@pytest.mark.parametrize("k", [1, -1])
def test_instruments_are_exact_at_the_chosen_step(models, k):
    model = models[True]
    pairs = step_pairs()
    with read_step(model, k):
        res = attribute(model, pairs, heads=True, progress=False)
        total = res.chosen.sum(-1) + res.bias_chosen
        assert ((total - res.reward_chosen).abs() / res.reward_chosen.abs().clamp(min=1)).max() < TOL
        fast = patch(model, pairs, mode=["noising", "denoising"], method="fast", progress=False)
        naive = patch(model, pairs, mode=["noising", "denoising"], method="naive", progress=False)
        for key in fast.patched:
            assert torch.allclose(fast.patched[key], naive.patched[key], atol=1e-4), key
        tok = token_attribution(model, pairs)
        for side in ("chosen", "rejected"):
            assert (tok.total(side) - tok.reward[side].double()).abs().max() < 1e-4
    ids = torch.stack([pairs[0].chosen])
    steps = model.step_rewards(ids)
    assert abs(float(res.reward_chosen[0]) - float(steps[0, k])) < TOL


def test_which_earlier_steps_moved_step_k(models):
    """Token attribution at step k grouped by step: the question a PRM user asks, in a few lines."""
    model = models[True]
    pair = step_pairs()[1]
    k = 1
    with read_step(model, k):
        tok = token_attribution(model, [pair])
    values = torch.as_tensor(tok.token_values("chosen", 0))
    steps = model.reward_head.step_index(pair.chosen[None])[0]
    per_step = torch.zeros(int(steps.max()) + 1, dtype=values.dtype).index_add_(0, steps, values)
    assert per_step[k + 1 :].abs().max() == 0  # later steps cannot move step k (causal attention)
    local = (
        tok.b_O["chosen"][0].sum()
        + tok.mlp["chosen"][0].sum()
        + tok.embed["chosen"][0]
        + tok.bias["chosen"][0]
    )
    assert abs(float(per_step.sum() + local) - float(tok.reward["chosen"][0])) < 1e-4


def test_cache_decomposition_at_a_step(models):
    model = models[True]
    ids, mask = batch("left")
    with read_step(model, 1):
        reward, cache = model.run_with_cache(ids, attention_mask=mask)
        rows, readout = torch.arange(4), model.readout_positions(ids, mask)
        stack, labels = cache.decompose_resid(return_labels=True, apply_ln=False, pos_slice=None)
        scale = cache["ln_final.hook_scale"][rows, readout]
        dirs = model.tokens_to_residual_directions(ids)
        terms = torch.stack([(stack[i][rows, readout] / scale * dirs).sum(-1) for i in range(len(labels))])
        assert (terms.sum(0) + model.reward_bias_for(ids, mask) - reward).abs().max() < 1e-4
        assert (reward - model.step_rewards(ids, attention_mask=mask)[:, 1]).abs().max() < TOL
