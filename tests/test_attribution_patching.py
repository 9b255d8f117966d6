"""Attribution patching: each estimate is the exact directional derivative of the target's reward along
the patch (checked by Richardson-extrapolated central differences on a float64 model whose norms are
made to compute in float64 too), from 2 forwards + 1 backward, parameters untouched; its error against
real patching is reported."""

import pytest
import torch
from helpers import one_thread, token_pairs  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens.instruments import attribution_patch, patch
from reward_lens.instruments.patching.atp import AtPComparison
from reward_lens.model.components import RMSNorm

PAIRS = token_pairs([(9, 4), (3, 8), (6, 6)], prompt_len=4)
EQUAL = token_pairs([(5, 5), (4, 4)], prompt_len=2, seed=3)


@pytest.fixture(scope="module")
def model64(llama_hf):
    """A float64 model. RMSNorm computes in float32 by design (exact decomposition in fp32 models), which
    would limit a finite-difference check to ~1e-4; for this check the norms run in the input's dtype."""

    def float64_norm(self, x):
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        out = self.hook_normalized(x / scale)
        return out if self.w is None else out * self.w

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RMSNorm, "forward", float64_norm)
        yield HookedRewardModel.from_hf_model(llama_hf, dtype=torch.float64)


def directional_derivative(model, target, source, hook_name, index, positions, eps=1e-2):
    """d/dt r(x + t d) at 0, d = source - target activation at `positions`: central differences at eps and
    eps/2 combined by Richardson extrapolation (truncation error O(eps^4))."""
    _, ct = model.run_with_cache(target[None], names_filter=hook_name)
    _, cs = model.run_with_cache(source[None], names_filter=hook_name)
    t_pos, s_pos = positions
    delta = cs[hook_name][0, s_pos][:, index] - ct[hook_name][0, t_pos][:, index]

    def run(t):
        def nudge(x, hook):
            x = x.clone()
            x[0, t_pos, index] += t * delta
            return x

        return model.run_with_hooks(target[None], fwd_hooks=[(hook_name, nudge)])[0].item()

    central = lambda h: (run(h) - run(-h)) / (2 * h)  # noqa: E731
    return (4 * central(eps / 2) - central(eps)) / 3


SITES = [
    ("embed", "hook_embed", ...),
    ("attn_L1", "blocks.1.hook_attn_out", ...),
    ("mlp_L0", "blocks.0.hook_mlp_out", ...),
    ("L2H1", "blocks.2.attn.hook_z", 1),
    ("resid_L2", "blocks.2.hook_resid_pre", ...),
]


@pytest.mark.parametrize("side", ["right", "left"])
def test_estimates_are_the_directional_derivative_at_the_readout(model64, side):
    res = attribution_patch(
        model64,
        PAIRS,
        mode=["noising", "denoising"],
        level=["component", "head", "residual"],
        padding_side=side,
        batch_size=2,
        progress=False,
    )
    names = res.components
    for i, pair in enumerate(PAIRS):
        for name, hook, index in SITES:
            for mode, (target, source) in (
                ("noising", (pair.chosen, pair.rejected)),
                ("denoising", (pair.rejected, pair.chosen)),
            ):
                expected = directional_derivative(
                    model64, target, source, hook, index, ([len(target) - 1], [len(source) - 1])
                )
                got = res.effect(mode)[i, names.index(name)].item()
                assert got == pytest.approx(expected, rel=1e-6, abs=1e-9), (mode, name)


def test_estimates_over_all_positions(model64):
    res = attribution_patch(model64, EQUAL, positions="all", level="component", progress=False)
    pair = EQUAL[1]
    every = list(range(len(pair.chosen)))
    expected = directional_derivative(
        model64, pair.chosen, pair.rejected, "blocks.1.hook_mlp_out", ..., (every, every)
    )
    assert res.effect("noising")[1, res.components.index("mlp_L1")].item() == pytest.approx(
        expected, rel=1e-6, abs=1e-9
    )


def test_cost_is_two_forwards_and_one_backward(llama_model, monkeypatch):
    forwards = []  # per forward: whether any weight required a gradient while it ran
    params = list(llama_model.parameters())
    handle = llama_model.embed.register_forward_hook(
        lambda *a: forwards.append(any(p.requires_grad for p in params))
    )
    grads = []
    original = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: grads.append(1) or original(*a, **k))
    try:
        attribution_patch(llama_model, PAIRS, level=["component", "head"], batch_size=3, progress=False)
    finally:
        handle.remove()
    assert len(forwards) == 2 and len(grads) == 1  # one batch: target (with grad) + source, one backward
    assert not any(forwards)  # activation-only autograd: the weights frozen while the instrument runs
    assert all(p.requires_grad and p.grad is None for p in params)  # as loaded (TL's), no .grad kept


def test_zero_and_mean_modes_and_comparison_with_real_patching(llama_model):
    kw = dict(mode=["noising", "denoising", "zero", "mean"], level=["component", "head"], progress=False)
    atp = attribution_patch(llama_model, PAIRS, **kw)
    real = patch(llama_model, PAIRS, **kw)
    cmp = atp.compare(real)
    assert isinstance(cmp, AtPComparison)
    assert len(cmp.metrics) == 6  # (mode, target) pairs
    noising = cmp.frame[(cmp.frame["mode"] == "noising")]
    a, p = noising["atp_effect"].to_numpy(), noising["patch_effect"].to_numpy()
    m = cmp.metrics.set_index(["mode", "target"]).loc[("noising", "chosen")]
    assert m["mean_abs_error"] == pytest.approx(abs(a - p).mean(), rel=1e-6)
    assert m["relative_error"] == pytest.approx(abs(a - p).sum() / abs(p).sum(), rel=1e-6)
    assert torch.allclose(torch.tensor(p, dtype=torch.float32), real.effect("noising").flatten(), atol=1e-6)
    # first order: well correlated with real patching on this tiny model, but not equal to it
    assert m["spearman_pooled"] > 0.5 and m["max_abs_error"] > 1e-6
    assert {"pair", "component", "mode", "target", "atp_effect"} <= set(atp.to_frame().columns)
    import matplotlib.figure

    assert isinstance(cmp.plot(), matplotlib.figure.Figure)
    with pytest.raises(ValueError, match="other pairs"):
        atp.compare(patch(llama_model, PAIRS[:2], **kw))
