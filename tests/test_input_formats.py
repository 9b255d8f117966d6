"""Input formats against the real `trl` package: tiny reward models trained with trl's RewardTrainer for a few
steps, then `to_tokens` ids compared with the ids TRL itself tokenised (the processed train_dataset's
`chosen_ids` / `rejected_ids`) for every pair, up to and including the readout, and hooked rewards with
transformers' on them (fp32, 1e-5).

Three set-ups: conversational data with a Llama-3-style template and pad = EOS (TRL's default when the
tokenizer has no pad token); standard (string) data, "concat"; a chat template without BOS given through
TRL's `chat_template_path` on a tokenizer that adds BOS. Plus OpenRLHF's convention and template strings.
"""

import json
import warnings

import pytest
import torch
from helpers import LLAMA3_TEMPLATE, word_tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification

from reward_lens import HookedRewardModel, load_pairs

trl = pytest.importorskip("trl")  # in the test extras; importorskip only keeps a bare install importable
datasets = pytest.importorskip("datasets")

TOL = 1e-5
WORDS = (
    "what is two plus three five four six the sky blue green a fruit pear apple name color yes no i "
    "think it . ?"
).split()
ROLES = ["user", "assistant", "system"]
QWEN_LIKE_TEMPLATE = (  # no BOS, as Qwen's (and TRL's chat_template_path example)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if "
    "add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QA = [
    ("what is two plus three ?", "five .", "four ."),
    ("name a fruit .", "pear", "the sky is blue . i think it is green ."),
    ("what color is the sky ?", "the sky is blue .", "green"),
    ("is a pear a fruit ?", "yes . a pear is a fruit .", "no"),
]


def make_tokenizer(specials, bos, eos, pad=None, add_bos=False):
    return word_tokenizer(
        ["<unk>"] + specials + ROLES + WORDS, bos=bos, eos=eos, pad=pad, specials=specials, add_bos=add_bos
    )


