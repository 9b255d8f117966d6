"""The full `reward-lens audit` CLI on checkpoints as real training stacks save them (random weights, so it
is quick): a Llama-3-style chat RM with pad = EOS (TRL's default; transformers reads one token before the
trailing EOS) and an OpenRLHF-layout checkpoint (`RewardModel`, `value_head`, read at the last attended
token). Every step runs (divergence included), the report and results.json are written, and the audit's
rewards are the training stack's own rewards on the ids it would see (fp32, 1e-4)."""

import json

import pandas as pd
import torch
from helpers import llama3_tokenizer, one_thread, randomise_norms  # noqa: F401

from reward_lens.app.cli import main

WORDS = (
    "what is two plus three five four six the sky blue green a fruit pear apple name color yes no i "
    "think it is . ? sure maybe"
).split()
QA = [
    ("what is two plus three ?", "five .", "four ."),
    ("name a fruit .", "pear", "the sky is blue . i think it is green ."),
    ("what color is the sky ?", "the sky is blue .", "green"),
    ("is a pear a fruit ?", "yes . a pear is a fruit .", "no"),
    ("name a color .", "blue", "maybe a fruit ? i think pear ."),
    ("is the sky green ?", "no . the sky is blue .", "sure"),
]
N = len(QA)


def write_pairs(path, conversational: bool):
    rows = []
    for p, c, r in QA:
        if conversational:  # TRL's conversational format
            rows.append(
                {
                    "prompt": [{"role": "user", "content": p}],
                    "chosen": [{"role": "assistant", "content": c}],
                    "rejected": [{"role": "assistant", "content": r}],
                }
            )
        else:
            rows.append({"prompt": p, "chosen": c, "rejected": r})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def llama_config(tok, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        **extra,
    )


def run_audit_cli(model_dir, pairs, out):
    args = [
        "audit",
        "--model",
        str(model_dir),
        "--pairs",
        str(pairs),
        "--out",
        str(out),
        "--max-pairs",
        str(N),
        "--batch-size",
        "4",
    ]
    assert main(args) == 0
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "data:image/png;base64," in html
    results = json.loads((out / "results.json").read_text())
    assert results["n_pairs"] == N
    div = results["divergence"]
    assert div["n_patches"] == len(pd.read_csv(out / "divergence.csv")) > 0
    for name in ("lens", "attribution", "patching", "faithfulness", "divergence"):
        assert (out / f"{name}.csv").stat().st_size > 0
    return results


def chat_ids(tok):
    """apply_chat_template's ids of every (prompt, response), in the order [pair0 chosen, pair0 rejected,
    ...]."""
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": resp}],
            tokenize=True,
            return_dict=False,
        )
        for p, c, r in QA
        for resp in (c, r)
    ]


def audit_rewards(out) -> list:
    """The clean rewards the audit read, [pair0 chosen, pair0 rejected, ...] (patching.csv: noising patches
    the chosen run, denoising the rejected one)."""
    frame = pd.read_csv(out / "patching.csv")
    clean = {
        (t, int(p)): float(r) for t, p, r in frame[["target", "pair", "clean_reward"]].itertuples(index=False)
    }
    return [clean[(t, i)] for i in range(N) for t in ("chosen", "rejected")]


@torch.no_grad()
def test_audit_on_a_pad_is_eos_llama3_chat_rm(tmp_path):
    from transformers import LlamaForSequenceClassification

    tok = llama3_tokenizer(WORDS)
    torch.manual_seed(0)
    hf = LlamaForSequenceClassification(llama_config(tok, num_labels=1)).eval()
    randomise_norms(hf)
    hf.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    results = run_audit_cli(tmp_path / "rm", write_pairs(tmp_path / "pairs.jsonl", True), tmp_path / "out")
    assert results["input_format"] == "chat"
    # The rewards the audit reports are transformers' on apply_chat_template's ids (trailing EOS = pad: read
    # one token before it).
    expected = []
    for ids in chat_ids(tok):
        assert ids[-1] == tok.eos_token_id == tok.pad_token_id
        expected.append(float(hf(torch.tensor([ids])).logits[0, 0]))
    check_rewards(tmp_path / "out", expected)


@torch.no_grad()
def test_audit_on_an_openrlhf_checkpoint(tmp_path):
    from test_openrlhf import MEAN, STD, openrlhf_reference, save_openrlhf
    from transformers import LlamaModel

    tok = llama3_tokenizer(WORDS)
    torch.manual_seed(1)
    base = LlamaModel(llama_config(tok)).eval()
    randomise_norms(base, 1)
    head = torch.randn(1, base.config.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.5
    directory = save_openrlhf(tmp_path / "rm", base, head)
    tok.save_pretrained(directory)
    results = run_audit_cli(directory, write_pairs(tmp_path / "pairs.jsonl", False), tmp_path / "out")
    assert results["input_format"] == "openrlhf"
    # OpenRLHF's dataset: the rendered chat with its last token replaced by EOS; read at the last attended
    # token.
    expected = []
    for ids in chat_ids(tok):
        row = torch.tensor([ids[:-1] + [tok.eos_token_id]])
        expected.append(float(openrlhf_reference(base, head, row, torch.ones_like(row))[0]))
    assert MEAN and STD  # normalised as saved (normalize_reward=True)
    check_rewards(tmp_path / "out", expected)


def check_rewards(out, expected):
    got = audit_rewards(out)
    assert len(got) == len(expected) == 2 * N
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4
