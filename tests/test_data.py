"""Preference data: RewardBench-style files in every format, the bundled pairs, token pairs, and the pair
batching/readout helpers the instruments share."""

import json

import pandas as pd
import pytest
import torch
from helpers import one_thread, tiny_tokenizer, token_pairs  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens.core.batching import tokenize_pair_batch
from reward_lens.core.directions import readout_direction, reward_from_final_resid
from reward_lens.data.pairs import PreferencePair, TokenPair, as_pairs, bundled_pairs, load_pairs

ROWS = [
    {"prompt": "p1", "chosen": "good", "rejected": "bad", "subset": "chat", "id": 7},
    {"prompt": "p2", "chosen": "yes", "rejected": "no", "subset": "safety", "id": 8},
]


def test_bundled_pairs():
    pairs = bundled_pairs()
    assert len(pairs) == 30
    assert all(
        isinstance(p, PreferencePair) and p.prompt and p.chosen and p.rejected and p.subset for p in pairs
    )
    assert len({p.id for p in pairs}) == 30
    assert all(p.chosen != p.rejected for p in pairs)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_load_every_format(tmp_path, suffix):
    path = tmp_path / f"pairs{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".csv":
        pd.DataFrame(ROWS).to_csv(path, index=False)
    else:
        pd.DataFrame(ROWS).to_parquet(path)
    pairs = load_pairs(path)
    assert [(p.prompt, p.chosen, p.rejected, p.subset, p.id) for p in pairs] == [
        ("p1", "good", "bad", "chat", "7"),
        ("p2", "yes", "no", "safety", "8"),
    ]
    assert as_pairs(str(path)) == pairs


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no pairs file"):
        load_pairs(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "chosen": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['rejected'\]"):
        load_pairs(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no preference pairs"):
        load_pairs(empty)
    with pytest.raises(ValueError, match="unsupported pairs file type"):
        load_pairs(bad.rename(tmp_path / "bad.txt"))
    with pytest.raises(ValueError, match="no preference pairs given"):
        as_pairs([])
    with pytest.raises(ValueError, match="mixing"):
        as_pairs([PreferencePair("p", "c", "r"), TokenPair([1, 2], [1, 3])])
    with pytest.raises(ValueError, match="at least one token"):
        TokenPair([], [1])


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_pair_batch(llama_model, side):
    pairs = token_pairs([(4, 2), (1, 5)], prompt_len=3, seed=5) + [
        TokenPair([5, 6, 7, 8], [5, 6, 9], prompt_len=1)
    ]
    batch = tokenize_pair_batch(llama_model, pairs, slice(0, 3), side)
    for tok, seqs in (
        (batch.chosen, [p.chosen for p in pairs]),
        (batch.rejected, [p.rejected for p in pairs]),
    ):
        for b, seq in enumerate(seqs):
            assert torch.equal(tok.input_ids[b][tok.attention_mask[b].bool()], seq)
            assert tok.input_ids[b, tok.readout[b]] == seq[-1]
    assert batch.prompt_len.tolist()[2] == 1  # given explicitly
    for b, p in enumerate(pairs[:2]):  # default: the longest common prefix
        n = int(batch.prompt_len[b])
        assert torch.equal(p.chosen[:n], p.rejected[:n]) and (
            n == min(len(p.chosen), len(p.rejected)) or p.chosen[n] != p.rejected[n]
        )
    with pytest.raises(ValueError, match="prompt_len=9"):
        tokenize_pair_batch(llama_model, [TokenPair([1, 2, 3], [1, 2], prompt_len=9)], slice(0, 1))


def test_text_pair_batch_shares_the_prompt(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf, tokenizer=tiny_tokenizer())
    pairs = bundled_pairs()[:3]
    batch = tokenize_pair_batch(model, pairs, slice(0, 3), "left")
    for b, p in enumerate(pairs):
        prompt_only = model.to_tokens([p.prompt], [""])["input_ids"][0]
        # the shared prefix covers the rendered prompt ("User: ... Assistant:") at least
        assert int(batch.prompt_len[b]) >= len(prompt_only) - 1


def test_readout_direction_reproduces_the_reward(llama_model):
    pairs = token_pairs([(4, 2), (1, 5)], prompt_len=3)
    batch = tokenize_pair_batch(llama_model, pairs, slice(0, 2))
    tok = batch.chosen
    rewards, cache = llama_model.run_with_cache(tok.input_ids, attention_mask=tok.attention_mask)
    direction, bias = readout_direction(llama_model, tok)
    assert direction.shape == (2, llama_model.cfg.d_model) and torch.equal(
        direction[0], llama_model.reward_direction.float()
    )
    final = cache[f"blocks.{llama_model.cfg.n_layers - 1}.hook_resid_post"][torch.arange(2), tok.readout]
    assert torch.allclose(reward_from_final_resid(llama_model, final, direction, bias), rewards, atol=1e-6)
