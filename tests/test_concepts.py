"""Concept vectors (difference of means, logistic probe) and their causal dose-response, on the planted
organism (analytic answers), on the bundled natural-language contrast sets, and on ArmoRM."""

import numpy as np
import pytest
import torch
from organism import concept_items, organism, single_thread, tiny_armorm  # noqa: F401 (single_thread: autouse)

from reward_lens import (
    ContrastPair,
    concept_effect,
    concept_vector,
    dose_response,
    list_contrast_sets,
    load_contrast_set,
    read_objective,
)
from reward_lens.core.readout import readout_run
from reward_lens.representations.dose import _fit

BUNDLED = {"agreement", "confidence", "formatting", "refusal", "verbosity"}


def test_bundled_contrast_sets_are_natural_language_and_large_enough():
    assert set(list_contrast_sets()) == BUNDLED
    for name in BUNDLED:
        items = load_contrast_set(name)
        assert len(items) >= 20, name
        assert len({it.id for it in items}) == len(items)
        assert len({it.prompt for it in items}) == len(items)  # distinct base items, not clones
        for it in items:
            assert it.concept == name and it.positive != it.negative
            for text in (it.prompt, it.positive, it.negative):
                assert len(text.split()) >= 3 and any(c.isalpha() for c in text), (name, text)
    assert load_contrast_set("sycophancy") == load_contrast_set("agreement")
    verbose = load_contrast_set("verbosity")
    assert all(len(it.positive) > 2 * len(it.negative) for it in verbose)  # positive = the padded answer
    with pytest.raises(ValueError, match="bundled"):
        load_contrast_set("no-such-set")


@pytest.mark.parametrize("method", ["mean_diff", "probe"])
def test_concept_vector_recovers_the_planted_direction(method):
    o = organism()
    cv = concept_vector(o.model, concept_items(40), method=method)
    assert cv.layers == [0, 1, 2] and cv.vectors.shape == (3, 64)
    w = o.model.reward_direction
    for layer in cv.layers:
        v = cv.vector(layer)
        assert float(v @ o.u) >= 0.9
        # cosine with the reward direction, checked against a direct computation
        assert float(cv.cosine[cv.layers.index(layer)]) == pytest.approx(float(v @ w / w.norm()), abs=1e-5)
    assert float(cv.cosine[1]) == pytest.approx(o.beta_u / float(w.norm()), abs=0.05)
    assert (cv.accuracy == 1.0).all() and len(cv.test_items) == 10 and cv.n_train == 30
    if method == "mean_diff":  # in residual units: the planted size c_u
        assert float(cv.vectors[1].norm()) == pytest.approx(o.c_u, rel=0.05)
    frame = cv.to_frame()
    assert list(frame["layer"]) == [0, 1, 2] and {"cosine", "accuracy", "typical_norm"} <= set(frame.columns)
    assert cv.plot().axes


@pytest.mark.parametrize("method", ["mean_diff", "probe"])
def test_concept_vector_recovers_it_when_pairs_also_differ_in_word_identity(method):
    """Negatives end in a random (not the twin) word: the contrast carries word-identity noise too."""
    o = organism()
    cv = concept_vector(o.model, concept_items(40, twins=False), method=method, layers=[1])
    assert float(cv.vector(1) @ o.u) >= 0.9 and float(cv.accuracy[0]) == 1.0


def _interleaved(items):
    """dose_response's row order: each item's positive, then its negative response."""
    return [it.prompt for it in items for _ in range(2)], [
        r for it in items for r in (it.positive, it.negative)
    ]


def _planted_slope(o, items, layer, direction_coef):
    """Analytic first-order slope: rho * (w . v_hat) * mean(1 / s), rho the median readout norm at the
    layer."""
    prompts = [it.prompt for it in items] * 2
    responses = [it.positive for it in items] + [it.negative for it in items]
    hook = f"blocks.{layer}.hook_resid_post"
    run = readout_run(o.model, prompts, responses, [hook, "ln_final.hook_scale"])
    rho = float(run.acts[hook].norm(dim=-1).median())
    return rho * direction_coef * float((1.0 / run.acts["ln_final.hook_scale"][:, 0]).mean()), rho


@pytest.mark.parametrize("positions", ["all", "readout"])
def test_dose_response_slope_matches_the_planted_one(positions):
    o = organism()
    cv = concept_vector(o.model, concept_items(40), layers=[1])
    dr = dose_response(o.model, cv, positions=positions)  # default probes: the held-out test items
    expected, rho = _planted_slope(o, cv.test_items, 1, o.beta_u)
    assert dr.scale == pytest.approx(rho, rel=1e-5)
    assert dr.slope == pytest.approx(expected, rel=0.10)
    assert dr.r2 > 0.99
    assert dr.rewards.shape == (20, 11) and dr.item_slopes.shape == (20,)
    assert float(dr.item_slopes.mean()) == pytest.approx(dr.slope, rel=1e-4)  # OLS is linear in y
    assert len(dr.to_frame()) == 20 * 11 and dr.plot().axes
    # At alpha = 0 nothing was added: the clean rewards.
    prompts, responses = _interleaved(cv.test_items)
    clean = readout_run(o.model, prompts, responses).rewards
    assert torch.allclose(dr.rewards[:, 5], clean, atol=1e-5)


