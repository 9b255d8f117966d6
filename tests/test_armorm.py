"""ArmoRM (LlamaForRewardModelWithGating) loaded from its directory format without remote code, against a
reference written from the published forward's steps (tests/armorm_reference.py). fp32, tol 1e-4."""

import pytest
import torch
from armorm_reference import ASSISTANT_HEADER, ReferenceArmoRM, chat_ids, save_tiny_armorm

from reward_lens import ArmoRMHead, HookedRewardModel, read_objective
from reward_lens.model.heads.armorm import ARMORM_OBJECTIVES

TOL = 1e-4
PAD = 128001


@pytest.fixture(scope="module")
def armorm_dir(tmp_path_factory):
    return save_tiny_armorm(tmp_path_factory.mktemp("armorm"), seed=0)


@pytest.fixture(scope="module")
def reference(armorm_dir):
    return ReferenceArmoRM.from_directory(armorm_dir)


@pytest.fixture(scope="module")
def models(armorm_dir):
    return {fold: HookedRewardModel.from_pretrained(armorm_dir, fold_ln=fold) for fold in (False, True)}


def batch(side: str = "right"):
    """Four chats of different lengths, one with two turns (the gate must use the last header)."""
    rows = [
        chat_ids(4, 5, seed=0),
        chat_ids(2, 2, seed=1),
        chat_ids(3, 1, seed=2, n_turns=2),
        chat_ids(6, 3, seed=3),
    ]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        sl = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask


def reference_run(reference, ids, mask):
    return reference(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))


def test_loads_as_armorm_without_remote_code(models, armorm_dir):
    import json

    assert "auto_map" in json.loads((armorm_dir / "config.json").read_text())  # present, and ignored
    model = models[True]
    assert isinstance(model.reward_head, ArmoRMHead)
    assert model.cfg.head_type == "armorm" and model.cfg.n_outputs == 1
    assert model.reward_head.objective_names == list(ARMORM_OBJECTIVES)
    assert model.reward_head.gating_pattern == ASSISTANT_HEADER
    assert float(model.reward_head.logit_scale) == pytest.approx(2.5)
    assert model.ln_final.w is None  # folded into W_reg and the gate's first layer


@pytest.mark.parametrize("fold_ln", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_score_objectives_and_gate_match_reference(models, reference, fold_ln, side):
    model = models[fold_ln]
    ids, mask = batch(side)
    ref = reference_run(reference, ids, mask)
    names = [
        "reward_head.hook_pooled",
        "reward_head.hook_gate",
        "reward_head.hook_transformed",
        "reward_head.hook_objectives",
    ]
    score, cache = model.run_with_cache(ids, attention_mask=mask, names_filter=names)
    assert model.readout_positions(ids, mask).tolist() == ref["readout"].tolist()
    assert (score - ref["score"]).abs().max() < TOL
    assert (cache["reward_head.hook_pooled"] - ref["rewards"]).abs().max() < TOL
    assert (cache["reward_head.hook_gate"] - ref["gate"]).abs().max() < TOL
    assert (cache["reward_head.hook_transformed"] - ref["transformed"]).abs().max() < TOL
    assert cache["reward_head.hook_objectives"].shape == (*ids.shape, 19)
    # the test has teeth: the gate is far from uniform and the transform is not the identity
    assert (ref["gate"] / 2.5).max() > 0.2 and (ref["transformed"] - ref["rewards"]).abs().max() > 0.1


def test_readout_rule_is_armorm_s(models):
    model = models[True]
    ids, mask = batch("right")
    first_pad = (ids == PAD).int().argmax(-1)
    assert model.readout_positions(ids, mask).tolist() == [(int(p) - 1) % ids.shape[1] for p in first_pad]
    assert model.readout_positions(batch("left")[0]).tolist() == [ids.shape[1] - 1] * 4


def test_fold_ln_true_and_false_agree(models):
    ids, mask = batch("right")
    assert torch.allclose(
        models[False](ids, attention_mask=mask), models[True](ids, attention_mask=mask), atol=1e-5
    )


@pytest.mark.parametrize("fold_ln", [False, True])
def test_direction_for_reproduces_the_score(models, fold_ln):
    model = models[fold_ln]
    ids, mask = batch("left")
    score, cache = model.run_with_cache(ids, attention_mask=mask)
    rows, readout = torch.arange(ids.shape[0]), model.readout_positions(ids, mask)
    resid = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][rows, readout]
    direction = model.reward_direction_for(ids, mask)
    assert direction.shape == (4, model.cfg.d_model)
    recon = ((resid / cache["ln_final.hook_scale"][rows, readout]) * direction).sum(-1) + model.reward_bias
    assert (recon - score).abs().max() < TOL


def test_direction_is_shared_by_responses_to_one_prompt(models):
    model = models[True]
    prompt = chat_ids(5, 0, seed=7)[:-1]  # bos, prompt, assistant header
    a = torch.cat([prompt, torch.tensor([11, 12, 13, 128009])])[None]
    b = torch.cat([prompt, torch.tensor([400, 500, 600, 700, 800, 128009])])[None]
    da, db = model.reward_direction_for(a), model.reward_direction_for(b)
    assert torch.allclose(da, db, atol=1e-6)
    assert not torch.allclose(model(a), model(b), atol=1e-3)


