"""QRM (LlamaForRewardModelWithGating31 / ...Gating3) loaded from its directory format without remote code,
against a reference written from the published forward (tests/qrm_reference.py): score, every objective,
every quantile and the gate within 1e-5 in fp32; per-objective / per-quantile views; exact decomposition."""

import pytest
import torch
from armorm_reference import chat_ids
from helpers import one_thread  # noqa: F401
from qrm_reference import ReferenceQRM, save_tiny_qrm

from reward_lens import HookedRewardModel, QRMHead, attribute, patch, read_objective, token_attribution
from reward_lens.data.pairs import TokenPair

TOL = 1e-5
PAD = 128001


@pytest.fixture(scope="module", params=["LlamaForRewardModelWithGating31", "LlamaForRewardModelWithGating3"])
def qrm(request, tmp_path_factory):
    path = save_tiny_qrm(tmp_path_factory.mktemp("qrm"), seed=0, architecture=request.param)
    ref = ReferenceQRM.from_directory(path)
    return ref, {fold: HookedRewardModel.from_pretrained(path, fold_ln=fold) for fold in (False, True)}


def batch(side):
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


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_score_objectives_quantiles_and_gate_match_reference(qrm, fold, side):
    ref, models = qrm
    model = models[fold]
    assert isinstance(model.reward_head, QRMHead) and model.reward_head.family == "qrm"
    ids, mask = batch(side)
    out = ref(ids, mask)
    names = [
        "reward_head.hook_pooled",
        "reward_head.hook_gate",
        "reward_head.hook_quantiles",
        "reward_head.hook_transformed",
    ]
    score, cache = model.run_with_cache(ids, attention_mask=mask, names_filter=names)
    assert (score - out["score"]).abs().max() < TOL
    assert (cache["reward_head.hook_pooled"] - out["expectations"]).abs().max() < TOL
    assert (cache["reward_head.hook_transformed"] - out["rewards"]).abs().max() < TOL
    assert (cache["reward_head.hook_quantiles"] - out["quantile_rewards"]).abs().max() < TOL
    assert (cache["reward_head.hook_gate"] - out["gate"]).abs().max() < TOL
    head = model.reward_head
    for q in range(head.num_quantiles):
        head.set_quantile(q)
        try:
            assert (model(ids, attention_mask=mask) - out["quantiles"][:, q]).abs().max() < TOL
        finally:
            head.set_quantile(None)
    assert torch.allclose(out["quantiles"].mean(1), out["score"], atol=1e-5)  # the score: the quantiles' mean
    for j in (0, 7, 18):
        with read_objective(model, j):
            assert (model(ids, attention_mask=mask) - out["expectations"][:, j]).abs().max() < TOL
    assert (out["gate"] / 1.7).max() > 0.2  # teeth: the gate is far from uniform


def test_gated_direction_reproduces_the_score(qrm):
    _, models = qrm
    model = models[True]
    ids, mask = batch("left")
    score, cache = model.run_with_cache(ids, attention_mask=mask)
    rows, readout = torch.arange(4), model.readout_positions(ids, mask)
    resid = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][rows, readout]
    direction, bias = model.reward_readout_for(ids, mask)
    recon = (resid / cache["ln_final.hook_scale"][rows, readout] * direction).sum(-1) + bias
    assert (recon - score).abs().max() < TOL


def test_instruments_are_exact(qrm):
    _, models = qrm
    model = models[True]
    pairs = [
        TokenPair(chat_ids(3, 4, seed=s), chat_ids(3, 6, seed=s)[:-2].clone(), id=f"p{s}") for s in range(3)
    ]
    for p in pairs:  # same prompt, different responses, each ending with <|eot_id|>
        p.rejected[-1] = 128009
    res = attribute(model, pairs, heads=True, progress=False)
    total = res.chosen.sum(-1) + res.bias_chosen
    assert ((total - res.reward_chosen).abs() / res.reward_chosen.abs().clamp(min=1)).max() < TOL
    fast = patch(model, pairs, method="fast", progress=False)
    naive = patch(model, pairs, method="naive", progress=False)
    for key in fast.patched:
        assert torch.allclose(fast.patched[key], naive.patched[key], atol=1e-4), key
    tok = token_attribution(model, pairs)
    assert (tok.total("chosen") - tok.reward["chosen"].double()).abs().max() < 1e-4


def test_hooked_round_trip_and_bad_quantile(qrm, tmp_path):
    _, models = qrm
    model = models[True]
    model.save_pretrained(tmp_path)
    again = HookedRewardModel.from_pretrained(tmp_path)
    ids, mask = batch("right")
    assert torch.equal(again(ids, attention_mask=mask), model(ids, attention_mask=mask))
    with pytest.raises(ValueError, match="quantile index 9 out of range"):
        model.reward_head.set_quantile(9)


def test_gate_without_token_ids_is_refused_and_one_objective_needs_none(qrm):
    """A gated forward from a residual without input_ids cannot find the prompt's end: one line naming QRM;
    with one objective selected the score is that objective's, no gate read."""
    _, models = qrm
    model = models[True]
    ids, mask = batch("right")
    full, cache = model.run_with_cache(ids, attention_mask=mask)
    resid = cache["blocks.1.hook_resid_pre"]
    with pytest.raises(ValueError, match="QRM's gate needs the token ids"):
        model(resid, mask, start_at_layer=1)
    with read_objective(model, 2):
        one = model(resid, mask, start_at_layer=1)
    objectives = cache["reward_head.hook_pooled"]
    assert (one - objectives[:, 2]).abs().max() < TOL
