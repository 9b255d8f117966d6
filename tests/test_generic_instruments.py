"""The component-level instruments on the generic path (tiny random GPT-2 / GPT-NeoX / Llama, fp32).

GPT-2 exercises a LayerNorm final norm (centering, bias) and learned positions (the "pos_embed" term);
GPT-NeoX parallel blocks (no resid_mid); Llama loaded generically is compared with the native model.
"""

import pytest
import torch
from helpers import tiny_hf_model
from test_generic import tiny

from reward_lens import HookedRewardModel
from reward_lens.data.pairs import TokenPair
from reward_lens.instruments import attribute, attribution_patch, divergence_patch, lens, patch
from reward_lens.model.generic.wrapper import GenericPathError

REL = 1e-5
MODES = ["noising", "denoising", "zero", "mean"]


def token_pairs(n=3, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (5,), generator=g)
        chosen = torch.cat([prompt, torch.randint(3, vocab, (4 + i,), generator=g)])
        rejected = torch.cat([prompt, torch.randint(3, vocab, (6 - i,), generator=g)])
        out.append(TokenPair(chosen, rejected, id=f"p{i}"))
    return out


PAIRS = token_pairs()


@pytest.fixture(scope="module")
def models():
    return {arch: HookedRewardModel.from_hf_model(tiny(arch)) for arch in ("gpt2", "neox")}


@pytest.fixture(scope="module")
def llama_pair():
    hf = tiny_hf_model("llama")
    return HookedRewardModel.from_hf_model(hf), HookedRewardModel.from_hf_model(hf, generic=True)


@pytest.mark.parametrize("arch", ["gpt2", "neox"])
def test_attribution_is_exact_with_position_embeddings_and_layernorm(models, arch):
    model = models[arch]
    result = attribute(model, PAIRS, progress=False)
    expected = ["embed"] + (["pos_embed"] if arch == "gpt2" else [])
    assert result.components[: len(expected) + 1] == expected + ["attn_L0"]
    assert result.heads_chosen is None  # no per-head terms on the generic path
    assert result.max_relative_error() < REL
    # The gap terms are the difference of two exact decompositions.
    gap = result.gap.sum(-1) + result.bias_chosen - result.bias_rejected
    assert (gap - result.reward_gap).abs().max() < REL * result.reward_gap.abs().max()
    with pytest.raises(GenericPathError, match="native"):
        attribute(model, PAIRS, heads=True, progress=False)


@pytest.mark.parametrize("arch", ["gpt2", "neox"])
def test_lens_ends_at_the_reward_in_both_variants(models, arch):
    model = models[arch]
    result = lens(model, PAIRS, progress=False)
    for variant in ("normed", "frozen"):  # "normed" recomputes the (centered, for LN) final norm
        for side, reward in (("chosen", result.reward_chosen), ("rejected", result.reward_rejected)):
            last = result.get(variant, side)[:, -1]
            assert (last - reward).abs().max() < REL * reward.abs().max(), (variant, side)
    # The frozen lens is additive: its steps are the attribution terms of the blocks in between.
    terms = attribute(model, PAIRS, progress=False)
    frozen = result.get("frozen", "chosen")
    per_block = terms.chosen[:, -2 * model.cfg.n_layers :].view(len(PAIRS), -1, 2).sum(-1)
    assert (frozen.diff(dim=-1) - per_block).abs().max() < REL * frozen.abs().max()
    if arch == "gpt2":
        mid = lens(model, PAIRS, include_mid=True, progress=False)
        assert len(mid.sites) == 1 + 2 * model.cfg.n_layers
    else:
        with pytest.raises(GenericPathError, match="parallel"):
            lens(model, PAIRS, include_mid=True, progress=False)


@pytest.mark.parametrize("arch", ["gpt2", "neox"])
@pytest.mark.parametrize("positions", ["readout", "prompt"])
def test_patching_fast_route_equals_naive(models, arch, positions):
    model = models[arch]
    modes = (
        MODES if positions == "readout" else ["zero", "mean"]
    )  # the prompt is shared: noising it is a no-op
    kw = dict(mode=modes, level=["component", "residual"], positions=positions, progress=False)
    fast = patch(model, PAIRS, **kw)
    naive = patch(model, PAIRS, method="naive", **kw)
    assert "pos_embed" in fast.components or arch != "gpt2"
    for key in fast.patched:
        scale = max(1.0, naive.patched[key].abs().max().item())
        assert (fast.patched[key] - naive.patched[key]).abs().max() < REL * scale, key
    assert fast.effect(modes[0]).abs().max() > 1e-3  # the patches do something
    assert set(fast.to_frame().columns) >= {"pair", "component", "layer", "mode", "patched_reward", "effect"}
    with pytest.raises(GenericPathError, match="native"):
        patch(model, PAIRS, level="head", progress=False)


def test_divergence_patching_says_it_needs_a_native_model(models):
    with pytest.raises((ValueError, NotImplementedError), match="native"):
        divergence_patch(models["gpt2"], PAIRS, progress=False)


def test_generic_llama_agrees_with_the_native_instruments(llama_pair):
    native, generic = llama_pair
    a_n = attribute(native, PAIRS, heads=False, progress=False)
    a_g = attribute(generic, PAIRS, progress=False)
    assert a_n.components == a_g.components
    assert (a_n.chosen - a_g.chosen).abs().max() < 1e-5 and (a_n.rejected - a_g.rejected).abs().max() < 1e-5
    l_n, l_g = (
        lens(native, PAIRS, include_mid=True, progress=False),
        lens(generic, PAIRS, include_mid=True, progress=False),
    )
    for key in l_n.values:
        assert (l_n.values[key] - l_g.values[key]).abs().max() < 1e-5, key
    atp_n = attribution_patch(native, PAIRS, level="component", progress=False)
    atp_g = attribution_patch(generic, PAIRS, progress=False)  # default level: components only here
    assert [s.name for s in atp_g.sites] == [s.name for s in atp_n.sites]
    for key in atp_n.estimates:
        assert (atp_n.estimates[key] - atp_g.estimates[key]).abs().max() < 1e-5, key


def test_attribution_patching_with_position_embeddings(models):
    model = models["gpt2"]
    result = attribution_patch(model, PAIRS, mode="noising", progress=False)
    names = [s.name for s in result.sites]
    assert "pos_embed" in names and not any(s.kind == "head" for s in result.sites)
    est = result.estimates[("noising", "chosen")][:, names.index("pos_embed")]
    # Independently: d reward(chosen) / d pos_embed[readout] . (pos_embed(rejected) - pos_embed(chosen)) at
    # the readouts.
    for i, pair in enumerate(PAIRS):
        chosen, rejected = pair.chosen[None], pair.rejected[None]
        stored = {}

        def leaf(x, hook):
            stored["x"] = x.detach().requires_grad_(True)
            return stored["x"]

        with torch.enable_grad():
            reward = model.run_with_hooks(chosen, fwd_hooks=[("hook_pos_embed", leaf)])
            (grad,) = torch.autograd.grad(reward.sum(), stored["x"])
        _, c_cache = model.run_with_cache(chosen, names_filter=["hook_pos_embed"])
        _, r_cache = model.run_with_cache(rejected, names_filter=["hook_pos_embed"])
        delta = r_cache["hook_pos_embed"][0, -1] - c_cache["hook_pos_embed"][0, -1]
        assert abs(float(grad[0, -1] @ delta) - float(est[i])) < 1e-5 * max(1.0, abs(float(est[i])))
    assert est.abs().max() > 1e-4  # chosen and rejected end at different positions: a real difference
