"""Readout-aligned path patching: the fast path (target cache, one token recomputed) equals the naive
reference (full forwards with hooks) within 1e-5 relative (fp32; relative to max(|patched reward|, |clean
gap|)) on Llama (GQA), Mistral (sliding window),
Qwen3 (q/k norms) and Gemma-2 (post-norms, soft-caps), both padding sides and both modes; it agrees with
activation patching where the two coincide; and on a planted circuit (head A writes a feature that head B
reads at the readout) the A -> B path carries the whole effect while A -> readout direct does not."""

import pytest
import torch
from helpers import one_thread, tiny_hf_model, token_pairs  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens.data.pairs import TokenPair
from reward_lens.instruments import patch
from reward_lens.instruments.patching.path import PathPatchResult, default_receivers, path_patch

RTOL = 1e-5
PAIRS = token_pairs([(5, 9), (12, 3), (7, 7)], prompt_len=4)
SENDERS = ["L0H0", "L0H3", "attn_L0", "mlp_L0", "L1H2"]
RECEIVERS = ["L1H1.q", "L1KV1.k", "L1KV0.v", "mlp_L0", "mlp_L1", "L2H3.q", "L2KV1.v", "readout"]


def model_for(arch, hf_models):
    if arch == "gemma2":
        from test_gemma2 import tiny_gemma2

        return HookedRewardModel.from_hf_model(tiny_gemma2())
    return HookedRewardModel.from_hf_model(hf_models[arch])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma2"])
def test_fast_equals_naive(hf_models, arch):
    model = model_for(arch, hf_models)
    for side, mode in (("right", "noising"), ("left", "denoising")):
        fast = path_patch(model, PAIRS, SENDERS, RECEIVERS, mode=mode, padding_side=side)
        naive = path_patch(model, PAIRS, SENDERS, RECEIVERS, mode=mode, padding_side=side, method="naive")
        ok = torch.isfinite(naive.patched)
        assert torch.equal(ok, torch.isfinite(fast.patched))
        # relative to the larger of the patched reward and the pair's clean gap (tiny random models have
        # rewards near 0, where a relative error is pure fp32 rounding)
        scale = torch.maximum(naive.patched.abs(), naive.clean_gap.abs()[:, None, None])
        err = (fast.patched - naive.patched)[ok].abs() / scale[ok].clamp(min=1e-6)
        assert err.max() < RTOL
        assert fast.effect()[ok].abs().max() > 1e-2  # the paths do something: the comparison has teeth
        assert torch.allclose(fast.clean_chosen, naive.clean_chosen, atol=1e-5)
    # Upstream receivers are not paths: an MLP of layer 0 does not read a layer-1 head.
    assert torch.isnan(fast.patched[:, SENDERS.index("L1H2"), RECEIVERS.index("mlp_L0")]).all()
    assert torch.isfinite(fast.patched[:, SENDERS.index("L0H0"), RECEIVERS.index("mlp_L0")]).all()


def test_last_mlp_to_readout_is_activation_patching(llama_model):
    # Nothing lies between the last MLP and the readout: its direct path is its readout activation patch.
    L = llama_model.cfg.n_layers
    res = path_patch(llama_model, PAIRS, [f"mlp_L{L - 1}"], ["readout"])
    ref = patch(llama_model, PAIRS, mode="noising", level="component", progress=False)
    col = ref.components.index(f"mlp_L{L - 1}")
    assert torch.allclose(res.patched[:, 0, 0], ref.patched_reward("noising")[:, col], atol=1e-5)


MARK, END = 5, 6