def test_dose_response_of_a_raw_direction_and_the_fit():
    o = organism()
    items = concept_items(12, seed=3)
    dr = dose_response(o.model, o.q, items, layer=2, alphas=[-0.2, -0.1, 0.0, 0.1, 0.2])
    expected, _ = _planted_slope(o, items, 2, o.beta_q)
    assert dr.slope == pytest.approx(expected, rel=0.10) and dr.hook_name == "blocks.2.hook_resid_post"
    a = np.array([-1.0, 0.0, 0.5, 2.0, 3.0])
    y = np.array([0.3, 1.1, 1.0, 3.9, 5.2])
    slope, intercept, r2 = _fit(torch.tensor(a), torch.tensor(y))
    ref = np.polyfit(a, y, 1)
    assert slope == pytest.approx(ref[0]) and intercept == pytest.approx(ref[1])
    assert r2 == pytest.approx(np.corrcoef(a, y)[0, 1] ** 2)
    with pytest.raises(ValueError, match="layer"):
        dose_response(o.model, o.q, items)
    with pytest.raises(ValueError, match="layer"):
        dose_response(o.model, concept_vector(o.model, concept_items(8)), items)


def test_concept_effect_is_the_planted_gap():
    o = organism()
    items = concept_items(10, seed=2)
    effect = concept_effect(o.model, items)
    run = readout_run(
        o.model, [it.prompt for it in items], [it.positive for it in items], ["ln_final.hook_scale"]
    )
    # positive and negative differ exactly by c_u·u, so the gap is beta_u·c_u/s up to the norm's small change
    approx = o.beta_u * o.c_u / run.acts["ln_final.hook_scale"][:, 0]
    assert torch.allclose(effect, approx, rtol=0.05)


def _bundled_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Whitespace()
    words = {"User", ":", "Assistant"}
    for name in BUNDLED:
        for it in load_contrast_set(name):
            for text in (it.prompt, it.positive, it.negative):
                words.update(w for w, _ in pre.pre_tokenize_str(text))
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(sorted(words))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def test_bundled_sets_run_end_to_end_on_a_text_model():
    from helpers import tiny_hf_model

    from reward_lens import HookedRewardModel

    tokenizer = _bundled_tokenizer()
    hf = tiny_hf_model("llama", vocab_size=len(tokenizer))
    model = HookedRewardModel.from_hf_model(hf, tokenizer=tokenizer)
    items = load_contrast_set("agreement")
    tok = model.to_tokens([it.prompt for it in items], [it.positive for it in items])
    assert int((tok["input_ids"] == 1).sum()) == 0  # every word is in the vocabulary
    cv = concept_vector(model, "sycophancy", layers=[0, 2], batch_size=12)
    assert cv.name == "agreement" and cv.vectors.shape == (2, 64) and len(cv.test_items) == 6
    assert torch.isfinite(cv.vectors).all() and ((cv.accuracy >= 0) & (cv.accuracy <= 1)).all()
    dr = dose_response(model, cv, layer=2, alphas=[-0.1, 0.0, 0.1])
    assert dr.rewards.shape == (12, 3) and np.isfinite(dr.slope)


def test_armorm_per_objective_and_gated(tmp_path):
    m = tiny_armorm(str(tmp_path))
    items = concept_items(16, seed=6)
    cv = concept_vector(m, items)
    names = m.reward_head.objective_names
    assert cv.objective_cosines.shape == (m.cfg.n_layers, len(names)) and cv.objective_names == names
    # gated cosine: against the mean prompt-conditioned direction over the set
    tok = m.to_tokens([it.prompt for it in items], [it.positive for it in items])
    mean_dir = m.reward_direction_for(tok["input_ids"], tok["attention_mask"]).mean(0)
    v = cv.vectors[-1]
    assert float(cv.cosine[-1]) == pytest.approx(
        float(torch.nn.functional.cosine_similarity(v, mean_dir, dim=0)), abs=1e-4
    )
    frame = cv.to_frame()
    assert f"cosine[{names[0]}]" in frame.columns
    dr = dose_response(m, cv, layer=1, alphas=[-0.2, 0.0, 0.2])
    assert dr.objectives.shape == (len(cv.test_items) * 2, 3, len(names))
    fits = dr.objective_fits()
    assert list(fits["objective"]) == names
    one = dose_response(m, cv, layer=1, alphas=[-0.2, 0.0, 0.2], objective=names[2])
    assert one.slope == pytest.approx(float(fits["slope"].iloc[2]), abs=1e-4)
    with read_objective(m, names[2]):
        clean = readout_run(m, *_interleaved(cv.test_items)).rewards
    assert torch.allclose(dr.objectives[:, 1, 2], clean, atol=1e-5)
    assert m.reward_head.objective is None


def test_clear_errors():
    o = organism()
    with pytest.raises(ValueError, match="out of range"):
        concept_vector(o.model, concept_items(8), layers=[5])
    with pytest.raises(ValueError, match="method"):
        concept_vector(o.model, concept_items(8), method="pca")
    with pytest.raises(ValueError, match="at least 2"):
        concept_vector(o.model, [ContrastPair("a ?", "agree", "maybe")])
