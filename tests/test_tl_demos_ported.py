"""TransformerLens 4.3's Main Demo, Exploratory Analysis Demo and Activation Patching Demo ported cell by
cell onto the demo RM: the cells tests/test_tl_demo_cells.py, test_tl_tutorials_padded.py and
test_tl_last_mile.py do not already cover. Only the model (`load_demo_model`), the tokens (mixed-length pairs
through `model.to_tokens`, left-padded, passed without a mask) and the metric (a reward difference) are
swapped; a "needs change" note marks any other edit. Every number is checked against an independent
computation: each row scored alone, a manual einsum on cached activations and weights, or the raw
(unrepeated) weights. fp32, tolerance 1e-5 (1e-4 for patching sweeps).

Code cells (setup = installs, imports, plot helpers; display = plots only, their data checked where it is
computed; skip = the README's "No analogue" list):
  Main Demo         60: setup 8, display 3 (12, 17, 47), skip 20 (loss, text input, distilgpt2, b_U / W_U,
                    BOS-dependence, generate, checkpoints / evals), runnable 29: 23 unchanged, 29 right.
  Exploratory       45: setup 4, display 13, skip 2 (test_prompt; to_tokens on a text, cell 38),
                    runnable 26: 17 unchanged, 26 right.
  Activation Patch. 24: setup 8, skip 6 (attn-only-2l), runnable 10: 10 unchanged, 10 right.
"""

from __future__ import annotations

import warnings
from functools import partial

import einops
import pytest
import torch
import torch.nn as nn
import transformer_lens.patching as patching
import transformer_lens.utilities as utils
from transformer_lens import FactoredMatrix
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from reward_lens.demo import demo_pairs, load_demo_model

TOL, SWEEP_TOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def model():
    model = load_demo_model(device="cpu", dtype="float32")
    model.enable_compatibility_mode(disable_warnings=True)
    return model


def short_pairs(model, n):
    """n demo pairs whose chosen and rejected rows all differ in length (short rows keep sweeps fast)."""

    def length(p, r):
        return int(model.to_tokens(p.prompt, r)["input_ids"].shape[1])

    ranked = sorted(demo_pairs(), key=lambda p: length(p, p.chosen) + length(p, p.rejected))
    out, seen = [], set()
    for p in ranked:
        lc, lr = length(p, p.chosen), length(p, p.rejected)
        if lc != lr and lc not in seen and lr not in seen:
            seen |= {lc, lr}
            out.append(p)
        if len(out) == n:
            return out
    raise AssertionError("too few distinct lengths")


@pytest.fixture(scope="module")
def ioi(model):
    """Rows chosen_0, rejected_0, chosen_1, ... (all lengths differ); corrupted = adjacent rows swapped, as
    the Activation Patching Demo builds it. The metric: chosen minus rejected reward, so swapping flips it."""
    pairs = short_pairs(model, 2)
    prompts = [p.prompt for p in pairs for _ in range(2)]
    responses = [r for p in pairs for r in (p.chosen, p.rejected)]
    tokens = model.to_tokens(prompts, responses)["input_ids"]
    corrupted = tokens[[(i + 1 if i % 2 == 0 else i - 1) for i in range(len(tokens))]]
    return tokens, corrupted


def logits_to_ave_logit_diff(logits, per_prompt=False):  # the metric swapped: a reward difference
    diff = logits[0::2] - logits[1::2]
    return diff if per_prompt else diff.mean()


def strip(model, row):
    return row[(row != model.cfg.pad_token_id).long().cumsum(0) > 0]


def alone(model, ids):
    return torch.stack([model(strip(model, row)[None])[0] for row in ids])


