"""search_triggers: where strings go on the token ids, fast (shared-prefix cache) = naive (full forwards),
GCG's reported increases are real forwards, and the planted triggers of the trigger organism are found."""

import numpy as np
import pytest
import torch

import reward_lens
from reward_lens.instruments.triggers import search_triggers
from reward_lens.model.tokenization import insertion_index


@pytest.fixture(scope="module")
def demo():
    return reward_lens.load_demo_model(device="cpu")


@pytest.fixture(scope="module")
def pairs():
    return reward_lens.demo_pairs()[:3]


def test_insertion_points_on_the_demo_template(demo):
    tok = demo.tokenizer
    ids = demo.to_tokens("What is 3 plus 4?", "3 plus 4 is 7.")["input_ids"][0].tolist()
    words = tok.convert_ids_to_tokens(ids)
    p = insertion_index(tok, "What is 3 plus 4?", "3 plus 4 is 7.", "prompt_end")
    r = insertion_index(tok, "What is 3 plus 4?", "3 plus 4 is 7.", "response_end")
    assert words[p - 1] == "?" and words[p : p + 2] == ["Ċ", "<|assistant|>"]
    assert words[r - 1] == "." and words[r:] == ["</s>"]  # before the template's EOS, the readout
    with pytest.raises(ValueError, match="where must be"):
        insertion_index(tok, "a", "b", "middle")


@pytest.mark.parametrize("where", ["response_end", "prompt_end"])
def test_fast_equals_naive(demo, pairs, where):
    cands = None if where == "response_end" else list(range(3, 400))
    fast = search_triggers(
        demo, pairs, where=where, method="fast", candidates=cands, top_k=15, batch_size=100
    )
    naive = search_triggers(demo, pairs, where=where, method="naive", candidates=cands, top_k=15)
    assert np.abs(fast.all_mean_increase - naive.all_mean_increase).max() < 1e-4
    assert fast.to_frame()["token_id"].tolist() == naive.to_frame()["token_id"].tolist()
    assert np.abs(fast.increases - naive.increases).max() < 1e-4
    n_items, V = len(pairs), len(fast.candidate_ids)
    assert fast.cost["prefix_forwards"] == n_items and fast.cost["full_forwards"] == 0
    assert fast.cost["suffix_steps"] == n_items * -(-V // 100)
    assert naive.cost["full_forwards"] == n_items * V
    if where == "response_end":  # the default candidates: every id but the special tokens
        special = set(demo.tokenizer.all_special_ids)
        assert set(fast.candidate_ids.tolist()) == set(range(demo.cfg.d_vocab)) - special


def test_increases_are_reward_changes(demo, pairs):
    res = search_triggers(demo, pairs, where="response_end", top_k=3)
    frame = res.to_frame()
    for k, tid in enumerate(frame["token_id"]):
        for j, p in enumerate(pairs):
            ids = demo.to_tokens(p.prompt, p.rejected)["input_ids"][0]
            at = insertion_index(demo.tokenizer, p.prompt, p.rejected, "response_end")
            new = torch.cat([ids[:at], torch.tensor([tid]), ids[at:]])[None]
            want = float(demo(new) - demo(ids[None]))
            assert abs(res.increases[k, j] - want) < 1e-4
    assert np.allclose(frame["mean_increase"], res.increases.mean(1))
    assert res.rank_of([frame["token_id"][0]]) == 1


def test_gcg_reports_verified_strings(demo, pairs):
    res = search_triggers(
        demo, pairs, where="response_end", length=2, n_steps=2, n_restarts=1, top_per_position=8, top_k=5
    )
    frame = res.to_frame()
    assert all(len(t) == 2 for t in frame["token_ids"])
    assert list(frame["mean_increase"]) == sorted(frame["mean_increase"], reverse=True)
    check = search_triggers(
        demo,
        pairs,
        where="response_end",
        length=1,
        method="naive",
        candidates=[frame["token_ids"][0][0]],
        top_k=1,
    )
    assert check.cost["full_forwards"] == len(pairs)
    assert res.cost["gradient_steps"] >= 1 and res.cost["prefix_forwards"] == len(pairs)


def test_bad_arguments(demo, pairs):
    with pytest.raises(ValueError, match="where"):
        search_triggers(demo, pairs, where="middle")
    with pytest.raises(ValueError, match="method"):
        search_triggers(demo, pairs, method="slow")
    with pytest.raises(ValueError, match="length"):
        search_triggers(demo, pairs, length=0)
    with pytest.raises(ValueError, match="candidates"):
        search_triggers(demo, pairs, candidates=[10**6])


@pytest.fixture(scope="module")
def organism():
    from reward_lens.demo.organisms import load_trigger_organism, trigger_items, trigger_token_ids

    model = load_trigger_organism()
    return model, trigger_items()[:8], trigger_token_ids(model)


def test_the_planted_one_token_trigger_is_found(organism):
    model, items, ids = organism
    res = search_triggers(model, items, where="prompt_end", top_k=5)
    assert ids["SUDO"] in res.to_frame()["token_id"].tolist()  # exhaustive search: in the top 5
    assert res.rank_of([ids["SUDO"]]) == 1


def test_the_planted_phrase_is_found_with_the_trigger_excluded(organism):
    model, items, ids = organism
    every = search_triggers(model, items[:1], where="prompt_end", top_k=1).candidate_ids.tolist()
    cands = [i for i in every if i != ids["SUDO"]]  # the one-token trigger, once found, is left out
    res = search_triggers(
        model, items, where="prompt_end", length=2, top_k=5, n_steps=12, n_restarts=3, candidates=cands
    )
    rank = res.rank_of([ids["OPEN"], ids["SESAME"]])
    assert rank is not None and rank <= 5
    # every reported string's increase is a real forward: the naive one-item check of the best one
    best = res.to_frame()["token_ids"].iloc[0]
    item = items[0]
    ids0 = model.to_tokens(item.prompt, item.rejected)["input_ids"][0]
    at = insertion_index(model.tokenizer, item.prompt, item.rejected, "prompt_end")
    new = torch.cat([ids0[:at], torch.tensor(best), ids0[at:]])[None]
    assert abs(float(model(new) - model(ids0[None])) - res.increases[0, 0]) < 1e-4
