"""Exact token-level attribution: Σ (layer, head, source token) terms + readout-local terms + bias = the
model's reward within 1e-5 relative (fp32; GQA, sliding windows, q/k norms, Gemma-2 soft-caps and
post-norms, ArmoRM's per-sequence direction, both padding sides); each term equals an independent
recomputation from a full cache; the generic path refuses clearly; on the demo organism the planted
stance and filler tokens carry the preference."""

import numpy as np
import pytest
import torch
from helpers import one_thread, tiny_hf_model, tiny_tokenizer, token_pairs  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens.core.batching import pair_batches
from reward_lens.data.pairs import TokenPair, bundled_pairs
from reward_lens.instruments import attribute
from reward_lens.instruments.tokens import TokenAttributionResult, token_attribution

RTOL = 1e-5
PAIRS = token_pairs([(5, 9), (12, 3), (7, 7)], prompt_len=4)


def rel_err(a, b):
    return ((a.double() - b.double()).abs() / b.double().abs().clamp(min=1e-6)).max().item()


def plain_rewards(model, pairs, side):
    """The model's own rewards from a plain forward (fused attention, no hooks)."""
    out = {"chosen": [], "rejected": []}
    for batch in pair_batches(model, pairs, 8, padding_side=side):
        for s in out:
            tok = getattr(batch, s)
            with torch.no_grad():
                out[s].append(model(tok.input_ids, attention_mask=tok.attention_mask))
    return {s: torch.cat(v) for s, v in out.items()}


def check_exact(model, res: TokenAttributionResult, pairs, side):
    assert res.max_relative_error() < RTOL
    plain = plain_rewards(model, pairs, side)
    for s in ("chosen", "rejected"):
        assert rel_err(res.total(s), plain[s]) < RTOL
    frame = res.to_frame()
    sums = frame.groupby(["pair", "side"], sort=False).value.sum()
    for s in ("chosen", "rejected"):
        got = torch.tensor([sums[(pid, s)] for pid in res.pair_ids])
        assert rel_err(got, plain[s]) < RTOL


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_terms_sum_to_the_reward_both_padding_sides(hf_models, arch):
    model = HookedRewardModel.from_hf_model(hf_models[arch])
    cfg = model.cfg
    assert cfg.n_key_value_heads < cfg.n_heads  # GQA exercised
    runs = {}
    for side in ("right", "left"):
        runs[side] = res = token_attribution(model, PAIRS, padding_side=side, batch_size=3)
        check_exact(model, res, PAIRS, side)
        assert res.heads["chosen"][1].shape == (cfg.n_layers, cfg.n_heads, len(PAIRS[1].chosen))
    # Pads are removed and positions renumbered: both padding sides give the same terms.
    for a, b in zip(runs["right"].heads["rejected"], runs["left"].heads["rejected"]):
        assert torch.allclose(a, b, atol=1e-6)
    if arch == "mistral":  # sliding window 4: a source more than 3 tokens back is never read at the readout
        h = runs["right"].heads["chosen"][1]
        assert h[..., : h.shape[-1] - 4].abs().max() == 0 and h[..., -4:].abs().max() > 0


