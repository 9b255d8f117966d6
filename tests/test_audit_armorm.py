"""The audit on a tiny ArmoRM-format model: the gate / per-objective view and the reward-term conflicts."""

import json

import pytest
from armorm_reference import save_tiny_armorm
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from reward_lens import HookedRewardModel, bundled_pairs
from reward_lens.app.audit import run_audit

TEMPLATE = (
    "<bos> {% for m in messages %}{% if m['role'] == 'assistant' %}<sep> {% endif %}{{ m['content'] }} "
    "{% endfor %}<eos>"
)


def chat_tokenizer(pairs, vocab_size=120):
    texts = [f"{p.prompt} {r}" for p in pairs for r in (p.chosen, p.rejected)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        texts,
        trainers.WordLevelTrainer(
            vocab_size=vocab_size, special_tokens=["<pad>", "<unk>", "<bos>", "<eos>", "<sep>"]
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )
    fast.chat_template = TEMPLATE
    return fast


def tiny_armorm(tmp_path, pairs):
    """A tiny ArmoRM-format model whose gate reads the prompt up to the <sep> token, with a chat
    tokenizer trained on `pairs`."""
    tok = chat_tokenizer(pairs)
    sep = tok.convert_tokens_to_ids("<sep>")
    path = save_tiny_armorm(
        tmp_path / "armo", vocab_size=len(tok), pad_token_id=tok.pad_token_id, gating_token_pattern=[sep]
    )
    return HookedRewardModel.from_pretrained(path, tokenizer=tok)


def test_audit_reports_gate_objectives_and_conflicts(tmp_path):
    pairs = bundled_pairs()[:6]
    model = tiny_armorm(tmp_path, pairs)
    assert model.cfg.head_type == "armorm"
    audit = run_audit(model, pairs, tmp_path / "out", batch_size=4, echo=lambda s: None)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    objectives = results["armorm"]["objectives"]
    assert len(objectives) == 19 and {"objective", "mean_gate", "pair_accuracy", "mean_gap"} <= set(
        objectives[0]
    )
    # The gate weights sum to logit_scale for every prompt, so their means do too.
    assert sum(o["mean_gate"] for o in objectives) == pytest.approx(2.5, rel=1e-4)
    assert (
        results["conflicts"]
        and "ArmoRM: gate and objectives" in (tmp_path / "out" / "report.html").read_text()
    )
    # Attribution along the prompt-conditioned direction stays exact on the gated score.
    assert results["attribution_max_relative_error"] < 1e-4
    assert audit.frames["armorm_objectives"].shape[0] == 19
