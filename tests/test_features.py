"""SAE features along the reward direction: exact attribution (Σ terms = frozen-scale lens value), alignment,
top features for the gap, causal single-feature ablation vs attribution (closed form at the last layer)."""

import pytest
import torch
from organism import concept_items, organism, single_thread, tiny_armorm  # noqa: F401 (single_thread: autouse)

from reward_lens import feature_ablation, feature_alignment, feature_attribution, read_objective
from reward_lens.data.pairs import PreferencePair
from reward_lens.representations.sae import SAEConfig, SparseAutoencoder, gather_activations


def planted_sae(o, hook: str, n_random: int = 30, k: int = 3) -> SparseAutoencoder:
    """A TopK SAE whose latent 0 decodes to u and latent 1 to q (the rest random), encoder = decoder^T."""
    d = o.model.cfg.d_model
    g = torch.Generator().manual_seed(1)
    rand = torch.randn(n_random, d, generator=g)
    D = torch.cat([o.u[None], o.q[None], rand / rand.norm(dim=-1, keepdim=True)])
    sae = SparseAutoencoder(SAEConfig(d_in=d, d_sae=D.shape[0], k=k, hook_name=hook))
    with torch.no_grad():
        sae.W_dec.copy_(D)
        sae.W_enc.copy_(D.T)
        sae.b_dec.copy_(gather_activations(o.model, concept_items(10, seed=4), hook).mean(0))
    return sae


def concept_pairs(n: int, seed: int = 9):
    return [
        PreferencePair(it.prompt, it.positive, it.negative, id=it.id) for it in concept_items(n, seed=seed)
    ]


def lens_values(model, pairs, side, hook):
    """Independent: resid_l[readout] / ln_final scale . w from a full run_with_cache, one sequence at a
    time."""
    out = []
    for p in pairs:
        tok = model.to_tokens(p.prompt, getattr(p, side))
        _, cache = model.run_with_cache(tok["input_ids"])
        x = cache[hook][0, -1].double()
        s = cache["ln_final.hook_scale"][0, -1, 0].double()
        out.append(float(x @ model.reward_direction.double() / s))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_attribution_terms_sum_exactly_to_the_lens_value(layer):
    o = organism()
    hook = f"blocks.{layer}.hook_resid_post"
    sae = planted_sae(o, hook)
    pairs = concept_pairs(6)
    fa = feature_attribution(o.model, sae, pairs)
    scale = float(fa.lens["chosen"].abs().max())
    assert fa.completeness_error() <= 1e-5 * max(1.0, scale)
    for side in ("chosen", "rejected"):
        assert torch.allclose(
            fa.lens[side].double(), lens_values(o.model, pairs, side, hook), rtol=1e-5, atol=1e-5
        )
        if layer == o.model.cfg.n_layers - 1:  # the last layer's lens value + bias is the reward
            assert torch.allclose(fa.lens[side] + float(o.model.reward_bias), fa.rewards[side], atol=1e-5)
    # Feature terms are f_i (d_i . w) / s for the active features, zero elsewhere.
    f = fa.acts["chosen"].to_dense()
    expected = f * (sae.W_dec @ o.model.reward_direction)[None] / fa.scale["chosen"][:, None]
    assert torch.allclose(fa.dense_terms("chosen"), expected, atol=1e-6)
    assert int((f > 0).sum(-1).max()) <= 3
    gap = fa.gap()
    total_gap = fa.dense_terms("gap").sum(-1) + gap["sae_bias"] + gap["error"]
    assert torch.allclose(total_gap, gap["lens"], atol=1e-5 * max(1.0, scale))


def test_top_feature_for_the_gap_is_the_planted_one():
    o = organism()
    sae = planted_sae(o, "blocks.1.hook_resid_post")
    fa = feature_attribution(o.model, sae, concept_pairs(10))
    top = fa.top_features(3)
    assert int(top["feature"].iloc[0]) == 0  # latent 0 decodes to u
    # It carries the lens gap: chosen and rejected differ exactly by c_u·u at the readout.
    planted = fa.dense_terms("gap")[:, 0]
    assert torch.allclose(planted, fa.gap()["lens"], rtol=0.05)
    assert float(top["alignment"].iloc[0]) == pytest.approx(o.beta_u, abs=1e-5)
    frame = fa.to_frame()
    assert {"pair", "side", "term", "feature", "activation", "attribution"} <= set(frame.columns)
    assert set(frame["term"]) == {"feature", "sae_bias", "error", "lens"}
    assert fa.plot().axes


def test_feature_alignment_is_d_dot_w():
    o = organism()
    sae = planted_sae(o, "blocks.1.hook_resid_post")
    al = feature_alignment(o.model, sae)
    w = o.model.reward_direction
    assert al.alignment[0] == pytest.approx(o.beta_u, abs=1e-5)
    assert al.alignment[1] == pytest.approx(o.beta_q, abs=1e-5)
    assert torch.allclose(al.alignment, sae.W_dec @ w, atol=1e-6)
    assert torch.allclose(al.cosine, (sae.W_dec @ w) / (sae.W_dec.norm(dim=-1) * w.norm()), atol=1e-6)
    assert list(al.top(2)["feature"]) == [1, 0]  # beta_q = 1.5 > beta_u = 1