# =========================================================================== Main Demo
def test_main_demo_cells_10_to_13_cache_of_one_sequence(model, ioi):
    tokens, _ = ioi
    gpt2_tokens = strip(model, tokens[1])[None]  # one sequence, as the demo's gpt2_tokens
    gpt2_logits, gpt2_cache = model.run_with_cache(gpt2_tokens, remove_batch_dim=True)
    attention_pattern = gpt2_cache["pattern", 0, "attn"]
    T = gpt2_tokens.shape[1]
    assert attention_pattern.shape == (model.cfg.n_heads, T, T)
    # independently: the same row inside the left-padded batch, at its real positions
    _, batch_cache = model.run_with_cache(tokens)
    assert torch.allclose(attention_pattern, batch_cache["pattern", 0][1, :, -T:, -T:], atol=TOL)
    assert torch.allclose(gpt2_logits, alone(model, tokens[1:2]), atol=TOL)
    attn_hook_name, attn_layer = "blocks.0.attn.hook_pattern", 0
    _, gpt2_attn_cache = model.run_with_cache(
        gpt2_tokens, remove_batch_dim=True, stop_at_layer=attn_layer + 1, names_filter=[attn_hook_name]
    )
    assert list(gpt2_attn_cache.keys()) == [attn_hook_name]
    assert torch.allclose(gpt2_attn_cache[attn_hook_name], attention_pattern)


def test_main_demo_cell_18_repeated_random_tokens(model):
    """Needs change: ids drawn below d_vocab (960, not 10000); `loss_fn` has no analogue: the reward is
    checked, each row against itself alone."""
    torch.manual_seed(0)
    random_tokens = torch.randint(100, model.cfg.d_vocab, (4, 12))
    repeated_tokens = einops.repeat(random_tokens, "batch seq_len -> batch (2 seq_len)")
    repeated_logits = model(repeated_tokens)
    assert repeated_logits.shape == (4,)
    singles = torch.stack([model(row[None])[0] for row in repeated_tokens])
    assert torch.allclose(repeated_logits, singles, atol=TOL)


def test_main_demo_cell_20_pattern_hook_on_one_sequence(model):
    torch.manual_seed(1)
    single_random_sequence = torch.randint(100, model.cfg.d_vocab, (1, 10))
    repeated_random_sequence = einops.repeat(single_random_sequence, "batch seq_len -> batch (2 seq_len)")
    seen = []

    def visualize_pattern_hook(pattern, hook):  # display() swapped for recording
        seen.append(pattern[0, 1].clone())

    out = model.run_with_hooks(
        repeated_random_sequence,
        return_type=None,
        fwd_hooks=[(utils.get_act_name("pattern", 3), visualize_pattern_hook)],
    )
    assert out is None and len(seen) == 1
    _, cache = model.run_with_cache(repeated_random_sequence)
    assert torch.allclose(seen[0], cache["pattern", 3][0, 1], atol=TOL)
    assert torch.allclose(seen[0].sum(-1), torch.ones(20), atol=TOL)


def test_main_demo_cells_23_24_tl_named_parameters(model):
    params = dict(model.tl_named_parameters())
    block0 = {n: p for n, p in params.items() if n.startswith("blocks.0.")}
    assert {
        "blocks.0.attn.W_Q",
        "blocks.0.attn.W_K",
        "blocks.0.attn.W_V",
        "blocks.0.attn.W_O",
        "blocks.0.mlp.W_in",
        "blocks.0.mlp.W_out",
    } <= set(block0)
    assert torch.equal(block0["blocks.0.attn.W_Q"], model.W_Q[0])
    assert block0["blocks.0.attn.W_Q"].shape == (model.cfg.n_heads, model.cfg.d_model, model.cfg.d_head)
    assert torch.equal(block0["blocks.0.mlp.W_out"], model.W_out[0])
    top = {n for n in params if not n.startswith("blocks")}
    assert "embed.W_E" in top and torch.equal(params["embed.W_E"], model.W_E)
    assert not any("W_U" in n or "W_pos" in n for n in top)  # no analogue: reward head, RoPE


