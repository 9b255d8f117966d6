"""The hooked model's contract: exact decomposition, TransformerLens tools unchanged, forward options."""

import json

import pytest
import torch
import transformer_lens.patching as tl_patching
from helpers import padded_batch, tiny_hf_model
from transformer_lens import ActivationCache

from reward_lens import HookedRewardModel
from reward_lens.converters import supported_architectures

REL = 1e-5


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


@pytest.mark.parametrize("fold_ln", [True, False])
def test_exact_decomposition_at_readout(llama_hf, fold_ln):
    model = HookedRewardModel.from_hf_model(llama_hf, fold_ln=fold_ln)
    ids, mask = padded_batch([11, 6, 9], "right")
    rewards, cache = model.run_with_cache(ids, attention_mask=mask)
    ro = model.readout_positions(ids, mask)
    b = torch.arange(len(ro))
    parts = [cache["hook_embed"]] + [
        cache[f"blocks.{l}.hook_{k}_out"] for l in range(model.cfg.n_layers) for k in ("attn", "mlp")
    ]
    resid = torch.stack(parts).sum(0)[b, ro]
    scale = cache["ln_final.hook_scale"][b, ro]
    recon = (resid / scale) @ model.reward_direction + model.reward_bias
    assert rel_err(recon, rewards) < REL
    # TransformerLens's own cache methods agree with that.
    stack = cache.decompose_resid(apply_ln=True)[:, b, ro]  # [components, batch, d_model]
    assert rel_err(stack.sum(0) @ model.reward_direction + model.reward_bias, rewards) < REL
    acc = cache.accumulated_resid(apply_ln=False)[-1][b, ro]
    assert rel_err(acc, cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][b, ro]) < REL
    heads = cache.stack_head_results(apply_ln=True)[:, b, ro] @ model.reward_direction
    attn_total = sum(
        (cache[f"blocks.{l}.hook_attn_out"][b, ro] / scale) @ model.reward_direction
        for l in range(model.cfg.n_layers)
    )
    assert rel_err(heads.sum(0), attn_total) < REL  # no attention output bias in Llama


def test_cache_is_a_transformer_lens_activation_cache(llama_model):
    ids, mask = padded_batch([5, 4], "right")
    _, cache = llama_model.run_with_cache(
        ids, attention_mask=mask, names_filter=lambda n: n.endswith("resid_post")
    )
    assert isinstance(cache, ActivationCache)
    assert set(cache.keys()) == {f"blocks.{l}.hook_resid_post" for l in range(llama_model.cfg.n_layers)}


def test_reward_head_hooks(llama_model):
    ids, mask = padded_batch([7, 3], "right")
    rewards, cache = llama_model.run_with_cache(ids, attention_mask=mask)
    per_pos = cache["reward_head.hook_rewards"]
    assert per_pos.shape == (2, 7, 1)
    assert torch.allclose(cache["reward_head.hook_pooled"][:, 0], rewards)
    assert torch.allclose(per_pos[torch.arange(2), llama_model.readout_positions(ids, mask), 0], rewards)


def test_transformer_lens_patching_runs_and_matches_manual_patch(llama_model):
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, 97, (1, 6), generator=g)
    corrupt = clean.clone()
    corrupt[0, 2] = (corrupt[0, 2] + 5) % 96 + 1
    _, clean_cache = llama_model.run_with_cache(clean)
    metric = lambda rewards: rewards.sum()  # noqa: E731
    resid = tl_patching.get_act_patch_resid_pre(llama_model, corrupt, clean_cache, metric)
    heads = tl_patching.get_act_patch_attn_head_out_by_pos(llama_model, corrupt, clean_cache, metric)
    every = tl_patching.get_act_patch_block_every(llama_model, corrupt, clean_cache, metric)
    n_layers, n_heads = llama_model.cfg.n_layers, llama_model.cfg.n_heads
    assert (
        resid.shape == (n_layers, 6)
        and heads.shape == (n_layers, 6, n_heads)
        and every.shape == (3, n_layers, 6)
    )

    def patch_z(z, hook):
        z[:, 3, 1] = clean_cache["blocks.1.attn.hook_z"][:, 3, 1]
        return z

    manual = llama_model.run_with_hooks(corrupt, fwd_hooks=[("blocks.1.attn.hook_z", patch_z)]).sum()
    assert torch.allclose(heads[1, 3, 1], manual, atol=1e-6)

    def patch_resid(r, hook):
        r[:, 2] = clean_cache["blocks.2.hook_resid_pre"][:, 2]
        return r

    manual = llama_model.run_with_hooks(corrupt, fwd_hooks=[("blocks.2.hook_resid_pre", patch_resid)]).sum()
    assert torch.allclose(resid[2, 2], manual, atol=1e-6)
    assert torch.allclose(every[0], resid)


def test_start_and_stop_at_layer_compose(llama_model):
    ids, mask = padded_batch([8, 5], "left")
    full = llama_model(ids, attention_mask=mask)
    mid = llama_model(ids, attention_mask=mask, stop_at_layer=2)
    _, cache = llama_model.run_with_cache(ids, attention_mask=mask)
    assert torch.allclose(mid, cache["blocks.2.hook_resid_pre"])
    resumed = llama_model(mid, attention_mask=mask, start_at_layer=2, input_ids=ids)
    assert torch.allclose(resumed, full, atol=1e-6)


