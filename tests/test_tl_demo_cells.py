"""Cells of TransformerLens's Main Demo, Exploratory Analysis Demo and Activation Patching Demo, as a user
ports them to the demo RM: the tutorial code as written, with only the model, the tokens (a mixed-length,
left-padded batch passed without a mask) and the metric (the reward) swapped. Each number is checked against
an independent computation (each row alone, the cache, or the weights); fp32, tolerance 1e-5.

Cells with no reward-model analogue (generation, vocabulary logits, other TL models) are listed in the
README's "No analogue" list.
"""

from __future__ import annotations

import warnings
from functools import partial

import einops
import pytest
import torch
import transformer_lens.patching as patching
import transformer_lens.utilities as utils

from reward_lens.demo import demo_pairs, load_demo_model

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    model = load_demo_model(device="cpu", dtype="float32")
    model.enable_compatibility_mode(disable_warnings=True)  # the demos' first cell
    return model


@pytest.fixture(scope="module")
def ioi(model):
    """The Activation Patching batch: clean rows, corrupted = adjacent rows swapped (lengths differ)."""
    pairs = [p for p in demo_pairs() if p.subset == "arithmetic"][:4]
    clean_tokens = model.to_tokens([p.prompt for p in pairs], [p.chosen for p in pairs])["input_ids"]
    corrupted_tokens = clean_tokens[[(i + 1 if i % 2 == 0 else i - 1) for i in range(len(clean_tokens))]]
    return clean_tokens, corrupted_tokens


def alone(model, ids):
    pad = model.cfg.pad_token_id
    return torch.stack([model(row[(row != pad).long().cumsum(0) > 0][None])[0] for row in ids])


def test_compatibility_mode_changes_nothing(model, ioi):
    clean_tokens, _ = ioi
    before = model(clean_tokens)
    model.enable_compatibility_mode(
        center_unembed=True,
        center_writing_weights=True,
        fold_ln=True,
        disable_warnings=True,
        refactor_factored_attn_matrices=True,
    )
    assert torch.equal(model(clean_tokens), before)
    with pytest.warns(UserWarning, match="refactor_factored_attn_matrices"):
        model.enable_compatibility_mode(refactor_factored_attn_matrices=True)


# --------------------------------------------------------------------------- Main Demo
def test_main_demo_induction_scores_with_return_type_none(model, ioi):
    clean_tokens, _ = ioi
    seq_len = 6
    repeated_tokens = torch.cat([clean_tokens[:, -seq_len:]] * 2, dim=1)
    induction_score_store = torch.zeros((model.cfg.n_layers, model.cfg.n_heads), device=model.cfg.device)

    def induction_score_hook(pattern, hook):
        induction_stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - seq_len)
        induction_score = einops.reduce(induction_stripe, "batch head_index position -> head_index", "mean")
        induction_score_store[hook.layer(), :] = induction_score

    pattern_hook_names_filter = lambda name: name.endswith("pattern")  # noqa: E731
    out = model.run_with_hooks(
        repeated_tokens, return_type=None, fwd_hooks=[(pattern_hook_names_filter, induction_score_hook)]
    )
    assert out is None
    _, cache = model.run_with_cache(repeated_tokens)
    for layer in range(model.cfg.n_layers):
        stripe = cache["pattern", layer].diagonal(dim1=-2, dim2=-1, offset=1 - seq_len).mean((0, -1))
        assert torch.allclose(induction_score_store[layer], stripe, atol=TOL)


def test_main_demo_hook_listing_with_return_type_none(model, ioi):
    clean_tokens, _ = ioi
    printed = []

    def print_name_shape_hook_function(activation, hook):
        printed.append((hook.name, tuple(activation.shape)))

    not_in_late_block_filter = lambda name: (  # noqa: E731
        name.startswith("blocks.0.") or not name.startswith("blocks")
    )
    model.run_with_hooks(
        clean_tokens, return_type=None, fwd_hooks=[(not_in_late_block_filter, print_name_shape_hook_function)]
    )
    names = [n for n, _ in printed]
    assert names[0] == "hook_embed" and names[-1] == "ln_final.hook_normalized"  # TL: ln_final before None
    assert "ln_final.hook_scale" in names and not any(n.startswith("reward_head") for n in names)
    assert len(names) == len(set(names))


def test_main_demo_head_ablation_on_v(model, ioi):
    clean_tokens, _ = ioi
    layer_to_ablate, head_index_to_ablate = 0, 1

    def head_ablation_hook(value, hook):
        value[:, :, head_index_to_ablate, :] = 0.0
        return value

    ablated = model.run_with_hooks(
        clean_tokens, fwd_hooks=[(utils.get_act_name("v", layer_to_ablate), head_ablation_hook)]
    )
    # independently: the kv head's value is zero, so the query heads it serves write only b_O
    group = model.cfg.n_heads // model.cfg.n_key_value_heads
    served = list(range(head_index_to_ablate * group, (head_index_to_ablate + 1) * group))

    def zero_z(z, hook):
        z[:, :, served] = 0.0
        return z

    z_name = utils.get_act_name("z", layer_to_ablate)
    expected = model.run_with_hooks(clean_tokens, fwd_hooks=[(z_name, zero_z)])
    assert torch.allclose(ablated, expected, atol=TOL)
    assert not torch.allclose(ablated, model(clean_tokens), atol=1e-3)