def test_main_demo_cells_29_33_str_tokens_and_to_string(model, ioi):
    """Cell 30/31 (`to_tokens` on a bare text) has no analogue; the rest runs unchanged."""
    tokens, corrupted = ioi
    tok = model.tokenizer
    example_text = "What is 4 times 3? That is 12."
    example_text_str_tokens = model.to_str_tokens(example_text)
    assert example_text_str_tokens[0] == tok.bos_token
    assert "".join(example_text_str_tokens[1:]) == example_text
    assert model.to_string(256) == tok.decode([256])
    row = tokens[0]
    assert model.to_string(row.squeeze()) == tok.decode(row.tolist())
    assert model.to_string(corrupted) == [tok.decode(r.tolist()) for r in corrupted]  # Exploratory cell 19
    assert model.to_str_tokens(row) == [tok.decode([t]) for t in row.tolist()]


def test_main_demo_cells_40_43_factored_matrix():
    """Runs unchanged: TransformerLens's own FactoredMatrix, no model involved."""
    torch.manual_seed(50)
    A, B = torch.randn(5, 2), torch.randn(2, 5)
    AB, AB_factor = A @ B, FactoredMatrix(A, B)
    assert torch.allclose(AB.norm(), AB_factor.norm(), atol=TOL)
    assert (AB_factor.rdim, AB_factor.ldim, AB_factor.mdim) == (5, 5, 2)
    assert torch.allclose(torch.linalg.svd(AB).S[:2], AB_factor.S, atol=TOL)
    C = torch.randn(5, 300)
    assert torch.allclose((AB_factor @ C).norm(), (AB @ C).norm(), rtol=1e-5)
    assert torch.isclose(AB_factor.AB, AB).all()


