"""MLP-head reward models (INF-ORM, Qwen2.5-Math-RM, GRM) loaded from tiny random checkpoints saved with
their authors' names, against reference forwards written from the authors' definitions
(tests/mlp_reference.py); and the exact per-sequence (frozen ReLU mask) decomposition. fp32."""

import json

import pytest
import torch
from helpers import one_thread, token_pairs  # noqa: F401
from mlp_reference import Reference, padded, random_rows, save_tiny

from reward_lens import HookedRewardModel, MLPHead, attribute, patch, path_patch, token_attribution

TOL = 1e-5
RM_KINDS = ("inform", "qwen2_rm", "grm", "grm_linear", "grm_deep")
LENGTHS = (5, 9, 7, 12)  # row 0 shorter than the longest: it starts with a pad when left-padded


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {k: save_tiny(k, tmp_path_factory.mktemp(k), seed=i) for i, k in enumerate(RM_KINDS)}


@pytest.fixture(scope="module")
def models(dirs):
    return {
        (k, fold): HookedRewardModel.from_pretrained(dirs[k], fold_ln=fold)
        for k in RM_KINDS
        for fold in (False, True)
    }


@pytest.mark.parametrize("kind", RM_KINDS)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("fold", [False, True])
def test_rewards_match_the_authors_forward(dirs, models, kind, side, fold):
    ref = Reference.from_directory(dirs[kind])
    model = models[(kind, fold)]
    assert isinstance(model.reward_head, MLPHead) and model.reward_head.family.startswith("mlp:")
    ids, mask = padded(random_rows(LENGTHS, seed=3), side)
    out = ref(ids, mask)
    assert model.readout_positions(ids, mask).tolist() == out["readout"].tolist()
    reward = model(ids, attention_mask=mask)
    assert (reward - out["reward"]).abs().max() < TOL
    if kind != "grm_linear":  # the test has teeth: some ReLUs are off at the readout
        _, cache = model.run_with_cache(ids, attention_mask=mask, names_filter="reward_head.hook_hidden.0")
        on = (cache["reward_head.hook_hidden.0"] > 0).float().mean()
        assert 0.1 < float(on) < 0.9


def test_pooling_rules(models):
    ids, mask = padded(random_rows(LENGTHS, seed=3), "right")
    T = ids.shape[1]
    inform = models[("inform", True)]
    assert inform.readout_positions(ids, mask).tolist() == [n - 1 if n < T else T - 1 for n in LENGTHS]
    grm = models[("grm", True)]
    assert grm.readout_positions(ids, mask).tolist() == [n - 1 for n in LENGTHS]
    left, lmask = padded(random_rows(LENGTHS, seed=3), "left")
    assert grm.readout_positions(left, lmask).tolist() == [T - 1] * 4


@pytest.mark.parametrize("kind", RM_KINDS)
def test_frozen_mask_direction_and_bias_reproduce_the_reward(models, kind):
    model = models[(kind, True)]
    ids, mask = padded(random_rows(LENGTHS, seed=4), "left")
    reward, cache = model.run_with_cache(ids, attention_mask=mask)
    rows, readout = torch.arange(4), model.readout_positions(ids, mask)
    resid = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][rows, readout]
    scale = cache["ln_final.hook_scale"][rows, readout]
    direction, bias = model.reward_readout_for(ids, mask)
    recon = (resid / scale * direction).sum(-1) + bias
    assert ((recon - reward).abs() / reward.abs().clamp(min=1)).max() < TOL
    # tokens_to_residual_directions: the cache decomposition with the per-sequence bias
    stack, labels = cache.decompose_resid(return_labels=True, apply_ln=False, pos_slice=None)
    dirs_ = model.tokens_to_residual_directions(ids)
    assert torch.allclose(dirs_, direction, atol=1e-6)
    terms = torch.stack([(stack[i][rows, readout] / scale * dirs_).sum(-1) for i in range(len(labels))])
    assert ((terms.sum(0) + model.reward_bias_for(ids, mask) - reward).abs()).max() < 1e-4
    if kind != "grm_linear":  # directions differ across sequences
        cos = torch.nn.functional.cosine_similarity(direction[0], direction[1], dim=0)
        assert cos < 0.999


def test_no_single_direction_is_a_clear_error(models):
    with pytest.raises(ValueError, match="reward_direction_for"):
        models[("inform", True)].reward_direction  # noqa: B018  (raises)
    with pytest.raises(ValueError, match="reward_bias_for"):
        models[("inform", True)].reward_bias  # noqa: B018  (raises)


@pytest.mark.parametrize("kind", ["inform", "grm_deep"])
def test_attribution_patching_and_tokens_are_exact(models, kind):
    model = models[(kind, True)]
    pairs = token_pairs([(4, 6), (7, 3), (5, 5)], prompt_len=3, vocab=95, low=3)
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
    fast, naive = (path_patch(model, pairs, method=m) for m in ("fast", "naive"))
    assert torch.allclose(fast.patched.nan_to_num(), naive.patched.nan_to_num(), atol=1e-4)


def test_patched_readout_recomputes_the_relu_mask(models):
    """The fast path scores a patched residual with the head itself (its masks), not the clean direction."""
    from reward_lens.core.directions import reward_from_final_resid

    model = models[("inform", True)]
    ids, mask = padded(random_rows((6, 6), seed=5), "left")
    _, cache = model.run_with_cache(ids, attention_mask=mask)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][:, -1]
    direction, bias = model.reward_readout_for(ids, mask)
    swapped = final.flip(0)  # row 0 read with row 1's residual
    own = reward_from_final_resid(model, swapped, direction, bias)
    assert torch.allclose(own, model(ids, attention_mask=mask).flip(0), atol=1e-5)


def test_unknown_vhead_layer_type_is_refused(dirs, tmp_path):
    import shutil

    path = tmp_path / "grm_bad"
    shutil.copytree(dirs["grm"], path)
    raw = json.loads((path / "config.json").read_text())
    raw["vhead_layer_type"] = "attention"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="vhead_layer_type='attention'.*supported: mlp, linear"):
        HookedRewardModel.from_pretrained(path)


def test_head_and_config_disagreeing_is_a_clear_error(dirs, tmp_path):
    import shutil

    path = tmp_path / "grm_wide"
    shutil.copytree(dirs["grm"], path)
    raw = json.loads((path / "config.json").read_text())
    raw["vhead_num_neurons"] = 41
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="v_head.summary.0.weight has shape"):
        HookedRewardModel.from_pretrained(path)


def test_hooked_checkpoint_round_trip(models, tmp_path):
    model = models[("grm_deep", True)]
    model.save_pretrained(tmp_path)
    again = HookedRewardModel.from_pretrained(tmp_path)
    ids, mask = padded(random_rows(LENGTHS, seed=3), "right")
    assert torch.equal(again(ids, attention_mask=mask), model(ids, attention_mask=mask))
