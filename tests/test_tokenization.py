"""(prompt, response) tokenisation: chat template without a doubled BOS, plain format, padding, truncation."""

import pytest
import torch
from helpers import word_tokenizer

from reward_lens import HookedRewardModel

WORDS = "what is 2+2 ? 4 the sky blue user assistant : hello world a b c".split()
TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"


def make_tokenizer(template=True):
    return word_tokenizer(
        ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"] + WORDS,
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        template=TEMPLATE if template else None,
    )


@pytest.fixture()
def model(llama_hf):
    return HookedRewardModel.from_hf_model(llama_hf, tokenizer=make_tokenizer())


def test_chat_template_applied_once_with_single_bos(model):
    batch = model.to_tokens(["what is 2+2 ?"], ["4"])
    ids = batch["input_ids"][0].tolist()
    tok = model.tokenizer
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(ids) == [
        "<s>",
        "<|user|>",
        "what",
        "is",
        "2+2",
        "?",
        "<|end|>",
        "<|assistant|>",
        "4",
        "<|end|>",
    ]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_sides_give_the_same_rewards(model, side):
    prompts, responses = ["what is 2+2 ?", "hello"], ["4", "the sky is blue a b c"]
    batch = model.to_tokens(prompts, responses, padding_side=side)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert (ids[mask == 0] == model.cfg.pad_token_id).all()
    rewards = model(ids, attention_mask=mask)
    singles = torch.stack(
        [model(model.to_tokens([p], [r])["input_ids"])[0] for p, r in zip(prompts, responses)]
    )
    assert torch.allclose(rewards, singles, atol=1e-5)


def test_plain_format_without_template(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf, tokenizer=make_tokenizer(template=False))
    from reward_lens.model.tokenization import render_pair

    assert render_pair(model.tokenizer, "hello", "world") == "User: hello\n\nAssistant: world"
    assert model.to_tokens(["hello"], ["world"])["input_ids"].shape[0] == 1


def test_truncation_keeps_the_end_and_warns(model):
    with pytest.warns(UserWarning, match="truncated from the left"):
        batch = model.to_tokens(["a b c " * 10], ["4"], max_length=8)
    ids = batch["input_ids"][0].tolist()
    assert len(ids) == 8 and model.tokenizer.convert_ids_to_tokens(ids)[-2:] == ["4", "<|end|>"]


def test_mismatched_lengths_are_a_clear_error(model):
    with pytest.raises(ValueError, match="one response per prompt"):
        model.to_tokens(["a", "b"], ["c"])


def test_batched_chat_encoding_equals_one_pair_at_a_time(model):
    """The chat format tokenises a list of pairs in one apply_chat_template call: the ids equal encoding
    each pair alone, text pairs and message-list pairs mixed, on this template and the demo's."""
    from reward_lens.demo import demo_pairs, load_demo_model
    from reward_lens.model.tokenization import encode_pair, encode_pairs

    convo = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    cases = [
        (model.tokenizer, ["what is 2+2 ?", "the sky", "", "hello"], ["4", "blue", convo, "a b c"]),
        (
            load_demo_model(device="cpu").tokenizer,
            [p.prompt for p in demo_pairs()[:12]],
            [p.chosen for p in demo_pairs()[:12]],
        ),
    ]
    for tok, prompts, responses in cases:
        one = [encode_pair(tok, p, r, "chat") for p, r in zip(prompts, responses)]
        assert encode_pairs(tok, prompts, responses, "chat") == one
        assert len({len(x) for x in one}) > 1  # lengths differ: no padding leaks into the ids