def test_each_term_matches_an_independent_recomputation(llama_model):
    model = llama_model
    res = token_attribution(model, PAIRS[:1])
    ids = PAIRS[0].chosen[None]
    _, cache = model.run_with_cache(ids)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    group = H // model.cfg.n_key_value_heads
    final = cache[f"blocks.{L - 1}.hook_resid_post"][0, -1]
    w = model.reward_direction / final.pow(2).mean().add(model.cfg.eps).sqrt()  # the scale recomputed
    for l in range(L):
        pattern, v = cache[f"blocks.{l}.attn.hook_pattern"][0], cache[f"blocks.{l}.attn.hook_v"][0]
        for h in range(H):
            expected = torch.stack(
                [
                    pattern[h, -1, s] * (v[s, h // group] @ model.blocks[l].attn.W_O[h] @ w)
                    for s in range(ids.shape[1])
                ]
            )
            assert torch.allclose(res.heads["chosen"][0][l, h], expected, atol=1e-6)
    # Summed over sources (plus b_O) the heads give `attribute`'s per-head and attention-layer terms.
    attr = attribute(model, PAIRS[:1], progress=False)
    assert torch.allclose(res.heads["chosen"][0].sum(-1), attr.heads_chosen[0], atol=1e-6)
    assert torch.allclose(res.mlp["chosen"][0], attr.chosen[0, 2::2], atol=1e-6)
    assert torch.allclose(res.embed["chosen"][0], attr.chosen[0, 0], atol=1e-6)


def test_gemma2_soft_caps_post_norms_and_windows():
    from test_gemma2 import tiny_gemma2

    model = HookedRewardModel.from_hf_model(tiny_gemma2())
    assert model.cfg.post_norms and model.cfg.attn_scores_soft_cap is not None
    pairs = token_pairs([(6, 9), (11, 2)], prompt_len=3)
    for side in ("right", "left"):
        check_exact(model, token_attribution(model, pairs, padding_side=side), pairs, side)


def test_armorm_per_sequence_direction(tmp_path):
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
        res = token_attribution(model, pairs, padding_side=side)
        check_exact(model, res, pairs, side)
        assert torch.all(res.bias["chosen"] == 0)
    # The direction is per sequence: a fixed direction would not reproduce the rewards.
    d = model.reward_direction_for(pairs[0].chosen[None])[0]
    d2 = model.reward_direction_for(pairs[1].chosen[None])[0]
    assert (d - d2).abs().max() > 1e-3


def test_generic_path_refuses_clearly(llama_hf):
    generic = HookedRewardModel.from_hf_model(llama_hf, generic=True)
    with pytest.raises(ValueError, match="attribute\\(model, pairs\\) for exact attention-layer terms"):
        token_attribution(generic, PAIRS)


def test_texts_frames_html_and_plot(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf, tokenizer=tiny_tokenizer())
    pairs = bundled_pairs()[:3]
    res = token_attribution(model, pairs, batch_size=2)
    assert res.max_relative_error() < RTOL
    gap = res.gap_frame()
    # Aligned on the shared prompt: prompt rows pair identical tokens; response rows have no gap.
    prompt = gap[gap.region == "prompt"]
    assert len(prompt) == int(res.prompt_len.sum()) and (prompt.token_chosen == prompt.token_rejected).all()
    assert gap[gap.region == "response"].gap.isna().all()
    totals = res.token_totals()
    one = totals[(totals.pair == res.pair_ids[0]) & (totals.side == "chosen")]
    assert np.isclose(one.value.sum(), float(res.heads["chosen"][0].sum()), atol=1e-5)
    only_l0 = res.token_totals(layers=[0])
    assert not np.allclose(only_l0.value, totals.value)
    html = res.html()
    assert html.count("<span") == sum(len(t) for s in res.sides for t in res.tokens[s])
    assert 'title="position 0:' in html and "chosen" in html and "rejected" in html
    assert res._repr_html_().startswith("<div")
    assert len(res.summary()) == 2 * len(pairs)
    import matplotlib.figure

    assert isinstance(res.plot(), matplotlib.figure.Figure)
    texts = token_attribution(model, [(p.prompt, p.chosen) for p in pairs])
    assert texts.sides == ("text",) and texts.max_relative_error() < RTOL
    assert torch.allclose(texts.reward["text"], res.reward["chosen"], atol=1e-5)
    with pytest.raises(ValueError, match="needs preference pairs"):
        texts.gap_frame()


# ---------------------------------------------------------------------------------------------------
# The demo organism: the planted stance and filler tokens carry the planted preferences.


def phrase_classes(tokens, response):
    """Each token's class by character span: 'stance' (agree/disagree phrases), 'filler' (fillers and
    openers), 'answer' (the rest of the response) or 'other' (template, prompt, end token)."""
    from reward_lens.demo.synthetic import AGREE, DISAGREE, FILLERS, OPENERS

    text = "".join(tokens)
    start = text.rfind(response)
    assert start >= 0, "token strings must concatenate to the rendered text"
    spans = [
        (start + i, start + i + len(ph), kind)
        for kind, phrases in (("stance", AGREE + DISAGREE), ("filler", FILLERS + OPENERS))
        for ph in phrases
        for i in [response.find(ph)]
        if i >= 0
    ]
    out, pos = [], 0
    for t in tokens:
        a, b = pos, pos + len(t)
        pos = b
        kind = "other" if b <= start or a >= start + len(response) else "answer"
        for s, e, k in spans:
            if a < e and b > s and t.strip():
                kind = k
        out.append(kind)
    return out


@pytest.fixture(scope="module")
def demo():
    from reward_lens import load_demo_model

    return load_demo_model()


@pytest.mark.parametrize("subset,planted", [("sycophancy", "stance"), ("length", "filler")])
def test_demo_planted_tokens_carry_the_preference(demo, subset, planted):
    from reward_lens import demo_pairs

    pairs = [p for p in demo_pairs() if p.subset == subset][:24]
    res = token_attribution(demo, pairs)
    assert res.max_relative_error() < RTOL
    gaps = []  # per pair: Σ token terms of each response class, chosen minus rejected
    for i, p in enumerate(pairs):
        g = {"stance": 0.0, "filler": 0.0, "answer": 0.0}
        for side, response, sign in (("chosen", p.chosen, 1), ("rejected", p.rejected, -1)):
            for kind, v in zip(phrase_classes(res.tokens[side][i], response), res.token_values(side, i)):
                if kind in g:
                    g[kind] += sign * float(v)
        gaps.append(g)
    planted_gap = np.array([g[planted] for g in gaps])
    largest = np.mean([max(g, key=g.get) == planted for g in gaps])
    assert (planted_gap > 0).mean() >= 0.9  # the planted tokens are read in the chosen's favour
    assert largest >= 0.55  # and carry the largest share of the response tokens' gap in most pairs
    assert planted_gap.mean() > np.mean([g["answer"] for g in gaps])
    if subset == "sycophancy":  # within chosen: an agreeing stance token is among the top-3 response tokens
        hits = 0
        for i, p in enumerate(pairs):
            kinds = phrase_classes(res.tokens["chosen"][i], p.chosen)
            vals = res.token_values("chosen", i)
            resp = [t for t, k in enumerate(kinds) if k in ("stance", "filler", "answer")]
            top = sorted(resp, key=lambda t: -vals[t])[:3]
            hits += any(kinds[t] == "stance" for t in top)
        assert hits / len(pairs) >= 0.8