def test_main_demo_cells_44_46_ov_copying_score(model):
    OV_circuit_all_heads = model.OV
    eig = OV_circuit_all_heads.eigenvalues
    assert eig.shape == (model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_head) and eig.is_complex()
    OV_copying_score = eig.sum(dim=-1).real / eig.abs().sum(dim=-1)
    # independently: query head h's OV from the raw kv weights (kv head h // group), full d_model matrix
    group = model.cfg.n_heads // model.cfg.n_key_value_heads
    for layer in range(model.cfg.n_layers):
        attn = model.blocks[layer].attn
        for h in range(model.cfg.n_heads):
            full = attn._W_V[h // group].double() @ attn.W_O[h].double()
            ev = torch.linalg.eigvals(full)
            top = ev[ev.abs().argsort(descending=True)[: model.cfg.d_head]]
            expected = ev.sum().real / top.abs().sum()
            assert abs(float(OV_copying_score[layer, h]) - float(expected)) < 1e-4, (layer, h)


class SquareThenAdd(nn.Module):  # cell 53, as written
    def __init__(self, offset):
        super().__init__()
        self.offset = nn.Parameter(torch.tensor(offset))
        self.hook_square = HookPoint()

    def forward(self, x):
        return self.offset + self.hook_square(x * x)


class TwoLayerModel(HookedRootModule):
    def __init__(self):
        super().__init__()
        self.layer1, self.layer2 = SquareThenAdd(3.0), SquareThenAdd(-4.0)
        self.hook_in, self.hook_mid, self.hook_out = HookPoint(), HookPoint(), HookPoint()
        super().setup()

    def forward(self, x):
        return self.hook_out(self.layer2(self.hook_mid(self.layer1(self.hook_in(x)))))


def test_main_demo_cells_53_55_hooked_root_module():
    """Runs unchanged (TransformerLens only): reward-lens leaves HookedRootModule as it is."""
    two = TwoLayerModel()
    out, cache = two.run_with_cache(torch.tensor(5.0))
    assert out.item() == 780.0 and cache["hook_mid"].item() == 28.0
    assert cache["layer2.hook_square"].item() == 784.0

    def set_to_zero_hook(tensor, hook):
        return torch.tensor(0.0)

    zeroed = two.run_with_hooks(torch.tensor(5.0), fwd_hooks=[("layer2.hook_square", set_to_zero_hook)])
    assert zeroed.item() == -4.0


def test_block_attention_has_transformer_lens_raw_kv_names(model):
    """The README's `_W_K`, `_W_V`, `_b_K`, `_b_V` on `model.blocks[l].attn` (an AttributeError before)."""
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        for raw, stacked in (
            (attn._W_K, model._W_K),
            (attn._W_V, model._W_V),
            (attn._b_K, model._b_K),
            (attn._b_V, model._b_V),
        ):
            assert raw.shape[0] == model.cfg.n_key_value_heads and torch.equal(raw, stacked[layer])


# =========================================================================== Exploratory Analysis Demo
@pytest.fixture(scope="module")
def explored(model, ioi):
    """Cells 4, 8, 18: set_use_attn_result(True), the clean and corrupted caches."""
    tokens, corrupted_tokens = ioi
    model.set_use_attn_result(True)
    try:
        original_logits, cache = model.run_with_cache(tokens)
        corrupted_logits, corrupted_cache = model.run_with_cache(corrupted_tokens, return_type="logits")
    finally:
        model.set_use_attn_result(False)
    return original_logits, cache, corrupted_logits, corrupted_cache


def test_exploratory_demo_cells_7_to_9_reward_difference(model, ioi, explored):
    tokens, corrupted_tokens = ioi
    original_logits, _, corrupted_logits, _ = explored
    for row in tokens:  # cell 7 on the rows' texts
        text = model.to_string(strip(model, row))
        assert model.to_str_tokens(text, prepend_bos=False)
    per_prompt = logits_to_ave_logit_diff(original_logits, per_prompt=True)
    singles = alone(model, tokens)
    assert torch.allclose(per_prompt, singles[0::2] - singles[1::2], atol=TOL)
    assert torch.allclose(logits_to_ave_logit_diff(corrupted_logits), -per_prompt.mean(), atol=TOL)


def residual_stack_to_logit_diff(residual_stack, cache, logit_diff_directions):
    """Cell 12; needs change: the difference is taken between rows after projecting each row on its own
    reward direction (a reward difference is not one residual direction), so the einsum keeps `batch`."""
    scaled_residual_stack = cache.apply_ln_to_stack(residual_stack, layer=-1, pos_slice=-1)
    per_row = torch.einsum("...bd,bd->...b", scaled_residual_stack, logit_diff_directions)
    return (per_row[..., 0::2] - per_row[..., 1::2]).mean(-1)


def test_exploratory_demo_cells_10_to_15_direct_reward_attribution(model, ioi, explored):
    tokens, _ = ioi
    original_logits, cache, _, _ = explored
    original_average_logit_diff = logits_to_ave_logit_diff(original_logits)
    # cell 10, needs change: W_U[:, answer_tokens] -> tokens_to_residual_directions (each row's direction)
    directions = model.tokens_to_residual_directions(tokens)
    assert directions.shape == (tokens.shape[0], model.cfg.d_model)
    final_token_residual_stream = cache["resid_post", -1][:, -1, :]  # cell 11
    scaled = cache.apply_ln_to_stack(final_token_residual_stream, layer=-1, pos_slice=-1)
    rms = final_token_residual_stream.pow(2).mean(-1, keepdim=True).add(model.cfg.eps).sqrt()  # by hand
    assert torch.allclose(scaled, final_token_residual_stream / rms, atol=TOL)
    per_row = torch.einsum("bd,bd->b", scaled, directions) + model.reward_bias
    assert torch.allclose(per_row, alone(model, tokens), atol=TOL)
    accumulated_residual, labels = cache.accumulated_resid(
        layer=-1, incl_mid=True, pos_slice=-1, return_labels=True
    )  # cell 13
    logit_lens = residual_stack_to_logit_diff(accumulated_residual, cache, directions)
    assert len(labels) == 2 * model.cfg.n_layers + 1
    assert torch.allclose(logit_lens[-1], original_average_logit_diff, atol=TOL)
    per_layer_residual, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)  # cell 14
    per_layer = residual_stack_to_logit_diff(per_layer_residual, cache, directions)
    assert torch.allclose(per_layer.sum(), original_average_logit_diff, atol=TOL)  # the bias cancels
    # cell 15
    per_head_residual, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    per_head = einops.rearrange(
        residual_stack_to_logit_diff(per_head_residual, cache, directions),
        "(layer head_index) -> layer head_index",
        layer=model.cfg.n_layers,
    )
    # independently: z @ W_O per head at the readout, over the final norm's scale, on the direction
    scale = cache["ln_final.hook_scale"][:, -1]
    for layer in range(model.cfg.n_layers):
        write = torch.einsum("bhd,hdm->hbm", cache["z", layer][:, -1], model.W_O[layer]) / scale
        by_hand = torch.einsum("hbm,bm->hb", write, directions)
        assert torch.allclose(per_head[layer], (by_hand[:, 0::2] - by_hand[:, 1::2]).mean(-1), atol=TOL)
    top = torch.topk(per_head.flatten(), k=3).indices  # cell 17 (its plot is display only)
    assert model.to_str_tokens(tokens[0]) and len(top) == 3


