"""Reward editing: projecting a concept out of the head or the residual, verification on held-out probes,
and the export round trip through transformers (the exported checkpoint gives the edited rewards)."""

import pytest
import torch
from organism import concept_items, organism, quality_pairs, single_thread, tiny_armorm  # noqa: F401

from reward_lens import HookedRewardModel, concept_vector, edit_reward, export_hf

TOL = 1e-4  # fp32: exported transformers model vs edited hooked model


@pytest.fixture(scope="module")
def concept():
    return concept_vector(organism().model, concept_items(40))


def test_head_edit_removes_the_concept_and_keeps_accuracy(concept):
    o = organism()
    w_before = o.model.reward_direction.clone()
    ed = edit_reward(o.model, concept, pairs=quality_pairs(24))
    v = concept.vector(2)
    assert ed.where == "head" and ed.n_probes == 10 and ed.n_pairs == 24
    assert ed.effect_before == pytest.approx(o.beta_u * o.c_u / 0.77, rel=0.1)  # ~beta_u c_u / s
    assert ed.effect_reduction > 0.95 and ed.accuracy_before == 1.0 and ed.accuracy_after == 1.0
    assert ed.verified
    w_after = ed.model.reward_direction
    assert abs(float(w_after @ v)) < 1e-5 * float(w_before.norm())
    assert torch.allclose(w_after, w_before - (w_before @ v) * v, atol=1e-6)  # nothing else changed
    assert torch.equal(o.model.reward_direction, w_before)  # the original is untouched
    frame = ed.to_frame()
    assert list(frame["metric"]) == ["concept_effect", "pair_accuracy"] and ed.plot().axes


def test_residual_edit_zeroes_the_direction_at_that_layer(concept):
    o = organism()
    ed = edit_reward(o.model, concept, where=1, pairs=quality_pairs(24))
    v = concept.vector(1)
    items = concept_items(6, seed=8)
    tok = o.model.to_tokens([it.prompt for it in items], [it.positive for it in items])
    _, cache = ed.model.run_with_cache(tok["input_ids"], attention_mask=tok["attention_mask"])
    along = cache["blocks.1.hook_resid_post"] @ v
    assert float(along.abs().max()) < 1e-5 * float(cache["blocks.1.hook_resid_post"].norm(dim=-1).max())
    _, clean = o.model.run_with_cache(tok["input_ids"], attention_mask=tok["attention_mask"])
    assert float((clean["blocks.1.hook_resid_post"] @ v).abs().max()) > 0.5  # it was there before
    assert torch.equal(ed.model.blocks[2].attn.W_O, o.model.blocks[2].attn.W_O)  # later blocks untouched
    assert ed.where == "resid L1" and ed.verified and ed.effect_reduction > 0.95 and ed.accuracy_after == 1.0


@pytest.mark.parametrize("where", ["head", 1])
def test_export_round_trip_gives_the_edited_rewards(concept, tmp_path, where):
    from transformers import LlamaForSequenceClassification

    o = organism()
    ed = edit_reward(o.model, concept, where=where)
    path = ed.export(tmp_path / "edited", hf_config=o.hf.config)
    hf = LlamaForSequenceClassification.from_pretrained(path).eval()
    items = concept_items(8, seed=12)
    tok = o.model.to_tokens([it.prompt for it in items], [it.positive for it in items])
    with torch.no_grad():
        exported = hf(**tok).logits[:, 0]
    edited = ed.model(tok["input_ids"], attention_mask=tok["attention_mask"])
    original = o.model(tok["input_ids"], attention_mask=tok["attention_mask"])
    assert (exported - edited).abs().max() < TOL
    assert (exported - original).abs().min() > 0.5  # the concept's reward really is gone from the checkpoint
    assert (path / "tokenizer.json").exists() and (path / "config.json").exists()


def test_export_unfolded_norms_default_rope_and_qkv_biases(tmp_path):
    """Inverse map with norm weights kept (fold_ln=False), RoPE inferred, q/k/v biases: a Qwen2 model
    exported as Llama gives the original transformers Qwen2 model's rewards."""
    from helpers import padded_batch, tiny_hf_model
    from organism import VOCAB
    from transformers import LlamaForSequenceClassification

    qwen = tiny_hf_model(
        "qwen2", vocab_size=len(VOCAB), use_sliding_window=False, layer_types=["full_attention"] * 3
    )
    ids, mask = padded_batch([9, 5, 7], "right")
    with torch.no_grad():
        reference = qwen(ids, attention_mask=mask).logits[:, 0]
    for fold in (False, True):
        model = HookedRewardModel.from_hf_model(qwen, fold_ln=fold)
        path = export_hf(model, tmp_path / f"q{fold}")
        llama = LlamaForSequenceClassification.from_pretrained(path).eval()
        assert llama.config.attention_bias and bool(
            llama.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
        )
        with torch.no_grad():
            assert (llama(ids, attention_mask=mask).logits[:, 0] - reference).abs().max() < TOL
    # A head edit on the unfolded model divides by the final norm's weight and still exports exactly.
    model = HookedRewardModel.from_hf_model(qwen, fold_ln=False)
    v = torch.randn(64, generator=torch.Generator().manual_seed(0))
    model.tokenizer = (
        organism().tokenizer
    )  # the same vocabulary size; probes only feed the effect numbers here
    ed = edit_reward(model, v, probes=concept_items(4))
    assert abs(float(ed.model.reward_direction @ (v / v.norm()))) < 1e-5
    llama = LlamaForSequenceClassification.from_pretrained(ed.export(tmp_path / "edited")).eval()
    with torch.no_grad():
        assert (
            llama(ids, attention_mask=mask).logits[:, 0] - ed.model(ids, attention_mask=mask)
        ).abs().max() < TOL


def test_armorm_head_edit_blinds_every_reader(tmp_path):
    m = tiny_armorm(str(tmp_path))
    v = torch.randn(m.cfg.d_model, generator=torch.Generator().manual_seed(3))
    v = v / v.norm()
    ed = edit_reward(m, v, probes=concept_items(4))
    head = ed.model.reward_head
    assert float((head.W_reg.T @ v).abs().max()) < 1e-5  # every objective (folded norm: W reads resid/s)
    assert float((head.W_gate[0].T @ v).abs().max()) < 1e-5  # and the gate's first layer
    assert not torch.equal(m.reward_head.W_reg, head.W_reg)  # the original is untouched
    with pytest.raises(ValueError, match="cannot export"):
        ed.export(tmp_path / "x")


def test_clear_errors(concept, tmp_path):
    from helpers import tiny_hf_model

    o = organism()
    with pytest.raises(ValueError, match="RoPE"):
        export_hf(o.model, tmp_path / "rope")  # llama3-scaled RoPE needs the original config
    mistral = HookedRewardModel.from_hf_model(tiny_hf_model("mistral"))
    with pytest.raises(ValueError, match="sliding-window"):
        export_hf(mistral, tmp_path / "m")
    with pytest.raises(ValueError, match="probes"):
        edit_reward(o.model, o.u)
    with pytest.raises(ValueError, match="where"):
        edit_reward(o.model, concept, where="mlp")
    with pytest.raises(ValueError, match="out of range"):
        edit_reward(o.model, concept, where=7)
