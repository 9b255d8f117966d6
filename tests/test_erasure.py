"""LEACE erasure against EleutherAI's concept-erasure, its guarantee (no covariance left with the concept),
the exact fold into the scalar head, and concept scrubbing's hooks."""

import numpy as np
import pytest
import torch

from reward_lens import demo_pairs, load_demo_model
from reward_lens.representations.erasure import (
    erase_at_head,
    fit_leace,
    head_inputs,
    scrub_layers,
)


@pytest.fixture(scope="module")
def demo():
    return load_demo_model(device="cpu")


def _data(n=400, d=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 1, generator=g, dtype=torch.float64)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ mix + z @ torch.randn(
        1, d, generator=g, dtype=torch.float64
    )
    return x, z


def test_leace_equals_concept_erasure():
    from concept_erasure import LeaceFitter

    x, z = _data()
    fitter = LeaceFitter(x.shape[1], 1, dtype=torch.float64, shrinkage=False, constrain_cov_trace=False)
    fitter.update(x, z)
    theirs = fitter.eraser(x)
    ours = fit_leace(x, z)(x.float()).double()
    assert torch.allclose(ours, theirs, atol=1e-4 * float(x.abs().max()))


def test_erased_activations_have_no_covariance_with_the_concept_within_groups():
    x, z = _data()
    groups = np.repeat(np.arange(40), 10)
    x = x + torch.tensor(np.repeat(np.random.default_rng(0).normal(size=(40, 12)) * 3, 10, axis=0))
    er = fit_leace(x, z, groups)
    xe = er(x.float()).double()

    def centred(t):
        out = t.clone()
        for v in np.unique(groups):
            m = torch.as_tensor(groups == v)
            out[m] = t[m] - t[m].mean(0)
        return out

    cov = centred(xe).T @ centred(z) / len(x)
    before = centred(x).T @ centred(z) / len(x)
    assert float(cov.abs().max()) < 1e-5 * float(before.abs().max())


def test_head_fold_is_exact(demo):
    pairs = demo_pairs()[:48]
    prompts, responses = [p.prompt for p in pairs], [p.chosen for p in pairs]
    n = head_inputs(demo, prompts, responses)
    z = torch.tensor([len(r) for r in responses], dtype=torch.float64)
    er = fit_leace(n, z)
    edited = erase_at_head(demo, er)
    d = demo.reward_direction.detach().float()
    expected = er(n) @ d + float(torch.as_tensor(demo.reward_bias).detach())
    with torch.no_grad():
        got = []
        for p, r in zip(prompts, responses):
            tok = demo.to_tokens([p], [r])
            got.append(edited(tok["input_ids"], attention_mask=tok["attention_mask"]).reshape(()))
        got = torch.stack(got)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5)
    # the fold erased what it was fitted to: the edited reward has no covariance with z on these texts
    r = got.double() - got.double().mean()
    assert abs(float(r @ (z - z.mean()))) < 1e-3 * float(
        (expected.double() - expected.double().mean()).abs().sum()
    )
    assert demo.reward_head.W_R.data_ptr() != edited.reward_head.W_R.data_ptr()  # the original is untouched


def test_scrubbing_installs_one_eraser_per_layer(demo):
    pairs = demo_pairs()[:24]
    prompts, responses = [p.prompt for p in pairs], [p.chosen for p in pairs]
    z = np.array([len(r) for r in responses], dtype=float)
    edited, erasers = scrub_layers(demo, prompts, responses, z)
    assert len(erasers) == demo.cfg.n_layers
    tok = demo.to_tokens(prompts[:2], responses[:2])
    with torch.no_grad():
        _, cache = edited.run_with_cache(tok["input_ids"], attention_mask=tok["attention_mask"])
        _, clean = demo.run_with_cache(tok["input_ids"], attention_mask=tok["attention_mask"])
    last = f"blocks.{demo.cfg.n_layers - 1}.hook_resid_post"
    assert not torch.allclose(cache[last], clean[last])
    # layer 0's eraser applied to the clean residual gives the scrubbed one
    assert torch.allclose(
        cache["blocks.0.hook_resid_post"], erasers[0](clean["blocks.0.hook_resid_post"]), atol=1e-5
    )


def test_non_scalar_heads_are_refused():
    from reward_lens.demo.organisms import load_gate_organism

    gate = load_gate_organism()
    er = fit_leace(torch.randn(10, gate.cfg.d_model), torch.randn(10))
    with pytest.raises(ValueError, match="scalar"):
        erase_at_head(gate, er)
