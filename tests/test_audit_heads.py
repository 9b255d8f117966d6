"""`reward-lens audit --model DIR` on tiny replicas of every head family (INF-ORM, Qwen2.5-Math-RM, GRM,
Qwen2.5-Math-PRM as their authors save them; a generative judge saved as a hooked checkpoint): every step
runs, the report names the head family, and for per-sequence directions gives their cosine spread."""

import json

import pytest
import torch
from helpers import LLAMA3_SPECIALS, one_thread, word_tokenizer  # noqa: F401
from mlp_reference import save_tiny
from test_audit_training_stacks import WORDS, N, write_pairs

from reward_lens import HookedRewardModel
from reward_lens.app.cli import main

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ "
    "m['content'] | trim }}{% if m['role'] == 'assistant' %} <extra_0>{% endif %}<|eot_id|>{% endfor %}"
)


def tokenizer():
    """Llama-3-style chat tokens, a pad distinct from EOS, the PRM step tag (`<extra_0>` ends a response)."""
    specials = LLAMA3_SPECIALS + ["<pad>", "<extra_0>"]
    return word_tokenizer(
        specials + ["user", "assistant", "Yes", "No"] + WORDS,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<pad>",
        specials=specials,
        template=TEMPLATE,
    )


def audit(model_dir, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", conversational=False)
    out = tmp_path / "out"
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
    results = json.loads((out / "results.json").read_text())
    assert results["n_pairs"] == N and results["attribution_max_relative_error"] < 1e-4
    return results, (out / "report.html").read_text(), out


@pytest.mark.parametrize("kind", ["inform", "qwen2_rm", "grm", "qwen2_prm"])
def test_audit_reads_the_head_family(kind, tmp_path):
    tok = tokenizer()
    path = save_tiny(kind, tmp_path / kind, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    tok.save_pretrained(path)
    results, html, out = audit(path, tmp_path)
    family = results["head_family"]
    assert family["family"].startswith("prm:" if kind == "qwen2_prm" else "mlp:")
    spread = family["direction_cosine"]
    assert -1 <= spread["to_mean_direction"]["min"] <= spread["to_mean_direction"]["mean"] <= 1
    assert spread["to_mean_direction"]["min"] < 0.9999  # the ReLU masks differ across sequences
    assert "Reward head" in html and family["family"] in html
    assert (out / "head_direction_cosines.csv").exists()
    if kind == "qwen2_prm":
        assert family["per_step"] and family["step_read"] == -1


def test_audit_of_a_judge(tmp_path):
    import transformers

    tok = tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    judge = HookedRewardModel.from_judge(tmp_path / "lm", "Yes", "No")
    judge.save_pretrained(tmp_path / "judge")
    results, html, _ = audit(tmp_path / "judge", tmp_path)
    assert results["head_family"]["family"] == "judge:Yes-vs-No"
    assert not results["head_family"]["per_sequence_direction"] and "judge:Yes-vs-No" in html


def test_audit_of_qrm(tmp_path):
    from qrm_reference import save_tiny_qrm

    tok = tokenizer()
    header = tok.encode("<|start_header_id|> assistant <|end_header_id|>", add_special_tokens=False)
    path = save_tiny_qrm(
        tmp_path / "qrm", vocab_size=len(tok), pad_token_id=tok.pad_token_id, gating_token_pattern=header
    )
    tok.chat_template = TEMPLATE.replace(" <extra_0>", "")
    tok.save_pretrained(path)
    results, html, _ = audit(path, tmp_path)
    assert results["head_family"]["family"] == "qrm" and len(results["armorm"]["objectives"]) == 19
    assert results["head_family"]["direction_cosine"]["to_mean_direction"]["min"] < 0.9999
    assert "ArmoRM: gate and objectives" in html and "qrm" in html


def test_direction_spread_from_the_shared_passes_equals_a_direct_computation(tmp_path):
    """The audit reads the per-sequence directions from its pipeline call; recomputed here batch by batch
    with `readout_direction` (chosen and rejected of every pair), the cosines agree."""
    from reward_lens.app.head_family import head_family_view
    from reward_lens.core.batching import pair_batches
    from reward_lens.core.directions import readout_direction
    from reward_lens.data.pairs import load_pairs

    tok = tokenizer()
    path = save_tiny("inform", tmp_path / "inform", vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    tok.save_pretrained(path)
    model = HookedRewardModel.from_pretrained(path, device="cpu")
    pairs = load_pairs(write_pairs(tmp_path / "pairs.jsonl", conversational=False))[:N]
    spread = head_family_view(model, pairs, 3)["summary"]["direction_cosine"]
    sides = {"chosen": [], "rejected": []}
    for batch in pair_batches(model, pairs, 2):
        for side in sides:
            sides[side].append(readout_direction(model, getattr(batch, side))[0].double())
    c, r = (torch.nn.functional.normalize(torch.cat(v), dim=-1) for v in sides.values())
    every = torch.cat([c, r])
    mean = torch.nn.functional.normalize(every.mean(0), dim=0)
    assert spread["to_mean_direction"]["mean"] == pytest.approx(float((every @ mean).mean()), abs=1e-6)
    assert spread["to_mean_direction"]["min"] == pytest.approx(float((every @ mean).min()), abs=1e-6)
    assert spread["chosen_vs_rejected"]["mean"] == pytest.approx(float((c * r).sum(-1).mean()), abs=1e-6)
