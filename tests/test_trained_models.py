"""Reward models straight out of training stacks: `from_hf_model(trainer.model)` right after a real TRL
RewardTrainer run (TRL's default config: bf16=True, i.e. accelerate's CPU bf16 autocast wrapped around
`forward`; the in-memory config still says LlamaForCausalLM), and PEFT LoRA adapter directories.

Tolerances (fp32): hooked rewards vs transformers' fp32 forward within 1e-4 (native, norms folded) and
1e-5 for the PEFT merge; storage sharing and weight edits are checked exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import one_thread, padded_batch, randomise_norms, tiny_tokenizer  # noqa: F401

from reward_lens import GenericHookedRewardModel, HookedRewardModel

trl = pytest.importorskip("trl")  # in the test extras; the skip only guards a bare install


def llama_config(**overrides):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        rms_norm_eps=1e-5,
        **overrides,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A few TRL RewardTrainer steps from a saved causal-LM base, TRL's default precision settings."""
    import datasets
    import transformers

    root = tmp_path_factory.mktemp("trl")
    tok = tiny_tokenizer(vocab_size=96)
    tok.add_special_tokens({"eos_token": "[EOS]"})  # id 96: TRL appends EOS to standard data
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama_config())
    randomise_norms(base)
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    rows = [
        {"prompt": "what is the answer ?", "chosen": " the answer is yes .", "rejected": " no ."},
        {"prompt": "is it good ?", "chosen": " it is good", "rejected": " it is not good , no"},
    ] * 4
    args = trl.RewardConfig(
        output_dir=str(root / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        learning_rate=1e-2,
        disable_tqdm=True,
    )
    trainer = trl.RewardTrainer(
        model=str(root / "base"),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
    )
    trainer.train()
    return trainer, tok


def fp32_reference(hf_model, ids, mask):
    """transformers' own forward (the class's, not accelerate's wrapper), no autocast, cumsum position ids."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        return type(hf_model).forward(hf_model, ids, attention_mask=mask, position_ids=pos).logits[:, 0]


def storages(module: torch.nn.Module) -> set:
    tensors = list(module.parameters()) + list(module.buffers())
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def test_trainer_model_right_after_training(trained):
    trainer, tok = trained
    hf = trainer.model
    # The situation of the issue, reproduced: TRL's defaults wrap forward in bf16 autocast, config is stale.
    assert args_bf16(trainer) and "_original_forward" in hf.__dict__
    assert hf.config.architectures == ["LlamaForCausalLM"]
    ids, mask = padded_batch([4, 7, 2], "left", vocab=97)
    ref = fp32_reference(hf, ids, mask)
    wrapped = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0]
    assert (wrapped.float() - ref).abs().max() > 1e-5  # the autocast forward really is a different number

    hooked = HookedRewardModel.from_hf_model(hf, tok)
    assert type(hooked) is HookedRewardModel  # the native map, chosen by the module's class
    assert hooked.cfg.original_architecture == "LlamaForSequenceClassification"
    assert (hooked(ids, attention_mask=mask) - ref).abs().max() < 1e-4

    generic = HookedRewardModel.from_hf_model(hf, tok, generic=True)  # its parity check runs in fp32
    assert isinstance(generic, GenericHookedRewardModel)
    assert (generic(ids, attention_mask=mask) - ref).abs().max() < 1e-4
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an enclosing autocast does not reach the check
        HookedRewardModel.from_hf_model(hf, tok, generic=True)
    assert "_original_forward" in hf.__dict__  # the user's model is left as it was


def args_bf16(trainer) -> bool:
    return bool(trainer.args.bf16) and trainer.accelerator.mixed_precision == "bf16"


def test_no_shared_storage_and_hf_edits_do_not_leak(trained):
    trainer, tok = trained
    hf = trainer.model
    ids, mask = padded_batch([5, 3], "left", vocab=97)
    hooked = HookedRewardModel.from_hf_model(hf, tok, fold_ln=False)  # unfolded: most tensors could alias
    generic = HookedRewardModel.from_hf_model(hf, tok, generic=True)
    assert not storages(hooked) & storages(hf)
    assert not storages(generic) & storages(hf)
    before, before_generic = hooked(ids, attention_mask=mask), generic(ids, attention_mask=mask)
    saved = copy.deepcopy(hf.state_dict())
    try:
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(-0.5)
        assert (fp32_reference(hf, ids, mask) - before).abs().max() > 1e-3  # the edit changes HF's reward
        assert torch.equal(hooked(ids, attention_mask=mask), before)
        assert torch.equal(generic(ids, attention_mask=mask), before_generic)
    finally:
        hf.load_state_dict(saved)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """A LoRA reward-model adapter as PEFT saves it, on a saved LlamaForSequenceClassification base."""
    import peft
    import transformers

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(1)
    base = transformers.LlamaForSequenceClassification(llama_config(num_labels=1))
    randomise_norms(base, 1)
    base.save_pretrained(root / "base")
    base = transformers.LlamaForSequenceClassification.from_pretrained(
        root / "base"
    )  # name_or_path = the dir
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
    )
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # "training": random updates of the LoRA factors and the saved score head
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "adapter")
    merged = copy.deepcopy(model).merge_and_unload().eval()
    return root / "adapter", model, merged


def test_peft_adapter_directory_loads_merged(lora_dir):
    adapter, peft_model, merged = lora_dir
    assert not (adapter / "config.json").exists()
    ids, mask = padded_batch([6, 2, 4], "left", vocab=97)
    ref = fp32_reference(merged, ids, mask)
    hooked = HookedRewardModel.from_pretrained(adapter)
    assert (hooked(ids, attention_mask=mask) - ref).abs().max() < 1e-5
    # The adapter really moved the rewards (the base alone would fail this test).
    base_only = HookedRewardModel.from_pretrained(adapter.parent / "base")
    assert (base_only(ids, attention_mask=mask) - ref).abs().max() > 1e-3
    # The same adapter in memory, unmerged: merged into a copy, the PeftModel left untouched.
    in_memory = HookedRewardModel.from_hf_model(peft_model)
    assert (in_memory(ids, attention_mask=mask) - ref).abs().max() < 1e-5
    assert hasattr(peft_model, "peft_config") and not storages(in_memory) & storages(peft_model)


def test_peft_missing_gives_one_clear_error(lora_dir, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(ImportError, match="PEFT.*merge_and_unload"):
        HookedRewardModel.from_pretrained(lora_dir[0])
    from reward_lens.app.cli import main

    assert main(["audit", "--model", str(lora_dir[0]), "--max-pairs", "2"]) == 2  # one line, no traceback
    assert "PEFT" in capsys.readouterr().err
