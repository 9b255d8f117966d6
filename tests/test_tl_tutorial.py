"""TransformerLens-tutorial analysis code, run on a reward model with only the model, tokens and metric
swapped.

The code below follows the shape of TransformerLens's "Exploratory Analysis Demo" (direct logit
attribution via accumulated_resid / decompose_resid / stack_head_results + apply_ln_to_stack, then an
activation-patching heatmap); logit_diff_directions became the reward direction, the logits the reward.
"""

import torch
import transformer_lens.patching as patching
from helpers import padded_batch


def test_tutorial_style_analysis_runs_on_a_reward_model(llama_model):
    model = llama_model
    clean_tokens, _ = padded_batch([8], "right", seed=3)
    corrupted_tokens = clean_tokens.clone()
    corrupted_tokens[0, 4] = corrupted_tokens[0, 4] % 90 + 1

    # --- direct "logit" attribution, tutorial style ---
    rewards, cache = model.run_with_cache(clean_tokens)
    reward_direction = model.reward_direction  # was: model.tokens_to_residual_directions(answer_tokens)
    final_residual_stream = cache["resid_post", -1]
    final_token_residual_stream = final_residual_stream[:, -1, :]
    scaled_final_token_residual_stream = cache.apply_ln_to_stack(
        final_token_residual_stream, layer=-1, pos_slice=-1
    )
    reward_from_resid = scaled_final_token_residual_stream @ reward_direction + model.reward_bias
    assert torch.allclose(reward_from_resid, rewards, atol=1e-5)

    accumulated_residual, labels = cache.accumulated_resid(
        layer=-1, incl_mid=True, pos_slice=-1, return_labels=True
    )
    scaled = cache.apply_ln_to_stack(accumulated_residual, layer=-1, pos_slice=-1)
    lens_curve = scaled @ reward_direction
    assert lens_curve.shape == (2 * model.cfg.n_layers + 1, 1) and len(labels) == lens_curve.shape[0]
    assert torch.allclose(lens_curve[-1] + model.reward_bias, rewards, atol=1e-5)

    per_layer_residual, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    per_layer = cache.apply_ln_to_stack(per_layer_residual, layer=-1, pos_slice=-1) @ reward_direction
    assert torch.allclose(per_layer.sum(0) + model.reward_bias, rewards, atol=1e-5)

    per_head_residual, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    per_head = cache.apply_ln_to_stack(per_head_residual, layer=-1, pos_slice=-1) @ reward_direction
    assert per_head.shape == (model.cfg.n_layers * model.cfg.n_heads, 1)
    attn_total = sum(
        per_layer[i]
        for i, label in enumerate(cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)[1])
        if label.endswith("attn_out")
    )
    assert torch.allclose(per_head.sum(0), attn_total, atol=1e-5)

    # --- activation patching heatmap, tutorial style ---
    clean_reward = rewards[0]
    corrupted_reward = model(corrupted_tokens)[0]

    def reward_metric(patched_rewards):  # was: normalised logit difference
        return (patched_rewards[0] - corrupted_reward) / (clean_reward - corrupted_reward)

    resid_pre_act_patch_results = patching.get_act_patch_resid_pre(
        model, corrupted_tokens, cache, reward_metric
    )
    assert resid_pre_act_patch_results.shape == (model.cfg.n_layers, clean_tokens.shape[1])
    # Patching the whole residual at the readout position of the first layer restores the clean run.
    assert torch.allclose(resid_pre_act_patch_results[0, 4], torch.tensor(1.0), atol=1e-4)
    every_block_result = patching.get_act_patch_block_every(model, corrupted_tokens, cache, reward_metric)
    assert every_block_result.shape == (3, model.cfg.n_layers, clean_tokens.shape[1])
    # The only differing token is position 4: patching any other position at layer 0 changes nothing.
    assert torch.allclose(resid_pre_act_patch_results[0, :4], torch.zeros(4), atol=1e-4)
