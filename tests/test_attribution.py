"""Exact direct attribution: the terms sum to the reward (and the gap) minus the bias within 1e-5 relative,
final norm included; heads and neurons sum to their layer's term; an independent recomputation from a
full cache agrees; Gemma-2 post-norms, ArmoRM per-sequence directions and the generic path too."""

import pytest
import torch
from helpers import one_thread, tiny_hf_model, tiny_tokenizer, token_pairs  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens.data.pairs import TokenPair, bundled_pairs
from reward_lens.instruments import attribute

RTOL = 1e-5
PAIRS = token_pairs([(9, 4), (3, 8), (6, 6)], prompt_len=4)


def rel_err(a, b):
    return ((a.double() - b.double()).abs() / b.double().abs().clamp(min=1e-6)).max().item()


def check_exact(res, rtol=RTOL):
    assert rel_err(res.chosen.sum(-1) + res.bias_chosen, res.reward_chosen) < rtol
    assert rel_err(res.rejected.sum(-1) + res.bias_rejected, res.reward_rejected) < rtol
    assert rel_err(res.gap.sum(-1) + res.bias_chosen - res.bias_rejected, res.reward_gap) < rtol
    assert res.max_relative_error() < rtol


@pytest.mark.parametrize("fold_ln", [True, False])
@pytest.mark.parametrize("side", ["right", "left"])
def test_terms_sum_to_reward_heads_and_neurons_to_their_layer(llama_hf, fold_ln, side):
    model = HookedRewardModel.from_hf_model(llama_hf, fold_ln=fold_ln)
    res = attribute(model, PAIRS, neurons=True, padding_side=side, batch_size=2, progress=False)
    check_exact(res)
    L = model.cfg.n_layers
    attn = res.chosen[:, 1::2]
    mlp = res.chosen[:, 2::2]
    assert attn.shape == (3, L)
    assert (res.heads_chosen.sum(-1) + res.head_bias_chosen - attn).abs().max() < 1e-6
    assert (res.neurons_chosen.sum(-1) + res.neuron_bias_chosen - mlp).abs().max() < 1e-6
    assert (res.heads_rejected.sum(-1) + res.head_bias_rejected - res.rejected[:, 1::2]).abs().max() < 1e-6


def test_matches_an_independent_recomputation_and_the_final_norm_matters(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf, fold_ln=False)  # ln_final keeps its weight
    res = attribute(model, PAIRS[:1], progress=False)
    ids = PAIRS[0].chosen[None]
    reward, cache = model.run_with_cache(ids)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][0, -1]
    scale = final.pow(2).mean().add(model.cfg.eps).sqrt()  # recomputed, not the hook's
    w = model.reward_head.W_R[:, 0] * model.ln_final.w
    expected = [cache["hook_embed"][0, -1] @ w / scale]
    for l in range(model.cfg.n_layers):
        expected += [
            cache[f"blocks.{l}.hook_attn_out"][0, -1] @ w / scale,
            cache[f"blocks.{l}.hook_mlp_out"][0, -1] @ w / scale,
        ]
    assert torch.allclose(res.chosen[0], torch.stack(expected), atol=1e-6)
    # Per head from hook_z and W_O directly.
    z = cache["blocks.1.attn.hook_z"][0, -1]
    heads = torch.stack([z[h] @ model.blocks[1].attn.W_O[h] @ w / scale for h in range(model.cfg.n_heads)])
    assert torch.allclose(res.heads_chosen[0, 1], heads, atol=1e-6)
    # Ignoring the final norm (no division by its scale) misses the reward badly.
    unnormed = torch.stack(expected).sum() * scale + model.reward_bias
    assert rel_err(unnormed[None], reward) > 0.5


def test_gemma2_post_norms_are_exact():
    from test_gemma2 import tiny_gemma2

    model = HookedRewardModel.from_hf_model(tiny_gemma2())
    res = attribute(model, PAIRS, neurons=True, progress=False)
    check_exact(res)
    assert (res.heads_chosen.sum(-1) + res.head_bias_chosen - res.chosen[:, 1::2]).abs().max() < 1e-5
    assert (res.neurons_chosen.sum(-1) + res.neuron_bias_chosen - res.chosen[:, 2::2]).abs().max() < 1e-5


def test_armorm_uses_the_per_sequence_direction(tmp_path):
    from armorm_reference import save_tiny_armorm

    path = save_tiny_armorm(
        tmp_path, num_objectives=5, vocab_size=300, pad_token_id=299, gating_token_pattern=[290, 291]
    )
    model = HookedRewardModel.from_pretrained(path)
    prompts = ([7, 8, 9, 290, 291], [5, 6, 290, 291])
    pairs = [
        TokenPair(prompts[0] + [11, 12, 13], prompts[0] + [21]),
        TokenPair(prompts[1] + [31], prompts[1] + [41, 42, 43, 44]),
    ]
    for side in ("right", "left"):
        res = attribute(model, pairs, padding_side=side, progress=False)
        check_exact(res)
        assert torch.all(res.bias_chosen == 0)


def test_generic_path_component_terms_match_native(llama_hf):
    generic = HookedRewardModel.from_hf_model(llama_hf, generic=True)
    native = HookedRewardModel.from_hf_model(llama_hf)
    g, n = attribute(generic, PAIRS, progress=False), attribute(native, PAIRS, progress=False)
    check_exact(g)
    assert (
        g.heads_chosen is None and n.heads_chosen is not None
    )  # heads=None: only where per-head hooks exist
    assert torch.allclose(g.chosen, n.chosen, atol=1e-6)


def test_text_pairs_frame_and_plot(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf, tokenizer=tiny_tokenizer())
    pairs = bundled_pairs()[:5]
    res = attribute(model, pairs, batch_size=2, progress=False)
    check_exact(res)
    frame = res.to_frame()
    assert list(frame.columns) == ["pair", "component", "layer", "level", "head", "chosen", "rejected", "gap"]
    assert len(frame) == 5 * (1 + 2 * model.cfg.n_layers)
    heads = res.to_frame("head")
    assert len(heads) == 5 * model.cfg.n_layers * (model.cfg.n_heads + 1)
    with pytest.raises(ValueError, match="neurons=True"):
        res.to_frame("neuron")
    import matplotlib.figure

    assert isinstance(res.plot(), matplotlib.figure.Figure)


def test_multi_output_head_is_a_clear_error(llama_hf):
    model = HookedRewardModel.from_hf_model(tiny_hf_model("llama", num_labels=2))
    with pytest.raises(ValueError, match="2 outputs"):
        attribute(model, PAIRS, progress=False)


def test_a_head_the_decomposition_cannot_reproduce_is_reported(llama_model, monkeypatch):
    import reward_lens.core.pipeline as module  # where the instruments take the readout direction from

    real = module.readout_direction
    monkeypatch.setattr(
        module, "readout_direction", lambda model, tok: (2 * real(model, tok)[0], real(model, tok)[1])
    )
    with pytest.warns(UserWarning, match="not linear in the final residual"):
        attribute(llama_model, PAIRS, progress=False)
