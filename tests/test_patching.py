"""Contrastive patching: the KV-cache fast path equals naive full-forward patching (1e-5, fp32) for every
mode, level and position choice, both padding sides, GQA, sliding windows, qk-norm, Gemma-2 and ArmoRM;
plus hand-written hook checks and the semantics of the modes."""

import pytest
import torch
from helpers import one_thread, tiny_tokenizer, token_pairs  # noqa: F401

import reward_lens.instruments.patching.contrastive as patching_module
from reward_lens import HookedRewardModel
from reward_lens.data.pairs import TokenPair, bundled_pairs
from reward_lens.instruments import patch, site_means

TOL = 1e-5
MODES = ["noising", "denoising", "zero", "mean"]
LEVELS = ["component", "head", "residual"]
PAIRS = token_pairs([(9, 4), (3, 8), (6, 6)], prompt_len=4)  # unequal lengths, readout-aligned
EQUAL = token_pairs([(5, 5), (3, 3), (7, 7)], prompt_len=3, seed=1)


def assert_same(fast, naive, tol=TOL):
    assert fast.patched.keys() == naive.patched.keys()
    for key in fast.patched:
        scale = max(1.0, naive.patched[key].abs().max().item())
        err = (fast.patched[key] - naive.patched[key]).abs().max().item()
        assert err < tol * scale, f"{key}: fast vs naive differ by {err:.2e}"
    assert torch.allclose(fast.clean_chosen, naive.clean_chosen, atol=tol)


@pytest.mark.parametrize("side", ["right", "left"])
def test_fast_equals_naive_at_the_readout(llama_model, side, count_readout_sweeps):
    assert llama_model.cfg.n_key_value_heads < llama_model.cfg.n_heads  # GQA is exercised
    kw = dict(mode=MODES, level=LEVELS, padding_side=side, batch_size=3, progress=False)
    fast = patch(llama_model, PAIRS, method="fast", **kw)
    assert len(count_readout_sweeps) == 2  # one per target, its modes together: the KV path really ran
    naive = patch(llama_model, PAIRS, method="naive", **kw)
    assert_same(fast, naive)
    assert len(fast.sites) == 7 + 12 + 4


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("positions", ["prompt", "all"])
def test_fast_equals_naive_multi_position(llama_model, side, positions):
    kw = dict(
        mode=MODES,
        level=LEVELS,
        padding_side=side,
        positions=positions,
        batch_size=3,
        progress=False,
        max_rows=12,
    )
    pairs = EQUAL if positions == "all" else PAIRS
    assert_same(
        patch(llama_model, pairs, method="fast", **kw), patch(llama_model, pairs, method="naive", **kw)
    )


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])  # sliding window 4 (sequences longer), qk-norm
def test_fast_equals_naive_other_architectures(hf_models, arch):
    model = HookedRewardModel.from_hf_model(hf_models[arch])
    pairs = token_pairs([(9, 4), (2, 10)], prompt_len=3)
    for side in ("right", "left"):
        kw = dict(mode=["noising", "zero"], level=["component", "head"], padding_side=side, progress=False)
        assert_same(patch(model, pairs, **kw), patch(model, pairs, method="naive", **kw))


def test_fast_equals_naive_gemma2():
    from test_gemma2 import tiny_gemma2  # post-norms, soft-capped scores, sliding windows, (1 + w) norms

    model = HookedRewardModel.from_hf_model(tiny_gemma2())
    pairs = token_pairs([(9, 4), (2, 10)], prompt_len=3)
    kw = dict(mode=["noising", "denoising", "mean"], level=LEVELS, progress=False)
    assert_same(patch(model, pairs, **kw), patch(model, pairs, method="naive", **kw))


def test_fast_equals_naive_armorm(tmp_path, count_readout_sweeps):
    from armorm_reference import save_tiny_armorm

    path = save_tiny_armorm(
        tmp_path, num_objectives=5, vocab_size=300, pad_token_id=299, gating_token_pattern=[290, 291]
    )
    model = HookedRewardModel.from_pretrained(path)
    prompt = [7, 8, 9, 290, 291]
    pairs = [
        TokenPair(prompt + [11, 12, 13, 14], prompt + [21, 22]),
        TokenPair([5] + prompt + [31], [5] + prompt + [41, 42, 43]),
    ]
    for side in ("right", "left"):
        kw = dict(
            mode=["noising", "denoising"], level=["component", "head"], padding_side=side, progress=False
        )
        fast = patch(model, pairs, **kw)
        assert_same(fast, patch(model, pairs, method="naive", **kw))
    assert (
        count_readout_sweeps
    )  # the gate reads the prompt, so the per-sequence direction keeps the fast path exact
    # ArmoRM reads the token before the first pad id: with a pad id inside a sequence, later tokens are
    # attended after the readout; they never reach the reward, so both targets keep the (exact) fast path.
    inner = [TokenPair(prompt + [11, 299, 13, 14], prompt + [21, 22])]
    calls = len(count_readout_sweeps)
    kw = dict(mode=["noising", "denoising"], level="component", progress=False)
    assert_same(patch(model, inner, **kw), patch(model, inner, method="naive", **kw))
    assert len(count_readout_sweeps) == calls + 2
    # A gating pattern after the readout is read from the patched run: the fast path must fall back.
    late_gate = [TokenPair([7, 8, 9, 11, 299, 290, 291, 13], prompt + [21, 22])]
    calls = len(count_readout_sweeps)
    assert_same(patch(model, late_gate, **kw), patch(model, late_gate, method="naive", **kw))
    assert len(count_readout_sweeps) == calls + 1  # denoising's target (rejected) still takes the fast path


