"""Divergence-aware patching: OOD scores recomputed independently (numpy PCA of clean states from full
caches, the patched state built by hand), the calibration on clean-vs-clean swaps, flags and effects."""

import numpy as np
import pytest
import torch
from helpers import one_thread, token_pairs  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens.instruments import divergence_patch, patch
from reward_lens.instruments.divergence import PCAMahalanobis

PAIRS = token_pairs([(9, 4), (3, 8), (6, 6), (5, 2), (7, 7), (2, 6)], prompt_len=3, seed=4)


def numpy_mahalanobis(ref: np.ndarray, x: np.ndarray, k: int, floor: float = 1e-6) -> np.ndarray:
    mean = ref.mean(0)
    cov = np.cov(ref, rowvar=False)
    vals, vecs = np.linalg.eigh(cov)
    order = np.argsort(vals)[::-1]
    vals, vecs = vals[order], vecs[:, order]
    var = np.maximum(vals[:k], floor * vals.sum())
    proj = (x - mean) @ vecs[:, :k]
    return np.sqrt((proj**2 / var).sum(-1))


def readout_acts(model, ids, names):
    _, cache = model.run_with_cache(ids[None])
    return {n: cache[n][0, -1].double().numpy() for n in names}


def test_pca_mahalanobis_matches_numpy():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 8, generator=g) @ torch.randn(8, 8, generator=g)
    x = torch.randn(5, 8, generator=g)
    for k in (3, 8):
        fit = PCAMahalanobis.fit(X, n_components=k)
        assert np.allclose(
            fit.score(x).numpy(), numpy_mahalanobis(X.double().numpy(), x.double().numpy(), k), rtol=1e-8
        )


def test_scores_calibration_flags_by_hand(llama_model):
    res = divergence_patch(llama_model, PAIRS, mode="noising", batch_size=4, progress=False)
    names = res.patching.components
    j = names.index("attn_L1")
    mid, pre, out = "blocks.1.hook_resid_mid", "blocks.1.hook_resid_pre", "blocks.1.hook_attn_out"
    acts = [
        (
            readout_acts(llama_model, p.chosen, [mid, pre, out]),
            readout_acts(llama_model, p.rejected, [mid, out]),
        )
        for p in PAIRS
    ]
    ref = np.stack([a[mid] for pair in acts for a in pair])  # clean resid_mid of layer 1, both responses
    k = min(len(ref) - 1, 16)
    patched = np.stack([c[pre] + r[out] for c, r in acts])  # chosen's residual + rejected's attention output
    assert np.allclose(res.scores[:, j].numpy(), numpy_mahalanobis(ref, patched, k), rtol=1e-4)
    n = len(PAIRS)
    swapped = np.stack(
        [acts[i][0][pre] + acts[(i + 1) % n][0][out] for i in range(n)]
    )  # chosen_i <- chosen_{i+1}
    assert np.allclose(res.calibration_scores[:, j].numpy(), numpy_mahalanobis(ref, swapped, k), rtol=1e-4)
    # threshold, flags, effects with and without them
    assert torch.allclose(res.threshold, torch.quantile(res.calibration_scores, 0.95, dim=0))
    assert torch.equal(res.flagged, res.scores > res.threshold)
    dropped = res.effect(drop_flagged=True)
    assert torch.equal(dropped.isnan(), res.flagged)
    summary = res.summary()
    eff = res.effect().numpy()
    kept = np.where(res.flagged.numpy(), np.nan, eff)
    assert np.allclose(summary["mean_effect_all"], eff.mean(0))
    assert np.allclose(summary["mean_effect_in_distribution"], np.nanmean(kept, 0), equal_nan=True)
    assert (summary["n_flagged"].to_numpy() == res.flagged.sum(0).numpy()).all()
    # the effects are those of ordinary patching
    plain = patch(llama_model, PAIRS, progress=False)
    assert torch.allclose(res.effect(), plain.effect("noising"), atol=1e-6)
    frame = res.to_frame()
    assert {"ood_score", "threshold", "flagged", "effect", "patched_reward"} <= set(frame.columns)
    assert len(frame) == n * len(names)
    import matplotlib.figure

    assert isinstance(res.plot(), matplotlib.figure.Figure)


def test_final_state_and_norm_ratio(llama_model):
    L = llama_model.cfg.n_layers
    final = f"blocks.{L - 1}.hook_resid_post"
    res = divergence_patch(
        llama_model, PAIRS, mode="denoising", level="residual", state="final", progress=False
    )
    acts = [
        (readout_acts(llama_model, p.chosen, [final]), readout_acts(llama_model, p.rejected, [final]))
        for p in PAIRS
    ]
    ref = np.stack([a[final] for pair in acts for a in pair])
    j = res.patching.components.index(f"resid_L{L}")
    # denoising the final residual hands the rejected run the chosen's final state: an in-sample reference
    # point
    chosen_final = np.stack([c[final] for c, _ in acts])
    assert np.allclose(
        res.scores[:, j].numpy(), numpy_mahalanobis(ref, chosen_final, min(len(ref) - 1, 16)), rtol=1e-4
    )
    ratio = divergence_patch(
        llama_model, PAIRS, mode="zero", level="component", method="norm_ratio", progress=False
    )
    j = ratio.patching.components.index("mlp_L0")
    mid0, post0 = "blocks.0.hook_resid_mid", "blocks.0.hook_resid_post"
    for i, p in enumerate(PAIRS):
        a = readout_acts(llama_model, p.chosen, [mid0, post0])
        r = np.linalg.norm(a[mid0]) / np.linalg.norm(a[post0])  # zeroed MLP: the state is resid_mid
        assert ratio.scores[i, j].item() == pytest.approx(max(r, 1 / r), rel=1e-5)


def test_clear_errors(llama_model, llama_hf):
    with pytest.raises(ValueError, match="at least 2 pairs"):
        divergence_patch(llama_model, PAIRS[:1], progress=False)
    with pytest.raises(ValueError, match="one mode"):
        divergence_patch(llama_model, PAIRS, mode=["noising", "zero"], progress=False)
    with pytest.raises(ValueError, match="method must be"):
        divergence_patch(llama_model, PAIRS, method="kl", progress=False)
    generic = HookedRewardModel.from_hf_model(llama_hf, generic=True)
    with pytest.raises(ValueError, match="native architecture"):
        divergence_patch(generic, PAIRS, progress=False)