def test_main_demo_token_helpers(model):
    """Cells 34-37 with the demo vocabulary's words (" is" is one token, as " cat" is in GPT-2's)."""
    tok = model.tokenizer
    short, text = "What is 4 times 3", "What is 4 times 3? That is 12."
    with_bos = model.get_token_position(" is", short)
    without_bos = model.get_token_position(" is", short, prepend_bos=False)
    ids = tok(short, add_special_tokens=False)["input_ids"]
    assert without_bos == ids.index(model.to_single_token(" is")) and with_bos == without_bos + 1
    first = model.get_token_position(" is", text, mode="first")
    last = model.get_token_position(" is", text, mode="last")
    full = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    token = model.to_single_token(" is")
    assert first == full.index(token) and last == len(full) - 1 - full[::-1].index(token) and last > first
    str_tokens = model.to_str_tokens("2342+2017=21445")
    assert str_tokens[0] == tok.bos_token and "".join(str_tokens[1:]) == "2342+2017=21445"
    assert model.to_str_tokens(" Claire", prepend_bos=False)[0] != tok.bos_token
    assert model.to_string(77) == tok.decode([77])


# --------------------------------------------------------------------------- Exploratory Analysis Demo
def test_exploratory_demo_direct_path_to_queries(model, ioi):
    """Cell 32: A's clean-minus-corrupted output through B's (frozen-scale) query, via hook_q and result."""
    clean_tokens, corrupted_tokens = ioi
    model.set_use_attn_result(True)
    try:
        _, cache = model.run_with_cache(clean_tokens)
        _, corrupted_cache = model.run_with_cache(corrupted_tokens)
        A_layer, A, B_layer, B = 0, 2, 1, 3

        def patch_direct_path_A_output_to_B_attn_act(corrupted_attn_act, hook):
            A_output_act_name = utils.get_act_name("result", A_layer, "attn")
            clean_A_output = cache[A_output_act_name][:, :, A, :]
            corrupted_A_output = corrupted_cache[A_output_act_name][:, :, A, :]
            W_B = model.blocks[B_layer].attn.W_Q[B]
            corrupted_ln1_scale = corrupted_cache[utils.get_act_name("scale", B_layer, "ln1")]
            patched = corrupted_attn_act.clone()
            patched_B_act = (
                corrupted_attn_act[:, :, B, :]
                + (clean_A_output - corrupted_A_output) @ W_B / corrupted_ln1_scale
            )
            patched[:, :, B, :] = patched_B_act
            return patched

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            patched = model.run_with_hooks(
                corrupted_tokens,
                return_type="logits",
                fwd_hooks=[
                    (utils.get_act_name("q", B_layer, "attn"), patch_direct_path_A_output_to_B_attn_act)
                ],
            )
    finally:
        model.set_use_attn_result(False)
    assert any("differently padded" in str(w.message) for w in caught)  # rows swapped: lengths differ
    # independently: head B's query input is the corrupted residual plus A's write, at the frozen scale
    resid = corrupted_cache["resid_pre", B_layer]
    delta = cache["result", A_layer][:, :, A] - corrupted_cache["result", A_layer][:, :, A]
    attn = model.blocks[B_layer].attn
    q = (resid + delta) / corrupted_cache["scale", B_layer, "ln1"] @ attn.W_Q[B] + attn.b_Q[B]

    def set_q(act, hook):
        act[:, :, B] = q
        return act

    by_hand = model.run_with_hooks(corrupted_tokens, fwd_hooks=[("blocks.1.attn.hook_q", set_q)])
    assert torch.allclose(patched, by_hand, atol=TOL)


def patch_residual_component(corrupted_residual_component, hook, pos, clean_cache):  # cell 20, as written
    clean_value = clean_cache[hook.name][:, pos, :].clone()
    corrupted_residual_component = corrupted_residual_component.clone()
    corrupted_residual_component[:, pos : pos + 1, :] = clean_value.unsqueeze(1)
    return corrupted_residual_component


def patch_head_vector(corrupted_head_vector, hook, head_index, clean_cache):  # cell 25
    clean_value = clean_cache[hook.name][:, :, head_index, :].clone()
    corrupted_head_vector = corrupted_head_vector.clone()
    corrupted_head_vector[:, :, head_index : head_index + 1, :] = clean_value.unsqueeze(2)
    return corrupted_head_vector