def patch_residual_component(corrupted_residual_component, hook, pos, clean_cache):  # cell 20, as written
    clean_value = clean_cache[hook.name][:, pos, :].clone()
    corrupted_residual_component = corrupted_residual_component.clone()
    corrupted_residual_component[:, pos : pos + 1, :] = clean_value.unsqueeze(1)
    return corrupted_residual_component


def patch_head_vector(corrupted_head_vector, hook, head_index, clean_cache):  # cell 25, as written
    clean_value = clean_cache[hook.name][:, :, head_index, :].clone()
    corrupted_head_vector = corrupted_head_vector.clone()
    corrupted_head_vector[:, :, head_index : head_index + 1, :] = clean_value.unsqueeze(2)
    return corrupted_head_vector


def metric_from(explored):
    original_logits, _, corrupted_logits, _ = explored
    clean, corrupted = logits_to_ave_logit_diff(original_logits), logits_to_ave_logit_diff(corrupted_logits)
    return lambda logits: (logits_to_ave_logit_diff(logits) - corrupted) / (clean - corrupted)


def test_exploratory_demo_cell_22_attn_and_mlp_out_by_position(model, ioi, explored):
    tokens, corrupted_tokens = ioi
    _, cache, _, _ = explored
    normalize = metric_from(explored)
    L, T = model.cfg.n_layers, tokens.shape[1]
    patched = {"attn_out": torch.zeros(L, T), "mlp_out": torch.zeros(L, T)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in range(L):
            for position in range(T):
                hook_fn = partial(patch_residual_component, pos=position, clean_cache=cache)
                for kind, result in patched.items():
                    logits = model.run_with_hooks(
                        corrupted_tokens,
                        return_type="logits",
                        fwd_hooks=[(utils.get_act_name(kind, layer), hook_fn)],
                    )
                    result[layer, position] = normalize(logits)
    assert any("differently padded" in str(w.message) for w in caught)  # rows differ in length
    # independently at the readout column: each corrupted row alone, its last position set to the clean
    # row's (alone) activation there
    order = [(i + 1 if i % 2 == 0 else i - 1) for i in range(len(tokens))]
    for kind, result in patched.items():
        for layer in range(L):
            name = utils.get_act_name(kind, layer)
            rewards = []
            for b in range(len(tokens)):
                _, clean_alone = model.run_with_cache(strip(model, tokens[b])[None], names_filter=[name])

                def set_last(act, hook, value=clean_alone[name][:, -1]):
                    act[:, -1] = value
                    return act

                row = strip(model, corrupted_tokens[b])[None]
                rewards.append(model.run_with_hooks(row, fwd_hooks=[(name, set_last)])[0])
            assert abs(float(result[layer, -1] - normalize(torch.stack(rewards)))) < SWEEP_TOL, (kind, layer)
    assert order == [1, 0, 3, 2]


def test_exploratory_demo_cell_27_value_patching_per_kv_head(model, ioi, explored):
    """Needs change under grouped-query attention (as in TransformerLens): hook_v has n_key_value_heads
    heads, so the loop runs over range(model.cfg.n_key_value_heads), not n_heads."""
    tokens, corrupted_tokens = ioi
    _, cache, _, corrupted_cache = explored
    normalize = metric_from(explored)
    with pytest.raises(IndexError):  # the cell as written
        model.run_with_hooks(
            corrupted_tokens,
            fwd_hooks=[
                (
                    utils.get_act_name("v", 0, "attn"),
                    partial(patch_head_vector, head_index=model.cfg.n_heads - 1, clean_cache=cache),
                )
            ],
        )
    L, nkv = model.cfg.n_layers, model.cfg.n_key_value_heads
    group = model.cfg.n_heads // nkv
    patched_head_v_diff = torch.zeros(L, nkv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the differently-padded warning (checked elsewhere)
        for layer in range(L):
            for head_index in range(nkv):
                hook_fn = partial(patch_head_vector, head_index=head_index, clean_cache=cache)
                logits = model.run_with_hooks(
                    corrupted_tokens,
                    return_type="logits",
                    fwd_hooks=[(utils.get_act_name("v", layer, "attn"), hook_fn)],
                )
                patched_head_v_diff[layer, head_index] = normalize(logits)
                # independently: z of the query heads it serves = the corrupted pattern over the clean values
                served = list(range(head_index * group, (head_index + 1) * group))
                pattern = corrupted_cache["pattern", layer][:, served]
                z = torch.einsum("bhqk,bkd->bqhd", pattern, cache["v", layer][:, :, head_index])

                def set_z(act, hook, z=z, served=served):
                    act[:, :, served] = z
                    return act

                z_name = utils.get_act_name("z", layer)
                by_hand = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(z_name, set_z)])
                assert abs(float(patched_head_v_diff[layer, head_index] - normalize(by_hand))) < SWEEP_TOL
        expected = patching.get_act_patch_attn_head_v_all_pos(model, corrupted_tokens, cache, normalize)
    assert torch.allclose(patched_head_v_diff, expected[:, :nkv], atol=SWEEP_TOL)