def test_reward_direction_is_a_clear_error(models):
    with pytest.raises(ValueError, match="reward_direction_for"):
        models[True].reward_direction  # noqa: B018  (the property access raises)


def test_patching_the_gate_changes_the_score_as_computed_by_hand(models, reference):
    model = models[True]
    ids, mask = batch("right")
    ref = reference_run(reference, ids, mask)
    new_gate = torch.zeros(4, 19)
    new_gate[:, 3], new_gate[:, 10] = 0.25, 1.5

    def patch(g, hook):
        return new_gate

    patched = model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=[("reward_head.hook_gate", patch)])
    expected = (new_gate * ref["transformed"]).sum(-1)
    assert (patched - expected).abs().max() < TOL
    assert (patched - ref["score"]).abs().max() > 1e-2

    def zero_objective(r, hook):  # objective patching: zero objective 3 of the transformed rewards
        r = r.clone()
        r[:, 3] = 0
        return r

    patched = model.run_with_hooks(
        ids, attention_mask=mask, fwd_hooks=[("reward_head.hook_transformed", zero_objective)]
    )
    assert (patched - (ref["score"] - ref["gate"][:, 3] * ref["transformed"][:, 3])).abs().max() < TOL


def test_one_objective_as_the_reward(models, reference):
    model = models[False]
    ids, mask = batch("right")
    ref = reference_run(reference, ids, mask)
    with read_objective(model, "helpsteer-verbosity") as m:
        assert (m(ids, attention_mask=mask) - ref["rewards"][:, 4]).abs().max() < TOL
        # a single linear direction exists again, and decomposes the objective exactly
        _, cache = m.run_with_cache(ids, attention_mask=mask)
        rows, readout = torch.arange(4), m.readout_positions(ids, mask)
        resid = cache[f"blocks.{m.cfg.n_layers - 1}.hook_resid_post"][rows, readout]
        recon = (resid / cache["ln_final.hook_scale"][rows, readout]) @ m.reward_direction
        assert (recon - ref["rewards"][:, 4]).abs().max() < TOL
    assert model.reward_head.objective is None
    model.reward_head.set_objective(10)
    try:
        assert (model(ids, attention_mask=mask) - ref["rewards"][:, 10]).abs().max() < TOL
    finally:
        model.reward_head.set_objective(None)
    with pytest.raises(ValueError, match="unknown objective"):
        model.reward_head.set_objective("helpfulness")


def test_missing_gating_pattern_is_a_clear_error(models):
    ids = torch.randint(1, 1000, (2, 9))
    with pytest.raises(ValueError, match=r"rows \[0, 1\].*gating_pattern"):
        models[True](ids, attention_mask=torch.ones_like(ids))


def test_readout_cache_and_start_at_layer(models):
    model = models[True]
    ids, mask = batch("right")
    score = model(ids, attention_mask=mask)
    out, cache = model.run_with_cache(
        ids,
        attention_mask=mask,
        readout_only=True,
        names_filter=lambda n: n.startswith("reward_head") or n == "blocks.1.hook_resid_pre",
    )
    assert torch.equal(out, score)
    assert cache["reward_head.hook_objectives"].shape == (4, 1, 19)
    assert cache["reward_head.hook_gate_input"].shape == (4, model.cfg.d_model)
    _, full = model.run_with_cache(ids, attention_mask=mask, names_filter="blocks.1.hook_resid_pre")
    resumed = model(full["blocks.1.hook_resid_pre"], mask, start_at_layer=1, input_ids=ids)
    assert torch.allclose(resumed, score, atol=1e-6)


def test_hooked_checkpoint_round_trip(models, tmp_path):
    model = models[True]
    model.save_pretrained(tmp_path)
    again = HookedRewardModel.from_pretrained(tmp_path)
    ids, mask = batch("right")
    assert isinstance(again.reward_head, ArmoRMHead)
    assert torch.equal(again(ids, attention_mask=mask), model(ids, attention_mask=mask))


def test_custom_gating_pattern_and_objective_count(tmp_path):
    path = save_tiny_armorm(
        tmp_path,
        seed=3,
        num_objectives=5,
        vocab_size=300,
        pad_token_id=299,
        gating_token_pattern=[290, 291],
        logit_scale=0.7,
    )
    ref = ReferenceArmoRM.from_directory(path)
    model = HookedRewardModel.from_pretrained(path)
    assert model.reward_head.objective_names == [f"objective_{j}" for j in range(5)]
    ids = torch.tensor(
        [[5, 6, 290, 291, 7, 8, 290, 291, 9, 10], [5, 290, 291, 12, 13, 299, 299, 299, 299, 299]]
    )
    mask = (ids != 299).long()
    ref_out = reference_run(ref, ids, mask)
    assert model.reward_head.gate_positions(ids).tolist() == ref_out["gate_pos"].tolist() == [6, 1]
    assert (model(ids, attention_mask=mask) - ref_out["score"]).abs().max() < TOL


def test_padding_with_another_token_is_a_clear_error(models):
    ids, mask = batch("right")
    ids[mask == 0] = 5  # padded with a token that is not the config's pad_token_id
    with pytest.raises(ValueError, match="padded position"):
        models[True](ids, attention_mask=mask)