def patch_head_pattern(corrupted_head_pattern, hook, head_index, clean_cache):  # cell 30
    clean_value = clean_cache[hook.name][:, head_index, :, :].clone()
    corrupted_head_pattern = corrupted_head_pattern.clone()
    corrupted_head_pattern[:, head_index : head_index + 1, :, :] = clean_value.unsqueeze(1)
    return corrupted_head_pattern


def test_exploratory_demo_patching_cells(model):
    """Cells 18-31: chosen (clean) vs rejected (corrupted) of the same prompts, one left-padded batch; each
    sweep checked against transformer_lens.patching's helper and warned about once (rows differ in length)."""
    pairs = [p for p in demo_pairs() if p.subset == "arithmetic"][:3]
    batch = model.to_tokens(
        [p.prompt for p in pairs] * 2, [p.chosen for p in pairs] + [p.rejected for p in pairs]
    )
    tokens, corrupted_tokens = batch["input_ids"][:3], batch["input_ids"][3:]
    original_logits, cache = model.run_with_cache(tokens)
    corrupted_logits = model(corrupted_tokens)

    def normalize_patched_logit_diff(patched_logits):  # the metric swapped: the mean reward, normalised
        clean, corrupted = original_logits.mean(), corrupted_logits.mean()
        return (patched_logits.mean() - corrupted) / (clean - corrupted)

    L, H, T = model.cfg.n_layers, model.cfg.n_heads, tokens.shape[1]
    sweeps = [
        (
            "resid_pre",
            [(lay, pos) for lay in range(L) for pos in range(T)],
            patch_residual_component,
            "pos",
            patching.get_act_patch_resid_pre,
        ),
        (
            "z",
            [(lay, h) for lay in range(L) for h in range(H)],
            patch_head_vector,
            "head_index",
            patching.get_act_patch_attn_head_out_all_pos,
        ),
        (
            "attn",
            [(lay, h) for lay in range(L) for h in range(H)],
            patch_head_pattern,
            "head_index",
            patching.get_act_patch_attn_head_pattern_all_pos,
        ),
    ]
    for kind, index, fn, arg, helper in sweeps:
        result = torch.zeros(L, T if arg == "pos" else H)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for layer, i in index:
                hook_fn = partial(fn, clean_cache=cache, **{arg: i})
                name = utils.get_act_name(kind, layer, None if kind == "resid_pre" else "attn")
                patched_logits = model.run_with_hooks(
                    corrupted_tokens, fwd_hooks=[(name, hook_fn)], return_type="logits"
                )
                result[layer, i] = normalize_patched_logit_diff(patched_logits)
        assert sum("differently padded" in str(w.message) for w in caught) == 1, kind
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = helper(model, corrupted_tokens, cache, normalize_patched_logit_diff)
        assert torch.allclose(result, expected, atol=TOL), kind


# --------------------------------------------------------------------------- Activation Patching Demo
def test_activation_patching_demo_swapped_rows(model, ioi):
    clean_tokens, corrupted_tokens = ioi
    clean_logits, clean_cache = model.run_with_cache(clean_tokens)
    corrupted_logits, corrupted_cache = model.run_with_cache(corrupted_tokens)

    def get_logit_diff(logits):  # the metric swapped: even rows' rewards minus odd rows' (swapping flips it)
        return (logits[0::2] - logits[1::2]).mean()

    CLEAN_BASELINE = get_logit_diff(clean_logits).item()
    CORRUPTED_BASELINE = get_logit_diff(corrupted_logits).item()

    def ioi_metric(logits):
        return (get_logit_diff(logits) - CORRUPTED_BASELINE) / (CLEAN_BASELINE - CORRUPTED_BASELINE)

    assert abs(ioi_metric(clean_logits).item() - 1) < TOL and abs(ioi_metric(corrupted_logits).item()) < TOL
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resid_pre_act_patch_results = patching.get_act_patch_resid_pre(
            model, corrupted_tokens, clean_cache, ioi_metric
        )
    assert sum("differently padded" in str(w.message) for w in caught) == 1
    # the readout column: patching the last layer's resid_pre at -1 is the clean readout through block L-1
    # attending the corrupted keys; at layer 0 it is the clean readout token over the corrupted context
    last = model.cfg.n_layers - 1
    clean_readout = clean_cache["resid_pre", last][:, -1]

    def readout_only(resid, hook):
        resid[:, -1] = clean_readout
        return resid

    name = utils.get_act_name("resid_pre", last)
    expected = ioi_metric(model.run_with_hooks(corrupted_tokens, fwd_hooks=[(name, readout_only)]))
    assert abs(float(resid_pre_act_patch_results[last, -1]) - float(expected)) < TOL
    assert torch.allclose(alone(model, corrupted_tokens), corrupted_logits, atol=TOL)
    every = patching.get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, ioi_metric)
    assert every.shape == (5, model.cfg.n_layers, model.cfg.n_heads)
    nkv = model.cfg.n_key_value_heads  # k and v are patched per kv head; TL leaves the other slots zero
    assert torch.equal(every[2, :, nkv:], torch.zeros_like(every[2, :, nkv:]))