def test_generic_path_falls_back_and_agrees(llama_hf):
    generic = HookedRewardModel.from_hf_model(llama_hf, generic=True)
    native = HookedRewardModel.from_hf_model(llama_hf)
    kw = dict(mode=MODES, level=["component", "residual"], progress=False, padding_side="left")
    assert_same(patch(generic, PAIRS, **kw), patch(native, PAIRS, **kw))


def test_by_hand_noising_of_one_component_and_one_head(llama_model):
    pair = PAIRS[0]
    result = patch(llama_model, [pair], level=["component", "head"], progress=False)
    rc, cache_r = llama_model.run_with_cache(pair.rejected[None])
    names = result.components
    for name, hook_name, index in (
        ("attn_L1", "blocks.1.hook_attn_out", ...),
        ("L1H2", "blocks.1.attn.hook_z", 2),
    ):
        source = cache_r[hook_name][0, -1, index]

        def write(x, hook):
            x = x.clone()
            x[0, -1, index] = source
            return x

        expected = llama_model.run_with_hooks(pair.chosen[None], fwd_hooks=[(hook_name, write)])[0]
        assert abs(result.patched[("noising", "chosen")][0, names.index(name)] - expected) < TOL


def test_mode_semantics(llama_model):
    res = patch(
        llama_model, PAIRS, mode=["noising", "denoising"], level=["component", "residual"], progress=False
    )
    names = res.components
    final = names.index(f"resid_L{llama_model.cfg.n_layers}")
    # Patching the whole final residual at the readout hands the target the source's reward.
    assert torch.allclose(res.effect("noising", normalized=True)[:, final], torch.tensor(-1.0), atol=TOL)
    assert torch.allclose(res.effect("denoising", normalized=True)[:, final], torch.tensor(1.0), atol=TOL)
    # The residual entering block 0 is the embedding.
    assert torch.allclose(
        res.patched[("noising", "chosen")][:, names.index("resid_L0")],
        res.patched[("noising", "chosen")][:, names.index("embed")],
        atol=TOL,
    )


def test_contrastive_prompt_patches_are_no_ops(llama_model):
    res = patch(
        llama_model,
        PAIRS,
        mode=["noising", "zero"],
        level=["component", "head"],
        positions="prompt",
        progress=False,
    )
    assert res.effect("noising").abs().max() < 1e-6  # causal attention: both runs agree on the shared prefix
    assert res.effect("zero").abs().max() > 1e-3  # ablating it does matter


def test_site_means_are_the_mean_readout_activation(llama_model):
    sites = patching_module.sites_for(llama_model.cfg, ["component", "head"])
    means = site_means(llama_model, PAIRS, sites, batch_size=2)
    acts = []
    for p in PAIRS:
        for ids in (p.chosen, p.rejected):
            _, cache = llama_model.run_with_cache(ids[None])
            acts.append((cache["blocks.1.hook_mlp_out"][0, -1], cache["blocks.2.attn.hook_z"][0, -1, 3]))
    assert torch.allclose(means["mlp_L1"], torch.stack([a for a, _ in acts]).mean(0), atol=1e-6)
    assert torch.allclose(means["L2H3"], torch.stack([b for _, b in acts]).mean(0), atol=1e-6)


def test_text_pairs_and_frame(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf, tokenizer=tiny_tokenizer())
    pairs = bundled_pairs()[:4]
    fast = patch(model, pairs, mode=["noising", "zero"], level="component", batch_size=3, progress=False)
    assert_same(
        fast,
        patch(
            model,
            pairs,
            mode=["noising", "zero"],
            level="component",
            batch_size=3,
            method="naive",
            progress=False,
        ),
    )
    frame = fast.to_frame()
    for col in (
        "pair",
        "component",
        "layer",
        "mode",
        "patched_reward",
        "effect",
        "normalized_effect",
        "target",
    ):
        assert col in frame.columns
    assert len(frame) == 4 * 7 * 3  # pairs x sites x (noising/chosen, zero/chosen, zero/rejected)
    assert set(frame["pair"]) == {p.id for p in pairs}
    row = frame[(frame["mode"] == "noising") & (frame["component"] == "mlp_L2")].iloc[0]
    assert row["effect"] == pytest.approx(row["patched_reward"] - row["clean_reward"], abs=1e-6)


def test_plot_and_layers_subset(llama_model):
    res = patch(llama_model, PAIRS, level=LEVELS, layers=[1, 2], progress=False)
    assert [s.name for s in res.sites if s.level == "component"] == ["attn_L1", "mlp_L1", "attn_L2", "mlp_L2"]
    import matplotlib.figure

    assert isinstance(res.plot(), matplotlib.figure.Figure)


def test_clear_errors(llama_model):
    with pytest.raises(ValueError, match="positions='all'.*responses of"):
        patch(llama_model, PAIRS, positions="all", progress=False)
    patch(llama_model, PAIRS, mode="zero", positions="all", progress=False)  # no source: any lengths
    with pytest.raises(ValueError, match="unknown patching mode"):
        patch(llama_model, PAIRS, mode="noise", progress=False)
    with pytest.raises(ValueError, match="unknown level"):
        patch(llama_model, PAIRS, level="neuron", progress=False)
    with pytest.raises(ValueError, match="out of range"):
        patch(llama_model, PAIRS, layers=[7], progress=False)
    with pytest.raises(ValueError, match="ends with the pad token"):
        patch(llama_model, [TokenPair([3, 4, 0], [3, 5])], progress=False)