def planted_circuit() -> HookedRewardModel:
    """A 2-layer Llama (GQA) with hand-set weights: head A = L0H0 attends uniformly and copies a MARK
    feature (dim 0) into dim 1; head B = L1H2 (key/value head 1) attends to the END token (the readout) and
    copies dim 1 into dim 2; the reward reads dim 2 only. Every other weight is zero (MLPs write nothing)."""
    hf = tiny_hf_model(
        "llama",
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = HookedRewardModel.from_hf_model(hf)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.W_E[:, 4:] = torch.randn(model.cfg.d_vocab, model.cfg.d_model - 4, generator=g)
        model.embed.W_E[MARK, 0] = 4.0
        model.embed.W_E[END, 3] = 4.0
        a0, a1 = model.blocks[0].attn, model.blocks[1].attn
        a0.W_V[0, 0, 0], a0.W_O[0, 0, 1] = 1.0, 1.0
        # B's query is a constant and its key reads the END feature, in the slowest RoPE pair (no rotation).
        a1.b_Q[2, 3], a1.W_K[1, 3, 3] = 10.0, 10.0
        a1.W_V[1, 1, 0], a1.W_O[2, 0, 2] = 1.0, 5.0
        model.reward_head.W_R[2, 0] = 1.0
    return model


def planted_pairs(n=4):
    g = torch.Generator().manual_seed(1)
    pairs = []
    for i in range(n):
        prompt = torch.randint(7, 97, (4,), generator=g).tolist()
        resp = torch.randint(7, 97, (5 + i,), generator=g).tolist()
        chosen = prompt + resp[:2] + [MARK] + resp[2:] + [MARK] * (1 + i % 2) + [END]
        pairs.append(TokenPair(chosen, prompt + resp + [END], id=f"p{i}"))
    return pairs


def test_planted_circuit_path_carries_the_effect():
    model, pairs = planted_circuit(), planted_pairs()
    senders = ["L0H0", "L0H1", "L1H2"]
    receivers = ["L1H2.q", "L1KV1.k", "L1KV1.v", "L1KV0.v", "mlp_L0", "mlp_L1", "readout"]
    res = path_patch(model, pairs, senders, receivers)
    assert (res.clean_gap > 0.5).all()
    eff = res.effect(normalized=True)
    a, cell = senders.index("L0H0"), receivers.index
    assert (eff[:, a, cell("L1KV1.v")] < -0.99).all()  # A -> B's value at the readout: the whole preference
    assert (
        eff[:, a, cell("readout")].abs() < 0.02
    ).all()  # A -> readout direct: only the final norm's scale moves
    assert (eff[:, a, cell("L1H2.q")].abs() < 1e-6).all()  # B's query is a constant
    assert (eff[:, a, cell("L1KV0.v")].abs() < 1e-6).all()  # the other key/value head reads nothing of dim 1
    assert (eff[:, senders.index("L1H2"), cell("readout")] < -0.99).all()
    assert (eff[:, senders.index("L0H1")].nan_to_num().abs() < 1e-6).all()
    # Activation patching sees A's total effect; path patching says which path carries it.
    head = patch(model, pairs, mode="noising", level="head", progress=False)
    assert (head.effect("noising", normalized=True)[:, head.components.index("L0H0")] < -0.99).all()
    naive = path_patch(model, pairs, senders, receivers, method="naive")
    ok = torch.isfinite(naive.patched)
    assert (naive.patched[ok] - res.patched[ok]).abs().max() < 1e-5


def test_frame_summary_plot_and_errors(llama_model, llama_hf):
    res = path_patch(llama_model, PAIRS[:2], ["L0H0", "mlp_L1"])
    assert isinstance(res, PathPatchResult)
    assert res.receivers == default_receivers(llama_model.cfg)
    frame = res.to_frame()
    assert len(frame) == int(torch.isfinite(res.patched).sum())
    assert set(frame.columns) >= {"pair", "sender", "receiver", "effect", "normalized_effect"}
    assert abs(res.summary().mean_effect.iloc[0]) == res.summary().mean_effect.abs().max()
    import matplotlib.figure

    assert isinstance(res.plot(), matplotlib.figure.Figure)
    with pytest.raises(ValueError, match="unknown sender"):
        path_patch(llama_model, PAIRS, ["head0"], ["readout"])
    with pytest.raises(ValueError, match="unknown receiver"):
        path_patch(llama_model, PAIRS, ["L0H0"], ["L1H1.z"])
    with pytest.raises(ValueError, match="out of range"):
        path_patch(llama_model, PAIRS, ["L0H0"], ["L1KV7.k"])
    with pytest.raises(ValueError, match="mode must be one of"):
        path_patch(llama_model, PAIRS, ["L0H0"], ["readout"], mode="zero")
    generic = HookedRewardModel.from_hf_model(llama_hf, generic=True)
    with pytest.raises(ValueError, match="generic component-level path"):
        path_patch(generic, PAIRS, ["attn_L0"], ["readout"])