def train(tokenizer, records, out, **config):
    """A tiny Llama RM trained for 3 steps by trl's RewardTrainer; returns (trainer, saved directory)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
    )
    model = LlamaForSequenceClassification(cfg)
    args = trl.RewardConfig(
        output_dir=str(out / "run"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **config,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.RewardTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(records),
            processing_class=tokenizer,
        )
        trainer.train()
    trainer.save_model(str(out / "rm"))
    trainer.model.eval().float()
    return trainer, out / "rm"


def hf_reward(trainer, ids):
    with torch.no_grad():
        return trainer.model(torch.tensor([ids])).logits[0, 0]


def check_against_trl(trainer, model, prompts, responses, column):
    """`to_tokens` rows equal TRL's ids up to and including transformers' readout; rewards equal."""
    batch = model.to_tokens(prompts, responses)
    pad = model.cfg.pad_token_id
    assert pad == trainer.model.config.pad_token_id
    ours_batch = model(batch["input_ids"])  # left-padded, no mask: inferred
    for b, trl_ids in enumerate(trainer.train_dataset[column]):
        ours = batch["input_ids"][b][batch["attention_mask"][b].bool()].tolist()
        readout = max(i for i, t in enumerate(trl_ids) if t != pad)  # transformers: rightmost non-pad token
        assert ours == trl_ids[: readout + 1], (b, ours, trl_ids)
        assert abs(float(model(torch.tensor([ours]))[0]) - float(hf_reward(trainer, trl_ids))) < TOL
        assert abs(float(ours_batch[b]) - float(hf_reward(trainer, trl_ids))) < TOL


@pytest.fixture(scope="module")
def llama3_run(tmp_path_factory):
    tok = make_tokenizer(
        ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    )  # no pad token: TRL pads with EOS
    tok.chat_template = LLAMA3_TEMPLATE
    records = [
        {
            "prompt": [{"role": "user", "content": p}],
            "chosen": [{"role": "assistant", "content": c}],
            "rejected": [{"role": "assistant", "content": r}],
        }
        for p, c, r in QA
    ]
    trainer, path = train(tok, records, tmp_path_factory.mktemp("llama3"))
    return trainer, path, records


def test_conversational_llama3_pad_is_eos(llama3_run, tmp_path):
    trainer, path, records = llama3_run
    model = HookedRewardModel.from_pretrained(path)
    assert model.input_format == "auto" and model.cfg.pad_token_id == model.tokenizer.eos_token_id
    prompts = [r["prompt"] for r in records]
    check_against_trl(trainer, model, prompts, [r["chosen"] for r in records], "chosen_ids")
    check_against_trl(trainer, model, prompts, [r["rejected"] for r in records], "rejected_ids")
    # The same pairs through load_pairs (TRL's conversational jsonl) and input_format="chat" explicitly.
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    pairs = load_pairs(tmp_path / "pairs.jsonl")
    assert isinstance(pairs[0].chosen, tuple) and pairs[0].chosen[0]["role"] == "assistant"
    batch = model.to_tokens([p.prompt for p in pairs], [p.chosen for p in pairs], input_format="chat")
    assert torch.equal(
        batch["input_ids"], model.to_tokens(prompts, [r["chosen"] for r in records])["input_ids"]
    )
    # String pairs render as one user and one assistant message: the same ids.
    assert torch.equal(
        model.to_tokens(QA[0][0], QA[0][1])["input_ids"],
        model.to_tokens(prompts[0], records[0]["chosen"])["input_ids"],
    )


def test_standard_data_concat(tmp_path):
    tok = make_tokenizer(["<s>", "</s>", "<pad>"], bos="<s>", eos="</s>", pad="<pad>", add_bos=True)
    records = [{"prompt": p + " ", "chosen": c, "rejected": r} for p, c, r in QA]
    trainer, path = train(tok, records, tmp_path)
    model = HookedRewardModel.from_pretrained(path, input_format="concat")
    assert model.input_format == "concat"
    prompts = [r["prompt"] for r in records]
    check_against_trl(trainer, model, prompts, [r["chosen"] for r in records], "chosen_ids")
    check_against_trl(trainer, model, prompts, [r["rejected"] for r in records], "rejected_ids")
    assert trainer.train_dataset["chosen_ids"][0][0] == tok.bos_token_id  # TRL adds BOS: so do we
    # The default ("plain", no template) is different text: the format matters.
    plain = model.to_tokens(prompts[:1], [records[0]["chosen"]], input_format="plain")["input_ids"][
        0
    ].tolist()
    assert plain != trainer.train_dataset["chosen_ids"][0]


def test_chat_template_without_bos_via_chat_template_path(tmp_path):
    tok = make_tokenizer(
        ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"],
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        add_bos=True,
    )
    (tmp_path / "template.jinja").write_text(QWEN_LIKE_TEMPLATE)
    records = [
        {
            "prompt": [{"role": "user", "content": p}],
            "chosen": [{"role": "assistant", "content": c}],
            "rejected": [{"role": "assistant", "content": r}],
        }
        for p, c, r in QA
    ]
    trainer, path = train(tok, records, tmp_path, chat_template_path=str(tmp_path / "template.jinja"))
    model = HookedRewardModel.from_pretrained(path)
    prompts = [r["prompt"] for r in records]
    check_against_trl(trainer, model, prompts, [r["chosen"] for r in records], "chosen_ids")
    check_against_trl(trainer, model, prompts, [r["rejected"] for r in records], "rejected_ids")
    batch = model.to_tokens(prompts, [r["chosen"] for r in records])
    assert not (batch["input_ids"] == tok.bos_token_id).any()  # the template has no BOS and none is added


def test_openrlhf_and_template_string_formats(llama3_run):
    _, path, _ = llama3_run
    model = HookedRewardModel.from_pretrained(path, input_format="openrlhf")
    tok = model.tokenizer
    model.cfg.pad_token_id = tok.convert_tokens_to_ids("<unk>")  # OpenRLHF reads at EOS: pad must differ here
    prompt, chosen = QA[0][0], QA[0][1]
    row = model.to_tokens(prompt, chosen)["input_ids"][0].tolist()
    # OpenRLHF (reward_dataset.py): chat prompt with generation prompt + the rest of the conversation,
    # rstrip("\n"), " " + EOS unless present, no special tokens added, the last token replaced by EOS.
    msgs = [{"role": "user", "content": prompt}]
    head = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": chosen}], tokenize=False)
    text = (head + full[len(head) :]).rstrip("\n")
    ids = tok(text if text.endswith(tok.eos_token) else text + " " + tok.eos_token, add_special_tokens=False)[
        "input_ids"
    ]
    ids[-1] = tok.eos_token_id
    assert row == ids and row[-1] == tok.eos_token_id and row.count(tok.bos_token_id) == 1
    # A template string.
    custom = model.to_tokens(prompt, chosen, input_format="Q: {prompt} A: {response}")["input_ids"][
        0
    ].tolist()
    assert custom == tok("Q: " + prompt + " A: " + chosen)["input_ids"]
    with pytest.raises(ValueError, match="input_format"):
        model.to_tokens(prompt, chosen, input_format="chatml")
    with pytest.raises(ValueError, match="conversational pairs use .chat."):
        model.to_tokens(msgs, [{"role": "assistant", "content": chosen}], input_format="concat")


def test_cli_input_format_reaches_the_model(llama3_run, tmp_path, capsys):
    from reward_lens.app.audit import input_format_name  # what results.json names (test_cli runs the audit)
    from reward_lens.app.cli import main
    from reward_lens.app.options import load_model

    _, path, _ = llama3_run
    model, _ = load_model(str(path), None, None, "concat")
    assert model.input_format == "concat" and input_format_name(model) == "concat"
    assert input_format_name(HookedRewardModel.from_pretrained(path)) == "chat"  # "auto" resolved: a template
    assert (
        main(["audit", "--model", str(path), "--input-format", "chatml", "--out", str(tmp_path / "o")]) == 2
    )
    assert "unknown input_format 'chatml'" in capsys.readouterr().err
