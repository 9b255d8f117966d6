"""Gemma-2 reward models: parity with transformers' Gemma2ForSequenceClassification (fp32, tol 1e-4) with
every quirk active, checks that each quirk is really exercised, and the exact decomposition over the
post-normed component outputs."""

import pytest
import torch
import transformers
from helpers import assert_hf_parity, hf_parity_run, padded_batch

from reward_lens import HookedRewardModel

TOL = 1e-4
FINAL_CAP = 0.05  # transformers does not apply it to the reward; we check that and match it


def tiny_gemma2(seed: int = 0, **overrides) -> transformers.Gemma2ForSequenceClassification:
    fields = dict(
        vocab_size=97,
        hidden_size=72,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=128,
        pad_token_id=0,
        rms_norm_eps=1e-5,
        num_labels=1,
        sliding_window=4,
        query_pre_attn_scalar=20,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=FINAL_CAP,
        initializer_range=0.1,
    )
    fields.update(overrides)
    cfg = transformers.Gemma2Config(**fields)  # layer_types: sliding, full, sliding
    torch.manual_seed(seed)
    model = transformers.Gemma2ForSequenceClassification(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # Gemma norms multiply by (1 + w): random w, so gains spread around 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def gemma_hf():
    return tiny_gemma2()


hf_run = hf_parity_run


def test_config_carries_every_quirk(gemma_hf):
    cfg = HookedRewardModel.from_hf_model(gemma_hf).cfg
    assert cfg.post_norms and cfg.norm_weight_offset == 1.0
    assert cfg.embed_scale == pytest.approx(72**0.5)
    assert cfg.attn_scale == pytest.approx(20**0.5)
    assert cfg.attn_scores_soft_cap == 1.0
    assert cfg.window_sizes == [4, None, 4]
    assert cfg.act_fn == "gelu_pytorch_tanh"


@pytest.mark.parametrize("fold_ln", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_rewards_and_hidden_states_match_transformers(gemma_hf, fold_ln, side):
    model = HookedRewardModel.from_hf_model(gemma_hf, fold_ln=fold_ln)
    ids, mask = padded_batch([12, 7, 10, 3], side)
    assert_hf_parity(model, gemma_hf, ids, mask, TOL)


def test_final_logit_softcap_is_not_applied_to_the_reward(gemma_hf):
    # transformers' GenericForSequenceClassification never caps; rewards far beyond the cap prove it.
    ids, mask = padded_batch([12, 7, 10, 3], "right")
    hf_rewards = hf_run(gemma_hf, ids, mask).logits[:, 0]
    assert hf_rewards.abs().max() > 4 * FINAL_CAP
    ours = HookedRewardModel.from_hf_model(gemma_hf)(ids, attention_mask=mask)
    assert (ours - hf_rewards).abs().max() < TOL


def test_fused_attention_path_without_soft_cap():
    hf = tiny_gemma2(seed=1, attn_logit_softcapping=None)
    model = HookedRewardModel.from_hf_model(hf)
    ids, mask = padded_batch([12, 5], "left", seed=1)
    assert (model(ids, attention_mask=mask) - hf_run(hf, ids, mask).logits[:, 0]).abs().max() < TOL


ABLATIONS = {
    "sliding window": lambda m: [setattr(b.attn, "window", None) for b in m.blocks],
    "attention soft-cap": lambda m: setattr(m.cfg, "attn_scores_soft_cap", None),
    "query_pre_attn_scalar": lambda m: setattr(m.cfg, "attn_scale", m.cfg.d_head**0.5),
    "embedding scale": lambda m: setattr(m.cfg, "embed_scale", None),
    "post-norms": lambda m: setattr(m.cfg, "post_norms", False),
    "(1 + w) offset": lambda m: [
        setattr(mod, "offset", 0.0) for mod in m.modules() if hasattr(mod, "offset")
    ],
}


@pytest.mark.parametrize("quirk", list(ABLATIONS))
def test_each_quirk_matters_on_this_input(gemma_hf, quirk):
    """Switching any one quirk off breaks parity by far more than TOL: the parity test exercises it."""
    model = HookedRewardModel.from_hf_model(gemma_hf, fold_ln=False)
    ids, mask = padded_batch([12, 7, 10, 3], "right")
    ABLATIONS[quirk](model)
    err = (model(ids, attention_mask=mask) - hf_run(gemma_hf, ids, mask).logits[:, 0]).abs().max()
    assert err > 100 * TOL, f"{quirk}: {err}"


def test_embedding_scale_rounds_like_transformers_in_bfloat16(gemma_hf):
    import copy

    hf = copy.deepcopy(gemma_hf).to(torch.bfloat16)
    model = HookedRewardModel.from_hf_model(gemma_hf, dtype=torch.bfloat16)
    ids, _ = padded_batch([12], "right")
    _, cache = model.run_with_cache(ids, names_filter="hook_embed")
    with torch.no_grad():
        assert torch.equal(cache["hook_embed"], hf.model.embed_tokens(ids))


@pytest.mark.parametrize("fold_ln", [False, True])
def test_exact_decomposition_over_post_normed_components(gemma_hf, fold_ln):
    model = HookedRewardModel.from_hf_model(gemma_hf, fold_ln=fold_ln)
    ids, mask = padded_batch([12, 7, 10, 3], "left")
    rewards, cache = model.run_with_cache(ids, attention_mask=mask)
    readout = model.readout_positions(ids, mask)
    rows = torch.arange(ids.shape[0])
    total = cache["hook_embed"].clone()
    for l in range(model.cfg.n_layers):
        total = total + cache[f"blocks.{l}.hook_attn_out"] + cache[f"blocks.{l}.hook_mlp_out"]
    resid = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    assert torch.allclose(total, resid, atol=1e-5, rtol=0)  # components sum to the residual
    scale = cache["ln_final.hook_scale"][rows, readout]
    recon = (total[rows, readout] / scale) @ model.reward_direction + model.reward_bias
    assert ((recon - rewards).abs() / rewards.abs().clamp(min=1e-3)).max() < 1e-5
    # the components are the post-norm outputs: (1 + w_post) * unit-RMS vectors
    for l in range(model.cfg.n_layers):
        for out, norm in (("attn_out", model.blocks[l].ln1_post), ("mlp_out", model.blocks[l].ln2_post)):
            unit = cache[f"blocks.{l}.{'ln1_post' if out == 'attn_out' else 'ln2_post'}.hook_normalized"]
            assert torch.allclose(cache[f"blocks.{l}.hook_{out}"], unit * (1.0 + norm.w), atol=1e-6)
            ms = unit.pow(2).mean(-1)[mask.bool()]  # (pad rows of a zero pad embedding can be all zero)
            assert torch.allclose(ms, torch.ones_like(ms), atol=1e-3)


def test_from_pretrained_directory(gemma_hf, tmp_path):
    gemma_hf.save_pretrained(tmp_path)
    model = HookedRewardModel.from_pretrained(tmp_path)
    ids, mask = padded_batch([12, 6], "right")
    assert (model(ids, attention_mask=mask) - hf_run(gemma_hf, ids, mask).logits[:, 0]).abs().max() < TOL
