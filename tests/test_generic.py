"""The generic hooked path against transformers on tiny random GPT-2 / GPT-NeoX / Phi-3 reward models (fp32).

Tolerances: rewards within 1e-4 of transformers; Σ components = reward within 1e-5 relative; a hook-based
readout patch equals a patch made directly on the transformers modules within 1e-5.
"""

import pytest
import torch
import transformers
from helpers import padded_batch, tiny_hf_model

from reward_lens import GenericHookedRewardModel, GenericLoadError, GenericPathError, HookedRewardModel

TOL = 1e-4
REL = 1e-5


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights away from 1, norm and linear biases away from 0 (GPT-2's ln_1/ln_f included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if "norm" in type(module).__name__.lower():
                if getattr(module, "weight", None) is not None:
                    module.weight.copy_(1.0 + 0.5 * torch.randn(module.weight.shape, generator=g))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(0.3 * torch.randn(module.bias.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith("bias") and p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def tiny(arch: str, seed: int = 0, **overrides):
    common = dict(vocab_size=97, num_labels=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "gpt2":  # learned positions, LayerNorm with bias, Conv1D
        cfg = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=128, **common)
        cls = transformers.GPT2ForSequenceClassification
    elif arch in ("neox", "neox_sequential"):  # parallel attention + MLP (or not), partial rotary
        cfg = transformers.GPTNeoXConfig(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=96,
            max_position_embeddings=128,
            use_parallel_residual=arch == "neox",
            **common,
        )
        cls = transformers.GPTNeoXForSequenceClassification
    elif arch == "phi3":  # fused qkv and gate_up, RMSNorm
        cfg = transformers.Phi3Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            **common,
        )
        cls = transformers.Phi3ForSequenceClassification
    elif arch == "gemma":  # embeddings scaled by sqrt(d_model) inside the forward, RMSNorm with (1 + w)
        cfg = transformers.GemmaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=128,
            **common,
        )
        cls = transformers.GemmaForSequenceClassification
    else:
        raise KeyError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomise(model, seed)
    return model


ARCHS = ["gpt2", "neox", "neox_sequential", "phi3", "gemma"]
RMS_ARCHS = ("phi3", "gemma")


@pytest.fixture(scope="module")
def hf():
    return {arch: tiny(arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def generic(hf):
    return {arch: HookedRewardModel.from_hf_model(m) for arch, m in hf.items()}


def hf_run(model, ids, mask, **kwargs):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=pos, **kwargs)


def test_unknown_architectures_load_generically(generic):
    for arch, model in generic.items():
        assert isinstance(model, GenericHookedRewardModel), arch
    assert (
        generic["gpt2"].cfg.normalization_type == "LNPre"
        and generic["phi3"].cfg.normalization_type == "RMSPre"
    )
    assert "hook_pos_embed" in generic["gpt2"].hook_dict and "hook_pos_embed" not in generic["neox"].hook_dict
    assert generic["gpt2"].cfg.module_map["layers"] == "transformer.h"
    assert generic["gemma"].cfg.norm_weight_offset == 1.0 and generic["phi3"].cfg.norm_weight_offset == 0.0
    assert (
        generic["neox"].cfg.module_map["attn"] == "attention"
        and generic["phi3"].cfg.module_map["attn"] == "self_attn"
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_rewards_and_hidden_states_match_transformers(hf, generic, arch, side):
    model = generic[arch]
    ids, mask = padded_batch([11, 6, 9], side)
    out = hf_run(hf[arch], ids, mask, output_hidden_states=True)
    rewards, cache = model.run_with_cache(ids, attention_mask=mask)
    assert rewards.shape == (3,)
    assert (rewards - out.logits[:, 0]).abs().max() < TOL
    for layer in range(model.cfg.n_layers - 1):  # transformers' last hidden state is after the final norm
        diff = (cache[f"blocks.{layer}.hook_resid_post"] - out.hidden_states[layer + 1]) * mask[..., None]
        assert diff.abs().max() < TOL, f"layer {layer}"


def components_at_readout(model, cache, readout):
    rows = torch.arange(len(readout))
    names = ["hook_embed"] + (["hook_pos_embed"] if "hook_pos_embed" in model.hook_dict else [])
    for l in range(model.cfg.n_layers):
        names += [f"blocks.{l}.hook_attn_out", f"blocks.{l}.hook_mlp_out"]
    return names, torch.stack([cache[n][rows, readout] for n in names])  # [component, batch, d_model]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fold_ln", [True, False])
def test_components_sum_to_the_reward(hf, arch, fold_ln):
    model = HookedRewardModel.from_hf_model(hf[arch], fold_ln=fold_ln)
    assert model.cfg.normalization_type == ("RMS" if arch in RMS_ARCHS else "LN") + ("Pre" if fold_ln else "")
    ids, mask = padded_batch([10, 7, 4], "right", seed=1)
    rewards, cache = model.run_with_cache(ids, attention_mask=mask)
    readout = model.readout_positions(ids, mask)
    names, comps = components_at_readout(model, cache, readout)
    scale = cache["ln_final.hook_scale"][torch.arange(3), readout]  # the real final-norm scale, [batch, 1]
    if arch not in RMS_ARCHS:  # LayerNorm: each component's mean is removed before dividing by the scale
        comps = comps - comps.mean(-1, keepdim=True)
    direction, bias = model.reward_direction, model.reward_bias
    terms = (comps / scale) @ direction  # [component, batch]
    err = (terms.sum(0) + bias - rewards).abs().max()
    assert err <= REL * rewards.abs().max(), (err, rewards)
    assert terms.abs().max() > 10 * REL  # the terms are not trivially zero
    if arch not in RMS_ARCHS:
        # The direction has mean zero, so the centering is implicit: un-centered components give the same sum.
        assert abs(direction.sum()) < 1e-5 * direction.abs().sum()
        _, raw = components_at_readout(model, cache, readout)
        assert ((raw / scale) @ direction).sum(0).add(bias).sub(
            rewards
        ).abs().max() <= REL * rewards.abs().max()
        # The LayerNorm bias is in the reward bias: with fold_ln=False the head's own bias is b_R alone.
        assert abs(bias - model.reward_head.b_R[0]) > 1e-3 or fold_ln
    # TransformerLens's own helpers read the same cache and config (centering for LN, the cached scale).
    stack = cache.apply_ln_to_stack(cache.decompose_resid(layer=None, return_labels=False), layer=None)
    tl_terms = stack[:, torch.arange(3), readout] @ direction
    assert tl_terms.shape[0] == len(names)
    assert (tl_terms.sum(0) + bias - rewards).abs().max() <= REL * rewards.abs().max()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("site", ["attn", "mlp"])
def test_readout_patch_equals_a_patch_made_on_the_transformers_modules(hf, generic, arch, site):
    model, reference = generic[arch], hf[arch]
    layer = 1
    target, tmask = padded_batch([9, 6], "right", seed=2)
    source, smask = padded_batch([7, 10], "right", seed=3)
    t_read, s_read = model.readout_positions(target, tmask), model.readout_positions(source, smask)
    _, src_cache = model.run_with_cache(source, attention_mask=smask)
    src = src_cache[f"blocks.{layer}.hook_{site}_out"][torch.arange(2), s_read]

    def patch(act, hook):
        act = act.clone()
        act[torch.arange(2), t_read] = src
        return act

    patched = model.run_with_hooks(
        target, attention_mask=tmask, fwd_hooks=[(f"blocks.{layer}.hook_{site}_out", patch)]
    )

    # Naive: the same patch done with plain torch hooks on transformers' own attention / MLP module.
    layers = {"gpt2": "transformer.h", "phi3": "model.layers", "gemma": "model.layers"}.get(
        arch, "gpt_neox.layers"
    )
    attn = {"gpt2": "attn", "phi3": "self_attn", "gemma": "self_attn"}.get(arch, "attention")
    module = reference.get_submodule(f"{layers}.{layer}.{attn if site == 'attn' else 'mlp'}")
    captured = {}

    def capture(mod, args, out):
        captured["out"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    def replace(mod, args, out):
        value = (out[0] if isinstance(out, tuple) else out).clone()
        value[torch.arange(2), t_read] = captured["out"][torch.arange(2), s_read]
        return (value,) + tuple(out[1:]) if isinstance(out, tuple) else value

    handle = module.register_forward_hook(capture)
    try:
        hf_run(reference, source, smask)
    finally:
        handle.remove()
    handle = module.register_forward_hook(replace)
    try:
        naive = hf_run(reference, target, tmask).logits[:, 0]
    finally:
        handle.remove()
    clean = model(target, attention_mask=tmask)
    assert (patched - clean).abs().max() > 1e-3  # the patch does something
    assert (patched - naive).abs().max() < REL * max(1.0, naive.abs().max().item())


@pytest.mark.parametrize("arch", ARCHS)
def test_resid_mid_on_sequential_layers_only(hf, generic, arch):
    model = generic[arch]
    parallel = arch == "neox"
    assert model.cfg.sequential_layers == [not parallel] * model.cfg.n_layers
    target, tmask = padded_batch([9, 6], "right", seed=5)
    source, smask = padded_batch([8, 10], "right", seed=6)
    if parallel:
        with pytest.raises(GenericPathError, match="parallel"):
            model.run_with_cache(target, attention_mask=tmask, names_filter=["blocks.1.hook_resid_mid"])
        return
    _, cache = model.run_with_cache(target, attention_mask=tmask)
    mid = cache["blocks.1.hook_resid_pre"] + cache["blocks.1.hook_attn_out"]
    assert torch.equal(cache["blocks.1.hook_resid_mid"], mid)
    # Patching resid_mid at the readout = adding (source mid - target resid_pre) there in place of attn_out.
    t_read, s_read = model.readout_positions(target, tmask), model.readout_positions(source, smask)
    _, src_cache = model.run_with_cache(source, attention_mask=smask)
    src_mid = src_cache["blocks.1.hook_resid_mid"][torch.arange(2), s_read]

    def patch(act, hook):
        act = act.clone()
        act[torch.arange(2), t_read] = src_mid
        return act

    patched = model.run_with_hooks(
        target, attention_mask=tmask, fwd_hooks=[("blocks.1.hook_resid_mid", patch)]
    )
    layers = {"gpt2": "transformer.h", "phi3": "model.layers", "gemma": "model.layers"}.get(
        arch, "gpt_neox.layers"
    )
    attn = {"gpt2": "attn", "phi3": "self_attn", "gemma": "self_attn"}.get(arch, "attention")
    module = hf[arch].get_submodule(f"{layers}.1.{attn}")
    pre = cache["blocks.1.hook_resid_pre"][torch.arange(2), t_read]

    def replace(mod, args, out):
        value = (out[0] if isinstance(out, tuple) else out).clone()
        value[torch.arange(2), t_read] = src_mid - pre
        return (value,) + tuple(out[1:]) if isinstance(out, tuple) else value

    handle = module.register_forward_hook(replace)
    try:
        naive = hf_run(hf[arch], target, tmask).logits[:, 0]
    finally:
        handle.remove()
    assert (patched - model(target, attention_mask=tmask)).abs().max() > 1e-3
    assert (patched - naive).abs().max() < REL * max(1.0, naive.abs().max().item())


def test_sum_rule_violation_is_refused_naming_the_layer():
    model = tiny("gpt2")
    block = model.transformer.h[1]
    original = block.forward

    def scaled_residual(hidden_states, *args, **kwargs):  # e.g. a residual multiplier: not resid + attn + mlp
        return original(hidden_states, *args, **kwargs) + 0.5 * hidden_states

    block.forward = scaled_residual
    with pytest.raises(GenericLoadError, match=r"layer 1 \(transformer\.h\.1, GPT2Block\) is not resid_post"):
        GenericHookedRewardModel(model)


def test_transformed_embeddings_are_refused():
    model = tiny("gpt2")

    class Scale(torch.nn.Module):
        def forward(self, x):
            return 2.0 * x

    model.transformer.drop = Scale()  # between the embeddings and layer 0
    with pytest.raises(GenericLoadError, match="embedding output"):
        GenericHookedRewardModel(model)


def test_head_level_tools_raise_a_clear_error(generic):
    model = generic["gpt2"]
    with pytest.raises(GenericPathError, match="native"):
        model.blocks[0].attn.W_O  # noqa: B018  (the attribute access raises)
    assert not hasattr(model.blocks[0], "attn")
    with pytest.raises(GenericPathError, match="native"):
        model.W_O  # noqa: B018  (the attribute access raises)
    with pytest.raises(GenericPathError, match="native"):
        model.accumulated_bias(1)
    with pytest.raises(GenericPathError, match="native"):
        model.set_use_attn_result(True)
    ids, mask = padded_batch([5], "right")
    with pytest.raises(GenericPathError, match="native"):
        model.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_z", lambda a, hook: a)])
    with pytest.raises(GenericPathError, match="native"):
        model.run_with_cache(ids, names_filter=["blocks.1.attn.hook_z"])
    with pytest.raises(GenericPathError, match="native"):
        model.run_with_cache(ids, readout_only=True, names_filter=["blocks.1.mlp.hook_post"])
    with pytest.raises(KeyError, match="hook points"):
        model.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_typo", lambda a, hook: a)])


@pytest.mark.parametrize("arch", ["gpt2", "gemma"])
def test_start_stop_layers_and_readout_cache(generic, arch):
    model = generic[arch]
    ids, mask = padded_batch([8, 5], "right", seed=4)
    rewards, cache = model.run_with_cache(ids, attention_mask=mask)
    for layer in (0, 2, model.cfg.n_layers):
        name = f"blocks.{layer}.hook_resid_pre" if layer < model.cfg.n_layers else "blocks.2.hook_resid_post"
        resid = model(ids, attention_mask=mask, stop_at_layer=layer)
        assert torch.allclose(resid, cache[name], atol=1e-6)
        resumed = model(resid, attention_mask=mask, start_at_layer=layer, input_ids=ids)
        assert torch.allclose(resumed, rewards, atol=1e-6)
    out, small = model.run_with_cache(ids, attention_mask=mask, readout_only=True)
    readout = model.readout_positions(ids, mask)
    assert torch.allclose(out, rewards)
    for name in ("blocks.1.hook_attn_out", "ln_final.hook_scale", "hook_embed"):
        assert torch.equal(small[name][:, 0], cache[name][torch.arange(2), readout])


def test_from_pretrained_dispatch_and_round_trip(tmp_path):
    gpt2 = tiny("gpt2")
    gpt2.save_pretrained(tmp_path / "gpt2")
    model = HookedRewardModel.from_pretrained(tmp_path / "gpt2")  # no native weight map: generic
    assert isinstance(model, GenericHookedRewardModel)
    ids, mask = padded_batch([6, 4], "right")
    assert (model(ids, attention_mask=mask) - hf_run(gpt2, ids, mask).logits[:, 0]).abs().max() < TOL

    llama = tiny_hf_model("llama")
    llama.save_pretrained(tmp_path / "llama")
    assert not isinstance(HookedRewardModel.from_pretrained(tmp_path / "llama"), GenericHookedRewardModel)
    forced = HookedRewardModel.from_pretrained(tmp_path / "llama", generic=True)
    assert isinstance(forced, GenericHookedRewardModel)
    assert isinstance(HookedRewardModel.from_hf_model(llama, generic=True), GenericHookedRewardModel)
    expected = hf_run(llama, ids, mask).logits[:, 0]
    assert (forced(ids, attention_mask=mask) - expected).abs().max() < TOL
    forced.save_pretrained(tmp_path / "saved")  # reloads on the generic path (marker file)
    again = HookedRewardModel.from_pretrained(tmp_path / "saved")
    assert isinstance(again, GenericHookedRewardModel)
    assert (again(ids, attention_mask=mask) - expected).abs().max() < TOL

    lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    lm.save_pretrained(tmp_path / "lm")
    with pytest.raises(
        ValueError, match="(?s)supported: .*LlamaForSequenceClassification.*Generic loading was tried"
    ):
        HookedRewardModel.from_pretrained(tmp_path / "lm")
    with pytest.raises(GenericLoadError, match="not a sequence-classification model"):
        HookedRewardModel.from_hf_model(lm)


def test_from_hf_model_copies_unless_asked(hf):
    original = hf["phi3"]
    GenericHookedRewardModel.from_hf_model(original)
    assert not original.model.layers[0]._forward_pre_hooks  # the caller's model is left untouched
    shared = GenericHookedRewardModel.from_hf_model(tiny("phi3"), copy=False)
    assert shared.hf_model.model.layers[0]._forward_pre_hooks


def test_bfloat16_load(hf):
    model = HookedRewardModel.from_hf_model(hf["gpt2"], dtype="bfloat16")
    assert model.cfg.dtype == torch.bfloat16
    ids, mask = padded_batch([7, 5], "right")
    rewards = model(ids, attention_mask=mask).float()
    expected = hf_run(hf["gpt2"], ids, mask).logits[:, 0]
    assert (rewards - expected).abs().max() < 5e-2 * max(1.0, expected.abs().max().item())