def test_ablation_at_the_last_layer_matches_the_closed_form():
    """At the final residual, removing f_i d_i at the readout changes the reward to
    w . (x - f_i d_i) / rms(x - f_i d_i) + b: the final norm is recomputed, not frozen."""
    o = organism()
    m = o.model
    hook = f"blocks.{m.cfg.n_layers - 1}.hook_resid_post"
    sae = planted_sae(o, hook)
    pairs = concept_pairs(5)
    ab = feature_ablation(m, sae, pairs, features=[0, 1, 7])
    w = m.reward_direction.double()
    for p in pairs:
        for side in ("chosen", "rejected"):
            tok = m.to_tokens(p.prompt, getattr(p, side))
            reward, cache = m.run_with_cache(tok["input_ids"])
            x = cache[hook][0, -1]
            f = sae.encode(x)
            for i in (0, 1, 7):
                xa = (x - f[i] * sae.W_dec[i]).double()
                ablated = float(xa @ w / (xa.pow(2).mean() + m.cfg.eps).sqrt() + m.reward_bias)
                row = ab.frame[(ab.frame.pair == p.id) & (ab.frame.side == side) & (ab.frame.feature == i)]
                assert float(row["effect"].iloc[0]) == pytest.approx(float(reward[0]) - ablated, abs=2e-5)


def test_ablation_tracks_attribution_where_later_layers_do_not_read_the_feature():
    o = organism()
    sae = planted_sae(o, "blocks.1.hook_resid_post")
    pairs = concept_pairs(8)
    ab = feature_ablation(o.model, sae, pairs, n_features=4)
    assert ab.features[0] == 0
    gap = ab.frame[(ab.frame.side == "gap") & (ab.frame.feature == 0)]
    # Later blocks are blind to u; only the final norm's scale reacts, a few percent.
    assert ((gap["effect"] - gap["attribution"]).abs() <= 0.05 * gap["attribution"].abs()).all()
    assert ab.correlation("gap") > 0.8
    inactive = ab.frame[ab.frame.activation == 0]
    assert (inactive["effect"].abs() < 1e-4).all()
    everywhere = feature_ablation(o.model, sae, pairs, features=[0], positions="all")
    # Concept words occur only at the readout here, so ablating everywhere is ablating at the readout.
    a = ab.frame[ab.frame.feature == 0].sort_values(["pair", "side"])["effect"].to_numpy()
    b = everywhere.frame.sort_values(["pair", "side"])["effect"].to_numpy()
    assert abs(a - b).max() < 1e-4
    assert ab.plot().axes


def test_armorm_attribution_uses_the_prompt_conditioned_direction(tmp_path):
    m = tiny_armorm(str(tmp_path))
    hook = f"blocks.{m.cfg.n_layers - 1}.hook_resid_post"
    g = torch.Generator().manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in=m.cfg.d_model, d_sae=24, k=4, hook_name=hook))
    with torch.no_grad():
        sae.W_dec.copy_(torch.randn(24, m.cfg.d_model, generator=g))
        sae.W_enc.copy_(sae.W_dec.T)
    pairs = concept_pairs(4)
    fa = feature_attribution(m, sae, pairs)
    assert fa.alignment is None  # no single direction: each prompt has its own gate
    assert fa.completeness_error() < 1e-4
    assert torch.allclose(fa.lens["chosen"], fa.rewards["chosen"], atol=1e-4)  # ArmoRM has no bias
    one = feature_attribution(m, sae, pairs, objective="objective_1")
    with read_objective(m, "objective_1"):
        tok = m.to_tokens([p.prompt for p in pairs], [p.chosen for p in pairs])
        objective_reward = m(tok["input_ids"], attention_mask=tok["attention_mask"])
    assert torch.allclose(one.lens["chosen"], objective_reward, atol=1e-4)
    assert m.reward_head.objective is None  # restored
    with pytest.raises(ValueError, match="objective"):
        feature_alignment(m, sae)
    assert feature_alignment(m, sae, objective=1).alignment.shape == (24,)


def test_width_mismatch_is_a_clear_error():
    o = organism()
    sae = SparseAutoencoder(SAEConfig(d_in=32, d_sae=8, k=2, hook_name="blocks.1.hook_resid_post"))
    with pytest.raises(ValueError, match="does not match"):
        feature_attribution(o.model, sae, concept_pairs(2))
    wrong_hook = SparseAutoencoder(SAEConfig(d_in=64, d_sae=8, k=2, hook_name="blocks.7.hook_resid_post"))
    with pytest.raises(ValueError, match="no hook"):
        feature_attribution(o.model, wrong_hook, concept_pairs(2))