def test_readout_only_cache_keeps_one_position(llama_model):
    ids, mask = padded_batch([9, 4, 6], "right")
    rewards, full = llama_model.run_with_cache(ids, attention_mask=mask)
    r2, small = llama_model.run_with_cache(ids, attention_mask=mask, readout_only=True)
    ro = llama_model.readout_positions(ids, mask)
    b = torch.arange(3)
    assert torch.equal(rewards, r2)
    for name in ("hook_embed", "blocks.1.hook_resid_mid", "blocks.2.attn.hook_z", "ln_final.hook_scale"):
        assert small[name].shape[1] == 1
        assert torch.equal(small[name][:, 0], full[name][b, ro])
    pattern = small["blocks.0.attn.hook_pattern"]
    assert pattern.shape == (3, llama_model.cfg.n_heads, 1, 9)
    assert torch.equal(pattern[:, :, 0], full["blocks.0.attn.hook_pattern"][b, :, ro])
    # The decomposition works on the readout-only cache too.
    stack = small.decompose_resid(apply_ln=True)[:, :, 0]
    assert rel_err(stack.sum(0) @ llama_model.reward_direction + llama_model.reward_bias, rewards) < REL


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_fused_attention_equals_explicit_path(hf_models, arch):
    model = HookedRewardModel.from_hf_model(hf_models[arch])
    ids, mask = padded_batch([12, 5], "left")
    fused = model(ids, attention_mask=mask)
    # Any hook on the pattern forces the explicit softmax path.
    explicit = model.run_with_hooks(
        ids, attention_mask=mask, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda x, hook: x)]
    )
    assert (fused - explicit).abs().max() < 1e-5


def test_use_attn_result_gives_per_head_outputs(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf)
    ids, mask = padded_batch([6, 6], "right")
    base = model(ids, attention_mask=mask)
    model.set_use_attn_result(True)
    out, cache = model.run_with_cache(ids, attention_mask=mask)
    assert cache["blocks.0.attn.hook_result"].shape == (2, 6, model.cfg.n_heads, model.cfg.d_model)
    assert torch.allclose(
        cache["blocks.0.attn.hook_result"].sum(2) + model.blocks[0].attn.b_O,
        cache["blocks.0.hook_attn_out"],
        atol=1e-6,
    )
    assert torch.allclose(out, base, atol=1e-6)


def test_save_and_reload_hooked_checkpoint(llama_model, tmp_path):
    llama_model.save_pretrained(tmp_path / "hooked")
    cfg = json.loads((tmp_path / "hooked" / "reward_lens_config.json").read_text())
    assert cfg["normalization_type"] == "RMSPre"
    again = HookedRewardModel.from_pretrained(tmp_path / "hooked")
    ids, mask = padded_batch([7, 4], "right")
    assert torch.equal(again(ids, attention_mask=mask), llama_model(ids, attention_mask=mask))


def test_from_pretrained_reads_a_transformers_directory(tmp_path):
    hf = tiny_hf_model("qwen2", seed=3)
    hf.save_pretrained(tmp_path / "hf")
    model = HookedRewardModel.from_pretrained(tmp_path / "hf")
    assert model.tokenizer is None
    ids, mask = padded_batch([10, 3], "right")
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits[:, 0]
    assert (model(ids, attention_mask=mask) - ref).abs().max() < 1e-4
    with pytest.raises(ValueError, match="no tokenizer"):
        model.to_tokens(["a"], ["b"])


def test_unknown_architecture_lists_supported(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    cfg.architectures = ["FancyNewForSequenceClassification"]
    from reward_lens.loading.checkpoint import convert_state_dict

    with pytest.raises(ValueError) as err:
        convert_state_dict(HookedRewardModel, cfg, {})
    for arch in supported_architectures():
        assert arch in str(err.value)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        HookedRewardModel.from_pretrained(tmp_path / "nope")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_fp32(llama_hf, dtype):
    ref = HookedRewardModel.from_hf_model(llama_hf)
    model = HookedRewardModel.from_hf_model(llama_hf, dtype=dtype)
    assert model.cfg.dtype == dtype and model.blocks[0].attn.W_Q.dtype == dtype
    assert model.rotary.inv_freq.dtype == torch.float32  # RoPE frequencies are never rounded
    ids, mask = padded_batch([8, 5], "right")
    out = model(ids, attention_mask=mask)
    assert out.dtype == dtype
    assert (out.float() - ref(ids, attention_mask=mask)).abs().max() < 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU machine)")
def test_cuda_bf16_parity(llama_hf):
    model = HookedRewardModel.from_hf_model(llama_hf, device="cuda", dtype=torch.bfloat16)
    ids, mask = padded_batch([8, 5], "right")
    ref = HookedRewardModel.from_hf_model(llama_hf)(ids, attention_mask=mask)
    out = model(ids.cuda(), attention_mask=mask.cuda())
    assert out.device.type == "cuda"
    assert (out.float().cpu() - ref).abs().max() < 0.05


def test_hook_names_are_transformer_lens_names(llama_model):
    names = set(llama_model.hook_dict)
    required = [
        "hook_embed",
        "ln_final.hook_scale",
        "ln_final.hook_normalized",
        "reward_head.hook_rewards",
        "reward_head.hook_pooled",
    ]
    for l in range(llama_model.cfg.n_layers):
        required += [
            f"blocks.{l}.{h}"
            for h in (
                "hook_resid_pre",
                "hook_resid_mid",
                "hook_resid_post",
                "hook_attn_out",
                "hook_mlp_out",
                "ln1.hook_scale",
                "ln1.hook_normalized",
                "ln2.hook_scale",
                "ln2.hook_normalized",
                "mlp.hook_pre",
                "mlp.hook_post",
            )
        ]
        required += [
            f"blocks.{l}.attn.{h}"
            for h in (
                "hook_q",
                "hook_k",
                "hook_v",
                "hook_z",
                "hook_attn_scores",
                "hook_pattern",
                "hook_result",
            )
        ]
    assert not set(required) - names