def patch_direct_path_A_output_to_B_attn_act(
    corrupted_attn_act, hook, W_B, A_layer, A_head_index, B_layer, B_head_index, clean_cache, corrupted_cache
):
    """Cell 32 as written but for W_B (passed in: see the test)."""
    A_output_act_name = utils.get_act_name("result", A_layer, "attn")
    clean_A_output = clean_cache[A_output_act_name][:, :, A_head_index, :]
    corrupted_A_output = corrupted_cache[A_output_act_name][:, :, A_head_index, :]
    corrupted_B_act = corrupted_attn_act[:, :, B_head_index, :]
    corrupted_ln1_scale = corrupted_cache[utils.get_act_name("scale", B_layer, "ln1")]
    patched_B_act = corrupted_B_act + (clean_A_output - corrupted_A_output) @ W_B / corrupted_ln1_scale
    patched_attn_act = corrupted_attn_act.clone()
    patched_attn_act[:, :, B_head_index, :] = patched_B_act
    return patched_attn_act


@pytest.mark.parametrize("attn_act_type", ["k", "v"])
def test_exploratory_demo_cells_32_36_direct_path_to_keys_and_values(model, ioi, explored, attn_act_type):
    """Needs change under grouped-query attention: B runs over the kv heads and W_B is that kv head's raw
    weight, `attn._W_K[B]` / `attn._W_V[B]` (TransformerLens's `attn.W_K[B]` is query head B's copy)."""
    _, corrupted_tokens = ioi
    _, cache, _, corrupted_cache = explored
    normalize = metric_from(explored)
    A_layer, B_layer = 0, 2
    attn = model.blocks[B_layer].attn
    raw_W, raw_b = (attn._W_K, attn._b_K) if attn_act_type == "k" else (attn._W_V, attn._b_V)
    diffs = torch.zeros(model.cfg.n_heads, model.cfg.n_key_value_heads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for A in range(model.cfg.n_heads):
            for B in range(model.cfg.n_key_value_heads):
                hook = (
                    utils.get_act_name(attn_act_type, B_layer, "attn"),
                    partial(
                        patch_direct_path_A_output_to_B_attn_act,
                        W_B=raw_W[B],
                        A_layer=A_layer,
                        A_head_index=A,
                        B_layer=B_layer,
                        B_head_index=B,
                        clean_cache=cache,
                        corrupted_cache=corrupted_cache,
                    ),
                )
                diffs[A, B] = normalize(
                    model.run_with_hooks(corrupted_tokens, fwd_hooks=[hook], return_type="logits")
                )
                # independently: the kv head's input is the corrupted residual plus A's clean-minus-
                # corrupted write, over the frozen ln1 scale; k is hooked before RoPE
                delta = cache["result", A_layer][:, :, A] - corrupted_cache["result", A_layer][:, :, A]
                resid = corrupted_cache["resid_pre", B_layer] + delta
                act = resid / corrupted_cache["scale", B_layer, "ln1"] @ raw_W[B] + raw_b[B]

                def set_act(x, hook, act=act, B=B):
                    x[:, :, B] = act
                    return x

                by_hand = model.run_with_hooks(
                    corrupted_tokens, fwd_hooks=[(utils.get_act_name(attn_act_type, B_layer), set_act)]
                )
                assert abs(float(diffs[A, B] - normalize(by_hand))) < SWEEP_TOL, (A, B)
    assert diffs.abs().max() > 0


def test_exploratory_demo_cell_40_head_scores(model):
    """Needs change: ids below d_vocab; return_type="loss" has no analogue (None runs the same hooks)."""
    seq_len, batch_size = 30, 2
    prev_token_scores = torch.zeros((model.cfg.n_layers, model.cfg.n_heads))
    duplicate_token_scores = torch.zeros((model.cfg.n_layers, model.cfg.n_heads))
    induction_scores = torch.zeros((model.cfg.n_layers, model.cfg.n_heads))

    def score_hook(store, offset, pattern, hook):
        diagonal = pattern.diagonal(offset=offset, dim1=-1, dim2=-2)
        store[hook.layer()] = einops.reduce(diagonal, "batch head_index diagonal -> head_index", "mean")

    torch.manual_seed(0)
    original_tokens = torch.randint(100, model.cfg.d_vocab, size=(batch_size, seq_len))
    repeated_tokens = einops.repeat(original_tokens, "batch seq_len -> batch (2 seq_len)")
    pattern_filter = lambda act_name: act_name.endswith("hook_pattern")  # noqa: E731
    out = model.run_with_hooks(
        repeated_tokens,
        return_type=None,
        fwd_hooks=[
            (pattern_filter, partial(score_hook, prev_token_scores, 1)),
            (pattern_filter, partial(score_hook, duplicate_token_scores, seq_len)),
            (pattern_filter, partial(score_hook, induction_scores, seq_len - 1)),
        ],
    )
    assert out is None
    _, cache = model.run_with_cache(repeated_tokens)
    for layer in range(model.cfg.n_layers):
        p = cache["pattern", layer]
        idx = torch.arange(2 * seq_len)
        for store, offset in (
            (prev_token_scores, 1),
            (duplicate_token_scores, seq_len),
            (induction_scores, seq_len - 1),
        ):
            q = idx[offset:]
            assert torch.allclose(store[layer], p[:, :, q, q - offset].mean((0, -1)), atol=TOL)
    assert torch.equal(utils.get_corner(prev_token_scores), prev_token_scores[:3, :3])


def test_exploratory_demo_cells_42_44_add_hook_then_run_with_cache(model, ioi, explored):
    """The hook added with `add_hook` stays after `run_with_cache`, as in TransformerLens 4.3 (the demo's
    comment says run_with_cache removes it; TL's own HookedRootModule keeps it too): reset_hooks() removes
    it."""
    tokens, _ = ioi
    original_logits, cache, _, _ = explored
    layer, head = 2, 1

    def ablate_top_head_hook(z, hook):
        z = z.clone()
        z[:, -1, head, :] = 0
        return z

    model.set_use_attn_result(True)  # as the demo's cell 4 left it
    try:
        model.blocks[layer].attn.hook_z.add_hook(ablate_top_head_hook)
        ablated_logits, ablated_cache = model.run_with_cache(tokens)
        assert torch.allclose(model(tokens), ablated_logits, atol=TOL)  # still hooked, as in TL
        model.reset_hooks()
        assert torch.allclose(model(tokens), original_logits, atol=TOL)
        per_head_ablated = ablated_cache.stack_head_results(layer=-1, pos_slice=-1)  # cell 43
    finally:
        model.set_use_attn_result(False)
    # independently: each row alone with the same hook
    singles = [
        model.run_with_hooks(
            strip(model, row)[None], fwd_hooks=[(utils.get_act_name("z", layer), ablate_top_head_hook)]
        )[0]
        for row in tokens
    ]
    assert torch.allclose(ablated_logits, torch.stack(singles), atol=TOL)
    ablated_head = per_head_ablated[layer * model.cfg.n_heads + head]
    assert torch.equal(ablated_head, torch.zeros_like(ablated_head))
    by_hand = torch.einsum("bhd,hdm->hbm", ablated_cache["z", 0][:, -1], model.W_O[0])
    assert torch.allclose(per_head_ablated[: model.cfg.n_heads], by_hand, atol=TOL)
    # cell 44: the final norm's scale at the readout, by hand
    for c in (cache, ablated_cache):
        final = c["resid_post", -1][:, -1]
        scale = final.pow(2).mean(-1, keepdim=True).add(model.cfg.eps).sqrt()
        assert torch.allclose(c["ln_final.hook_scale"][:, -1], scale, atol=TOL)


# =========================================================================== Activation Patching Demo
def test_activation_patching_demo_cell_17_every_head_by_pos(model, ioi):
    """Cell 17 (by head and by position, every kind) as written; cells 8-16 are in test_tl_demo_cells.py and
    test_tl_tutorials_padded.py. The readout column of output / query / key / value is checked against each
    corrupted row alone with that head's activation at its last position set to the clean row's (alone)."""
    clean_tokens, corrupted_tokens = ioi
    clean_logits, clean_cache = model.run_with_cache(clean_tokens)
    corrupted_logits = model(corrupted_tokens)
    CLEAN_BASELINE = logits_to_ave_logit_diff(clean_logits).item()
    CORRUPTED_BASELINE = logits_to_ave_logit_diff(corrupted_logits).item()

    def ioi_metric(logits):
        return (logits_to_ave_logit_diff(logits) - CORRUPTED_BASELINE) / (CLEAN_BASELINE - CORRUPTED_BASELINE)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        every = patching.get_act_patch_attn_head_by_pos_every(
            model, corrupted_tokens, clean_cache, ioi_metric
        )
    assert any("differently padded" in str(w.message) for w in caught)
    L, T, H, nkv = model.cfg.n_layers, clean_tokens.shape[1], model.cfg.n_heads, model.cfg.n_key_value_heads
    assert every.shape == (5, L, T, H)
    assert every.max() > 0.01
    # as the cell does
    every = einops.rearrange(every, "act_type layer pos head -> act_type (layer head) pos")
    clean_alone = [model.run_with_cache(strip(model, row)[None])[1] for row in clean_tokens]
    for kind_index, kind in enumerate(["z", "q", "k", "v"]):
        for layer in range(L):
            name = utils.get_act_name(kind, layer)
            for head in range(nkv if kind in ("k", "v") else H):
                rewards = []
                for b, row in enumerate(corrupted_tokens):

                    def set_last(act, hook, value=clean_alone[b][name][:, -1, head]):
                        act[:, -1, head] = value
                        return act

                    one = strip(model, row)[None]
                    rewards.append(model.run_with_hooks(one, fwd_hooks=[(name, set_last)])[0])
                expected = ioi_metric(torch.stack(rewards))
                got = every[kind_index, layer * H + head, -1]
                assert abs(float(got - expected)) < SWEEP_TOL, (kind, layer, head)
